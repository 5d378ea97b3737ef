"""On-disk formats behind one `Reader` contract (`base`), their table (`registry`), and `open_reader`."""

from __future__ import annotations

import os
from typing import Any

from shardckpt import storage
from shardckpt.budget import CHUNK_CACHE_BYTES
from shardckpt.errors import CheckpointNotFoundError, UnknownFormatError
from shardckpt.formats.base import ArraySpec, Box, ChunkedReader, MappedReader, Reader, full_box
from shardckpt.formats.h5 import H5Reader
from shardckpt.formats.h5_sharded import ShardedH5Reader
from shardckpt.formats.hf import open_tensors
from shardckpt.formats.orbax import OrbaxReader
from shardckpt.formats.preset import PresetReader
from shardckpt.formats.registry import FORMATS, Format, provide, supported
from shardckpt.formats.safetensors import SafetensorsReader

__all__ = [
    "FORMATS",
    "ArraySpec",
    "Box",
    "ChunkedReader",
    "Format",
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
    "provide",
    "supported",
]


def detect_format(path: str | storage.Location) -> str:
    """Names the format of `path` (a name in `FORMATS`), local or in a bucket.

    Files are told by their names (a missing object is reported when its
    reader opens it), then by their first bytes; folders by what is in them.

    Raises:
        CheckpointNotFoundError: `path` does not exist.
        UnknownFormatError: `path` exists but is no format shardckpt reads.
        UnsupportedURLError: `path` is a URL of a scheme shardckpt does not read.
    """
    location = storage.parse(path)
    local = location.local_path
    if local is not None and not os.path.exists(local):
        raise CheckpointNotFoundError(f"No checkpoint at {local!r}. Fix: check the path. Supported: {supported()}.")
    folders = [fmt for fmt in FORMATS.values() if fmt.folder]
    for fmt in FORMATS.values():
        if fmt.suffixes and location.endswith(fmt.suffixes) and (fmt.detect is None or fmt.detect(location)):
            return fmt.name
    if folders[0].detect is not None and folders[0].detect(location):  # Orbax: one listing, no isdir first
        return folders[0].name
    if not storage.isdir(location):
        if local is None:
            raise storage.not_found(location, what=f"a checkpoint. Supported: {supported()}")
        with open(local, "rb") as f:
            head = f.read(8)
        for fmt in FORMATS.values():
            if fmt.magic and head.startswith(fmt.magic):
                return fmt.name
        return _unknown(location)
    for fmt in folders[1:]:
        if fmt.detect is not None and fmt.detect(location):
            return fmt.name
    return _unknown(location)


def _unknown(location: storage.Location) -> str:
    raise UnknownFormatError(
        f"{location.url!r} is not a checkpoint shardckpt reads. Supported: {supported()}. "
        "Fix: pass one of these (a Hugging Face folder needs config.json with a model_type "
        "beside model.safetensors or model.safetensors.index.json)."
    )


def open_reader(
    path: str | storage.Location,
    *,
    cache_bytes: int = CHUNK_CACHE_BYTES,
    model: Any = None,
    task: bool | None = None,
) -> Reader:
    """Opens `path` with the reader of its format (see `detect_format`).

    Args:
        path: The checkpoint.
        cache_bytes: Decoded-chunk cache of compressed formats (Orbax); see
            `shardckpt.budget.chunk_cache_bytes`.
        model: The model the checkpoint is read for, if known. A Hugging Face
            folder is read as `model`'s variables (its tensors are named for
            another framework, and the model says what to read); without a
            model, as its stored tensors under their own names (what `inspect`
            and `verify` show and check).
        task: Whether `model` is a keras-hub task: a preset folder's task
            weights (`task.weights.h5`) are read for a task only; None (no
            model): whenever the folder has them.
    """
    location = storage.parse(path)
    fmt = FORMATS[detect_format(location)]
    if fmt.needs_model and model is None:
        # inspect / verify: the stored tensors under their own names, which
        # need no keras-hub (they used to be refused with a hint to pass
        # model=, which neither of them takes).
        tensors = open_tensors(location)
        tensors.format = fmt.name
        return tensors
    if fmt.reader is None:
        raise UnknownFormatError(
            f"{location.url!r} is a checkpoint of format {fmt.name!r}, and no reader of it is loaded. Fix: "
            "import shardckpt (its presets package provides the reader)."
        )
    return fmt.reader(location, cache_bytes=cache_bytes, model=model, task=task)
