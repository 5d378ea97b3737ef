"""The host's global random generators, saved with each step and restored on resume.

`fit` shuffles array inputs with NumPy's global generator
(`np.random.permutation` at the start of each epoch) and a
`keras.utils.PyDataset` with Python's `random.shuffle`. A resumed run starts
its first epoch from a freshly seeded process, so it would draw another order
than the uninterrupted run did at that epoch. Both states are small (624
words each) and JSON-able; they are read on the training thread at the save,
which for a whole-epoch step is before the next epoch's draw.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np


def capture() -> dict[str, Any]:
    """The global NumPy and Python generator states, as JSON values."""
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    version, words, gauss = random.getstate()
    return {
        "numpy": [name, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)],
        "python": [version, list(words), gauss],
    }


def restore(state: dict[str, Any] | None) -> None:
    """Puts back what `capture` returned (nothing for steps saved without it)."""
    if not state:
        return
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    version, words, gauss = state["python"]
    random.setstate((version, tuple(words), gauss))
