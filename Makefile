# Quick start: `make demo` trains the default project, `make test` runs the tests.
# Both create .venv if it is missing and install forge with its dependencies first.

VENV ?= .venv
PY := $(VENV)/bin/python
FORGE := $(VENV)/bin/forge
STAMP := $(VENV)/.forge-installed
PROJECT := projects/tiny_lm

# On a machine without an NVIDIA GPU, install the CPU build of torch first; with a GPU,
# pip's default (CUDA) build is used. Override with `make TORCH_SPEC=... setup`.
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo yes)
ifeq ($(HAS_GPU),yes)
TORCH_SPEC ?= torch
else
TORCH_SPEC ?= torch==2.13.0
endif

.PHONY: setup demo test test-all bench lint mutation clean-demo

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet $(TORCH_SPEC)
	$(PY) -m pip install --quiet -e ".[dev,datasets]"
	@touch $(STAMP)

demo: $(STAMP)
	@bash scripts/demo.sh $(PROJECT)

# The default suite runs one test process per core (pytest-xdist), each file's tests in one
# process, sharing its fixtures. PYTEST_ARGS adds to either: `make test PYTEST_ARGS="-n 0"`
# runs it in one process, `make test-all PYTEST_ARGS="-n auto --dist loadfile"` in several.
PYTEST_ARGS ?=

# forge's own modules are compiled once here (where PYTHONDONTWRITEBYTECODE is set, every
# process the tests start would compile them again).
test: $(STAMP)
	@$(PY) -m compileall -q forge tests
	$(PY) -m pytest -q -n auto --dist loadfile $(PYTEST_ARGS)

test-all: $(STAMP)
	@$(PY) -m compileall -q forge tests
	$(PY) -m pytest -q -m "" $(PYTEST_ARGS)

# The whole reliability suite (kills, restarts, corruption, hostile input, full disk,
# concurrency) with its slow tests; rewrites docs/RELIABILITY.md from what it saw.
reliability: $(STAMP)
	$(PY) scripts/reliability.py

# Mutation testing of the checkpoint layer and the loop's resume state (pyproject's
# [tool.mutmut] says which files and tests); slow, not part of `make test`.
mutation: $(STAMP)
	$(PY) -m pip install --quiet -e ".[dev,mutation]"
	OMP_NUM_THREADS=1 $(VENV)/bin/mutmut run --max-children 2 || true
	$(VENV)/bin/mutmut results

bench: $(STAMP)
	$(PY) bench/run.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
