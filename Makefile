PY ?= python

.PHONY: install test test-gpu bench lint format clean-cache

install:
	$(PY) -m pip install -e ".[test]"

test:
	$(PY) -m pytest -q

test-gpu:
	$(PY) -m pytest -q -m gpu

bench:
	$(PY) bench/bench_decode.py
	$(PY) bench/bench_spec.py
	$(PY) bench/bench_linear.py

lint:
	$(PY) -m ruff check lumo tests bench
	$(PY) -m ruff format --check lumo tests bench

format:
	$(PY) -m ruff format lumo tests bench

clean-cache:
	$(PY) -m lumo.kernels clean-cache
