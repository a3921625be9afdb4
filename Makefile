# Developer entry points. `make run` and `make test` are all a new machine needs (python3, make).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# What `make run` needs (the service and its development database) and what the tests and
# linters add to it: two stamps, so that `make run` never installs the test tools.
RUN_STAMP := $(VENV)/.installed-run
DEV_STAMP := $(VENV)/.installed-dev
# Every version that make, the Dockerfile and CI install, for every extra and platform
# (`make constraints` writes it from pyproject.toml). pyproject says what the code works with;
# this file says what is installed.
CONSTRAINTS := constraints.txt
PIP_VERSION := 26.3
PIP_INSTALL := $(BIN)/python -m pip install --quiet --constraint $(CONSTRAINTS)
UV := $(BIN)/uv
UV_COMPILE := $(UV) pip compile --quiet --universal --all-extras --python-version 3.11 \
	--annotation-style line --custom-compile-command 'make constraints' pyproject.toml
# The lowest versions pyproject.toml allows, in a venv of their own (`make test-lowest`).
LOWEST_VENV ?= $(VENV)-lowest

.PHONY: install install-dev run demo test test-fast test-lowest lint format typecheck check \
	constraints constraints-upgrade constraints-check clean bench schema image

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet 'pip==$(PIP_VERSION)'

$(RUN_STAMP): pyproject.toml $(CONSTRAINTS) | $(BIN)/python
	$(PIP_INSTALL) -e '.[embedded]'
	touch $@

$(DEV_STAMP): pyproject.toml $(CONSTRAINTS) | $(BIN)/python
	$(PIP_INSTALL) -e '.[dev]'
	touch $@ $(RUN_STAMP)

install: $(RUN_STAMP)
install-dev: $(DEV_STAMP)

# uv alone, at its pinned version: what writes and checks constraints.txt must not need an
# install through the constraints that may be out of date.
$(UV): | $(BIN)/python
	$(PIP_INSTALL) uv

run: install  ## the service in development mode: embedded PostgreSQL, Core simulator, secrets
	$(BIN)/analysis-queue dev

demo: install  ## the write-up's scenario, printed (beside `make run` too)
	$(BIN)/analysis-queue demo

test: install-dev  ## the whole suite (unit, integration, acceptance)
	$(BIN)/pytest

test-fast: install-dev  ## a developer's loop: unit and integration tests, without the slow runs
	$(BIN)/pytest tests/unit tests/integration -m "not slow" -x -q

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

# uv keeps the versions already in the file wherever pyproject still allows them: after a
# change of pyproject only what it forces moves. constraints-upgrade moves everything.
constraints: $(UV)  ## rewrite constraints.txt from pyproject.toml
	$(UV_COMPILE) --output-file $(CONSTRAINTS)

constraints-upgrade: $(UV)  ## constraints.txt at the newest versions pyproject allows
	$(UV_COMPILE) --upgrade --output-file $(CONSTRAINTS)

constraints-check: $(UV)  ## fails when constraints.txt is not what pyproject.toml makes
	@tmp=$$(mktemp -d) && cp $(CONSTRAINTS) $$tmp/constraints.txt \
	&& $(UV_COMPILE) --output-file $$tmp/constraints.txt \
	&& if diff -u $(CONSTRAINTS) $$tmp/constraints.txt; then rm -rf $$tmp; \
	echo "constraints.txt is what pyproject.toml makes"; \
	else rm -rf $$tmp; echo "constraints.txt is out of date: run make constraints"; exit 1; fi

clean:
	rm -rf $(VENV) $(LOWEST_VENV) dist build .mypy_cache .ruff_cache .pytest_cache

schema: install-dev  ## rewrite sql/schema.sql from a fresh migrate (AQ_TEST_DATABASE_URL's server, else embedded)
	$(BIN)/python -m analysis_queue.dev.schema_file

image:  ## the production image with podman, no registry needed (deploy/image/build)
	deploy/image/build analysis-queue:latest

bench: install-dev  ## benchmarks (not tests): writes bench/results.json
	$(BIN)/python bench/run.py
