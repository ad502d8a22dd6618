# `make quickstart` and `make test` each create .venv and install jaxlm into it on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: quickstart test test-fast bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev,hf]"
	touch $@

quickstart: $(VENV)/.installed
	$(VENV)/bin/jaxlm train quickstart

test: $(VENV)/.installed
	$(PY) -m pytest -q

test-fast: $(VENV)/.installed
	$(PY) -m pytest -q -m "not slow"

bench: $(VENV)/.installed
	$(PY) benchmarks/train_throughput.py

clean:
	rm -rf outputs .pytest_cache
