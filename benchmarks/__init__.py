"""Benchmarks of the annotated Transformer (`make bench`, see benchmarks/bench.py)."""

from annotated.plumbing.scripts import starting

starting()  # for `python -m benchmarks.<command>`: a Ctrl-C while torch loads is one line (plumbing/scripts.py)
