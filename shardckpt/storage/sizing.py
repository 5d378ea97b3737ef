"""Sizes of objects in a bucket, which TensorStore's kvstore API does not report: summed over
a prefix by range probes (`du`), or read from an HDF5 superblock or a zip end record."""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING, Any

from shardckpt.errors import CorruptCheckpointError
from shardckpt.storage.location import Location

if TYPE_CHECKING:
    from shardckpt.storage.objectstore import ObjectStore

WINDOW = 64 * 1024
"""Objects up to this size are read whole to size them; larger ones are probed (see `du`)."""


def du(store: ObjectStore, location: Location) -> int:
    """Total bytes of every object under `location` (a prefix).

    TensorStore lists keys without sizes and reports no object size on reads,
    so each object is sized by 1-byte range reads (a read past the end is
    refused with OUT_OF_RANGE): doubling from 64 KiB until past the end, then
    bisecting down to a 64 KiB window whose tail is read. An object costs
    about 2*log2(size/64 KiB) one-byte requests and at most 64 KiB of
    download; every object's probes run concurrently, round by round.
    """
    kv = store.open(location)
    keys = [key.encode() for key in store.list_keys(location)]

    def answer(future: Any) -> Any:
        """The read's result, or None when it starts past the object's end."""
        try:
            return store.wait(future, location, "reading")
        except ValueError as e:
            if str(e).startswith("OUT_OF_RANGE"):
                return None
            raise

    # [known, beyond]: the size is at least `known` and at most `beyond`
    # (None: no byte past the end found yet).
    bounds: dict[bytes, list[Any]] = {key: [0, None] for key in keys}

    def next_probe(known: int, beyond: int | None) -> int | None:
        if beyond is None:
            return max(WINDOW, 2 * known)
        return (known + beyond) // 2 if beyond - known > WINDOW else None

    while True:
        probes = {key: offset for key in keys if (offset := next_probe(*bounds[key])) is not None}
        if not probes:
            break
        futures = {key: kv.read(key, byte_range=slice(offset, offset + 1)) for key, offset in probes.items()}
        for key, future in futures.items():
            if answer(future) is not None:
                bounds[key][0] = probes[key] + 1
            else:
                bounds[key][1] = probes[key]
    # The tail from `known` on: at most one window of bytes per object.
    tails = {key: kv.read(key, byte_range=slice(known, None)) for key, (known, _) in bounds.items()}
    total = 0
    for key, future in tails.items():
        result = answer(future)
        total += bounds[key][0] + (0 if result is None else len(result.value))
    return total


def hdf5_end(head: bytes, url: str) -> int:
    """An HDF5 file's size: base address + end-of-file address of its superblock."""
    version = head[8]
    if version in (0, 1):
        width = head[13]
        at = 24 if version == 0 else 28
    elif version in (2, 3):
        width = head[9]
        at = 12
    else:
        raise CorruptCheckpointError(f"{url!r} has an HDF5 superblock of unknown version {version}.")
    fmt = {4: "<I", 8: "<Q"}.get(width)
    if fmt is None:
        raise CorruptCheckpointError(f"{url!r} has an HDF5 superblock with {width}-byte addresses.")
    base = struct.unpack_from(fmt, head, at)[0]
    end = struct.unpack_from(fmt, head, at + 2 * width)[0]
    return int(base + end)


def zip_end(tail: bytes) -> int | None:
    """A zip archive's size from the end records in its last bytes (`tail`), or None."""
    at = tail.rfind(b"PK\x05\x06")
    if at < 0 or at + 22 > len(tail):
        return None
    cd_size, cd_offset, comment = struct.unpack_from("<IIH", tail, at + 12)
    # The central directory ends where the end records begin.
    records = len(tail) - at
    if 0xFFFFFFFF in (cd_size, cd_offset):
        loc = at - 20
        if loc < 0 or tail[loc : loc + 4] != b"PK\x06\x07":
            return None
        z64 = tail.rfind(b"PK\x06\x06", 0, loc)
        if z64 < 0:
            return None
        cd_size, cd_offset = struct.unpack_from("<QQ", tail, z64 + 40)
        records = len(tail) - z64
    if len(tail) - at < 22 + comment:
        return None
    return int(cd_offset + cd_size + records)
