# Two entry points, both self-installing: `make report` and `make test`.
# The venv is rebuilt only when the dependency declarations change.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
STAMP := $(VENV)/.installed
# This machine keeps the CPU build of torch 2.13.0 in /opt/wheels; elsewhere pip's own config applies.
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels)

.PHONY: install report test lint bench buck

install: $(STAMP)

$(STAMP): pyproject.toml setup.py
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet $(FIND_LINKS) -e '.[test]'
	touch $(STAMP)

report: $(STAMP)
	$(VENV)/bin/etfold report

test: $(STAMP)
	$(VENV)/bin/python -m pytest -n 2 --dist loadfile

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

bench: $(STAMP)
	for script in bench/bench_*.py; do $(VENV)/bin/python $$script || exit 1; done

buck:
	$(PYTHON) tools/buck_targets.py
