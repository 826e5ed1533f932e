# Two commands set up everything on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
NODE_DIR := tests/nodejs
NODE_STAMP := $(NODE_DIR)/node_modules/.installed

.PHONY: run test lint typecheck unit bytecode bench bench-compare fuzz clean conformance-reference chromium

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	@touch $(STAMP)

# The node clients (kafkajs, amqplib, mqtt.js, rocketmq-client-nodejs) the tests drive.
$(NODE_STAMP): $(NODE_DIR)/package.json $(NODE_DIR)/package-lock.json
	cd $(NODE_DIR) && npm ci --no-audit --no-fund --loglevel=error
	@touch $(NODE_STAMP)

# Headless Chromium and its driver from Debian's packages, for the web console's browser
# tests (tests/admin/test_console.py), installed when missing as the node clients are.
chromium:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || { \
	  SUDO=$$(test "$$(id -u)" -eq 0 || echo sudo); \
	  $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends \
	    chromium chromium-driver; }

# Compiled modules, cached once: a base image may set PYTHONDONTWRITEBYTECODE (this
# project's does), and then every process compiles all of polymq again when it starts
# (0.6 s of a server's start-up, paid by each of the hundreds the tests start).
# compileall writes the cache whatever that variable says, and only what changed.
bytecode: $(STAMP)
	@$(BIN)/python -m compileall -q $(PACKAGES) tests bench >/dev/null

run: $(STAMP) bytecode
	$(BIN)/polymq run $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# mypy checks the product under its installed names (polymq.<folder>) through a tree
# of links, since the folders themselves stay at the top of the repository.
TYPECHECK_TREE := build/typecheck/polymq
PACKAGES := gateway storage protocols nameserver navigation conformance

typecheck: $(STAMP)
	@mkdir -p $(TYPECHECK_TREE)
	@for p in $(PACKAGES); do ln -sfn ../../../$$p $(TYPECHECK_TREE)/$$p; done
	$(BIN)/mypy

# The suite in two runs. First every test not marked one_at_a_time, spread over
# TEST_WORKERS processes (pytest-xdist, `--dist loadgroup`: a module's tests stay on
# one worker; "logical" is every CPU, 0 one process). Then, in one process, the
# tests that kill, stop or time processes or drive many clients at once
# (tests/conftest.py marks them): beside another worker's load their clients'
# fixed deadlines failed. Both runs always run; a failure in either fails the target.
# pytest exits 5 when it collected no tests: for this project that is a broken suite,
# so it fails loudly (when neither run collected any) instead of passing.
# HYPOTHESIS_NO_PLUGINS: hypothesis (a test dependency, imported by the Kafka codec's
# kio when installed) would load trio's plugin, and trio pytest, into every server
# process the tests start: 0.6 s of each start-up.
TEST_WORKERS ?= logical
unit: export HYPOTHESIS_NO_PLUGINS = 1
unit: $(STAMP) $(NODE_STAMP) chromium bytecode
	@$(BIN)/pytest -n $(TEST_WORKERS) --dist loadgroup -m "not one_at_a_time" $(PYTEST_ARGS); \
	spread=$$?; \
	$(BIN)/pytest -n 0 -m one_at_a_time $(PYTEST_ARGS); alone=$$?; \
	if [ $$spread -eq 5 ] && [ $$alone -eq 5 ]; then \
	  echo "make: pytest collected no tests: failing" >&2; exit 5; fi; \
	for status in $$spread $$alone; do \
	  if [ $$status -ne 0 ] && [ $$status -ne 5 ]; then exit $$status; fi; done

test: lint typecheck unit

# `make bench` measures the storage engine; `make bench BENCH=kafka` (amqp, mqtt,
# rocketmq, http) one protocol against a server it starts itself.
BENCH ?= storage
bench: $(STAMP)
	$(BIN)/python -m bench.$(BENCH) $(ARGS)

# polymq beside RabbitMQ and Mosquitto from Debian's packages (installed when missing),
# each started on free ports over a throwaway directory and stopped at the end: the
# issue 21 table with ratios, medians of 3 alternating runs. ARGS=--quick for a smoke run.
bench-compare: $(STAMP)
	@command -v rabbitmq-server >/dev/null && test -x /usr/sbin/mosquitto || { \
	  SUDO=$$(test "$$(id -u)" -eq 0 || echo sudo); \
	  $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends \
	    rabbitmq-server mosquitto; }
	$(BIN)/python -m bench.compare $(ARGS)

# Coverage-guided fuzzing of every codec (docs/fuzzing.md): FUZZ_SECONDS per target, each
# in its own subprocess; `make fuzz FUZZ_TARGETS="sql92 mqtt5"` for some. Not part of
# `make test`, which runs only a 5-second fuzz per target (tests/fuzz/test_fuzz.py).
FUZZ_SECONDS ?= 60
FUZZ_TARGETS ?=
fuzz: $(STAMP)
	nice -n 10 $(BIN)/python -m tests.fuzz --seconds-per-target $(FUZZ_SECONDS) $(FUZZ_ARGS) $(FUZZ_TARGETS)

# The AMQP and MQTT conformance cases against RabbitMQ and Mosquitto from Debian's
# packages (installed if missing), beside polymq: reports in conformance-reports/.
conformance-reference: $(STAMP) $(NODE_STAMP)
	bash conformance/reference.sh

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache .hypothesis
