# kvops: `make setup`, `make test`, `make run`.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-done
export KVOPS_DATA_DIR ?= $(CURDIR)/data

.PHONY: setup test run bench clean

setup: $(STAMP)

# Re-run the install only when the dependency list changes.
$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) on PATH"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	bash scripts/system-packages.sh
	touch $(STAMP)

test: setup
	$(PY) -m pytest

run: setup
	$(PY) -m kvops.run

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
