"""Sizes of HDF5 files and zip archives from their own bytes.

An object in a bucket has no size TensorStore reports (see
`shardckpt.storage.ranged.RemoteObject.size`), and h5py and zipfile seek
from the end of the file object they read. The formats that own these
containers size them here: an HDF5 file from its superblock's end-of-file
address (checked to exist), a zip (a `.keras` archive) from its end record
in its last 64 KiB. `size_of` is the `storage.Sizer` the h5 readers pass to
`storage.open_source`.
"""

from __future__ import annotations

import struct

from shardckpt import storage
from shardckpt.errors import CorruptCheckpointError

HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"
_TAIL = 64 * 1024  # read from an object's end to learn its size (zip end records)


def open_container(location: storage.Location) -> storage.ByteSource:
    """The bytes of an HDF5 file or zip archive, local or in a bucket."""
    return storage.open_source(location, size_of)


def size_of(source: storage.ByteSource) -> int:
    """The size of an HDF5 file or a zip archive, read from its header or end record.

    Raises:
        CorruptCheckpointError: it is neither, or it is shorter than its header says.
    """
    head = source.probe(slice(0, 64))
    if isinstance(head, int):
        return head  # shorter than 64 bytes: its size came with the refusal
    if head.startswith(HDF5_MAGIC):
        size = hdf5_end(head, source.url)
        source.check_end(size)
        return size
    tail = source.probe(slice(-_TAIL, None))
    if isinstance(tail, int):
        return tail
    zip_size = zip_end(tail)
    if zip_size is None:
        raise CorruptCheckpointError(
            f"{source.url!r} is neither an HDF5 file nor a zip archive with its end "
            "record: it is truncated or no .weights.h5 / .keras file. Fix: upload it again."
        )
    return zip_size


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
