// kafkajs consumer group against polymq: two members split a 4-partition topic, then
// one leaves and the other takes everything. Prints each phase's assignments as JSON.
// Usage: node kafka_group.js HOST:PORT TOPIC
const { Kafka, logLevel } = require("kafkajs");

function assigned(consumer) {
  // GROUP_JOIN events carry the member's assignment: { topic: [partitions] }.
  return new Promise((resolve) => {
    consumer.on(consumer.events.GROUP_JOIN, (event) => resolve(event.payload.memberAssignment));
  });
}

async function main() {
  const [broker, topic] = process.argv.slice(2);
  const kafka = new Kafka({ clientId: "kafkajs-group", brokers: [broker], logLevel: logLevel.ERROR });
  const admin = kafka.admin();
  await admin.connect();
  await admin.createTopics({ topics: [{ topic, numPartitions: 4 }] });
  await admin.disconnect();
  const options = {
    groupId: `g-${topic}`,
    sessionTimeout: 6000,
    heartbeatInterval: 300,
    rebalanceTimeout: 6000,
    maxWaitTimeInMs: 100, // heartbeats go between fetches: keep long polls short
  };
  const first = kafka.consumer(options);
  const second = kafka.consumer(options);
  for (const consumer of [first, second]) {
    await consumer.connect();
    await consumer.subscribe({ topic, fromBeginning: true });
  }
  const firstJoins = [];
  first.on(first.events.GROUP_JOIN, (e) => firstJoins.push(e.payload.memberAssignment[topic] || []));
  const secondJoin = assigned(second);
  await first.run({ eachMessage: async () => {} });
  await second.run({ eachMessage: async () => {} });
  const both = (await secondJoin)[topic] || [];
  // Wait until the first member has joined the same generation as the second.
  const deadline = Date.now() + 30000;
  while (firstJoins.length === 0 || firstJoins[firstJoins.length - 1].length + both.length !== 4) {
    if (Date.now() > deadline) throw new Error(`no split: ${JSON.stringify(firstJoins)} ${both}`);
    await new Promise((r) => setTimeout(r, 50));
  }
  const split = [firstJoins[firstJoins.length - 1], both];
  const alone = assigned(first);
  await second.disconnect();
  const after = (await alone)[topic] || [];
  await first.disconnect();
  console.log(JSON.stringify({ split, after }));
}

main().catch((err) => {
  console.error(err);
  process.exit(1);
});
