"""Damage done to checkpoints on disk, as a bad disk or a torn copy would (data bytes, h5 headers)."""

from __future__ import annotations

import os
import struct

import h5py
import numpy as np


def flip_byte_of(tree: str, data: np.ndarray) -> str:
    """Flips one byte in the middle of `data`'s (uncompressed) bytes in the OCDBT data files under `tree`.

    Data files are those in folders named `d` (Orbax's own saves write
    per-process stores, `ocdbt.process_0/d/`). Returns the file changed.
    """
    raw = data.tobytes()
    files = [os.path.join(folder, n) for folder, _, names in os.walk(tree) for n in names]
    for path in sorted(f for f in files if os.path.basename(os.path.dirname(f)) == "d"):
        blob = open(path, "rb").read()
        at = blob.find(raw)
        if at >= 0:
            with open(path, "r+b") as f:
                f.seek(at + len(raw) // 2)
                f.write(bytes([blob[at + len(raw) // 2] ^ 0x10]))
            return path
    raise AssertionError("array bytes not found in the data files")


def _patch_once(path: str, old: bytes, new: bytes) -> None:
    blob = open(path, "rb").read()
    at = blob.find(old)
    assert at >= 0 and blob.find(old, at + 1) < 0, "pattern not found exactly once"
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(new)


def rewrite_h5_layout(path: str, key: str, *, offset: int | None = None, size: int | None = None) -> None:
    """Rewrites the data address and/or stored size in `key`'s contiguous layout message.

    A version-3 contiguous layout message is `03 01`, then the address and
    the size as 8-byte little-endian numbers (HDF5 file format spec, IV.A.2.i).
    """
    with h5py.File(path, "r") as f:
        ds = f[key]
        old_offset, old_size = ds.id.get_offset(), ds.id.get_storage_size()
    new = (old_offset if offset is None else offset, old_size if size is None else size)
    _patch_once(path, b"\x03\x01" + struct.pack("<QQ", old_offset, old_size), b"\x03\x01" + struct.pack("<QQ", *new))


def rewrite_h5_shape(path: str, key: str, shape: tuple[int, ...]) -> None:
    """Rewrites `key`'s dataspace: dimensions and maximum dimensions (as h5py writes both)."""
    with h5py.File(path, "r") as f:
        old = tuple(f[key].shape)
    fmt = "<" + "Q" * 2 * len(old)
    _patch_once(path, struct.pack(fmt, *old, *old), struct.pack(fmt, *shape, *shape))
