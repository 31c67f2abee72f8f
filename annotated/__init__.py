"""annotated: the Transformer, read top to bottom and run. Start with annotated/transformer.py."""
