"""Benchmarks and measurement tools, run from the repository root: python bench/bench_*.py, and
python -m bench.probe_linear (it imports bench.bench_linear)."""
