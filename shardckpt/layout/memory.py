"""What an optimizer keeps per trainable variable, for the plan's memory estimate.

Keras optimizers create most slots with `add_variable_from_reference`,
which copies the variable's shape and layout, so such a slot costs the
variable's bytes per device. For those whose every slot is such a copy the
counts below are read from `keras/src/optimizers/*.py` (`build()`): e.g.
Adam keeps momentum and velocity (2), plus a velocity maximum with
`amsgrad`. Options of the base optimizer add one each: `use_ema` (a moving
average of every variable) and `gradient_accumulation_steps` (a gradient
accumulator per variable). A `LossScaleOptimizer` counts as the optimizer
it wraps: the slots are the inner optimizer's, the wrapper adds two scalars.

Two optimizers keep something else, counted per variable (`slots_for`):
`Adafactor` (a velocity like the variable, and factored second moments
made with `add_variable`: no layout, so whole on every device) and `Muon`
(a momentum for every variable, a velocity for those it updates with
AdamW).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax.numpy as jnp
import keras

from shardckpt import _keras
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
# (`build()` in keras/src/optimizers/): `slots_for` counts them per variable.
_PER_VARIABLE = ("adafactor", "muon")


@dataclasses.dataclass(frozen=True)
class Slots:
    """An optimizer's state for one trainable variable.

    Attributes:
        sharded: Copies of the variable, each placed like it.
        replicated: `(shape, dtype name)` of arrays made with no layout:
            Keras replicates them, so each is whole on every device.
    """

    sharded: int
    replicated: tuple[tuple[tuple[int, ...], str], ...] = ()

    def replicated_bytes(self) -> int:
        """Bytes of `replicated` (on every device)."""
        return sum(math.prod(shape) * jnp.dtype(dtype).itemsize for shape, dtype in self.replicated)


def _unwrap(optimizer: Any) -> tuple[Any, str]:
    """The optimizer a `LossScaleOptimizer` wraps (else `optimizer`), and its lower-case name."""
    while isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    return optimizer, optimizer.lower() if isinstance(optimizer, str) else type(optimizer).__name__.lower()


def _base_extras(optimizer: Any) -> int:
    """Copies the base optimizer's options add for every variable (0 for a name)."""
    if isinstance(optimizer, str):
        return 0
    extra = 1 if getattr(optimizer, "use_ema", False) else 0  # the moving average of every variable
    if getattr(optimizer, "gradient_accumulation_steps", None):
        extra += 1  # `BaseOptimizer.build`: one accumulator per trainable variable
    return extra


@functools.cache
def _default_muon() -> Any:
    """The `Muon` the name "muon" stands for (its defaults), made once."""
    return keras.optimizers.Muon()


def slots_for(optimizer: Any, path: str, shape: tuple[int, ...], dtype: str) -> Slots:
    """What `optimizer` keeps for the trainable variable `path` of `shape` and `dtype`.

    Step counter, learning rate and a loss scale (scalars of the optimizer,
    not of a variable) are left out.

    Args:
        optimizer: A name ("adam", "adafactor", ...) or a
            `keras.optimizers.Optimizer` (a `LossScaleOptimizer`: the one it
            wraps; a name stands for the optimizer with its defaults).
        path: The variable's path (Muon's AdamW rule reads it).
        shape: The variable's shape.
        dtype: The variable's dtype name.

    Raises:
        LayoutError: The optimizer is not one whose slots are known.
    """
    inner, name = _unwrap(optimizer)
    if name == "adafactor":
        # `Adafactor.build`: a velocity from the reference, and the second moments factored over
        # the last two dimensions by `add_variable(dtype=var.dtype)`, or, below two dimensions,
        # two `backend.Variable(0)` placeholders (int32 scalars).
        if len(shape) >= 2:
            factors = ((tuple(shape[:-1]), dtype), (tuple(shape[:-2]) + (shape[-1],), dtype))
        else:
            factors = (((), "int32"), ((), "int32"))
        return Slots(1 + _base_extras(inner), factors)
    if name == "muon":
        # `Muon.build`: a momentum for every variable, a velocity where it updates with AdamW.
        muon = _default_muon() if isinstance(inner, str) else inner
        velocity = 1 if _keras.muon_uses_adamw(muon, path, shape) else 0
        return Slots(1 + velocity + _base_extras(inner))
    return Slots(slots_per_variable(optimizer))


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
    optimizer, name = _unwrap(optimizer)
    if name in _PER_VARIABLE:
        raise LayoutError(
            f"Optimizer {name!r} keeps no fixed number of full-size slots per variable (see "
            f"shardckpt.layout.memory). Fix: count them per variable with slots_for, as "
            f"LayoutPlan.bytes_per_device does. Received: optimizer={optimizer!r}"
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
    return slots + _base_extras(optimizer)
