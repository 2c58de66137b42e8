# adaptipe: `make demo` runs the main job on a built-in default, `make test` runs the tests.
# Every target creates .venv if missing and installs through constraints.txt, which pins
# torch==2.13.0 so pip never pulls a CUDA build on a CPU machine.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/pip --disable-pip-version-check
CONSTRAINTS ?= constraints.txt
SOURCES := $(shell find adaptipe controllers envs models -type f \( -name '*.py' -o -name '*.json' -o -name '*.csv' -o -name '*.skops' -o -name '*.safetensors' \) 2>/dev/null)
DEMO_DIR ?= runs/demo

.PHONY: demo test test-all bench lint clean

# Dependencies: re-installed when pyproject.toml or the constraints change.
$(VENV)/.deps: pyproject.toml $(CONSTRAINTS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q -c $(CONSTRAINTS) "setuptools>=69" wheel
	$(PIP) install -q -c $(CONSTRAINTS) -e ".[dev]" --config-settings editable_mode=strict
	touch $@

# The editable install is a link tree (strict mode, so mypy sees the package-dir
# mapping); re-link when source files or package data (profiles, artifacts) come or go.
$(VENV)/.linked: $(VENV)/.deps $(SOURCES)
	$(PIP) install -q --no-deps --no-build-isolation -e . --config-settings editable_mode=strict
	touch $@

demo: $(VENV)/.linked
	$(BIN)/python -m adaptipe.demo --out $(DEMO_DIR)

test: $(VENV)/.linked
	$(BIN)/pytest -q

test-all: $(VENV)/.linked
	$(BIN)/pytest -q -m ""

bench: $(VENV)/.linked
	@for b in bench/bench_*.py; do echo "== $$b" >&2; $(BIN)/python $$b || exit 1; done

lint: $(VENV)/.linked
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	cd $(VENV) && bin/mypy --config-file ../pyproject.toml -p adaptipe

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
