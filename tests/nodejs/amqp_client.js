// amqplib (node) against polymq's AMQP listener: work queue with prefetch and acks,
// fanout, confirms, mandatory returns, nack/requeue with redelivered, RPC over
// direct reply-to, headers round trip, priorities, DLX + TTL. Prints one JSON line of
// results; exits 1 on failure. Usage: node tests/nodejs/amqp_client.js PORT SUFFIX
const amqp = require("amqplib");

async function main() {
  const [port, suffix] = process.argv.slice(2);
  const conn = await amqp.connect(`amqp://guest:guest@127.0.0.1:${port}/`);
  const results = {};
  try {
    const ch = await conn.createConfirmChannel();
    const work = `node-work-${suffix}`;
    await ch.assertQueue(work, { durable: true });
    for (let i = 0; i < 20; i++) {
      ch.sendToQueue(work, Buffer.from(String(i)), { persistent: true, headers: { n: i, s: "x" } });
    }
    await ch.waitForConfirms();
    await ch.prefetch(5);
    const got = [];
    let requeued = false;
    let redelivered = false;
    let headers = null;
    await new Promise((resolve) => {
      ch.consume(work, (msg) => {
        const n = Number(msg.content.toString());
        if (n === 7 && !requeued) {
          requeued = true;
          ch.nack(msg, false, true);
          return;
        }
        if (n === 7) redelivered = msg.fields.redelivered;
        if (n === 3) headers = msg.properties.headers;
        got.push(n);
        ch.ack(msg);
        if (got.length === 20) resolve();
      });
    });
    results.work = got.slice().sort((a, b) => a - b);
    results.redelivered = redelivered;
    results.headers = headers;

    const fan = `node-fan-${suffix}`;
    await ch.assertExchange(fan, "fanout", { durable: false });
    const q1 = (await ch.assertQueue("", { exclusive: true })).queue;
    const q2 = (await ch.assertQueue("", { exclusive: true })).queue;
    await ch.bindQueue(q1, fan, "");
    await ch.bindQueue(q2, fan, "");
    ch.publish(fan, "", Buffer.from("to-all"));
    await ch.waitForConfirms();
    const m1 = await ch.get(q1, { noAck: true });
    const m2 = await ch.get(q2, { noAck: true });
    results.fanout = [m1 && m1.content.toString(), m2 && m2.content.toString()];

    const returned = new Promise((resolve) => ch.once("return", (msg) => resolve(msg.fields.replyCode)));
    ch.publish("", `node-nobody-${suffix}`, Buffer.from("lost"), { mandatory: true });
    results.returnCode = await returned;

    const service = `node-rpc-${suffix}`;
    const sch = await conn.createChannel();
    await sch.assertQueue(service, { autoDelete: true });
    await sch.consume(service, (msg) => {
      sch.sendToQueue(msg.properties.replyTo, Buffer.from(msg.content.toString().toUpperCase()), {
        correlationId: msg.properties.correlationId,
      });
      sch.ack(msg);
    });
    const cch = await conn.createChannel();
    const reply = new Promise((resolve) => {
      cch.consume("amq.rabbitmq.reply-to", (msg) => resolve([msg.content.toString(), msg.properties.correlationId]), { noAck: true });
    });
    cch.sendToQueue(service, Buffer.from("hello"), { replyTo: "amq.rabbitmq.reply-to", correlationId: "c9" });
    results.rpc = await reply;

    // Priorities: the highest level first.
    const prio = `node-prio-${suffix}`;
    await ch.assertQueue(prio, { maxPriority: 3 });
    for (const p of [1, 3, 0, 2]) ch.sendToQueue(prio, Buffer.from(String(p)), { priority: p });
    await ch.waitForConfirms();
    results.priorities = [];
    for (let i = 0; i < 4; i++) results.priorities.push((await ch.get(prio, { noAck: true })).content.toString());

    // DLX + TTL: the message expires unconsumed and arrives dead-lettered.
    const dlx = `node-dlx-${suffix}`;
    const dead = `node-dead-${suffix}`;
    await ch.assertExchange(dlx, "fanout");
    await ch.assertQueue(dead);
    await ch.bindQueue(dead, dlx, "");
    const ttl = `node-ttl-${suffix}`;
    await ch.assertQueue(ttl, { messageTtl: 100, deadLetterExchange: dlx });
    ch.sendToQueue(ttl, Buffer.from("late"));
    await ch.waitForConfirms();
    const deadline = Date.now() + 20000;
    let deadMsg = false;
    while (!deadMsg && Date.now() < deadline) {
      deadMsg = await ch.get(dead, { noAck: true });
      if (!deadMsg) await new Promise((r) => setTimeout(r, 50));
    }
    results.deadLettered = deadMsg && [deadMsg.content.toString(), deadMsg.properties.headers["x-death"][0].reason];

    // A 404 closes only the channel; the connection keeps working.
    const bad = await conn.createChannel();
    const closed = new Promise((resolve) => bad.on("error", (err) => resolve(err.code)));
    bad.publish(`node-missing-${suffix}`, "k", Buffer.from("x"));
    results.missingExchange = await closed;
    const after = await conn.createChannel();
    results.afterError = (await after.checkQueue(work)).queue;
  } finally {
    await conn.close();
  }
  console.log(JSON.stringify(results));
}

main().catch((err) => {
  console.error(err);
  process.exit(1);
});
