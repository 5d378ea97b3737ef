"""Optimizer slots a load gave no value moved onto their variable's sharding.

Keras gives a slot its variable's layout when the optimizer is built
(`add_variable_from_reference(layout=variable._layout)`). A variable built
under `lazy_init()` has none until it is loaded, so an optimizer built by
hand before the load (`model.optimizer.build(model.trainable_variables)`)
makes each slot where the distribution puts the slot's own path
(`adam/up_kernel_momentum`), which a `LayoutMap` of variable paths does not
match: a whole copy on every device. A checkpoint holding the optimizer's
state puts each slot where its variable goes (`targets`); one without it (a
`.weights.h5`, a weights-only Orbax step) leaves the slots as they were
made, so they are moved here, their values unchanged, where Keras would
have made them had the variables been placed already.
"""

from __future__ import annotations

from collections.abc import Container, Mapping
from typing import Any

import jax

from shardckpt import _keras


def follow_variables(model: Any, references: Mapping[int, Any], loaded: Container[int]) -> list[str]:
    """Moves each slot the load did not write onto its variable's sharding.

    Args:
        model: The model just loaded.
        references: `{id(slot): variable}` (`structure.slot_references`).
        loaded: `id`s of the variables the load gave a stored value; those
            slots were placed by the load's own targets and stay there.

    Returns:
        The paths of the slots moved.
    """
    optimizer = getattr(model, "optimizer", None)
    moved = []
    for slot in list(getattr(optimizer, "variables", None) or []):
        variable = references.get(id(slot))
        if variable is None or id(slot) in loaded:
            continue
        value, target = _keras.current_value(slot), _keras.current_value(variable)
        if value is None or target is None or value.sharding == target.sharding:
            continue
        # The slot takes the variable's Keras layout too, as `add_variable_from_reference`
        # gives it: later assigns (optimizer updates) re-place values on it.
        layout = _keras.current_layout(variable)
        if layout is None and isinstance(target.sharding, jax.sharding.NamedSharding):
            layout = target.sharding
        _keras.set_value(slot, jax.device_put(value, target.sharding), layout=layout)
        moved.append(slot.path)
    return moved
