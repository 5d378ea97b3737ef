"""On-disk formats behind one `Reader` contract (`base`), and `open_reader(path)`."""

from __future__ import annotations

import os
from typing import Any

from shardckpt.budget import CHUNK_CACHE_BYTES
from shardckpt.errors import CheckpointNotFoundError, UnknownFormatError
from shardckpt.formats import storage
from shardckpt.formats.base import ArraySpec, Box, ChunkedReader, MappedReader, Reader, full_box
from shardckpt.formats.h5 import H5Reader
from shardckpt.formats.h5_sharded import ShardedH5Reader, is_sharded_index
from shardckpt.formats.hf import is_hf_folder, open_tensors
from shardckpt.formats.orbax import OrbaxReader, is_orbax_dir
from shardckpt.formats.preset import PresetReader, is_preset_dir
from shardckpt.formats.remote import Unmapped
from shardckpt.formats.safetensors import SafetensorsReader

__all__ = [
    "ArraySpec",
    "Box",
    "ChunkedReader",
    "H5Reader",
    "MappedReader",
    "OrbaxReader",
    "PresetReader",
    "Reader",
    "SafetensorsReader",
    "ShardedH5Reader",
    "detect_format",
    "full_box",
    "open_reader",
]


def detect_format(path: str) -> str:
    """Names the format of `path`.

    One of "h5", "h5-sharded" (a Keras `.weights.json` index), "keras",
    "orbax", "preset" (a keras-hub preset folder), "safetensors" or "hf" (a
    Hugging Face folder: config.json with a model_type, and safetensors).

    Raises:
        CheckpointNotFoundError: `path` does not exist.
        UnknownFormatError: `path` exists but is no format shardckpt reads.
        UnsupportedURLError: `path` is a URL of a scheme shardckpt does not read.
    """
    location = storage.parse(path)
    if location.is_remote:
        return _detect_remote(location)
    path = location.path
    if not os.path.exists(path):
        raise CheckpointNotFoundError(
            f"No checkpoint at {path!r}. Fix: check the path (a .weights.h5, .weights.json, "
            ".keras, .safetensors, *.safetensors.index.json file, an Orbax folder, a "
            "keras-hub preset folder or a Hugging Face folder)."
        )
    if os.path.isdir(path):
        if is_orbax_dir(path):
            return "orbax"
        if is_preset_dir(path):
            return "preset"
        if is_hf_folder(path):
            return "hf"
    elif path.endswith((".h5", ".hdf5")):
        return "h5"
    elif path.endswith(".keras"):
        return "keras"
    elif path.endswith((".safetensors", ".safetensors.index.json")):
        return "safetensors"
    elif path.endswith(".json"):
        if is_sharded_index(path):
            return "h5-sharded"
    else:
        with open(path, "rb") as f:
            magic = f.read(8)
        if magic == b"\x89HDF\r\n\x1a\n":
            return "h5"
        if magic[:4] == b"PK\x03\x04":
            return "keras"
    raise UnknownFormatError(
        f"{path!r} is not a checkpoint shardckpt reads. Supported: Keras "
        "`.weights.h5` / `.keras` files, sharded `.weights.json` indexes, Orbax "
        "checkpoint folders, keras-hub preset folders, `.safetensors` files, "
        "`*.safetensors.index.json` sets and Hugging Face folders (config.json "
        "with a model_type beside model.safetensors or model.safetensors.index.json)."
    )


def _detect_remote(location: storage.Location) -> str:
    # Files are told by their names (a missing object is reported when the
    # reader opens it); folders by the objects in them.
    path = location.path
    if path.endswith((".h5", ".hdf5")):
        return "h5"
    if path.endswith(".keras"):
        return "keras"
    if path.endswith((".safetensors", ".safetensors.index.json")):
        return "safetensors"
    if path.endswith(".json") and is_sharded_index(location.url):
        return "h5-sharded"
    if is_orbax_dir(location.url):
        return "orbax"
    if not storage.isdir(location):
        raise storage.not_found(location)
    if is_preset_dir(location.url):
        return "preset"
    if is_hf_folder(location.url):
        return "hf"
    raise UnknownFormatError(
        f"{location.url!r} holds objects but no checkpoint shardckpt reads. In buckets: "
        "Orbax checkpoints (a root of step folders, or one step), `.weights.h5` / `.keras` "
        "files, sharded `.weights.json` indexes, `.safetensors` files and "
        "`*.safetensors.index.json` sets, keras-hub preset folders and Hugging Face folders."
    )


def open_reader(path: str, *, cache_bytes: int = CHUNK_CACHE_BYTES, model: Any = None) -> Reader:
    """Opens `path` with the reader for its format (see `detect_format`).

    Args:
        path: The checkpoint.
        cache_bytes: Decoded-chunk cache of compressed formats (Orbax); see
            `shardckpt.budget.chunk_cache_bytes`.
        model: The model the checkpoint is read for, if known. A keras-hub
            preset folder's task weights (`task.weights.h5`) are read for a
            task only; without a model, whenever the folder has them. A
            Hugging Face folder is read as `model`'s variables (its tensors
            are named for another framework, and the model says what to
            read); without a model, as its stored tensors under their own
            names (what `inspect` and `verify` show and check).
    """
    fmt = detect_format(path)
    location = storage.parse(path)
    path = location.url  # file:// URLs too
    reader = _open(fmt, path, cache_bytes=cache_bytes, model=model)
    if location.is_remote and fmt != "orbax":
        # Bucket files are read by byte ranges, not mapped: a plain Reader.
        return Unmapped(reader)
    return reader


def _open(fmt: str, path: str, *, cache_bytes: int, model: Any) -> Reader:
    if fmt == "hf":
        if model is None:
            # inspect / verify: the stored tensors, which need no keras-hub.
            # (They used to be refused with a hint to pass model=, which
            # neither of them takes.)
            tensors = open_tensors(path)
            tensors.format = "hf"
            return tensors
        from shardckpt.presets import hf  # keras-hub's name maps, imported only here

        return hf.open_reader(path, model)
    if fmt in ("h5", "keras"):
        return H5Reader(path)
    if fmt == "h5-sharded":
        return ShardedH5Reader(path)
    if fmt == "preset":
        from shardckpt.restore.keys import is_task  # Keras-aware, imported only here

        return PresetReader(path, task=None if model is None else is_task(model))
    if fmt == "orbax":
        return OrbaxReader(path, cache_bytes=cache_bytes)
    return SafetensorsReader(path)
