"""On-disk formats behind one `Reader` contract (`base`), their one list (`catalog`) and table (`registry`), and `open_reader`."""

from __future__ import annotations

from typing import Any

from shardckpt import storage
from shardckpt.budget import CHUNK_CACHE_BYTES
from shardckpt.errors import UnknownFormatError
from shardckpt.formats import registry
from shardckpt.formats.base import ArraySpec, Box, ChunkedReader, MappedReader, Reader, RemappedReader, Unread, full_box
from shardckpt.formats.declaration import Format, Lazy, Probe
from shardckpt.formats.h5 import H5Reader
from shardckpt.formats.h5_sharded import ShardedH5Reader
from shardckpt.formats.hf import open_tensors
from shardckpt.formats.orbax import OrbaxReader
from shardckpt.formats.preset import PresetReader
from shardckpt.formats.registry import FORMATS, register, supported, unregister
from shardckpt.formats.safetensors import SafetensorsReader

__all__ = [
    "FORMATS",
    "ArraySpec",
    "Box",
    "ChunkedReader",
    "Format",
    "H5Reader",
    "Lazy",
    "MappedReader",
    "OrbaxReader",
    "PresetReader",
    "Probe",
    "Reader",
    "RemappedReader",
    "SafetensorsReader",
    "ShardedH5Reader",
    "Unread",
    "detect_format",
    "full_box",
    "open_reader",
    "register",
    "supported",
    "unregister",
]


def detect_format(path: str | storage.Location) -> str:
    """Names the format of `path` (a name in `FORMATS`), local or in a bucket.

    By the formats' declared rules (`registry.detect`): suffixes, then a
    folder's marker files, then a file's first bytes; the highest priority
    wins where several match.

    Raises:
        CheckpointNotFoundError: `path` does not exist.
        UnknownFormatError: `path` exists but is no format shardckpt reads
            (one error listing every format, local or in a bucket).
        UnsupportedURLError: `path` is a URL of a scheme shardckpt does not read.
    """
    return registry.detect(path).name


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
    fmt = registry.detect(location)
    if fmt.needs_model and model is None:
        # inspect / verify: the stored tensors under their own names, which need no keras-hub.
        tensors = open_tensors(location)
        tensors.format = fmt.name
        return tensors
    if fmt.reader is None:
        raise UnknownFormatError(
            f"{location.url!r} is a checkpoint of format {fmt.name!r}, which shardckpt writes but does not "
            f"read. Fix: pass a checkpoint of a format it reads: {supported()}."
        )
    return fmt.reader(location, cache_bytes=cache_bytes, model=model, task=task)
