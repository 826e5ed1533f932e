// rocketmq-client-nodejs PushConsumer against polymq: consumes COUNT messages of TOPIC
// (failing each message's first delivery, so the retry path runs), then prints one JSON
// line with what it saw.
// usage: node tests/nodejs/rocketmq_push_consumer.js HOST:PORT TOPIC GROUP COUNT
'use strict';
const { PushConsumer, ConsumeResult } = require('rocketmq-client-nodejs');

async function main() {
  const [endpoints, topic, group, countText] = process.argv.slice(2);
  const count = Number(countText || '5');
  const deliveries = [];
  const done = new Set();
  let finish;
  const finished = new Promise((resolve) => { finish = resolve; });
  const consumer = new PushConsumer({
    endpoints,
    consumerGroup: group,
    subscriptions: new Map([[topic, '*']]),
    messageListener: {
      async consume(message) {
        const body = message.body.toString();
        deliveries.push({ body, attempt: message.deliveryAttempt });
        if (message.deliveryAttempt < 2) return ConsumeResult.FAILURE;
        done.add(body);
        if (done.size >= count) finish();
        return ConsumeResult.SUCCESS;
      },
    },
  });
  await consumer.startup();
  console.log(JSON.stringify({ started: true }));
  const timer = setTimeout(finish, 60000);
  await finished;
  clearTimeout(timer);
  await new Promise((resolve) => setTimeout(resolve, 500)); // let the last ack go out
  await consumer.shutdown();
  console.log(JSON.stringify({ deliveries }));
}

main().then(() => process.exit(0), (err) => {
  console.error(err);
  process.exit(1);
});
