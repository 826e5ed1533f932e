// mqtt.js against polymq: every QoS both ways, a retained message, v5 user
// properties. Usage: node mqtt_roundtrip.js URL PROTOCOL_VERSION. Prints JSON.
const mqtt = require("mqtt");

const url = process.argv[2];
const protocolVersion = Number(process.argv[3] || 4);
const opts = { protocolVersion, connectTimeout: 10000, reconnectPeriod: 0 };

function connect(clientId) {
  return mqtt.connectAsync(url, { ...opts, clientId });
}

async function main() {
  const timer = setTimeout(() => {
    console.error("timeout");
    process.exit(2);
  }, 60000);
  const sub = await connect(`js-sub-${protocolVersion}`);
  const pub = await connect(`js-pub-${protocolVersion}`);
  const received = [];
  let userProperties = null;
  const done = new Promise((resolve) => {
    sub.on("message", (topic, payload, packet) => {
      received.push([topic, payload.toString(), packet.qos]);
      if (packet.properties && packet.properties.userProperties) {
        userProperties = packet.properties.userProperties;
      }
      if (received.length === 3) resolve();
    });
  });
  await sub.subscribeAsync("js/+", { qos: 2 });
  const props = protocolVersion === 5 ? { properties: { userProperties: { k: "v" } } } : {};
  for (const qos of [0, 1, 2]) {
    await pub.publishAsync(`js/${qos}`, `q${qos}`, { qos, ...props });
  }
  await done;
  const firstThree = received.slice(0, 3).sort();
  await pub.publishAsync("js/keep", "kept", { qos: 1, retain: true });
  const late = await connect(`js-late-${protocolVersion}`);
  const retained = await new Promise((resolve) => {
    late.on("message", (topic, payload, packet) => resolve([topic, payload.toString(), packet.retain]));
    late.subscribe("js/keep", { qos: 1 });
  });
  await Promise.all([sub.endAsync(), pub.endAsync(), late.endAsync()]);
  clearTimeout(timer);
  console.log(JSON.stringify({ received: firstThree, retained, userProperties }));
}

main().catch((err) => {
  console.error(err);
  process.exit(1);
});
