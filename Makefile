# The front door: `make demo` serves the default model through the wrapper, `make test` runs every test.
VENV ?= .venv
PY := $(VENV)/bin/python
LISTEN ?= 127.0.0.1:8080
CTX ?= 8192
CONFIG ?= examples/hooks.yaml
ARGS ?=
S3_PORT ?= 8333

.PHONY: demo demo-media demo-spec demo-store demo-pool demo-swap s3 docs test unit integration bench lint server old-server \
  llama-swap model clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e '.[dev]'
	touch $@

server:  ## build (or find in the cache) the pinned llama-server and print its path
	@llama.cpp/build-server

old-server:  ## build (or find in the cache) the older llama-server the upgrade tests save under, and print its path
	@LLAMA_CPP_VERSION=$$(cat llama.cpp/OLD_VERSION) llama.cpp/build-server

llama-swap:  ## find or build the pinned llama-swap (llama-swap/VERSION) and print its path
	@llama-swap/build-llama-swap

model: $(VENV)/.installed  ## print the default model's path, assembling it on first use
	@llama.cpp/get-model

demo: $(VENV)/.installed
	@server=$$(llama.cpp/build-server) && model=$$(llama.cpp/get-model) && \
	echo "serving $$model on http://$(LISTEN) — Ctrl-C stops everything" && \
	exec $(VENV)/bin/llama-wrapper run --config $(CONFIG) --listen $(LISTEN) -- \
	    "$$server" -m "$$model" -c $(CTX) $(ARGS)

# The tries of README's "Try it on the demo": each is the demo with one feature on.
demo-media: $(VENV)/.installed  ## the projector on demand, with a tiny projector of random weights
	@$(MAKE) -s demo CONFIG=examples/media.yaml ARGS='--mmproj "$$$$($(PY) -m tests.demo projector "$$$$model")"'

demo-spec: $(VENV)/.installed  ## the demo model as its own draft, only while one request decodes
	@$(MAKE) -s demo CONFIG=examples/spec.yaml ARGS='-md "$$$$model" --spec-type draft-simple -np 2'

demo-store: $(VENV)/.installed  ## the demo on the bucket of `make s3` (run that first, in another shell)
	@$(MAKE) -s demo CONFIG=examples/store.yaml

s3: $(VENV)/.installed  ## a local S3 server (SeaweedFS) on 127.0.0.1:$(S3_PORT) for demo-store, until Ctrl-C
	@exec $(PY) -m tests.demo s3 $(S3_PORT)

demo-pool: $(VENV)/.installed  ## two wrappers of the demo model sharing one pool, on LISTEN's port and the next
	@server=$$(llama.cpp/build-server) && model=$$(llama.cpp/get-model) && \
	exec $(PY) -m tests.demo pool "$$server" "$$model" $(LISTEN)

demo-swap: $(VENV)/.installed  ## the real llama-swap (make llama-swap) with examples/llama-swap.yaml on the demo
	@server=$$(llama.cpp/build-server) && swap=$$(llama-swap/build-llama-swap) && \
	exec $(PY) -m tests.demo swap "$$swap" "$$server" $(LISTEN)

docs: $(VENV)/.installed  ## write docs/configuration.md's reference from the declared sections
	$(PY) -m wrapper.cli.reference docs/configuration.md

test: $(VENV)/.installed
	server=$$(llama.cpp/build-server) && LLAMA_SERVER=$$server $(PY) -m pytest -q -rs tests/unit tests/integration

unit: $(VENV)/.installed
	$(PY) -m pytest -q tests/unit

integration: $(VENV)/.installed  ## the integration tests alone, against the pinned llama-server (TESTS=FILE for one file)
	server=$$(llama.cpp/build-server) && LLAMA_SERVER=$$server $(PY) -m pytest -q -rs $(or $(TESTS),tests/integration)

bench: $(VENV)/.installed
	server=$$(llama.cpp/build-server) && LLAMA_SERVER=$$server $(PY) tests/bench/bench_proxy.py
	server=$$(llama.cpp/build-server) && LLAMA_SERVER=$$server $(PY) tests/bench/bench_slots.py
	server=$$(llama.cpp/build-server) && LLAMA_SERVER=$$server $(PY) tests/bench/bench_reload.py
	server=$$(llama.cpp/build-server) && LLAMA_SERVER=$$server $(PY) tests/bench/bench_degrade.py
	server=$$(llama.cpp/build-server) && LLAMA_SERVER=$$server $(PY) tests/bench/bench_conversations.py
	server=$$(llama.cpp/build-server) && LLAMA_SERVER=$$server $(PY) tests/bench/bench_traffic.py
	server=$$(llama.cpp/build-server) && LLAMA_SERVER=$$server $(PY) tests/bench/bench_pool.py
	server=$$(llama.cpp/build-server) && LLAMA_SERVER=$$server $(PY) tests/bench/bench_store.py
	server=$$(llama.cpp/build-server) && LLAMA_SERVER=$$server $(PY) tests/bench/bench_consumers.py
	server=$$(llama.cpp/build-server) && LLAMA_SERVER=$$server $(PY) tests/bench/bench_who_asks.py
	server=$$(llama.cpp/build-server) && LLAMA_SERVER=$$server $(PY) tests/bench/bench_router.py
	server=$$(llama.cpp/build-server) && LLAMA_SERVER=$$server $(PY) tests/bench/bench_crash.py
	server=$$(llama.cpp/build-server) && LLAMA_SERVER=$$server $(PY) tests/bench/bench_replay.py
	server=$$(llama.cpp/build-server) && LLAMA_SERVER=$$server $(PY) tests/bench/bench_checkpoints.py
	server=$$(llama.cpp/build-server) && LLAMA_SERVER=$$server $(PY) tests/bench/bench_priority.py
	server=$$(llama.cpp/build-server) && LLAMA_SERVER=$$server $(PY) tests/bench/bench_priority.py --kinds --busy
	server=$$(llama.cpp/build-server) && LLAMA_SERVER=$$server $(PY) tests/bench/bench_sleep.py
	server=$$(llama.cpp/build-server) && LLAMA_SERVER=$$server $(PY) tests/bench/bench_long_turn.py
	server=$$(llama.cpp/build-server) && LLAMA_SERVER=$$server $(PY) tests/bench/bench_swap.py
	$(PY) tests/bench/bench_kvconvert.py

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
