"""The tests drive headless Chromium with the docs' own client (docs/browser.py, also used by `make screenshots`)."""

from docs.browser import CHROMIUM, NO_CHROMIUM, Chromium

__all__ = ["CHROMIUM", "NO_CHROMIUM", "Chromium"]
