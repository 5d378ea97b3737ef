"""The one-device reference run that the "sharded training equals one device" tests compare with."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import numpy as np


def perturb(model: keras.Model, seed: int) -> None:
    """Moves every float weight off its initial value (zero biases, unit scales would hide mistakes)."""
    rng = np.random.default_rng(seed)
    for v in model.weights:
        if v.dtype.startswith("float"):
            v.assign(np.asarray(v.value) + 0.05 * rng.standard_normal(v.shape).astype("float32"))


def fit_twice_started(build: Callable[[], keras.Model], fit: Callable[[keras.Model], Any]) -> tuple[keras.Model, Any]:
    """Fits a fresh `build()` (weights perturbed) on one device; returns a second fresh
    `build()` holding the same starting weights, for the test to shard and fit, and
    what `fit` returned for the first."""
    keras.backend.clear_session()
    single = build()
    perturb(single, 0)
    weights = single.get_weights()
    reference = fit(single)
    keras.backend.clear_session()
    model = build()
    model.set_weights(weights)
    return model, reference
