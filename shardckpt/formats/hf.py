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

from collections.abc import Mapping
from typing import Any

import numpy as np

from shardckpt import storage
from shardckpt.errors import CheckpointNotFoundError, CorruptCheckpointError
from shardckpt.formats import hf_remap
from shardckpt.formats.base import ArraySpec, Box, MappedReader, RemappedReader, Unread
from shardckpt.formats.safetensors import SafetensorsReader

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def is_hf_folder(path: str | storage.Location) -> bool:
    """True for a folder with a Hugging Face `config.json` and safetensors weights."""
    location = storage.parse(path)
    try:
        names = set(storage.listdir(location))  # one listing (a request, in a bucket)
    except (NotADirectoryError, FileNotFoundError):
        return False  # a local file, or nothing
    if CONFIG not in names or not names & {SINGLE, INDEX}:
        return False
    try:
        config = storage.read_json(location.join(CONFIG), fix="re-download the folder.", missing_ok=True)
    except CorruptCheckpointError:
        return False  # no JSON: not a Hugging Face config
    return isinstance(config, dict) and "model_type" in config


def read_config(folder: str | storage.Location) -> dict:
    """The folder's `config.json`.

    Raises:
        CheckpointNotFoundError: there is none.
        CorruptCheckpointError: it is not a JSON object with a `model_type`.
    """
    location = storage.parse(folder)
    path = location.join(CONFIG)
    config = storage.read_json(path, fix="re-download the folder.", missing_ok=True)
    if config is None:
        raise CheckpointNotFoundError(f"No {CONFIG} in {location.url!r}: not a Hugging Face folder.")
    if not isinstance(config, dict) or "model_type" not in config:
        raise CorruptCheckpointError(
            f"{path.url!r} has no 'model_type': not a Hugging Face model config. Fix: pass the "
            "folder of a model saved by transformers (config.json + safetensors)."
        )
    return config


def open_tensors(folder: str | storage.Location) -> SafetensorsReader:
    """The folder's stored tensors: the index set if there is one, else `model.safetensors`."""
    location = storage.parse(folder)
    has_index = INDEX in storage.listdir(location)
    return SafetensorsReader(location.join(INDEX if has_index else SINGLE))


def safetensors_index(folder: str | storage.Location) -> Any:
    """The folder's `model.safetensors.index.json`, or None."""
    return storage.read_json(storage.parse(folder).join(INDEX), fix="re-download the folder.", missing_ok=True)


class HFReader(MappedReader, RemappedReader):
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
        unread: The stored tensors no variable is made of, sorted (`unread`).
    """

    format = "hf"

    def __init__(
        self, folder: str | storage.Location, tensors: SafetensorsReader, remaps: Mapping[str, Any],
        unread: Unread | None = None,
    ) -> None:
        self.path = str(folder)
        self._tensors = tensors
        self._remaps = dict(remaps)
        self._unread = unread if unread is not None else Unread()

    def _stored(self, key: str, first: int, shape: tuple[int, ...], strides: tuple[int, ...]) -> np.ndarray:
        """Elements of stored tensor `key` as `hf_remap.Fetch` describes them: a view of
        the memory map, or just those elements' bytes read (`SafetensorsReader.read_strided`)."""
        return self._tensors.read_strided(key, first, shape, strides)

    def keys(self) -> list[str]:
        return list(self._remaps)

    def unread(self) -> Unread:
        return self._unread

    def spec(self, key: str) -> ArraySpec:
        remap = self._remaps[key]
        return ArraySpec(shape=tuple(remap.shape), dtype=np.dtype(remap.dtype))

    def sources(self, key: str) -> list[str]:
        """The stored tensors variable `key` is made of."""
        return self._remaps[key].sources()

    def is_mapped(self, key: str) -> bool:
        """True when the stored tensors of `key` are memory-mapped (`view` holds no memory)."""
        return all(self._tensors.is_mapped(source) for source in self.sources(key))

    def source_dtype(self, key: str) -> np.dtype | None:
        """The dtype of the stored tensors variable `key` is made of (None: they differ)."""
        found = {np.dtype(self._tensors.spec(k).dtype) for k in self.sources(key)}
        return found.pop() if len(found) == 1 else None

    def round_once(self) -> None:
        """Drops the float-to-float casts of keras-hub's hooks (`hf_remap.without_float_casts`).

        `spec` then gives the stored dtype, for a caller that casts to its own
        dtype in one rounding.
        """
        self._remaps = {key: hf_remap.without_float_casts(remap) for key, remap in self._remaps.items()}

    def view(self, key: str, box: Box) -> np.ndarray:
        """`box` of variable `key`: a view of the memory map where the remap is one
        strided view of one tensor (transposes, reshapes, slices), else a new array."""
        remap = self._remaps[key]
        view = remap.view(box, self._stored)
        return view if view is not None else remap.read(box, self._stored)

    def read(self, key: str, box: Box) -> np.ndarray:
        return self._remaps[key].read(box, self._stored)

    def close(self) -> None:
        self._tensors.close()
