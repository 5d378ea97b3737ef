"""On-disk formats behind one `Reader` contract (`base`), and `open_reader(path)`."""

from __future__ import annotations

import os

from shardckpt.budget import CHUNK_CACHE_BYTES
from shardckpt.errors import CheckpointNotFoundError, UnknownFormatError
from shardckpt.formats import storage
from shardckpt.formats.base import ArraySpec, Box, ChunkedReader, MappedReader, Reader, full_box
from shardckpt.formats.h5 import H5Reader
from shardckpt.formats.orbax import OrbaxReader, is_orbax_dir
from shardckpt.formats.safetensors import SafetensorsReader

__all__ = [
    "ArraySpec",
    "Box",
    "ChunkedReader",
    "H5Reader",
    "MappedReader",
    "OrbaxReader",
    "Reader",
    "SafetensorsReader",
    "detect_format",
    "full_box",
    "open_reader",
]


def detect_format(path: str) -> str:
    """Names the format of `path`: "h5", "keras", "orbax" or "safetensors".

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
            f"No checkpoint at {path!r}. Fix: check the path (a .weights.h5, .keras, "
            ".safetensors, *.safetensors.index.json file or an Orbax folder)."
        )
    if os.path.isdir(path):
        if is_orbax_dir(path):
            return "orbax"
    elif path.endswith((".h5", ".hdf5")):
        return "h5"
    elif path.endswith(".keras"):
        return "keras"
    elif path.endswith((".safetensors", ".safetensors.index.json")):
        return "safetensors"
    else:
        with open(path, "rb") as f:
            magic = f.read(8)
        if magic == b"\x89HDF\r\n\x1a\n":
            return "h5"
        if magic[:4] == b"PK\x03\x04":
            return "keras"
    raise UnknownFormatError(
        f"{path!r} is not a checkpoint shardckpt reads. Supported: Keras "
        "`.weights.h5` / `.keras` files, Orbax checkpoint folders, `.safetensors` "
        "files and `*.safetensors.index.json` sets."
    )


def _detect_remote(location: storage.Location) -> str:
    if location.path.endswith((".h5", ".hdf5", ".keras", ".safetensors", ".json")):
        storage.refuse_remote(
            location,
            what="path",
            reason="reading .weights.h5, .keras and safetensors files from a bucket is not "
            "supported yet (Orbax checkpoints in buckets are). Fix: copy the file to local disk, "
            "or convert it into the bucket once: `shardckpt convert FILE "
            f"{location.scheme}://BUCKET/PATH` and load that.",
        )
    if is_orbax_dir(location.url):
        return "orbax"
    if not storage.isdir(location):
        raise storage.not_found(location)
    raise UnknownFormatError(
        f"{location.url!r} holds objects but no Orbax checkpoint. In buckets shardckpt reads "
        "Orbax checkpoints (a root of step folders, or one step)."
    )


def open_reader(path: str, *, cache_bytes: int = CHUNK_CACHE_BYTES) -> Reader:
    """Opens `path` with the reader for its format (see `detect_format`).

    Args:
        path: The checkpoint.
        cache_bytes: Decoded-chunk cache of compressed formats (Orbax); see
            `shardckpt.budget.chunk_cache_bytes`.
    """
    fmt = detect_format(path)
    if fmt in ("h5", "keras"):
        return H5Reader(path)
    if fmt == "orbax":
        return OrbaxReader(path, cache_bytes=cache_bytes)
    return SafetensorsReader(path)
