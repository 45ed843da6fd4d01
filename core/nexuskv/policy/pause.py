"""Yield points of policy compilation: a reload hands the GIL to planning threads between its small steps.

Compiling a revision is tens of milliseconds of Python on the reloading thread. Without yield points, a plan that
starts meanwhile waits for the interpreter's switch interval (5 ms) at each GIL hand-over; with one between
every file, rule, expression and generated function, it waits for the current step only.
"""

from __future__ import annotations

import time

__all__ = ["pause"]


def pause() -> None:
    """Release the GIL for a moment, so a thread waiting for it runs now."""
    time.sleep(0)
