# kvops: `make setup`, `make test`, `make run`.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-done
export KVOPS_DATA_DIR ?= $(CURDIR)/data

.PHONY: setup setup-python setup-system test run clean

setup: setup-python setup-system

# The virtualenv; re-installed only when the dependency list changes.
setup-python: $(STAMP)

# Debian packages used outside the virtualenv (redis-server, chromium); skips what is there.
setup-system:
	bash scripts/system-packages.sh

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) on PATH"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

test: setup
	$(PY) -m pytest

run: setup
	$(PY) -m kvops.run

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
