# Each target builds its venv from nothing when needed, from a lock, with scripts/bootstrap.sh: a fresh
# machine gets exactly the versions CI tested. `make run` needs only the runtime (requirements-run.lock:
# torch's CPU build, no test or bench tools, no triton, no NIXL); the others install requirements.lock
# (runtime + nixl + gpu + test + bench extras) over it in the same .venv. torch comes first, --no-deps, as
# exactly the lock's torch==2.13.0+cpu: from $(TORCH_WHEELS) when that folder holds the wheel, else from
# the PyTorch CPU index ($(TORCH_INDEX)); everything after it is installed with --no-deps too, so nothing
# is resolved again and nothing can pull CUDA (tests/deploy/test_install.py checks it against PyPI with a
# clean pip configuration). `make run-gpu` builds .venv-gpu from requirements-cuda.lock: PyPI's CUDA torch.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
RUN_LOCK := requirements-run.lock
ROUTER_LOCK := requirements-router.lock
LOCK := requirements.lock
CUDA_LOCK := requirements-cuda.lock
RUN_STAMP := $(VENV)/.installed-run
STAMP := $(VENV)/.installed-full
GPU_VENV := .venv-gpu
GPU_STAMP := $(GPU_VENV)/.installed
TORCH_WHEELS ?= /opt/wheels
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
BOOTSTRAP := PYTHON=$(PYTHON) TORCH_WHEELS=$(TORCH_WHEELS) TORCH_INDEX=$(TORCH_INDEX) bash scripts/bootstrap.sh

.PHONY: run run-gpu test test-fast compose-test chaos bench lint lock clean

$(RUN_STAMP): pyproject.toml Makefile scripts/bootstrap.sh $(RUN_LOCK)
	$(BOOTSTRAP) $(VENV) $(RUN_LOCK)
	touch $@

$(STAMP): pyproject.toml Makefile scripts/bootstrap.sh $(LOCK)
	$(BOOTSTRAP) $(VENV) $(LOCK)
	touch $@

$(GPU_STAMP): pyproject.toml Makefile scripts/bootstrap.sh $(CUDA_LOCK)
	$(BOOTSTRAP) $(GPU_VENV) $(CUDA_LOCK)
	touch $@

run: $(RUN_STAMP)
	$(VENV)/bin/splitserve up

# The same on an NVIDIA GPU (Linux x86_64, a driver for PyPI's CUDA build of torch): its own venv, with
# triton and NIXL; the engine takes the GPU by itself.
run-gpu: $(GPU_STAMP)
	$(GPU_VENV)/bin/splitserve up

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

# Two pytest-xdist workers, a whole test file to each (--dist loadfile: a module's services start once):
# most of a test's time is a service process starting or answering, so two keep both cores ~82 % busy
# (vmstat over a fresh-clone `.ci/run`). The suite is bound by CPU: three workers kept the cores ~93 %
# busy but took ~15 % more CPU in all (1,340 against 1,120 s) and finished no sooner (10:54 and 12:05
# against 11:33), and mypy run beside the tests gained nothing either (12:11 of tests, 13:37 in all,
# against 11:33 and 13:31). The 20 slowest tests are printed at the end (the suite's budget: 12
# minutes on 2 cores).
# A worker that dies (--max-worker-restart=0) ends the run at once, naming its test: restarting it under
# --dist loadfile once left the run hung with both workers idle.
# --no-loadscope-reorder: files are handed out in collection order, which tests/conftest.py sorts
# costliest first; without it pytest-xdist (3.7 and newer) re-sorts them by their number of tests, and
# the long single-test files (the soak, the benches) started last.
TEST_WORKERS ?= 2
PYTEST_ARGS := -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --max-worker-restart=0 --durations=20

test: lint
	$(PY) -m pytest $(PYTEST_ARGS)

# Unit tests only, no lint: the quick loop while editing.
test-fast: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS) tests/unit

# The live compose test alone (tests/deploy/test_compose_live.py): builds the images from this checkout,
# brings the CPU stack up with `docker compose`, kills a decode container mid-stream, restarts Redis. Needs
# a Docker engine (DOCKER_HOST or /var/run/docker.sock); `make test` runs it too, or says why it skipped.
compose-test: $(STAMP)
	$(PY) -m pytest -q -rs tests/deploy/test_compose_live.py

# The chaos scenarios (tests/chaos), each repeated CHAOS_ROUNDS times (make test runs each once).
chaos: $(STAMP)
	CHAOS_ROUNDS=$${CHAOS_ROUNDS:-3} $(PY) -m pytest -q tests/chaos

bench: $(STAMP)
	$(VENV)/bin/splitserve bench all

# Refresh the locks after changing dependencies in pyproject.toml (Linux x86_64, CPython 3.11):
#   requirements.lock       runtime + nixl, gpu, test and bench extras, CPU torch (make test & co.)
#   requirements-run.lock   runtime only, CPU torch (make run); compiled with requirements.lock as
#                           constraints, so every pin is the one CI tested
#   requirements-router.lock  the run lock without torch and what only torch needs: the router image
#                           (scripts/router_lock.py)
#   requirements-cuda.lock  runtime + gpu extra (triton, nixl), PyPI's CUDA torch and its nvidia/cuda
#                           packages and triton pin (make run-gpu); the rest pinned as in requirements.lock
# `make lock UPGRADE=1` moves every pin to the newest release the ranges allow; without it uv keeps the
# pins already in the locks wherever they still fit.
#
# How the CPU locks stay off CUDA: torch is constrained to exactly 2.13.0+cpu, the CPU wheel that lies in
# $(TORCH_WHEELS) (uv reads no pip.conf, so it is named here). Its metadata names no nvidia-* package and
# no triton pin; PyPI's plain torch==2.13.0 names a dozen nvidia/cuda packages and triton==3.7.1, and a
# looser constraint would let uv take it. uv reads metadata only, it downloads no torch. The CPU locks keep
# torch==2.13.0+cpu, the pin the bootstrap installs; if $(TORCH_WHEELS) lacks the wheel uv stops, and the
# grep below refuses a CPU lock naming a CUDA package.
# uv is installed in a venv of its own inside .venv (not into .venv, which holds exactly the lock).
UV_VERSION := 0.13.9
UV := $(VENV)/.uv/bin/uv
UV_COMPILE := --python-version 3.11 --python-platform x86_64-manylinux_2_28 --custom-compile-command 'make lock' \
	$(if $(UPGRADE),--upgrade) --quiet

$(UV):
	$(PYTHON) -m venv $(VENV)/.uv
	$(VENV)/.uv/bin/python -m pip install --quiet --disable-pip-version-check uv==$(UV_VERSION)

lock: $(UV)
	echo 'torch==2.13.0+cpu' | $(UV) pip compile pyproject.toml --extra test --extra bench \
		--constraints /dev/stdin --find-links $(TORCH_WHEELS) $(UV_COMPILE) --output-file $(LOCK)
	$(UV) pip compile pyproject.toml --constraints $(LOCK) --find-links $(TORCH_WHEELS) $(UV_COMPILE) \
		--output-file $(RUN_LOCK)
	$(PYTHON) scripts/router_lock.py $(RUN_LOCK) > $(ROUTER_LOCK)
	{ echo 'torch==2.13.0'; grep -v -E '^(torch|triton)==' $(LOCK); } | $(UV) pip compile pyproject.toml \
		--extra gpu --constraints /dev/stdin $(UV_COMPILE) --output-file $(CUDA_LOCK)
	grep -q '^torch==2\.13\.0+cpu$$' $(LOCK)
	grep -q '^torch==2\.13\.0+cpu$$' $(RUN_LOCK)
	grep -q '^torch==2\.13\.0$$' $(CUDA_LOCK)
	! grep -n -i -E '^(nvidia-|cuda-)' $(LOCK) $(RUN_LOCK)

clean:
	rm -rf $(VENV) $(GPU_VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis .import_linter_cache
