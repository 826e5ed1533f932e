// kafkajs for the conformance suite: create a topic, produce keyed records with
// headers, consume them in a new group, delete the topic. Prints one JSON line.
// usage: node tests/nodejs/conformance_kafka.js HOST:PORT TOPIC GROUP [USER PASSWORD]
'use strict';
const { Kafka, logLevel } = require('kafkajs');

async function main() {
  const [broker, topic, groupId, user, password] = process.argv.slice(2);
  const kafka = new Kafka({
    clientId: 'conformance',
    brokers: [broker],
    logLevel: logLevel.NOTHING,
    sasl: user ? { mechanism: 'plain', username: user, password } : undefined,
    retry: { retries: 3, initialRetryTime: 100 },
  });
  const admin = kafka.admin();
  await admin.connect();
  await admin.createTopics({ topics: [{ topic, numPartitions: 1 }], waitForLeaders: true });
  const producer = kafka.producer();
  await producer.connect();
  const sent = [0, 1, 2].map((i) => ({ key: `k${i}`, value: `v${i}`, headers: { h: `x${i}` } }));
  await producer.send({ topic, acks: -1, messages: sent });
  await producer.disconnect();
  const consumer = kafka.consumer({ groupId, sessionTimeout: 6000, heartbeatInterval: 500 });
  await consumer.connect();
  await consumer.subscribe({ topic, fromBeginning: true });
  const got = [];
  await new Promise((resolve) => {
    consumer.run({
      eachMessage: async ({ message }) => {
        got.push([message.key.toString(), message.value.toString(), message.headers.h.toString()]);
        if (got.length === sent.length) resolve();
      },
    });
  });
  await consumer.disconnect();
  await admin.deleteTopics({ topics: [topic] });
  await admin.disconnect();
  console.log(JSON.stringify({ got }));
}

const timer = setTimeout(() => { console.error('timeout'); process.exit(2); }, 40000);
main().then(() => { clearTimeout(timer); process.exit(0); }, (e) => { console.error(String(e && e.stack || e)); process.exit(1); });
