"""Keras variables <-> checkpoint keys, for each family of formats, and `match`.

- Keras h5 (`.weights.h5`, `.keras`): keys follow Keras' object-graph walk
  (`layers/dense_1/vars/0`), not layer names. Rather than re-deriving that walk,
  `h5_keys` runs Keras' own `saving_lib._save_state` against a store that
  records which variable each layer writes under which key, so the mapping is
  exactly what `model.save_weights` would produce for this Keras version.
- Orbax (Keras' `OrbaxCheckpoint` / `get_state_tree()`): `<collection>/<path>`
  where collection is trainable_variables, non_trainable_variables,
  optimizer_variables or metrics_variables and path is `variable.path`.
- safetensors: `variable.path` (what `{v.path: v for v in model.weights}` gives).

Keras' `_save_state` walk and `H5IOStore` are private (see `shardckpt._keras`):
there is no public way to ask Keras which key a variable is saved under.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import keras

from shardckpt import _keras, state
from shardckpt.errors import CheckpointMismatchError
from shardckpt.formats.base import Reader

# Checkpoint collections that are optional: a weights-only checkpoint lacks
# them, and a model without a built optimizer has nothing to put there.
# ("optimizer/" is where Keras' h5 files keep optimizer variables.)
OPTIONAL_PREFIXES = (*(f"{c}/" for c in state.OPTIONAL_COLLECTIONS), "optimizer/")


class _RecordingStore(_keras.H5IOStore):
    """An `H5IOStore` that opens no file and records `key -> variable`."""

    def __init__(self) -> None:  # noqa: D107 (deliberately skips the file open)
        self.mode = "w"
        self.records: dict[str, Any] = {}
        self._prefix = ""

    def __bool__(self) -> bool:
        return True

    def make(self, path: str, metadata: dict | None = None) -> _RecordingStore:
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
        _keras.save_state(model, store)
    return store.records


def state_keys(model: Any) -> dict[str, Any]:
    """Returns `{state-tree key: variable}` as `model.get_state_tree()` nests them."""
    out: dict[str, Any] = {}
    for name, variables in state.collections(model).items():
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
    return isinstance(value, keras.Variable)


def is_optional_key(key: str) -> bool:
    """True for optimizer/metric keys, which a model may legitimately lack."""
    return key.startswith(OPTIONAL_PREFIXES)


@dataclasses.dataclass
class KeyMatch:
    """How a checkpoint's keys and a model's variables pair up (`match`).

    Attributes:
        pairs: `(key, variable)` to load, one per variable, shapes equal.
        missing: `(key, variable)` the checkpoint lacks, except keys of an
            optional collection the checkpoint has none of (a weights-only
            checkpoint: the optimizer keeps its state).
        unexpected: Checkpoint keys no variable wants, sorted.
        skipped: Optional checkpoint keys whose collection the model lacks
            entirely (optimizer state into a model without an optimizer).
        mismatched: One line per variable that cannot be loaded from its key:
            shapes differ, or the layer saves a computed value.
    """

    pairs: list[tuple[str, Any]] = dataclasses.field(default_factory=list)
    missing: list[tuple[str, Any]] = dataclasses.field(default_factory=list)
    unexpected: list[str] = dataclasses.field(default_factory=list)
    skipped: list[str] = dataclasses.field(default_factory=list)
    mismatched: list[str] = dataclasses.field(default_factory=list)

    def missing_lines(self) -> list[str]:
        """`missing` as `CheckpointMismatchError` lists it."""
        return [f"{variable.path} (key {key!r})" for key, variable in self.missing]

    def raise_if_mismatched(self, path: str, *, strict: bool) -> None:
        """Raises one error listing every problem: mismatches always, missing and
        unexpected keys when `strict`.

        Raises:
            CheckpointMismatchError: naming each key and variable.
        """
        if self.mismatched or (strict and (self.missing or self.unexpected)):
            raise CheckpointMismatchError(
                path,
                missing=self.missing_lines() if strict else (),
                unexpected=self.unexpected if strict else (),
                mismatched=self.mismatched,
            )


def match(wanted: dict[str, Any], reader: Reader) -> KeyMatch:
    """Pairs the model's keys (`keys_for`, or a subset) with the checkpoint's.

    Reads metadata only (`reader.spec`). A variable saved under two keys (a
    shared layer) is loaded once.
    """
    stored = set(reader.keys())
    collections_stored = {k.split("/", 1)[0] for k in stored}
    result = KeyMatch()
    seen: set[int] = set()
    for key, variable in wanted.items():
        if not is_variable(variable):
            result.mismatched.append(
                f"{key}: the layer saves a computed value here (quantized or LoRA "
                "layer), which load_sharded cannot place; load it with "
                "model.load_weights"
            )
            continue
        if key not in stored:
            if is_optional_key(key) and key.split("/", 1)[0] not in collections_stored:
                continue
            if id(variable) not in seen:
                result.missing.append((key, variable))
            continue
        stored.discard(key)
        if id(variable) in seen:
            continue
        seen.add(id(variable))
        spec = reader.spec(key)
        if tuple(spec.shape) != tuple(variable.shape):
            result.mismatched.append(
                f"{variable.path}: checkpoint {key!r} has shape {tuple(spec.shape)}, "
                f"the variable {tuple(variable.shape)}"
            )
            continue
        result.pairs.append((key, variable))
    for key in sorted(stored):
        collection = key.split("/", 1)[0] + "/"
        if is_optional_key(key) and not any(k.startswith(collection) for k in wanted):
            result.skipped.append(key)
        else:
            result.unexpected.append(key)
    return result
