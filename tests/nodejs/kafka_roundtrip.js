// kafkajs against polymq: create a topic, produce (plain and gzip), consume in a group,
// commit, and print what arrived as JSON. Usage: node kafka_roundtrip.js HOST:PORT TOPIC
const { Kafka, CompressionTypes, logLevel } = require("kafkajs");

async function main() {
  const [broker, topic] = process.argv.slice(2);
  const kafka = new Kafka({
    clientId: "kafkajs-test",
    brokers: [broker],
    logLevel: logLevel.ERROR,
    retry: { retries: 3, initialRetryTime: 100 },
  });
  const admin = kafka.admin();
  await admin.connect();
  await admin.createTopics({ topics: [{ topic, numPartitions: 2 }] });
  await admin.disconnect();

  const producer = kafka.producer();
  await producer.connect();
  await producer.send({
    topic,
    messages: [
      { key: "k1", value: "plain-1", partition: 0, headers: { h: "v" } },
      { key: "k2", value: "plain-2", partition: 1 },
    ],
  });
  await producer.send({
    topic,
    compression: CompressionTypes.GZIP,
    messages: [{ key: "k3", value: "gzip-3", partition: 0 }],
  });
  await producer.disconnect();

  const consumer = kafka.consumer({ groupId: `g-${topic}`, sessionTimeout: 6000, heartbeatInterval: 500 });
  await consumer.connect();
  await consumer.subscribe({ topic, fromBeginning: true });
  const received = [];
  await new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`only ${received.length} messages`)), 30000);
    consumer.run({
      eachMessage: async ({ partition, message }) => {
        received.push({
          partition,
          offset: message.offset,
          key: message.key.toString(),
          value: message.value.toString(),
          headers: Object.fromEntries(
            Object.entries(message.headers || {}).map(([k, v]) => [k, v.toString()]),
          ),
        });
        if (received.length === 3) {
          clearTimeout(timer);
          resolve();
        }
      },
    });
  });
  await consumer.disconnect();
  const admin2 = kafka.admin();
  await admin2.connect();
  const offsets = await admin2.fetchOffsets({ groupId: `g-${topic}`, topics: [topic] });
  await admin2.disconnect();
  received.sort((a, b) => a.value.localeCompare(b.value));
  console.log(JSON.stringify({ received, offsets }));
}

main().catch((err) => {
  console.error(err);
  process.exit(1);
});
