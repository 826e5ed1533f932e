// kafkajs with SASL against polymq: produce one message and read it back.
// Usage: node kafka_sasl.js HOST:PORT TOPIC MECHANISM USER PASSWORD
// MECHANISM is plain, scram-sha-256 or scram-sha-512. Prints JSON, or exits 1 with the error.
const { Kafka, logLevel } = require("kafkajs");

async function main() {
  const [broker, topic, mechanism, username, password] = process.argv.slice(2);
  const kafka = new Kafka({
    clientId: "kafkajs-sasl-test",
    brokers: [broker],
    sasl: { mechanism, username, password },
    logLevel: logLevel.NOTHING,
    retry: { retries: 0 },
  });
  const producer = kafka.producer();
  await producer.connect();
  await producer.send({ topic, messages: [{ value: `via-${mechanism}` }] });
  await producer.disconnect();
  const consumer = kafka.consumer({ groupId: `g-${topic}` });
  await consumer.connect();
  await consumer.subscribe({ topic, fromBeginning: true });
  const value = await new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error("no message")), 30000);
    consumer.run({
      eachMessage: async ({ message }) => {
        clearTimeout(timer);
        resolve(message.value.toString());
      },
    });
  });
  await consumer.disconnect();
  console.log(JSON.stringify({ value }));
}

main().catch((err) => {
  console.error(err.type || err.name, err.message);
  process.exit(1);
});
