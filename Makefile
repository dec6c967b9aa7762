# The README's two commands: `make train` and `make test`. Each sets up .venv first.
PY := .venv/bin/python
export RAY_AUTH_MODE ?= disabled

.PHONY: setup train test test-fast bench-cpu
setup:
	bash infra/setup.sh

# Builds the dataset (seconds; skipped when it exists), then trains on a local Ray cluster with
# 2 CPU workers, recorded in MLflow (sqlite:///mlflow.db here unless MLFLOW_TRACKING_URI is set).
# Each run gets its own name (runs/small_cpu-<time>); rerun jobs/train_lm.py with the same
# --run-name to resume one.
train: setup
	$(PY) jobs/prepare_data.py --config jobs/configs/small_cpu.json
	$(PY) jobs/train_lm.py --config jobs/configs/small_cpu.json --workers 2 \
		--run-name small_cpu-$(shell date +%Y%m%d-%H%M%S)

test: setup
	$(PY) -m pytest -q tests

test-fast: setup
	$(PY) -m pytest -q -m "not slow" tests

bench-cpu: setup
	$(PY) jobs/benchmark.py --suite cpu
