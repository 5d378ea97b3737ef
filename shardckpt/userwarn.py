"""Warnings attributed to the user's own line.

A fixed `stacklevel` counts frames, so the same warning reached by another
route (`parallelize` -> `auto_layout`, a distribution asked by Keras while a
layer builds) points into shardckpt or Keras instead of the caller's code,
and Python's default filter then shows it once per shardckpt line rather
than once per user line. `warn` walks out of the libraries instead: what
Python 3.12's `warnings.warn(skip_file_prefixes=...)` does, on 3.11 too.
"""

from __future__ import annotations

import sys
import warnings

# Packages whose frames stand between the user's call and the warning.
_LIBRARIES = frozenset({"shardckpt", "keras", "keras_hub", "jax", "jaxlib", "orbax", "optree"})


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """`warnings.warn(message, category)` at the first frame outside the libraries.

    Args:
        message: The warning's text.
        category: Its class.
    """
    level = 2  # the caller of `warn`
    frame = sys._getframe(1)
    while frame.f_back is not None and str(frame.f_globals.get("__name__", "")).split(".")[0] in _LIBRARIES:
        frame = frame.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level)
