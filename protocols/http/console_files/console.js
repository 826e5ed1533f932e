// The polymq web console: plain JavaScript over the admin API (docs/admin.md), no
// build step. Each page is a function that fetches what it shows and draws it into
// <main>; actions call the same API as `polymq admin` and redraw their page.
"use strict";

const main = document.getElementById("main");
const loginForm = document.getElementById("login");
let timer = null;

function credentials() {
  return sessionStorage.getItem("polymq-auth");
}

async function api(method, path, body) {
  // X-Requested-With: the API then answers 401 without a Basic challenge, which
  // would hold the request behind the browser's own password prompt.
  const headers = { Accept: "application/json", "X-Requested-With": "XMLHttpRequest" };
  const auth = credentials();
  if (auth) headers.Authorization = "Basic " + auth;
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const response = await fetch(path, {
    method, headers, body: body === undefined ? undefined : JSON.stringify(body),
  });
  if (response.status === 401) {
    showLogin(credentials() ? "wrong user name or password" : "");
    throw new Error("sign in first");
  }
  if (!response.ok) {
    let detail = response.statusText;
    try { detail = JSON.stringify((await response.json()).detail); } catch (e) { /* text */ }
    throw new Error(`${method} ${path}: ${response.status} ${detail}`);
  }
  return response.status === 204 ? {} : response.json();
}

function showLogin(error) {
  main.hidden = true;
  loginForm.hidden = false;
  document.getElementById("login-error").textContent = error || "";
}

loginForm.addEventListener("submit", (event) => {
  event.preventDefault();
  const user = document.getElementById("login-user").value;
  const password = document.getElementById("login-password").value;
  sessionStorage.setItem("polymq-auth", btoa(`${user}:${password}`));
  document.getElementById("who").textContent = user;
  loginForm.hidden = true;
  main.hidden = false;
  route();
});

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else if (value !== undefined && value !== null) node.setAttribute(key, value);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function table(id, headers, rows) {
  return el("table", { id },
    el("thead", {}, el("tr", {}, headers.map((h) => el("th", {}, h)))),
    el("tbody", {}, rows));
}

function cell(value) {
  return el("td", { class: typeof value === "number" ? "num" : null }, value ?? "");
}

let lastStatus = ["", false];  // the latest action's outcome, kept across redraws

function status(text, isError) {
  lastStatus = [text, Boolean(isError)];
  const line = document.getElementById("status");
  if (line) { line.textContent = text; line.className = isError ? "error" : ""; }
}

async function act(what, call) {
  try {
    const result = await call();
    status(what + ": done");
    return result;
  } catch (e) {
    status(e.message, true);
    return null;
  }
}

function field(name, placeholder, value) {
  return el("input", { name, placeholder, value });
}

function values(form) {
  return Object.fromEntries(new FormData(form).entries());
}

// -- pages -----------------------------------------------------------------------

const history = [];  // [time, messages in, messages out] per poll, for the chart

async function overview() {
  const [connections, usage, nodes] = await Promise.all([
    api("GET", "/admin/connections"), api("GET", "/admin/usage"), api("GET", "/admin/nodes"),
  ]);
  const perProtocol = {};
  let totalIn = 0;
  let totalOut = 0;
  for (const u of usage.usage) {
    const p = (perProtocol[u.protocol] ||= { in: 0, out: 0 });
    p.in += u.messages_in; p.out += u.messages_out;
    totalIn += u.messages_in; totalOut += u.messages_out;
  }
  history.push([Date.now(), totalIn, totalOut]);
  if (history.length > 60) history.shift();
  const rate = history.length > 1 ? (() => {
    const [t0, i0, o0] = history[history.length - 2];
    const [t1, i1, o1] = history[history.length - 1];
    const s = Math.max(0.001, (t1 - t0) / 1000);
    return [((i1 - i0) / s).toFixed(1), ((o1 - o0) / s).toFixed(1)];
  })() : ["–", "–"];
  const cards = el("div", { class: "cards", id: "overview-cards" },
    card("messages in/s", rate[0]), card("messages out/s", rate[1]),
    card("messages in", totalIn), card("messages out", totalOut),
    card("connections", connections.connections.length),
    card("storage", nodes.form === "merged" ? "embedded" : `${nodes.nodes.length} nodes`),
    // Bytes used on disk are not reported by the engine or the nodes; the nodes'
    // heartbeats carry the free space of their data directories: the least of them
    // (nodes may share a disk, so a sum would count it twice).
    nodes.form === "merged" || !nodes.nodes.length ? null : card("disk free (least, per node)",
      bytes(Math.min(...nodes.nodes.map((x) => x.disk_free_bytes)))));
  const canvas = el("canvas", { id: "chart", width: 600, height: 140 });
  draw(canvas);
  return [
    el("h2", {}, "Overview"), cards,
    el("h2", {}, "Messages in (green) and out (blue) per second"), canvas,
    el("h2", {}, "Per protocol"),
    table("overview-protocols", ["protocol", "connections", "messages in", "messages out"],
      [...new Set([...Object.keys(perProtocol), ...Object.keys(connections.per_protocol)])]
        .sort().map((p) => el("tr", { "data-name": p }, cell(p),
          cell(connections.per_protocol[p] || 0), cell(perProtocol[p]?.in || 0),
          cell(perProtocol[p]?.out || 0)))),
  ];
}

function card(label, value) {
  return el("div", { class: "card" }, el("div", {}, label), el("div", { class: "value" }, value));
}

function draw(canvas) {
  const ctx = canvas.getContext("2d");
  const rates = history.slice(1).map((h, i) => {
    const prev = history[i];
    const s = Math.max(0.001, (h[0] - prev[0]) / 1000);
    return [(h[1] - prev[1]) / s, (h[2] - prev[2]) / s];
  });
  const top = Math.max(1, ...rates.flat());
  for (const [index, color] of [[0, "#2e7d32"], [1, "#1565c0"]]) {
    ctx.strokeStyle = color;
    ctx.beginPath();
    rates.forEach((r, i) => {
      const x = (i / 59) * canvas.width;
      const y = canvas.height - (r[index] / top) * (canvas.height - 10) - 5;
      if (i === 0) ctx.moveTo(x, y); else ctx.lineTo(x, y);
    });
    ctx.stroke();
  }
}

function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return i ? `${n.toFixed(1)} ${units[i]}` : `${n} B`;
}

function duration(ms) {
  for (const [unit, size] of [["d", 86400000], ["h", 3600000], ["min", 60000], ["s", 1000]]) {
    if (ms >= size && ms % size === 0) return `${ms / size} ${unit}`;
  }
  return `${ms} ms`;
}

function ago(ms) {
  const s = Math.max(0, Math.round(ms / 1000));
  if (s < 120) return `${s} s ago`;
  if (s < 7200) return `${Math.floor(s / 60)} min ago`;
  if (s < 172800) return `${Math.floor(s / 3600)} h ago`;
  return `${Math.floor(s / 86400)} d ago`;
}

function retention(config) {
  // The topic's own retention; none set: the engine's default ([storage] retention).
  const parts = [];
  if (config.retention_ms === -1) parts.push("until consumed");
  else if (config.retention_ms) parts.push(duration(config.retention_ms));
  if (config.retention_bytes) parts.push(bytes(config.retention_bytes));
  return parts.join(", ") || "default";
}

// The previous look at the topics: [time, {"ns/topic": [appended, consumed]}], so
// each look shows what came in and went out since the one before, and its rate.
let topicSample = null;

function sinceLast(key, appended, consumed, now) {
  if (!topicSample || !(key in topicSample[1])) return ["–", "–", "–", "–"];
  const [before, [a0, c0]] = [topicSample[0], topicSample[1][key]];
  const s = Math.max(0.001, (now - before) / 1000);
  // A group reset back (or a topic made anew) is no traffic: counted as none.
  const i = Math.max(0, appended - a0);
  const o = Math.max(0, consumed - c0);
  return [i, (i / s).toFixed(1), o, (o / s).toFixed(1)];
}

async function topics() {
  const [data, groupsData] = await Promise.all([
    api("GET", "/admin/topics"), api("GET", "/admin/groups")]);
  // Who reads each topic: the groups with a committed offset (or a popped queue) on
  // it; "consumed" sums the committed offsets of its offset groups.
  const readers = {};
  const consumed = {};
  for (const g of groupsData.groups) {
    for (const q of g.queues) {
      const key = `${g.namespace}/${q.topic}`;
      (readers[key] ||= new Set()).add(g.name);
      if (q.committed !== undefined) consumed[key] = (consumed[key] || 0) + q.committed;
    }
  }
  const now = Date.now();
  const sample = {};
  const create = el("form", { class: "inline", id: "topic-create", onsubmit: async (e) => {
    e.preventDefault();
    const v = values(e.target);
    await act(`create topic ${v.name}`, () => api("POST", `/admin/topics/${v.namespace}`,
      { name: v.name, queue_count: Number(v.queue_count || 1) }));
    route();
  } }, "New topic", field("namespace", "namespace", "default"), field("name", "name"),
  field("queue_count", "queues", "1"), el("button", { type: "submit" }, "Create"));
  const peeked = el("div", { id: "peeked" });
  const rows = data.topics.map((t) => {
    const key = `${t.namespace}/${t.name}`;
    const appended = t.queues.reduce((n, q) => n + q.latest, 0);
    sample[key] = [appended, consumed[key] || 0];
    const [inSince, inRate, outSince, outRate] = sinceLast(key, appended, consumed[key] || 0, now);
    return el("tr", { "data-name": t.name },
      cell(t.namespace), cell(t.name), cell(t.config.queue_count), cell(t.config.message_type),
      cell(t.queues.reduce((n, q) => n + q.latest - q.earliest, 0)),
      cell(inSince), cell(inRate), cell(outSince), cell(outRate),
      cell([...(readers[key] || [])].sort().join(", ")), cell(retention(t.config)),
      el("td", {},
        el("button", { class: "peek", onclick: async () => {
          const m = await act("peek", () => api("GET",
            `/admin/topics/${t.namespace}/${encodeURIComponent(t.name)}/messages?limit=20`));
          if (m) peeked.replaceChildren(...messages(`Messages of ${t.name}`, m.messages));
        } }, "Peek"),
        el("form", { class: "inline publish", onsubmit: async (e) => {
          e.preventDefault();
          await act(`publish to ${t.name}`, () => api("POST",
            `/admin/topics/${t.namespace}/${encodeURIComponent(t.name)}/messages`,
            { body: values(e.target).body }));
          route();
        } }, field("body", "test message"), el("button", { type: "submit" }, "Publish")),
        el("button", { class: "delete", onclick: async () => {
          if (!confirm(`Delete topic ${t.name} and its messages?`)) return;
          await act(`delete ${t.name}`, () => api("DELETE",
            `/admin/topics/${t.namespace}/${encodeURIComponent(t.name)}`));
          route();
        } }, "Delete")));
  });
  topicSample = [now, sample];
  return [el("h2", {}, "Topics"), create,
    el("p", {}, "In and out: messages appended, and committed by the topic's offset groups, " +
      "since the previous look at this page, and per second."),
    table("topics-table", ["namespace", "topic", "queues", "type", "messages", "in", "in/s",
      "out", "out/s", "groups", "retention", ""], rows), peeked];
}

function messages(title, list) {
  return [el("h2", {}, title), table("messages-table",
    ["queue", "offset", "size", "tag", "key", "body", "properties"],
    list.map((m) => el("tr", {}, cell(m.queue_id), cell(m.offset), cell(m.size), cell(m.tag),
      cell(m.key), cell(m.body + (m.truncated ? "…" : "")),
      cell(Object.entries(m.properties).map(([k, v]) => `${k}=${v}`).join(", ")))))];
}

function amqpFlags(q) {
  const flags = [["durable", "D"], ["exclusive", "Excl"], ["auto_delete", "AD"]]
    .filter(([key]) => q[key]).map(([, short]) => short);
  return flags.join(" ") || "-";
}

async function queues() {
  const data = await api("GET", "/admin/queues");
  const peeked = el("div", { id: "peeked" });
  const create = el("form", { class: "inline", id: "queue-create", onsubmit: async (e) => {
    e.preventDefault();
    const v = values(e.target);
    await act(`create queue ${v.name}`, () => api("PUT",
      `/admin/queues/${v.namespace}/${encodeURIComponent(v.name)}`));
    route();
  } }, "New MNS queue", field("namespace", "namespace", "default"), field("name", "name"),
  el("button", { type: "submit" }, "Create"));
  // MNS queues have actions here; AMQP queues are managed by their clients (as
  // RabbitMQ's own), shown with their flags, consumers and bindings.
  const rows = data.queues.map((q) => {
    const path = `/admin/queues/${q.namespace}/${encodeURIComponent(q.name)}`;
    const actions = q.kind !== "mns" ? el("td", {}) : el("td", {},
      el("button", { class: "peek", onclick: async () => {
        const m = await act("peek", () => api("GET", path + "/messages?limit=20"));
        if (m) peeked.replaceChildren(...messages(`Messages of ${q.name}`, m.messages));
      } }, "Peek"),
      el("button", { class: "purge", onclick: async () => {
        const r = await act(`purge ${q.name}`, () => api("POST", path + "/purge"));
        if (r) { status(`purged ${r.purged} messages from ${q.name}`); route(); }
      } }, "Purge"),
      el("button", { class: "delete", onclick: async () => {
        if (!confirm(`Delete queue ${q.name}?`)) return;
        await act(`delete ${q.name}`, () => api("DELETE", path));
        route();
      } }, "Delete"));
    const amqp = q.kind === "amqp";
    return el("tr", { "data-name": q.name, "data-kind": q.kind },
      cell(q.kind), cell(q.namespace), cell(q.name), cell(q.messages_ready),
      cell(q.messages_unacked), cell(amqp ? "" : q.delayed), cell(amqp ? q.consumer_count : ""),
      cell(amqp ? amqpFlags(q) : ""),
      cell(amqp ? q.consumers.map((c) => `${c.consumer_tag} (connection ${c.connection_id}` +
        ` on ${c.gateway})`).join(", ") : ""),
      cell(amqp ? q.bindings.map((b) => `${b.exchange} → ${b.routing_key}`).join(", ") : ""),
      actions);
  });
  return [el("h2", {}, "Queues"), create,
    table("queues-table", ["kind", "namespace", "queue", "ready", "unacked", "delayed",
      "consumers", "flags", "consumer tags", "bindings", ""], rows),
    peeked];
}

async function groups() {
  const data = await api("GET", "/admin/groups");
  const rows = data.groups.map((g) => {
    // Offsets can be reset on the topics a group commits offsets for (pop groups have none).
    const topicsOf = [...new Set(g.queues.filter((q) => q.committed !== undefined)
      .map((q) => q.topic))];
    return el("tr", { "data-name": g.name },
      cell(g.namespace), cell(g.name), cell(g.lag),
      // Offset groups: committed/latest per queue; pop groups (MNS, AMQP, MQTT): the
      // queue's messages not yet acknowledged and how many of them are in flight.
      cell(g.queues.map((q) => q.committed === undefined
        ? `${q.topic}: ${q.lag} (${q.inflight} in flight)`
        : `${q.topic}[${q.queue_id}] ${q.committed}/${q.latest}`).join(", ")),
      el("td", {}, !topicsOf.length ? null : el("form", { class: "inline reset", onsubmit: async (e) => {
        e.preventDefault();
        const v = values(e.target);
        const body = { topic: v.topic, to: v.to };
        if (v.to === "offset") body.offset = Number(v.value);
        if (v.to === "timestamp") body.timestamp_ms = Number(v.value);
        await act(`reset ${g.name}`, () => api("POST",
          `/admin/groups/${g.namespace}/${encodeURIComponent(g.name)}/reset-offsets`, body));
        route();
      } },
      el("select", { name: "topic" }, topicsOf.map((t) => el("option", { value: t }, t))),
      el("select", { name: "to" }, ["earliest", "latest", "offset", "timestamp"]
        .map((t) => el("option", { value: t }, t))),
      field("value", "offset / ms"), el("button", { type: "submit" }, "Reset offsets")),
      el("button", { class: "members", onclick: async () => {
        const d = await act(`members of ${g.name}`, () => api("GET",
          `/admin/groups/${g.namespace}/${encodeURIComponent(g.name)}`));
        if (d) described.replaceChildren(...members(d));
      } }, "Members")));
  });
  const described = el("div", { id: "described" });
  return [el("h2", {}, "Consumer groups"),
    el("p", {}, "Stop a group's consumers before resetting its offsets."),
    table("groups-table", ["namespace", "group", "lag", "queues", ""], rows),
    described];
}

function members(d) {
  // A group's members of every protocol, and the queues it pops (AMQP, MQTT shared)
  // with their lag.
  const shown = [el("h2", {}, `Members of ${d.name}`),
    table("members-table", ["protocol", "member", "client id", "host", "queue / filter",
      "connected"], d.members.map((m) => el("tr", { "data-name": m.client_id },
      cell(m.protocol), cell(m.member_id), cell(m.client_id), cell(m.client_host),
      cell(m.queue || m.filter || ""),
      cell(m.connected === undefined ? "" : (m.connected ? "yes" : "no")))))];
  if (d.pop_queues.length) {
    shown.push(el("h2", {}, `Queues ${d.name} pops`), table("pop-queues-table",
      ["kind", "queue", "ready", "unacked", "lag", "consumers"],
      d.pop_queues.map((q) => el("tr", { "data-name": q.queue }, cell(q.kind), cell(q.queue),
        cell(q.ready), cell(q.unacked), cell(q.lag), cell(q.consumers)))));
  }
  return shown;
}

async function connections() {
  const data = await api("GET", "/admin/connections");
  const now = Date.now();
  // Rates: what metering counted for the connection over the time it has been open.
  const perSecond = (n, c) => n === null ? "–"
    : (n / Math.max(0.001, (now - c.opened_ms) / 1000)).toFixed(1);
  const rows = data.connections.map((c) => el("tr", { "data-id": c.id },
    cell(c.id), cell(c.protocol), cell(c.peer), cell(c.user), cell(c.namespace), cell(c.client_id),
    cell(c.tls === null ? "?" : (c.tls ? "yes" : "no") + (c.certificate ? ` (${c.certificate})` : "")),
    cell(ago(now - c.opened_ms)),
    cell(c.messages_in ?? "–"), cell(c.messages_out ?? "–"),
    cell(bytes(c.bytes_in)), cell(bytes(c.bytes_out)),
    cell(perSecond(c.messages_in, c)), cell(perSecond(c.messages_out, c)),
    el("td", {}, el("button", { class: "close", onclick: async () => {
      await act(`close ${c.id}`, () => api("DELETE", `/admin/connections/${c.id}`));
      route();
    } }, "Close"))));
  return [el("h2", {}, "Connections (this gateway)"),
    el("p", {}, "Messages and bytes as metering counted them for the connection since " +
      "it opened; – where its protocol's work is not counted per connection (HTTP, " +
      "RocketMQ) or nothing was yet. TLS ? : its listener does not say."),
    table("connections-table", ["id", "protocol", "peer", "user", "namespace", "client id",
      "TLS", "opened", "msgs in", "msgs out", "bytes in", "bytes out", "in/s", "out/s", ""],
    rows)];
}

async function namespaces() {
  const data = await api("GET", "/admin/namespaces");
  const create = el("form", { class: "inline", id: "namespace-create", onsubmit: async (e) => {
    e.preventDefault();
    const v = values(e.target);
    await act(`create namespace ${v.name}`, () => api("POST", "/admin/namespaces",
      { name: v.name }));
    route();
  } }, "New namespace", field("name", "name"), el("button", { type: "submit" }, "Create"));
  return [el("h2", {}, "Namespaces"), create,
    table("namespaces-table", ["namespace", "topics", "queues"],
      data.namespaces.map((n) => el("tr", { "data-name": n.name },
        cell(n.name), cell(n.topics), cell(n.queues))))];
}

async function cluster() {
  const [nodes, gateways] = await Promise.all([
    api("GET", "/admin/nodes"), api("GET", "/admin/gateways")]);
  const nodeRows = nodes.nodes.map((n) => el("tr", { "data-name": n.node_id },
    cell(n.node_id), cell(n.address), cell(n.alive ? "up" : "DOWN"), cell(n.topics),
    cell(n.load), cell(`${(n.last_seen_ms_ago / 1000).toFixed(1)} s ago`),
    cell(n.owner ? `${n.owner} (epoch ${n.epoch})` : "")));
  const gatewayRows = gateways.gateways.map((g) => el("tr", { "data-name": g.gateway_id },
    cell(g.gateway_id + (g.gateway_id === gateways.self ? " (this one)" : "")), cell(g.zone),
    cell(g.load), cell(Object.entries(g.endpoints).map(([p, a]) => `${p}=${a}`).join(" "))));
  return [el("h2", {}, "Storage"),
    nodes.form === "merged" ? el("p", { id: "storage-form" }, "Merged form: one embedded engine.")
      : table("nodes-table", ["node", "address", "health", "topics", "load", "last heartbeat",
        "shard owner"], nodeRows),
    el("h2", {}, "Gateways"),
    table("gateways-table", ["gateway", "zone", "load", "endpoints"], gatewayRows)];
}

async function accounts() {
  const [data, rules] = await Promise.all([
    api("GET", "/admin/accounts"), api("GET", "/admin/permissions")]);
  return [el("h2", {}, `Accounts (auth mode: ${data.mode})`),
    table("accounts-table", ["user", "admin", "namespaces", "access key", "password", "SCRAM"],
      data.accounts.map((a) => el("tr", { "data-name": a.user }, cell(a.user),
        cell(a.admin ? "yes" : ""), cell(a.namespaces.join(", ") || "*"), cell(a.access_key),
        cell(a.has_password ? "yes" : ""), cell(a.scram.join(", "))))),
    el("h2", {}, "Permission rules"), addRule(),
    table("permissions-table", ["principal", "namespace", "resource", "pattern", "match",
      "operations", "effect", "source", ""],
      rules.rules.map((r) => el("tr", { "data-name": r.key }, cell(r.principal),
        cell(r.namespace), cell(r.resource), cell(r.pattern), cell(r.match),
        cell(r.operations.join(",")), cell(r.effect), cell(r.source),
        // Configured rules are read-only (the API answers 409): only stored ones go.
        el("td", {}, r.source !== "stored" ? null : el("button", { class: "delete",
          onclick: async () => {
            if (!confirm(`Delete the rule for ${r.principal} on ${r.pattern}?`)) return;
            await act(`delete rule ${r.key}`, () => api("DELETE",
              `/admin/permissions/${r.namespace}/${encodeURIComponent(r.key)}`));
            route();
          } }, "Delete"))))),
  ];
}

function choice(name, options) {
  return el("select", { name }, options.map((o) => el("option", { value: o }, o)));
}

function addRule() {
  // A rule as docs/permissions.md describes it; operations comma-separated ("all").
  return el("form", { class: "inline", id: "permission-add", onsubmit: async (e) => {
    e.preventDefault();
    const v = values(e.target);
    const rule = { principal: v.principal, namespace: v.namespace, resource: v.resource,
      pattern: v.pattern, match: v.match, effect: v.effect,
      operations: v.operations.split(",").map((o) => o.trim()).filter((o) => o) };
    const added = await act(`add rule for ${v.principal}`,
      () => api("POST", "/admin/permissions", rule));
    if (added) status(`added rule ${added.key}`);
    route();
  } }, "New rule", field("principal", "account"), field("namespace", "namespace", "default"),
  choice("resource", ["topic", "group", "transactional_id"]), field("pattern", "name or *"),
  choice("match", ["literal", "prefix", "glob"]), field("operations", "read,write,…"),
  choice("effect", ["allow", "deny"]), el("button", { type: "submit" }, "Add"));
}

const pages = {
  overview, namespaces, topics, queues, groups, connections, cluster, accounts,
};

async function route() {
  clearInterval(timer);
  const name = (location.hash || "#overview").slice(1);
  const page = pages[name] || overview;
  for (const a of document.querySelectorAll("#nav a")) {
    a.classList.toggle("active", a.getAttribute("href") === `#${name}`);
  }
  try {
    const content = await page();
    main.replaceChildren(
      el("p", { id: "status", class: lastStatus[1] ? "error" : null }, lastStatus[0]),
      ...content.flat());
    main.dataset.page = name;
    main.dataset.loaded = String(Date.now());
  } catch (e) {
    if (!loginForm.hidden) return;
    main.replaceChildren(el("p", { class: "error", id: "status" }, e.message));
  }
  if (name === "overview") timer = setInterval(route, 2000);
}

window.addEventListener("hashchange", route);
route();
