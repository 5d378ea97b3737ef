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

import os

import numpy as np

from shardckpt.errors import CheckpointNotFoundError
from shardckpt.formats import storage
from shardckpt.formats.base import ArraySpec, Box, MappedReader
from shardckpt.formats.h5 import H5Reader
from shardckpt.formats.h5_sharded import ShardedH5Reader

CONFIG_FILE = "config.json"
METADATA_FILE = "metadata.json"
TASK_CONFIG_FILE = "task.json"
MODEL_WEIGHTS = "model.weights.h5"
SHARDED_MODEL_WEIGHTS = "model.weights.json"
TASK_WEIGHTS = "task.weights.h5"
BACKBONE_PREFIX = "model/"
TASK_PREFIX = "task/"


def has_files(folder: str, *names: str) -> list[bool]:
    """Whether each of `names` is a file in `folder` (a local folder or a bucket prefix)."""
    location = storage.parse(folder)
    if location.is_remote:
        listed = set(storage.listdir(location))  # one request for all names
        return [name in listed for name in names]
    return [os.path.isfile(os.path.join(folder, name)) for name in names]


def join(folder: str, name: str) -> str:
    """`folder/name` for a local folder or a bucket URL."""
    location = storage.parse(folder)
    return location.join(name).url if location.is_remote else os.path.join(folder, name)


def is_preset_dir(path: str) -> bool:
    """True for a folder with `config.json` and the backbone's weights."""
    config, single, sharded = has_files(path, CONFIG_FILE, MODEL_WEIGHTS, SHARDED_MODEL_WEIGHTS)
    return config and (single or sharded)


def backbone_weights(folder: str) -> str:
    """The backbone's weights file of a preset (single file first, as keras-hub).

    Raises:
        CheckpointNotFoundError: the folder has neither weights file.
    """
    for name, found in zip((MODEL_WEIGHTS, SHARDED_MODEL_WEIGHTS), has_files(folder, MODEL_WEIGHTS, SHARDED_MODEL_WEIGHTS), strict=True):
        if found:
            return join(folder, name)
    raise CheckpointNotFoundError(
        f"The preset folder {folder!r} has neither {MODEL_WEIGHTS!r} nor "
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

    def __init__(self, path: str, *, task: bool | None = None) -> None:
        location = storage.parse(path)
        self.path = location.url if location.is_remote else os.fspath(path)
        weights = backbone_weights(self.path)
        self._parts: list[tuple[str, H5Reader | ShardedH5Reader]] = []
        try:
            reader = ShardedH5Reader(weights) if weights.endswith(".json") else H5Reader(weights)
            self._parts.append((BACKBONE_PREFIX, reader))
            task_path = join(self.path, TASK_WEIGHTS)
            if (task is None or task) and has_files(self.path, TASK_WEIGHTS)[0]:
                self._parts.append((TASK_PREFIX, H5Reader(task_path)))
        except BaseException:
            self.close()
            raise
        self._where = {prefix + key: (reader, key) for prefix, reader in self._parts for key in reader.keys()}

    @property
    def files(self) -> list[str]:
        """The weights files read, relative to the folder."""
        out = []
        for _, reader in self._parts:
            names = getattr(reader, "files", None)
            out.append(os.path.basename(reader.path))
            out += list(names or [])
        return out

    def keys(self) -> list[str]:
        return list(self._where)

    def spec(self, key: str) -> ArraySpec:
        reader, inner = self._where[key]
        return reader.spec(inner)

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
