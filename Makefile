# llmgw: `make up` runs the local stack, `make test` runs the whole suite. Both set up .venv first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install --quiet --disable-pip-version-check

.PHONY: up test unit e2e bench validate clean

$(VENV)/.runtime: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) -e .
	touch $@

$(VENV)/.dev: $(VENV)/.runtime
	$(PIP) -e '.[dev]'
	touch $@

up: $(VENV)/.runtime
	$(VENV)/bin/llmgw up

test: $(VENV)/.dev
	$(PY) -m pytest -q -p no:cacheprovider

unit: $(VENV)/.dev
	$(PY) -m pytest -q -m "not e2e"

e2e: $(VENV)/.dev
	$(PY) -m pytest -q -m e2e

bench: $(VENV)/.dev
	$(PY) -m bench.overhead
	$(PY) -m bench.quota

validate: $(VENV)/.runtime
	$(VENV)/bin/envoy --mode validate -c envoy/envoy.yaml --use-dynamic-base-id

clean:
	rm -rf $(VENV) .run .pytest_cache
