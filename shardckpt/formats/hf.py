"""Hugging Face folders: safetensors under Hugging Face names, read as Keras variables.

A Hugging Face folder is `config.json` (with a `model_type`) beside
`model.safetensors` or `model.safetensors.index.json` and its shards. Its
tensors are named and laid out for PyTorch modules, so a Keras variable is a
remap (transpose, reshape, slice, stack, concatenation, cast) of one or more
stored tensors. `HFReader` is the `Reader` of such a folder for one model:
its keys are the model's variable paths (as `load_sharded` matches
safetensors), and reading a box of a variable reads only the stored bytes
the box's elements come from. The remaps come from keras-hub's converters
(`shardckpt.presets.hf`); this module only holds the files.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from shardckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, ShardckptError
from shardckpt.formats import storage
from shardckpt.formats.base import ArraySpec, Box, MappedReader, full_box, strided
from shardckpt.formats.safetensors import SafetensorsReader

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def _join(folder: str, name: str) -> str:
    location = storage.parse(folder)
    return location.join(name).url if location.is_remote else os.path.join(folder, name)


def _read_json(path: str) -> Any:
    """`path` (local or in a bucket) parsed as JSON; None when it does not exist."""
    location = storage.parse(path)
    if location.is_remote:
        data = storage.read_bytes(location)  # small files: read whole
        return None if data is None else json.loads(data)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def is_hf_folder(path: str) -> bool:
    """True for a folder with a Hugging Face `config.json` and safetensors weights."""
    location = storage.parse(path)
    if location.is_remote:
        names = set(storage.listdir(location))
        if CONFIG not in names or not names & {SINGLE, INDEX}:
            return False
    else:
        config = os.path.join(path, CONFIG)
        if not os.path.isdir(path) or not os.path.isfile(config):
            return False
        if not (os.path.isfile(os.path.join(path, SINGLE)) or os.path.isfile(os.path.join(path, INDEX))):
            return False
    try:
        return "model_type" in _read_json(_join(path, CONFIG))
    except ShardckptError:
        raise  # a bucket's refusal is no answer to "is it a Hugging Face folder?"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, TypeError):
        return False


def read_config(folder: str) -> dict:
    """The folder's `config.json`.

    Raises:
        CheckpointNotFoundError: there is none.
        CorruptCheckpointError: it is not a JSON object with a `model_type`.
    """
    path = _join(folder, CONFIG)
    try:
        config = _read_json(path)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptCheckpointError(f"{path!r} is not valid JSON ({e}). Fix: re-download the folder.") from e
    if config is None:
        raise CheckpointNotFoundError(f"No {CONFIG} in {folder!r}: not a Hugging Face folder.")
    if not isinstance(config, dict) or "model_type" not in config:
        raise CorruptCheckpointError(
            f"{path!r} has no 'model_type': not a Hugging Face model config. Fix: pass the "
            "folder of a model saved by transformers (config.json + safetensors)."
        )
    return config


def open_tensors(folder: str) -> SafetensorsReader:
    """The folder's stored tensors: the index set if there is one, else `model.safetensors`."""
    location = storage.parse(folder)
    if location.is_remote:
        has_index = INDEX in storage.listdir(location)
    else:
        has_index = os.path.isfile(os.path.join(folder, INDEX))
    return SafetensorsReader(_join(folder, INDEX if has_index else SINGLE))


def safetensors_index(folder: str) -> Any:
    return _read_json(_join(folder, INDEX))


class HFReader(MappedReader):
    """Reader of a Hugging Face folder as the variables of one model.

    A `MappedReader`: a variable that is a transpose, reshape or slice of one
    stored tensor comes back from `view` as a strided view of the memory map
    (restore copies each device's part straight from it); one made of several
    tensors (stacked experts) or cast inside keras-hub's hook is a fresh
    array of just the box, read from each source tensor's own bytes.

    Args:
        folder: The folder.
        tensors: Its stored tensors (`open_tensors`); closed with the reader.
        remaps: `variable.path -> hf_remap.Tensor`, how each variable is made
            of stored tensors.
        unmapped: Variable paths the converter gives no value.
    """

    format = "hf"

    def __init__(self, folder: str, tensors: SafetensorsReader, remaps: Mapping[str, Any]) -> None:
        self.path = folder
        self._tensors = tensors
        self._remaps = dict(remaps)
        self._stored_cache: dict[str, np.ndarray] = {}

    def _stored(self, key: str, first: int, shape: tuple[int, ...], strides: tuple[int, ...]) -> np.ndarray:
        """Elements of stored tensor `key` as `hf_remap.Fetch` describes them."""
        if self._tensors.is_remote(key):
            return self._tensors.read_strided(key, first, shape, strides)  # ranged reads of just those
        # A read-only view of the memory map: no bytes are read here.
        flat = self._stored_cache.get(key)
        if flat is None:
            flat = self._tensors.view(key, full_box(self._tensors.spec(key).shape)).reshape(-1)
            self._stored_cache[key] = flat
        return strided(flat, first, shape, strides)

    def keys(self) -> list[str]:
        return list(self._remaps)

    def spec(self, key: str) -> ArraySpec:
        remap = self._remaps[key]
        return ArraySpec(shape=tuple(remap.shape), dtype=np.dtype(remap.dtype))

    def sources(self, key: str) -> list[str]:
        """The stored tensors variable `key` is made of."""
        return self._remaps[key].sources()

    def view(self, key: str, box: Box) -> np.ndarray:
        """`box` of variable `key`: a view of the memory map where the remap is one
        strided view of one tensor (transposes, reshapes, slices), else a new array."""
        remap = self._remaps[key]
        view = remap.view(box, self._stored)
        return view if view is not None else remap.read(box, self._stored)

    def read(self, key: str, box: Box) -> np.ndarray:
        return self._remaps[key].read(box, self._stored)

    def close(self) -> None:
        self._stored_cache.clear()
        self._tensors.close()
