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
- keras-hub preset folders: `model/<h5 key>` for the backbone's weights file,
  `task/<h5 key>` for `task.weights.h5` (a task's weights outside its
  backbone, named with the backbone's layers skipped, as keras-hub saves them).

Two adjustments to what Keras names:
- LoRA: Keras saves a LoRA-enabled layer's merged kernel (`kernel` property:
  base + A @ B * scale) under the kernel's key, and never the factors. The
  key maps to the base kernel variable, so a lazily built model receives the
  merged kernel there; its factors are not in the checkpoint and keep their
  `enable_lora` initialisation (A random, B zeros), so the model computes
  exactly the saved function and LoRA training can go on. (Keras'
  `load_weights` zeroes both factors, which leaves them with zero gradients.)
- Optimizer: Orbax keys hold the optimizer's generated name
  (`optimizer_variables/adam/...`), which becomes `adam_1` in a process that
  created another optimizer first. `align_optimizer_keys` matches by the path
  under the optimizer when model and checkpoint each have one optimizer.

`saving_lib._save_state` and `H5IOStore` are private Keras APIs; there is no
public way to ask Keras which key a variable is saved under.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

from keras.src.backend.common.variables import Variable
from keras.src.saving import saving_lib

# Checkpoint collections that are optional: a weights-only checkpoint lacks
# them, and a model without a built optimizer has nothing to put there.
OPTIONAL_PREFIXES = ("optimizer_variables/", "metrics_variables/", "optimizer/")
# The roles of a preset's weights files (see `preset_keys`).
PRESET_PREFIXES = ("model/", "task/")


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
def _lora_saves_base_kernel(model: Any) -> Iterator[None]:
    # A LoRA-enabled layer saves its merged kernel, computed from variables a
    # lazily built model has no value for. With `lora_enabled` off for the
    # walk, the same `save_own_variables` stores the base kernel variable
    # under the same key (see the module docstring).
    layers = [
        layer
        for layer in getattr(model, "_flatten_layers", list)()
        if getattr(layer, "lora_enabled", False) is True
    ]
    for layer in layers:
        layer.lora_enabled = False
    try:
        yield
    finally:
        for layer in layers:
            layer.lora_enabled = True


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


def h5_keys(model: Any, *, skip: Iterable[Any] = ()) -> dict[str, Any]:
    """Returns `{h5 key: variable}` exactly as Keras' `save_weights` names them.

    A value that is not a variable (a quantized layer's merged kernel, say)
    is recorded as given; `load_sharded` reports such keys as unsupported.

    Args:
        model: The model.
        skip: Objects left out of the walk, as Keras' `objects_to_skip`
            (keras-hub saves a task's own weights with its backbone's layers
            skipped).
    """
    store = _RecordingStore()
    with _optimizers_record_variables(model), _lora_saves_base_kernel(model):
        saving_lib._save_state(
            model,
            weights_store=store,
            assets_store=None,
            inner_path="",
            visited_saveables={id(o) for o in skip},
        )
    return store.records


def is_task(model: Any) -> bool:
    """True for a keras-hub task: a model holding a `backbone` model."""
    import keras

    backbone = getattr(model, "backbone", None)
    return isinstance(backbone, keras.Model) and backbone is not model


def preset_keys(model: Any) -> dict[str, Any]:
    """Returns `{preset key: variable}` for a keras-hub preset folder.

    A backbone's keys are its h5 keys behind `model/`; a task's are its
    backbone's behind `model/` and its other weights (named as keras-hub's
    `save_task_weights` does, backbone layers skipped) behind `task/`.
    """
    if not is_task(model):
        return {f"model/{k}": v for k, v in h5_keys(model).items()}
    backbone = model.backbone
    out = {f"model/{k}": v for k, v in h5_keys(backbone).items()}
    out.update({f"task/{k}": v for k, v in h5_keys(model, skip=list(backbone._flatten_layers())).items()})
    return out


def align_optimizer_keys(wanted: dict[str, Any], stored: Iterable[str]) -> dict[str, Any]:
    """Renames the model's optimizer keys to the checkpoint's optimizer name.

    Orbax state-tree keys of optimizer variables are
    `optimizer_variables/<optimizer name>/<variable>`, and the name is
    generated (`adam`, `adam_1`, ...). When the model's keys and the
    checkpoint's each hold exactly one optimizer name and they differ, the
    model's keys take the checkpoint's name, so variables match by their path
    under the optimizer. Otherwise `wanted` is returned as is, and a real
    difference is reported key by key.
    """
    prefix = "optimizer_variables/"

    def names(keys: Iterable[str]) -> set[str]:
        return {k[len(prefix) :].split("/", 1)[0] for k in keys if k.startswith(prefix) and "/" in k[len(prefix) :]}

    ours, theirs = names(wanted), names(stored)
    if len(ours) != 1 or len(theirs) != 1 or ours == theirs:
        return wanted
    old, new = f"{prefix}{ours.pop()}/", f"{prefix}{theirs.pop()}/"
    return {(new + k[len(old) :] if k.startswith(old) else k): v for k, v in wanted.items()}


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
    if fmt == "preset":
        return preset_keys(model)
    if fmt == "orbax":
        return state_keys(model)
    return path_keys(model)


def is_variable(value: Any) -> bool:
    return isinstance(value, Variable)


def _in_file(key: str) -> str:
    """`key` without a preset's `model/` / `task/` part: the key inside its h5 file."""
    for prefix in PRESET_PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix) :]
    return key


def collection(key: str, fmt: str = "") -> str:
    """The group a key belongs to (`optimizer`, `trainable_variables`, `task/optimizer`...)."""
    if fmt == "preset":
        head, _, rest = key.partition("/")
        return f"{head}/{rest.split('/', 1)[0]}"
    return key.split("/", 1)[0]


def is_optional_key(key: str, fmt: str = "") -> bool:
    """True for optimizer/metric keys, which a model may legitimately lack."""
    return (_in_file(key) if fmt == "preset" else key).startswith(OPTIONAL_PREFIXES)
