// mqtt.js for the conformance suite: one subscriber at QoS MAXQOS, a publisher sends at
// every QoS from 0 to MAXQOS. Prints one JSON line with the grants and what arrived.
// usage: node tests/nodejs/conformance_mqtt.js URL LEVEL MAXQOS TOPIC [USER PASSWORD]
'use strict';
const mqtt = require('mqtt');

async function main() {
  const [url, level, maxQos, topic, username, password] = process.argv.slice(2);
  const levels = [0, 1, 2].slice(0, Number(maxQos) + 1);
  const opts = { protocolVersion: Number(level), connectTimeout: 5000, reconnectPeriod: 0, username, password };
  const sub = await mqtt.connectAsync(url, { ...opts, clientId: `${topic.replace(/\W/g, '')}s` });
  const pub = await mqtt.connectAsync(url, { ...opts, clientId: `${topic.replace(/\W/g, '')}p` });
  const got = [];
  const done = new Promise((resolve) => {
    sub.on('message', (t, payload, packet) => {
      got.push([t, payload.toString(), packet.qos]);
      if (got.length === levels.length) resolve();
    });
  });
  const granted = await sub.subscribeAsync(topic, { qos: Number(maxQos) });
  for (const qos of levels) await pub.publishAsync(topic, `m${qos}`, { qos });
  await done;
  await pub.endAsync();
  await sub.endAsync();
  console.log(JSON.stringify({ granted: granted.map((g) => g.qos), got }));
}

const timer = setTimeout(() => { console.error('timeout'); process.exit(2); }, 30000);
main().then(() => { clearTimeout(timer); process.exit(0); }, (e) => { console.error(String(e && e.stack || e)); process.exit(1); });
