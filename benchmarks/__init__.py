"""Benchmarks of the annotated Transformer (`make bench`, see benchmarks/bench.py)."""
