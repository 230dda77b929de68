"""Benchmarks and measurement tools: python bench/NAME.py, or python -m bench.NAME from the repo root."""
