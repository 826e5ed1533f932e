// rocketmq-client-nodejs against polymq: a producer sends COUNT messages, a simple
// consumer receives and acks them. Prints one JSON line with what was sent and got.
// usage: node tests/nodejs/rocketmq_produce_consume.js HOST:PORT TOPIC GROUP COUNT
'use strict';
const { Producer, SimpleConsumer } = require('rocketmq-client-nodejs');

async function main() {
  const [endpoints, topic, group, countText] = process.argv.slice(2);
  const count = Number(countText || '5');
  const producer = new Producer({ endpoints, topics: [topic] });
  await producer.startup();
  const sent = [];
  for (let i = 0; i < count; i++) {
    const receipt = await producer.send({
      topic,
      tag: 'node',
      keys: [`key-${i}`],
      properties: new Map([['origin', 'node']]),
      body: Buffer.from(`node-${i}`),
    });
    sent.push(receipt.messageId);
  }
  await producer.shutdown();

  const consumer = new SimpleConsumer({
    endpoints,
    consumerGroup: group,
    subscriptions: new Map().set(topic, 'node'),
    awaitDuration: 3000,
  });
  await consumer.startup();
  const received = [];
  const deadline = Date.now() + 30000;
  while (received.length < count && Date.now() < deadline) {
    for (const message of await consumer.receive(32, 15000)) {
      received.push({
        id: message.messageId,
        body: message.body.toString(),
        tag: message.tag,
        keys: message.keys,
        origin: message.properties.get('origin'),
        attempt: message.deliveryAttempt,
      });
      await consumer.ack(message);
    }
  }
  await consumer.shutdown();
  console.log(JSON.stringify({ sent, received }));
}

main().then(() => process.exit(0), (err) => {
  console.error(err);
  process.exit(1);
});
