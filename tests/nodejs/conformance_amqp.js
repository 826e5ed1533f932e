// amqplib for the conformance suite: a confirm channel publishes with properties and
// headers; a consumer gets, nacks (requeue), gets it again redelivered, acks; the
// queue is deleted. Prints one JSON line.
// usage: node tests/nodejs/conformance_amqp.js URL QUEUE
'use strict';
const amqp = require('amqplib');

async function main() {
  const [url, queue] = process.argv.slice(2);
  const conn = await amqp.connect(url);
  const ch = await conn.createConfirmChannel();
  await ch.assertQueue(queue, { durable: true });
  ch.sendToQueue(queue, Buffer.from('hello'), {
    persistent: true, contentType: 'text/plain', correlationId: 'c1', headers: { n: 7, s: 'x' },
  });
  await ch.waitForConfirms();
  const seen = [];
  let consumerTag;
  await new Promise((resolve) => {
    consumerTag = ch.consume(queue, (msg) => {
      if (msg === null) return; // cancelled by the server
      seen.push({
        body: msg.content.toString(), redelivered: msg.fields.redelivered,
        contentType: msg.properties.contentType, correlationId: msg.properties.correlationId,
        headers: msg.properties.headers,
      });
      if (seen.length === 1) ch.nack(msg, false, true);
      else { ch.ack(msg); resolve(); }
    });
  });
  await ch.cancel((await consumerTag).consumerTag);
  await ch.deleteQueue(queue);
  await conn.close();
  console.log(JSON.stringify({ seen }));
}

const timer = setTimeout(() => { console.error('timeout'); process.exit(2); }, 30000);
main().then(() => { clearTimeout(timer); process.exit(0); }, (e) => { console.error(String(e && e.stack || e)); process.exit(1); });
