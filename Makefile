# The two README commands: `make run` (demo fleet on a local stack) and `make test` (the whole suite).
# Both install everything they need first: a venv with the package and its dev tools, and dynalite from npm.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: run test setup lint typecheck pytest sim docs clean

run: setup
	$(BIN)/fleetd dev

test: setup lint typecheck pytest sim

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

# The deterministic simulation: SIM_SEEDS seeded schedules of fleetd's own shard code under adversarial
# faults; exits non-zero on any invariant violation, naming the seed (replay: python -m bench.sim --seed N --trace).
SIM_SEEDS ?= 10000
sim:
	$(BIN)/python -m bench.sim --seeds $(SIM_SEEDS) --jobs 2 --out .sim-results.jsonl

# Regenerate docs/configuration.md from fleetd/config.py (tests/test_ops.py fails when it is stale).
docs: setup
	$(BIN)/python -m tools.gen_config_docs

clean:
	rm -rf $(VENV) node_modules .pytest_cache .mypy_cache .ruff_cache
