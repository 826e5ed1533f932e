// amqplib (node): RabbitMQ's requeue semantics against polymq's AMQP listener. Messages
// given back by reject / nack with requeue (single and allUpTo), by closing a channel
// and by closing a connection are ready at once: counted by checkQueue (a passive
// declare), returned by get, redelivered, in their original order. Prints one JSON
// line of results; exits 1 on failure. Usage: node tests/nodejs/amqp_requeue.js PORT SUFFIX
const amqp = require("amqplib");

const url = (port) => `amqp://guest:guest@127.0.0.1:${port}/`;

async function ready(ch, queue) {
  return (await ch.checkQueue(queue)).messageCount;
}

async function take(ch, queue, count) {
  const got = [];
  for (let i = 0; i < count; i++) {
    const msg = await ch.get(queue, { noAck: false });
    if (!msg) throw new Error(`get ${i} of ${count} found ${queue} empty`);
    got.push(msg);
  }
  return got;
}

async function drain(ch, queue) {
  const got = [];
  for (;;) {
    const msg = await ch.get(queue, { noAck: true });
    if (!msg) return got;
    got.push([Number(msg.content.toString()), msg.fields.redelivered]);
  }
}

async function main() {
  const [port, suffix] = process.argv.slice(2);
  const conn = await amqp.connect(url(port));
  const results = {};
  try {
    const ch = await conn.createConfirmChannel();
    const queue = `node-requeue-${suffix}`;
    await ch.assertQueue(queue, { durable: true });
    for (let i = 0; i < 5; i++) ch.sendToQueue(queue, Buffer.from(String(i)), { persistent: true });
    await ch.waitForConfirms();

    const [, second, third] = await take(ch, queue, 3);
    results.held = await ready(ch, queue);
    ch.reject(second, true);
    results.afterReject = await ready(ch, queue);
    ch.nack(third, true, true); // allUpTo: the first and the third
    results.afterNack = await ready(ch, queue);
    results.order = await drain(ch, queue);

    for (let i = 0; i < 5; i++) ch.sendToQueue(queue, Buffer.from(String(i)), { persistent: true });
    await ch.waitForConfirms();
    const holder = await conn.createChannel();
    await take(holder, queue, 2);
    await holder.close();
    results.afterChannelClose = await ready(ch, queue);
    const other = await amqp.connect(url(port));
    await take(await other.createChannel(), queue, 3);
    results.heldByConnection = await ready(ch, queue);
    await other.close();
    results.afterConnectionClose = await ready(ch, queue);
    results.afterCloses = await drain(ch, queue);
  } finally {
    await conn.close();
  }
  console.log(JSON.stringify(results));
}

main().catch((err) => {
  console.error(err && err.stack ? err.stack : err);
  process.exit(1);
});
