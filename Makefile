# The README's two commands: `make train` and `make test`. Each sets up .venv first.
PY := .venv/bin/python
export RAY_AUTH_MODE ?= disabled

.PHONY: setup train test test-fast bench-cpu
setup:
	bash infra/setup.sh

train: setup
	$(PY) jobs/train_local.py --config jobs/configs/small_cpu.json

test: setup
	$(PY) -m pytest -q tests

test-fast: setup
	$(PY) -m pytest -q -m "not slow" tests

bench-cpu: setup
	$(PY) jobs/benchmark.py --suite cpu
