"""How many full-size slots an optimizer keeps per trainable variable.

Keras optimizers create their slots with `add_variable_from_reference`,
which copies the variable's shape and layout, so every slot costs the
variable's bytes per device. The counts below are read from
`keras/src/optimizers/*.py` (`build()`): e.g. Adam keeps momentum and
velocity (2), plus a velocity maximum with `amsgrad`. Options of the base
optimizer add one each: `use_ema` (a moving average of every variable) and
`gradient_accumulation_steps` (a gradient accumulator per variable). A
`LossScaleOptimizer` counts as the optimizer it wraps: the slots are the
inner optimizer's, the wrapper adds two scalars.
"""

from __future__ import annotations

from typing import Any

import keras

from shardckpt.errors import LayoutError

_BASE_SLOTS = {
    "adam": 2,
    "adamw": 2,
    "nadam": 2,
    "adamax": 2,
    "adadelta": 2,
    "ftrl": 2,
    "lamb": 2,
    "adagrad": 1,
    "lion": 1,
    "sgd": 0,
    "rmsprop": 1,
}

# Optimizers whose slots are not a whole number of copies of every variable
# (`build()` in keras/src/optimizers/): the estimate refuses them, saying what
# Keras builds and which known optimizer brackets it.
_NOT_PER_VARIABLE = {
    "adafactor": (
        "beside a full-size velocity sharded like each variable, it keeps the second moments of a "
        "variable of 2 or more dimensions factored (shapes var.shape[:-1] and "
        "var.shape[:-2] + var.shape[-1:]), made with no layout, so replicated on every device. Fix: "
        "estimate with 'rmsprop' (the velocity alone) and add the factors' bytes by hand, or build the "
        "optimizer under the plan's distribution and sum its variables' addressable shards."
    ),
    "muon": (
        "it keeps a momentum for every variable and a velocity only for those it updates with AdamW "
        "(not 2-D, embeddings, exclude_layers). Fix: estimate with 'lion' (momentum alone) and 'adam' "
        "(momentum and velocity for all) for the bounds, or build the optimizer under the plan's "
        "distribution and sum its variables' addressable shards."
    ),
}


def slots_per_variable(optimizer: Any) -> int:
    """Full-size slots per trainable variable for `optimizer`.

    Args:
        optimizer: A name ("adam", "sgd", ...) or a `keras.optimizers.Optimizer`
            (a `LossScaleOptimizer`: the one it wraps).

    Returns:
        The slot count; options that add slots (SGD momentum, RMSprop
        momentum / centered, Adam amsgrad) are counted on instances.

    Raises:
        LayoutError: The optimizer is not one whose slots are known.
    """
    while isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    name = optimizer.lower() if isinstance(optimizer, str) else type(optimizer).__name__.lower()
    if name in _NOT_PER_VARIABLE:
        raise LayoutError(
            f"Optimizer {name!r} keeps no fixed number of full-size slots per variable: "
            f"{_NOT_PER_VARIABLE[name]} Received: optimizer={optimizer!r}"
        )
    if name not in _BASE_SLOTS:
        raise LayoutError(
            f"Unknown optimizer {optimizer!r}: its slot count is not known. Fix: use one of "
            f"{sorted(_BASE_SLOTS)}. Received: optimizer={optimizer!r}"
        )
    slots = _BASE_SLOTS[name]
    if not isinstance(optimizer, str):
        if getattr(optimizer, "amsgrad", False):
            slots += 1
        momentum = getattr(optimizer, "momentum", 0)
        if name in ("sgd", "rmsprop") and momentum:
            slots += 1
        if name == "rmsprop" and getattr(optimizer, "centered", False):
            slots += 1
        if getattr(optimizer, "use_ema", False):
            slots += 1  # the moving average of every variable
        if getattr(optimizer, "gradient_accumulation_steps", None):
            slots += 1  # `BaseOptimizer.build`: one accumulator per trainable variable
    return slots
