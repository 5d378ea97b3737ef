"""keras-hub preset folders read as one checkpoint.

A preset written by keras-hub's `save_to_preset` holds `config.json`,
`metadata.json`, the backbone's weights (`model.weights.h5`, or above
`max_shard_size` a sharded `model.weights.json` + `model_0000N.weights.h5`),
for a task also `task.json` + `task.weights.h5` (the task's weights outside
its backbone, saved with the backbone's layers skipped), and tokenizer assets.

Keys are the h5 keys of each weights file behind the file's role:
`model/<key>` for the backbone's, `task/<key>` for the task's, matched by
`shardckpt.restore.keys.preset_keys`.
"""

from __future__ import annotations

import numpy as np

from shardckpt import storage
from shardckpt.errors import CheckpointNotFoundError
from shardckpt.formats.base import ArraySpec, Box, MappedReader
from shardckpt.formats.h5 import H5Reader
from shardckpt.formats.h5_sharded import ShardedH5Reader

CONFIG_FILE = "config.json"
TASK_CONFIG_FILE = "task.json"
MODEL_WEIGHTS = "model.weights.h5"
SHARDED_MODEL_WEIGHTS = "model.weights.json"
TASK_WEIGHTS = "task.weights.h5"
BACKBONE_PREFIX = "model/"
TASK_PREFIX = "task/"


def has_files(folder: str | storage.Location, *names: str) -> list[bool]:
    """Whether each of `names` is a file in `folder` (one listing for all names)."""
    location = storage.parse(folder)
    try:
        listed = set(storage.listdir(location))  # in a bucket: one request for all names
    except (FileNotFoundError, NotADirectoryError):
        return [False for _ in names]
    return [name in listed for name in names]


def is_preset_dir(path: str | storage.Location) -> bool:
    """True for a folder with `config.json` and the backbone's weights."""
    config, single, sharded = has_files(path, CONFIG_FILE, MODEL_WEIGHTS, SHARDED_MODEL_WEIGHTS)
    return config and (single or sharded)


def backbone_weights(folder: str | storage.Location) -> storage.Location:
    """The backbone's weights file of a preset (single file first, as keras-hub).

    Raises:
        CheckpointNotFoundError: the folder has neither weights file.
    """
    location = storage.parse(folder)
    names = (MODEL_WEIGHTS, SHARDED_MODEL_WEIGHTS)
    for name, found in zip(names, has_files(location, *names), strict=True):
        if found:
            return location.join(name)
    raise CheckpointNotFoundError(
        f"The preset folder {location.url!r} has neither {MODEL_WEIGHTS!r} nor "
        f"{SHARDED_MODEL_WEIGHTS!r}. Fix: pass a folder written by keras-hub's "
        "save_to_preset, with its weights files."
    )


class PresetReader(MappedReader):
    """Reader for a keras-hub preset folder: backbone weights, and task weights.

    Args:
        path: The preset folder.
        task: Include `task.weights.h5` (keys `task/...`). None: when the
            folder has it. True on a folder without it: no task keys, so a
            task's own variables are reported missing.
    """

    format = "preset"

    def __init__(self, path: str | storage.Location, *, task: bool | None = None) -> None:
        location = storage.parse(path)
        self.path = storage.shown(path, location)
        weights = backbone_weights(location)
        self._parts: list[tuple[str, H5Reader | ShardedH5Reader]] = []
        try:
            reader = ShardedH5Reader(weights) if weights.endswith(".json") else H5Reader(weights)
            self._parts.append((BACKBONE_PREFIX, reader))
            if (task is None or task) and has_files(location, TASK_WEIGHTS)[0]:
                self._parts.append((TASK_PREFIX, H5Reader(location.join(TASK_WEIGHTS))))
        except BaseException:
            self.close()
            raise
        self._where = {prefix + key: (reader, key) for prefix, reader in self._parts for key in reader.keys()}

    def keys(self) -> list[str]:
        return list(self._where)

    def spec(self, key: str) -> ArraySpec:
        reader, inner = self._where[key]
        return reader.spec(inner)

    def is_mapped(self, key: str) -> bool:
        reader, inner = self._where[key]
        return reader.is_mapped(inner)

    def view(self, key: str, box: Box) -> np.ndarray:
        """`box` of `key` without a copy (see `H5Reader.view`)."""
        reader, inner = self._where[key]
        return reader.view(inner, box)

    def read(self, key: str, box: Box) -> np.ndarray:
        reader, inner = self._where[key]
        return reader.read(inner, box)

    def close(self) -> None:
        for _, reader in self._parts:
            reader.close()
        self._parts.clear()
