"""Tooling that renders the `annotated` modules (a package so `python -m docs.build` and the tests import it)."""

from annotated.plumbing.scripts import starting

starting()  # for `python -m docs.<command>`: a Ctrl-C while torch loads is one line (plumbing/scripts.py)
