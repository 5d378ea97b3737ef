"""Other callbacks of a resumed `fit` whose state no step holds.

`EarlyStopping` and `ReduceLROnPlateau` count epochs without improvement
(`wait`, `best`, a cooldown) and reset those counts in their own
`on_train_begin`. A resumed `fit` therefore starts their patience over at the
resumed epoch: the uninterrupted run may stop, or lower the learning rate, at
another epoch than the resumed one, and the weights differ. Measured
(`tests/test_resume_variations.py`): patience 2, never improving, resumed after
epoch 2 of 4: the unbroken run stops after epoch 3, the resumed one trains all
4. Keras' `BackupAndRestore` has the same gap. The resume says so, once,
naming them.
"""

from __future__ import annotations

from typing import Any

import keras

# Keras callbacks whose `on_train_begin` resets counts that decide what later epochs train.
_COUNTERS: tuple[tuple[type, str], ...] = (
    (keras.callbacks.EarlyStopping, "wait, best, best_weights"),
    (keras.callbacks.ReduceLROnPlateau, "wait, best, cooldown_counter"),
)


def unrestored(callbacks: list[Any], epoch: int) -> str:
    """The warning for a `fit` resumed at `epoch` with such callbacks ("" if none, or at epoch 0).

    Args:
        callbacks: Every callback of the `fit`.
        epoch: The epoch (0-based) the resumed `fit` continues with.
    """
    if epoch == 0:
        return ""
    named = [f"{type(c).__name__} ({fields})" for c in callbacks for cls, fields in _COUNTERS if isinstance(c, cls)]
    if not named:
        return ""
    return (f"the state of {', '.join(named)} is not saved in the checkpoint: their on_train_begin starts it "
            f"over at epoch {epoch + 1}, so they may stop training or lower the learning rate at another epoch "
            "than the uninterrupted run (whose patience counted the epochs before). Fix: give them their "
            "values back after the resume (save them with metadata=callable, read them from ckpt.resumed."
            "metadata['user'] in a callback placed after theirs, in its on_epoch_begin), or accept that "
            "their patience starts over")
