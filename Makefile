# Two entry points, both self-installing: `make report` and `make test`.
# The venv is (re)installed only when the dependency declarations or the pins change.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
STAMP := $(VENV)/.installed
CONSTRAINTS := constraints.txt
# The CPU build of torch pinned in constraints.txt comes from a local wheel directory when
# TORCH_WHEELS names one that exists (`make test TORCH_WHEELS=~/wheels`), else from
# PyTorch's CPU index (PyPI's Linux torch is the CUDA build, gigabytes).
TORCH_WHEELS ?= /opt/wheels
TORCH_SOURCE := $(if $(wildcard $(TORCH_WHEELS)),--find-links $(TORCH_WHEELS),--extra-index-url https://download.pytorch.org/whl/cpu)

.PHONY: install report test test-long test-wheel lint bench buck fuzz

install: $(STAMP)

$(STAMP): pyproject.toml setup.py $(CONSTRAINTS)
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet $(TORCH_SOURCE) -c $(CONSTRAINTS) -e '.[test]'
	touch $(STAMP)

report: $(STAMP)
	$(VENV)/bin/etfold report

# Ends with where the time went: the slowest tests (--durations) and, from test/conftest.py,
# the slowest files and each worker's busy time against the wall clock.
test: $(STAMP)
	$(VENV)/bin/python -m pytest -n 2 --dist loadgroup --durations=20

# The long profile: the cases `make test` samples (marked `long`: more dtypes, layouts and
# model pairings of properties the short profile proves once), and the wheel install below.
test-long: $(STAMP)
	$(VENV)/bin/python -m pytest -n 2 --dist loadgroup -m long

# The long profile of the wheel test: install the built wheel into a fresh venv from the
# configured package indexes (minutes; `make test` checks the wheel's contents and runs it unpacked).
test-wheel: $(STAMP)
	$(VENV)/bin/python -m pytest -m long test/etfold/test_wheel.py

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

bench: $(STAMP)
	for script in bench/bench_*.py; do $(VENV)/bin/python $$script || exit 1; done

# The long differential fuzzing profile (>= 2000 cases over the four fold families; resumable:
# a rerun with the same seed continues; two worker processes, restarted after a native crash).
# FUZZ_ARGS takes e.g. --budget MINUTES --seed N --cases N.
fuzz: $(STAMP)
	$(VENV)/bin/python tools/fuzz.py --jobs 2 $(FUZZ_ARGS)

buck:
	$(PYTHON) tools/buck_targets.py
