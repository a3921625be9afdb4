# Developer entry points. `make run` and `make test` are all a new machine needs (python3, make).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install run demo test test-fast lint format typecheck check clean bench

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

install: $(BIN)/.installed

run: install  ## the service with embedded defaults (PostgreSQL, Core simulator, secrets)
	$(BIN)/analysis-queue serve

demo: install  ## the write-up's scenario, printed
	$(BIN)/analysis-queue demo

test: install  ## the whole suite (unit, integration, acceptance)
	$(BIN)/pytest

test-fast: install
	$(BIN)/pytest tests/unit tests/integration -x -q

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

typecheck: install
	$(BIN)/mypy

check: lint typecheck test

clean:
	rm -rf $(VENV) dist build .mypy_cache .ruff_cache .pytest_cache

bench: install  ## benchmarks (not tests): writes bench/results.json
	$(BIN)/python bench/run.py
