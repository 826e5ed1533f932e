#!/usr/bin/env bash
# Reference runs: the AMQP and MQTT parts of the conformance suite against RabbitMQ
# (with its MQTT plugin) and Mosquitto from Debian's packages, so the expectations are
# seen to hold against brokers people trust, and against polymq the same way (accounts
# checked), with a side-by-side table (compared.md). Installs the packages if missing
# (needs root and apt), starts each broker on loopback on free ports with its own data
# directory (nothing system-wide is started or changed), writes the reports, stops them.
#
#   conformance/reference.sh [OUT_DIR]      (default: conformance-reports/)
#
# Exit status: 0 when every case passed or was a known-missing feature of that broker.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="$(mkdir -p "${1:-$ROOT/conformance-reports}" && cd "${1:-$ROOT/conformance-reports}" && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
WORK="$(mktemp -d /tmp/polymq-reference.XXXXXX)"
chmod 755 "$WORK" # the brokers drop root for their own users, which must read their files
PIDS=()
status=0

cleanup() {
  [ -n "${ERL_EPMD_PORT:-}" ] && stop_rabbitmq
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT

free_port() {
  "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

wait_port() { # host port seconds
  "$PY" - "$@" <<'PYEOF'
import socket, sys, time
host, port, limit = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
deadline = time.monotonic() + limit
while time.monotonic() < deadline:
    try:
        socket.create_connection((host, port), timeout=1).close()
        sys.exit(0)
    except OSError:
        time.sleep(0.2)
sys.exit(f"nothing listens on {host}:{port} after {limit:g}s")
PYEOF
}

install() {
  local missing=()
  command -v rabbitmq-server >/dev/null || missing+=(rabbitmq-server)
  command -v mosquitto >/dev/null && [ -x /usr/sbin/mosquitto ] || missing+=(mosquitto)
  if [ ${#missing[@]} -gt 0 ]; then
    echo "installing ${missing[*]} from Debian's packages"
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
  fi
  # The packages start system-wide services; ours run apart, so those are left alone.
}

conformance() { # name profile args...
  local name="$1" profile="$2"
  shift 2
  echo "== $name =="
  "$PY" -m conformance.cli --profile "$profile" --title "Conformance of $name" \
    --report "$OUT/$name" --json "$OUT/$name.json" "$@" | tee "$OUT/$name.txt" || status=1
}

start_rabbitmq() {
  local amqp_port="$1" mqtt_port="$2" ws_port="$3" dir="$WORK/rabbitmq"
  mkdir -p "$dir/mnesia" "$dir/log"
  # run as root, rabbitmq-server drops to the rabbitmq user, which must own its files
  trap_owner="$(id -u)"
  cat >"$dir/rabbitmq.conf" <<CONF
listeners.tcp.default = 127.0.0.1:$amqp_port
mqtt.listeners.tcp.default = 127.0.0.1:$mqtt_port
web_mqtt.tcp.ip = 127.0.0.1
web_mqtt.tcp.port = $ws_port
web_mqtt.ws_path = /mqtt
mqtt.allow_anonymous = false
loopback_users.guest = true
CONF
  echo "[rabbitmq_mqtt,rabbitmq_web_mqtt]." >"$dir/enabled_plugins"
  if [ "$trap_owner" = 0 ] && id rabbitmq >/dev/null 2>&1; then
    chown -R rabbitmq:rabbitmq "$dir"
  fi
  export RABBITMQ_NODENAME="polymq-ref-$$@localhost" RABBITMQ_CONFIG_FILE="$dir/rabbitmq" \
    RABBITMQ_MNESIA_BASE="$dir/mnesia" RABBITMQ_LOG_BASE="$dir/log" \
    RABBITMQ_ENABLED_PLUGINS_FILE="$dir/enabled_plugins" \
    RABBITMQ_DIST_PORT="$(free_port)" ERL_EPMD_PORT="$(free_port)" HOME="$dir"
  rabbitmq-server >"$dir/server.out" 2>&1 &
  PIDS+=($!)
  wait_port 127.0.0.1 "$amqp_port" 120 && wait_port 127.0.0.1 "$mqtt_port" 60 &&
    wait_port 127.0.0.1 "$ws_port" 60
}

stop_rabbitmq() {
  rabbitmqctl stop >/dev/null 2>&1 || true
  epmd -port "$ERL_EPMD_PORT" -kill >/dev/null 2>&1 || true # the one Erlang started for it
}

start_mosquitto() {
  local port="$1" ws_port="$2" dir="$WORK/mosquitto"
  mkdir -p "$dir"
  # with a password file, so the refusal of wrong credentials is checked too
  mosquitto_passwd -b -c "$dir/passwd" conformance conformance-password
  chmod 644 "$dir/passwd"
  cat >"$dir/mosquitto.conf" <<CONF
per_listener_settings false
allow_anonymous false
password_file $dir/passwd
persistence false
listener $port 127.0.0.1
listener $ws_port 127.0.0.1
protocol websockets
CONF
  /usr/sbin/mosquitto -c "$dir/mosquitto.conf" >"$dir/out" 2>&1 &
  PIDS+=($!)
  wait_port 127.0.0.1 "$port" 30 && wait_port 127.0.0.1 "$ws_port" 30
}

start_polymq() {
  local amqp_port="$1" mqtt_port="$2" ws_port="$3" dir="$WORK/polymq"
  mkdir -p "$dir"
  cat >"$dir/polymq.toml" <<CONF
[storage]
data_dir = "$dir/data"
[listeners.amqp]
port = $amqp_port
[listeners.mqtt]
port = $mqtt_port
[listeners.kafka]
enabled = false
[listeners.mqtt_ws]
port = $ws_port
[listeners.rocketmq]
enabled = false
[listeners.http]
enabled = false
[auth]
mode = "accounts"
[[auth.accounts]]
user = "conformance"
password = "conformance-password"
CONF
  "$ROOT/.venv/bin/polymq" run --config "$dir/polymq.toml" >"$dir/out" 2>&1 &
  POLYMQ_PID=$!
  PIDS+=("$POLYMQ_PID")
  wait_port 127.0.0.1 "$amqp_port" 60 && wait_port 127.0.0.1 "$mqtt_port" 60
}

cd "$ROOT"
install

amqp_port="$(free_port)"
polymq_mqtt_port="$(free_port)"
polymq_ws_port="$(free_port)"
start_polymq "$amqp_port" "$polymq_mqtt_port" "$polymq_ws_port"
conformance polymq polymq --protocols amqp,mqtt --amqp-port "$amqp_port" \
  --mqtt-port "$polymq_mqtt_port" --mqtt-ws-port "$polymq_ws_port" \
  --user conformance --password conformance-password --auth-enforced
kill "$POLYMQ_PID" && wait "$POLYMQ_PID" || true

amqp_port="$(free_port)"
rabbit_mqtt_port="$(free_port)"
rabbit_ws_port="$(free_port)"
start_rabbitmq "$amqp_port" "$rabbit_mqtt_port" "$rabbit_ws_port"
conformance rabbitmq rabbitmq --protocols amqp,mqtt --amqp-port "$amqp_port" \
  --mqtt-port "$rabbit_mqtt_port" --mqtt-ws-port "$rabbit_ws_port" \
  --user guest --password guest --auth-enforced
stop_rabbitmq

mosquitto_port="$(free_port)"
mosquitto_ws_port="$(free_port)"
start_mosquitto "$mosquitto_port" "$mosquitto_ws_port"
conformance mosquitto mosquitto --protocols mqtt --mqtt-port "$mosquitto_port" \
  --mqtt-ws-port "$mosquitto_ws_port" \
  --user conformance --password conformance-password --auth-enforced

"$PY" -m conformance.compare "$OUT/compared.md" polymq="$OUT/polymq.json" \
  rabbitmq="$OUT/rabbitmq.json" mosquitto="$OUT/mosquitto.json"
echo "reports in $OUT"
exit "$status"
