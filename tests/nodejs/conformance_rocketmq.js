// rocketmq-client-nodejs for the conformance suite: send messages with a tag, keys and
// a property; a simple consumer receives and acks them. Prints one JSON line.
// usage: node tests/nodejs/conformance_rocketmq.js HOST:PORT TOPIC GROUP [AK SK]
'use strict';
const { Producer, SimpleConsumer } = require('rocketmq-client-nodejs');

async function main() {
  const [endpoints, topic, consumerGroup, accessKey, secretKey] = process.argv.slice(2);
  const sessionCredentials = accessKey ? { accessKey, accessSecret: secretKey } : undefined;
  const producer = new Producer({ endpoints, sessionCredentials, topics: [topic] });
  await producer.startup();
  const sent = [];
  for (let i = 0; i < 3; i++) {
    const receipt = await producer.send({
      topic, tag: 'node', keys: [`key-${i}`], properties: new Map([['origin', 'node']]),
      body: Buffer.from(`node-${i}`),
    });
    sent.push(receipt.messageId);
  }
  await producer.shutdown();
  const consumer = new SimpleConsumer({
    endpoints, sessionCredentials, consumerGroup,
    subscriptions: new Map().set(topic, 'node'), awaitDuration: 3000,
  });
  await consumer.startup();
  const got = [];
  while (got.length < sent.length) {
    for (const m of await consumer.receive(16, 20000)) {
      got.push({ id: m.messageId, body: m.body.toString(), tag: m.tag, keys: m.keys, origin: m.properties.get('origin') });
      await consumer.ack(m);
    }
  }
  await consumer.shutdown();
  console.log(JSON.stringify({ sent, got }));
}

const timer = setTimeout(() => { console.error('timeout'); process.exit(2); }, 40000);
main().then(() => { clearTimeout(timer); process.exit(0); }, (e) => { console.error(String(e && e.stack || e)); process.exit(1); });
