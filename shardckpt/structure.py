"""The structural identity of a model's variables: immune to Keras' generated names.

Keras names an unnamed layer by a process-wide counter, so the same
architecture built twice in one process has `dense_2/kernel` where the
first had `dense/kernel`: anything keyed by `variable.path` misses the
second instance. Keras' own `.weights.h5` files are immune, because they
key each variable by its position in the model's object graph
(`layers/dense_1/vars/0`: class names in snake case, numbered in order of
appearance within their parent). This module computes that key, by
running Keras' own `save_weights` walk (`_keras.save_state`) against a
store that records variables instead of writing them.

API (small on purpose, meant to be shared by layouts and checkpoint
matching):

- `structural_paths(model) -> {id(variable): key}` for every variable in
  `model.variables`;
- `variables_by_key(model) -> {key: variable}`, its inverse;
- `RecordingStore` and `lora_off(model)`, the walk's parts, which restore's
  h5 key naming (`restore.keys.h5_keys`) and export's converter recording
  use too;
- `explicit_names(model)`: the names a user gave (the ones Keras did not
  generate), which match by name, never by position; `is_explicitly_named(obj)`
  for one object;
- `slot_references(model)`: each optimizer slot and the variable it was made
  from;
- `finalize_loaded(model, variables)`: the `finalize_state()` Keras' own
  loading runs on layers that derive state from their loaded variables;
- `index_variables(model)`: float variables Keras reads as indices (int4
  group indices), which a dtype cast must leave alone.

A variable the walk does not reach (none in Keras' built-in layers; a
custom layer may skip some in `save_own_variables`) gets the key
`variables/<i>`: its index in `model.variables`, which is just as stable
for the same architecture built the same way.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable, Iterator
from typing import Any

import keras

from shardckpt import _keras

# The prefixes `keras.layers.Bidirectional` gives its copies of the layer it wraps.
_BIDIRECTIONAL_COPY = "(?:forward_|backward_)?"

__all__ = [
    "RecordingStore",
    "explicit_names",
    "is_explicitly_named",
    "finalize_loaded",
    "lora_layers",
    "lora_off",
    "reference_prefixes",
    "slot_references",
    "structural_paths",
    "variables_by_key",
]


class RecordingStore(_keras.H5IOStore):
    """An `H5IOStore` that opens no file and records `key -> value` (the `.weights.h5` keys of a walk)."""

    def __init__(self) -> None:  # noqa: D107 (deliberately skips the file open)
        self.mode = "w"
        self.records: dict[str, Any] = {}
        self._prefix = ""

    def __bool__(self) -> bool:
        return True

    def make(self, path: str, metadata: dict | None = None) -> RecordingStore:
        self._prefix = f"{path}/vars" if path else "vars"
        return self

    def __setitem__(self, key: str, value: Any) -> None:
        self.records[f"{self._prefix}/{key}"] = value

    def close(self) -> None:
        pass


LORA_FACTORS = {"kernel": ("lora_kernel_a", "lora_kernel_b"), "embeddings": ("lora_embeddings_a", "lora_embeddings_b")}
"""Keras' names of the LoRA factors `enable_lora` creates beside a layer's base weight."""


def lora_factor_paths(paths: list[str]) -> set[str]:
    """The paths `enable_lora` would give the LoRA factors of the base weights among `paths`."""
    out: set[str] = set()
    for path in paths:
        owner, _, name = path.rpartition("/")
        out.update(f"{owner}/{factor}" for factor in LORA_FACTORS.get(name, ()))
    return out


@contextlib.contextmanager
def lora_off(model: Any) -> Iterator[None]:
    """Turns `lora_enabled` off on every LoRA-enabled layer of `model` for the block.

    A LoRA-enabled layer's `kernel` is its merged kernel (base + A @ B x
    scale), a new array computed from values a lazily built model lacks;
    with LoRA off, the same walk (Keras' save, a keras-hub converter) meets
    the base kernel variable under the same key.
    """
    lora = [
        layer
        for layer in getattr(model, "_flatten_layers", list)()
        if getattr(layer, "lora_enabled", False) is True
    ]
    for layer in lora:
        layer.lora_enabled = False
    try:
        yield
    finally:
        for layer in lora:
            layer.lora_enabled = True


# A LoRA-enabled layer's base variable, its merged value (a property), and its factors:
# Dense/EinsumDense (`_kernel`, `kernel`, `lora_kernel_a/b`), Embedding (`_embeddings`, ...).
_LORA_PARTS = (("_kernel", "kernel", "lora_kernel_a", "lora_kernel_b"),
               ("_embeddings", "embeddings", "lora_embeddings_a", "lora_embeddings_b"))


def lora_layers(model: Any) -> list[tuple[Any, Any, str, tuple[Any, Any]]]:
    """`(layer, base variable, merged attribute, (factor A, factor B))` of each LoRA-enabled layer."""
    out = []
    for layer in getattr(model, "_flatten_layers", list)():
        if getattr(layer, "lora_enabled", False) is not True:
            continue
        for base, merged, a, b in _LORA_PARTS:
            if getattr(layer, base, None) is not None and hasattr(layer, a) and hasattr(layer, b):
                out.append((layer, getattr(layer, base), merged, (getattr(layer, a), getattr(layer, b))))
                break
    return out


# Float variables that Keras reads as indices: the group of each input row of an int4 sub-channel
# or GPTQ layer (`take(scale, g_idx)`), made float32 under every dtype policy (`add_weight(...,
# dtype="float32")`), so a bfloat16 model keeps them float32 too.
_INDEX_ATTRIBUTES = ("g_idx",)


def index_variables(model: Any) -> dict[int, Any]:
    """`id -> variable` of the float variables of `model` that hold indices (int4 / GPTQ `g_idx`).

    A cast to a narrower float changes those indices once they pass its
    exact integers (256 in bfloat16: a layer of more than 32768 inputs in
    groups of 128), and each changed row reads another group's scale.
    """
    out = {}
    for layer in getattr(model, "_flatten_layers", list)():
        for name in _INDEX_ATTRIBUTES:
            variable = getattr(layer, name, None)
            if isinstance(variable, keras.Variable):
                out[id(variable)] = variable
    return out


def finalize_loaded(model: Any, variables: Iterable[Any]) -> list[Any]:
    """Calls `finalize_state()` on each layer of `model` that derives state from `variables`.

    Some layers keep state computed from their variables outside them: an
    adapted `keras.layers.Normalization` holds its `mean` and `variance` as
    tensors reshaped and cast from its `adapt_mean` / `adapt_variance`
    variables. Keras' own loading recomputes them (those layers' overridden
    `load_own_variables` calls `finalize_state()`); a load that assigns the
    variables directly must do the same, or the layer computes with the values
    it was built with (zeros and ones, or nothing at all under `lazy_init`).

    Only layers whose class defines its own `finalize_state` are called, and
    only those owning (themselves or through their sublayers) one of
    `variables`: a layer none of whose values changed keeps its state.
    Sublayers are finalized before the layers holding them.

    Args:
        model: A Keras model (or layer).
        variables: The variables that just got new values.

    Returns:
        The layers finalized, in the order they were.
    """
    changed = {id(v) for v in variables}
    base = getattr(keras.layers.Layer, "finalize_state", None)
    done = []
    # `_flatten_layers` lists a layer before its sublayers: reversed, a
    # container's finalize_state sees its sublayers' state already final.
    for layer in reversed(list(getattr(model, "_flatten_layers", list)())):
        own = getattr(type(layer), "finalize_state", None)
        if own is None or own is base or not any(id(v) in changed for v in layer.variables):
            continue
        layer.finalize_state()
        done.append(layer)
    return done


def structural_paths(model: Any) -> dict[int, str]:
    """`{id(variable): structural key}` for every variable of `model`.

    Two instances of one architecture get the same keys for corresponding
    variables, whatever names Keras generated for their layers.

    Example:

    ```python
    keys = structural_paths(model)
    keys[id(model.layers[1].kernel)]     # "layers/dense/vars/0"
    ```

    Args:
        model: A built Keras model (or layer); its variables may be unloaded.

    Returns:
        One key per variable of `model.variables` (an optimizer's are not
        model variables and are left out).
    """
    store = RecordingStore()
    optimizer = getattr(model, "optimizer", None)
    skip = [optimizer] if optimizer is not None else []
    with lora_off(model):
        _keras.save_state(model, store, skip=skip)
    wanted = {id(v) for v in model.variables}
    out: dict[int, str] = {}
    for key, value in store.records.items():
        if id(value) in wanted and id(value) not in out:
            out[id(value)] = key
    for i, v in enumerate(model.variables):
        out.setdefault(id(v), f"variables/{i}")
    return out


def variables_by_key(model: Any) -> dict[str, Any]:
    """`{structural key: variable}`: the inverse of `structural_paths`."""
    by_id = {id(v): v for v in model.variables}
    return {key: by_id[i] for i, key in structural_paths(model).items()}


def _named_objects(model: Any) -> Iterator[Any]:
    """The objects whose names appear in the model's variable paths: its layers
    (the model included), its optimizer, its metrics (nested ones too) and
    every variable (the last part of a path)."""
    yield from getattr(model, "_flatten_layers", list)()
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        yield optimizer
    metrics = list(getattr(model, "metrics", None) or [])
    while metrics:
        metric = metrics.pop()
        yield metric
        inner = getattr(metric, "metrics", None)  # Keras' CompileMetrics holds the compiled ones
        if isinstance(inner, list | tuple):
            metrics.extend(inner)
    yield from model.weights


def explicit_names(model: Any) -> frozenset[str]:
    """The names in `model`'s variable paths that a user gave, not Keras.

    Keras names an object it is given no name for `auto_name(class)`: the
    class name in snake case, then `_<n>` from a process-wide counter
    (`Dense` -> `dense`, `dense_1`, ...; see `_keras.auto_name_base`). Any
    other name was given: `layer_3`, `head_1` and `up` are explicit, and a
    counter in them is part of the name. Such names identify their object in
    any build of the model; generated ones do not (the counter depends on
    what the process built before).

    A user name that has the generated form (a `Dense` layer named
    `dense_4`) cannot be told from a generated one and counts as generated,
    as Keras' own generated names would.

    `keras.layers.Bidirectional` names its two copies of the wrapped layer
    `forward_<name>` and `backward_<name>`: when `<name>` was generated
    (`forward_lstm_3`), so is theirs, counter included.

    Args:
        model: A Keras model, built (its variables may be unloaded).

    Returns:
        The explicit names of its layers, the model, its optimizer and
        metrics, and its variables.
    """
    return frozenset(obj.name for obj in _named_objects(model) if is_explicitly_named(obj))


def is_explicitly_named(obj: Any) -> bool:
    """Whether `obj` (a layer, model, optimizer, metric or variable) has a name a user gave.

    Keras keeps no record of it (`Operation.__init__` replaces a missing
    name by `auto_name(class name)` and forgets): a name that is not the
    generated form for `obj`'s class (`dense`, `dense_<n>` for a `Dense`) was
    given. See `explicit_names` for the one ambiguous case and for
    `Bidirectional`'s copies.
    """
    name = getattr(obj, "name", None)
    if not isinstance(name, str) or not name:
        return False
    generated = rf"{re.escape(_keras.auto_name_base(type(obj)))}(?:_\d+)?"
    if isinstance(obj, keras.layers.Layer):
        # Bidirectional builds its forward (and, unless given one, backward) layer from the wrapped
        # layer's config renamed `forward_` / `backward_` + its name: a counter carried over from a
        # generated name changes with what the process built before, as the name it came from.
        generated = _BIDIRECTIONAL_COPY + generated
    return re.fullmatch(generated, name) is None


def slot_references(model: Any) -> dict[int, Any]:
    """`{id(slot): variable}`: each optimizer slot of `model` and the model variable it was made from.

    Keras makes a slot from a variable with `add_variable_from_reference`,
    which names it `<variable path, "/" -> "_">_<slot name>` (`adam/
    up_kernel_momentum`) and gives it the variable's layout, and keeps no
    link from one to the other. A slot is paired with the variable of the
    longest such prefix of its name and of its shape; the optimizer's other
    variables (step counter, learning rate) have none and are left out.

    Args:
        model: A Keras model; without an optimizer the result is empty.
    """
    optimizer = getattr(model, "optimizer", None)
    slots = list(getattr(optimizer, "variables", None) or [])
    if not slots:
        return {}
    by_stem: dict[str, list[Any]] = {}
    for variable in model.weights:
        by_stem.setdefault(variable.path.replace("/", "_"), []).append(variable)
    out: dict[int, Any] = {}
    for slot in slots:
        for stem in reference_prefixes(slot.name):
            same = [v for v in by_stem.get(stem, ()) if tuple(v.shape) == tuple(slot.shape)]
            if same:
                out[id(slot)] = same[0]
                break
    return out


def reference_prefixes(slot_name: str) -> Iterator[str]:
    """Where the variable part of an optimizer slot's name may end, longest first.

    Keras names a slot `<variable path, "/" -> "_">_<slot name>`
    (`add_variable_from_reference`), and a path's own "_" cannot be told from
    the one before the slot name: each prefix ending before an "_" is a
    candidate, and the longest that names a variable is the one.
    """
    end = len(slot_name)
    while (end := slot_name.rfind("_", 0, end)) > 0:
        yield slot_name[:end]
