// A rocketmq-client-nodejs producer that stays connected until stdin closes, for
// server-initiated Telemetry commands. Prints its client id once started.
// usage: node tests/nodejs/rocketmq_idle_client.js HOST:PORT TOPIC
'use strict';
const { Producer } = require('rocketmq-client-nodejs');

async function main() {
  const [endpoints, topic] = process.argv.slice(2);
  const producer = new Producer({ endpoints, topics: [topic] });
  await producer.startup();
  console.log(JSON.stringify({ clientId: producer.clientId }));
  process.stdin.resume();
  await new Promise((resolve) => process.stdin.on('end', resolve));
  await producer.shutdown();
}

main().then(() => process.exit(0), (err) => {
  console.error(err);
  process.exit(1);
});
