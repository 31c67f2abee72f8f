"""Tooling that renders the `annotated` modules (a package so `python -m docs.build` and the tests import it)."""
