# The README's two commands: `make train` and `make test`. Each sets up .venv first.
PY := .venv/bin/python
export RAY_AUTH_MODE ?= disabled

.PHONY: setup train test test-fast bench-cpu
setup:
	bash infra/setup.sh

# Builds the dataset (seconds; skipped when it exists), then trains on 2 CPU processes.
train: setup
	$(PY) jobs/prepare_data.py --config jobs/configs/small_cpu.json
	$(PY) jobs/train_lm.py --config jobs/configs/small_cpu.json

test: setup
	$(PY) -m pytest -q tests

test-fast: setup
	$(PY) -m pytest -q -m "not slow" tests

bench-cpu: setup
	$(PY) jobs/benchmark.py --suite cpu
