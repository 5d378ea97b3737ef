"""`format="orbax"`: the model's weights as one Orbax step, each device's piece written as it is.

The step is shardckpt's Orbax writer's (`formats.orbax.writer`, the layout
Keras' `model.load_weights(dir)` and `load_sharded` read): arrays keyed as
`model.get_state_tree()` nests them (trainable and non-trainable variables;
no optimizer), each array's outer chunk one piece of its sharding, pieces
staged in TensorStore transactions of at most the budget. One process: the
Orbax layout of several processes (one OCDBT store each, merged at commit)
is written by `shardckpt.OrbaxCheckpoint`, not here.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from shardckpt import _keras, dtypes, state
from shardckpt.budget import Budget
from shardckpt.errors import UnsupportedModelError
from shardckpt.exporting.model import lora_bases, lora_factors, overflowed, value_getters, value_of
from shardckpt.exporting.pieces import owned_pieces
from shardckpt.formats.orbax import writer as orbax_writer
from shardckpt.restore.keys import state_keys


def export_orbax(model: Any, partial: str, *, dtype: Any, budget: Budget) -> tuple[int, int, bytes, list[str]]:
    """Writes the step into the (empty) stage folder `partial`.

    Returns:
        (arrays, bytes, commit marker, casts): casts as `ExportReport.casts`.
    """
    import jax

    if jax.process_count() > 1:
        raise UnsupportedModelError(
            f"format='orbax' from {jax.process_count()} processes is not built here. Fix: save with "
            "shardckpt.OrbaxCheckpoint (multi-process Orbax steps), or export format='safetensors'."
        )
    optional = tuple(f"{c}/" for c in state.OPTIONAL_COLLECTIONS)
    # One function: LoRA kernels merged, factors left out (as Keras' save_weights), each merged
    # kernel under the key a plain model of the architecture has (`trainable_variables/`).
    factors = lora_factors(model)
    bases = lora_bases(model)
    keys = {}
    for k, v in state_keys(model, held=state.WEIGHT_COLLECTIONS).items():
        if k.startswith(optional) or id(v) in factors:
            continue
        if id(v) in bases:
            k = f"{state.WEIGHT_COLLECTIONS[0]}/{v.path}"
        keys[k] = v
    getters = value_getters(model)
    writer = orbax_writer.OrbaxStepWriter(partial, compression="none", chunk_byte_size=None)
    arrays, values, casts = [], [], []
    for key, variable in keys.items():
        value = value_of(variable, getters)
        own = np.dtype(value.dtype)
        stored = np.dtype(dtype) if dtype is not None and dtypes.is_float(own) else own
        if stored != own:
            casts.append(f"{variable.path}: {own} -> {stored}")
        write_shape = value.sharding.shard_shape(value.shape) if hasattr(value, "sharding") else value.shape
        arrays.append((key, tuple(value.shape), stored, tuple(write_shape)))
        values.append((value, stored))
    stores = writer.open_arrays(arrays)
    total = 0
    overflows = dtypes.Overflows(None if dtype is None else np.dtype(dtype))
    for (key, *_), store, (value, stored) in zip(arrays, stores, values, strict=True):
        if dtypes.narrows_range(value.dtype, stored):
            overflows.add(key.split("/", 1)[-1], overflowed(value, stored))
        for box, data in owned_pieces(value):
            with np.errstate(over="ignore"):  # counted above, said once below
                host = np.asarray(data).astype(stored, copy=False)
            with budget.holding(host.nbytes):
                txn = writer.transaction()
                orbax_writer.OrbaxStepWriter.write(store, txn, box, host).copy.result()
                txn.commit_async().result()  # one OCDBT commit per piece: TensorStore holds no more
            total += host.nbytes
    said = overflows.message("export format='orbax'")
    if said:
        logging.getLogger("shardckpt").warning("%s", said)
    # Layers whose state is in asset files (an adapted lookup layer's vocabulary)
    # travel beside the arrays, as in Keras' full Orbax saves: a fresh model
    # loading this step would otherwise compute with an empty vocabulary.
    files = _keras.save_assets(model)
    handlers = orbax_writer.write_assets(partial, files, compression="none") if files else {}
    marker = writer.finish(custom_metadata={"exported_by": "shardckpt.export"}, item_handlers=handlers)
    return len(arrays), total, marker, casts
