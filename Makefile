# The two README commands: `make run` (demo fleet on a local stack) and `make test` (the whole suite).
# Both install everything they need first: a venv with the package and its dev tools, and dynalite from npm.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: run test setup lint typecheck pytest docs clean

run: setup
	$(BIN)/fleetd dev

test: setup lint typecheck pytest

setup: $(VENV)/.installed node_modules/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

node_modules/.installed: package.json package-lock.json
	npm ci --no-audit --no-fund
	touch $@

lint:
	$(BIN)/ruff check .

typecheck:
	$(BIN)/mypy

pytest:
	$(BIN)/pytest $(PYTEST_ARGS)

# Regenerate docs/configuration.md from fleetd/config.py (tests/test_ops.py fails when it is stale).
docs: setup
	$(BIN)/python -m tools.gen_config_docs

clean:
	rm -rf $(VENV) node_modules .pytest_cache .mypy_cache .ruff_cache
