"""A keras-hub preset folder, its weights written piece by piece.

keras-hub's `save_to_preset` writes `config.json` and `metadata.json`
(kept: written by keras-hub's own saver, `shardckpt._keras_hub`), then the
backbone's `model.weights.h5` through Keras' `save_weights`, which gathers
every variable on one host. Here the weights file is laid out first with
the keys Keras' own walk gives (`restore.keys.h5_keys`, the names
`load_weights` looks up) and the groups it creates (recorded from the same
walk), then filled at each dataset's offset by the processes owning the
pieces (`formats.h5_writer`). Above `max_shard_size` it is Keras' sharded
layout (`model.weights.json` + `model_0000i.weights.h5`), as keras-hub
writes it. A task adds `task.json`, its preprocessor's files and, when it
has weights outside its backbone, `task.weights.h5`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shardckpt import _keras, dtypes
from shardckpt.formats.base import ArraySpec
from shardckpt.restore.keys import h5_keys, is_task


class _GroupStore(_keras.H5IOStore):
    """An `H5IOStore` that opens no file and records the groups Keras would create."""

    def __init__(self) -> None:  # noqa: D107 (deliberately skips the file open)
        self.mode = "w"
        self.groups: dict[str, dict[str, str]] = {}
        self._path = ""

    def __bool__(self) -> bool:
        return True

    def make(self, path: str, metadata: dict | None = None) -> _GroupStore:
        self._path = f"{path}/vars" if path else "vars"
        if metadata:  # Keras creates a group with metadata even when empty
            self.groups[self._path] = dict(metadata)
        return self

    def __setitem__(self, key: str, value: Any) -> None:
        self.groups.setdefault(self._path, {})

    def close(self) -> None:
        pass


def _groups(model: Any, skip: list[Any]) -> dict[str, dict[str, str]]:
    store = _GroupStore()
    optimizer = getattr(model, "optimizer", None)
    # The optimizer is not part of a preset; its save would copy its state.
    _keras.save_state(model, store, skip=[*skip, *([optimizer] if optimizer is not None else [])])
    return store.groups


def weight_files(model: Any) -> list[tuple[str, dict[str, Any], dict[str, dict[str, str]]]]:
    """`[(stem, {h5 key: variable}, groups)]`: `model` then, for a task, `task`."""
    out = []
    backbone = model.backbone if is_task(model) else model
    keys = {k: v for k, v in h5_keys(backbone).items() if not k.startswith("optimizer/")}
    out.append(("model", keys, _groups(backbone, [])))
    if is_task(model) and model.has_task_weights():
        skip = list(backbone._flatten_layers())
        task_keys = {k: v for k, v in h5_keys(model, skip=skip).items() if not k.startswith("optimizer/")}
        out.append(("task", task_keys, _groups(model, skip)))
    return out


def spec_of(variable: Any, dtype: Any) -> ArraySpec:
    own = np.dtype(variable.dtype)
    stored = np.dtype(dtype) if dtype is not None and dtypes.is_float(own) else own
    return ArraySpec(shape=tuple(variable.shape), dtype=stored)
