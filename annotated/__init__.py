"""annotated: the Transformer, read top to bottom and run. Start with annotated/transformer.py."""

from annotated.plumbing.scripts import starting

starting()  # for `python -m annotated.<command>`: a Ctrl-C while torch loads is one line (plumbing/scripts.py)
