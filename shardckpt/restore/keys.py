"""Keras variables <-> checkpoint keys, for each family of formats.

- Keras h5 (`.weights.h5`, `.keras`): keys follow Keras' object-graph walk
  (`layers/dense_1/vars/0`), not layer names. Rather than re-deriving that walk,
  `h5_keys` runs Keras' own `saving_lib._save_state` against a store that
  records which variable each layer writes under which key, so the mapping is
  exactly what `model.save_weights` would produce for this Keras version.
- Orbax (Keras' `OrbaxCheckpoint` / `get_state_tree()`): `<collection>/<path>`
  where collection is trainable_variables, non_trainable_variables,
  optimizer_variables or metrics_variables and path is `variable.path`.
- safetensors: `variable.path` (what `{v.path: v for v in model.weights}` gives).

`saving_lib._save_state` and `H5IOStore` are private Keras APIs; there is no
public way to ask Keras which key a variable is saved under.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from keras.src.backend.common.variables import Variable
from keras.src.saving import saving_lib

# Checkpoint collections that are optional: a weights-only checkpoint lacks
# them, and a model without a built optimizer has nothing to put there.
OPTIONAL_PREFIXES = ("optimizer_variables/", "metrics_variables/", "optimizer/")


class _RecordingStore(saving_lib.H5IOStore):
    """An `H5IOStore` that opens no file and records `key -> variable`."""

    def __init__(self) -> None:  # noqa: D107 (deliberately skips the file open)
        self.mode = "w"
        self.records: dict[str, Any] = {}
        self._prefix = ""

    def __bool__(self) -> bool:
        return True

    def make(self, path: str, metadata: dict | None = None) -> "_RecordingStore":
        self._prefix = f"{path}/vars" if path else "vars"
        return self

    def __setitem__(self, key: str, value: Any) -> None:
        self.records[f"{self._prefix}/{key}"] = value

    def close(self) -> None:
        pass


@contextlib.contextmanager
def _optimizers_record_variables(model: Any) -> Iterator[None]:
    # BaseOptimizer.save_own_variables stores `variable.numpy()` (a host copy of
    # the whole optimizer state, and an error for unloaded variables); record
    # the variables themselves, in the same order, instead.
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or not hasattr(optimizer, "variables"):
        yield
        return

    def record(store: Any) -> None:
        for i, variable in enumerate(optimizer.variables):
            store[str(i)] = variable

    optimizer.save_own_variables = record
    try:
        yield
    finally:
        del optimizer.save_own_variables


def h5_keys(model: Any) -> dict[str, Any]:
    """Returns `{h5 key: variable}` exactly as Keras' `save_weights` names them.

    A value that is not a variable (a quantized layer's merged kernel, say)
    is recorded as given; `load_sharded` reports such keys as unsupported.
    """
    store = _RecordingStore()
    with _optimizers_record_variables(model):
        saving_lib._save_state(
            model, weights_store=store, assets_store=None, inner_path="", visited_saveables=set()
        )
    return store.records


def state_keys(model: Any) -> dict[str, Any]:
    """Returns `{state-tree key: variable}` as `model.get_state_tree()` nests them."""
    collections = {
        "trainable_variables": model.trainable_variables,
        "non_trainable_variables": model.non_trainable_variables,
        "metrics_variables": list(getattr(model, "metrics_variables", []) or []),
    }
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        collections["optimizer_variables"] = list(optimizer.variables)
    out: dict[str, Any] = {}
    for name, variables in collections.items():
        for variable in variables:
            out.setdefault(f"{name}/{variable.path}", variable)
    return out


def path_keys(model: Any) -> dict[str, Any]:
    """Returns `{variable.path: variable}` for every model weight (safetensors)."""
    return {v.path: v for v in model.weights}


def keys_for(model: Any, fmt: str) -> dict[str, Any]:
    """Returns the key -> variable map for checkpoint format `fmt`."""
    if fmt in ("h5", "keras"):
        return h5_keys(model)
    if fmt == "orbax":
        return state_keys(model)
    return path_keys(model)


def is_variable(value: Any) -> bool:
    return isinstance(value, Variable)


def is_optional_key(key: str) -> bool:
    """True for optimizer/metric keys, which a model may legitimately lack."""
    return key.startswith(OPTIONAL_PREFIXES)
