"""The learning rate of an epoch resumed in its middle.

A step saved in the middle of epoch k holds the learning rate that epoch's
`on_epoch_begin` hooks set (`LearningRateScheduler` among them). The resumed
`fit` calls `on_epoch_begin(k)` again, and a schedule that depends on the
current rate (`lambda epoch, lr: lr * 0.9`) applies epoch k's step a second
time: measured, the final rate was 0.0006561 against the unbroken run's
0.000729, and the weights differed (`tests/test_preemption.py`). The rate
restored is put back once every `on_epoch_begin` of the resumed epoch has run:
at the first `on_train_batch_begin`, before its batch trains. (A callback that
sets the rate in `on_train_batch_begin` and is listed before the checkpoint has
its setting for that one batch undone; the INFO line says when the rate is put
back.)
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np


def _variable(model: Any) -> Any:
    """The optimizer's learning-rate variable, or None (no optimizer, or a `LearningRateSchedule`)."""
    optimizer = getattr(model, "optimizer", None)
    variable = getattr(optimizer, "_learning_rate", None)
    return variable if isinstance(variable, keras.Variable) else None


def capture(model: Any) -> np.ndarray | None:
    """The learning rate just restored into `model` (None where there is no variable to hold it)."""
    variable = _variable(model)
    return None if variable is None else np.array(variable.value)


def put_back(model: Any, restored: np.ndarray) -> bool:
    """Sets the learning rate back to `restored`; True when an `on_epoch_begin` had changed it."""
    variable = _variable(model)
    if variable is None or np.array_equal(np.asarray(variable.value), restored):
        return False
    variable.assign(restored)
    return True
