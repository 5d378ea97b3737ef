"""The reader contract every on-disk format implements, and its capabilities.

A reader knows a checkpoint's keys, the shape and dtype of each array, and can
read any rectangular box of an array into a fresh host buffer (`Reader`).
Formats whose storage allows it also declare `MappedReader` (zero-copy views
of memory-mapped files) or `ChunkedReader` (chunk-aligned and batched reads).
A reader knows nothing about models, devices or shardings: deciding *which*
boxes to read is the job of `shardckpt.restore.readplan`; reading them is the
reader's only job. To add a format, implement `Reader` (plus a capability if
it fits), then declare it in `shardckpt.formats.catalog` (README, "Adding a format").
"""

from __future__ import annotations

import dataclasses
from types import EllipsisType
from typing import Protocol, runtime_checkable

import ml_dtypes
import numpy as np

# Re-exported: the restore strategies fill these buffers.
from shardckpt.dtypes import ALIGNMENT as ALIGNMENT
from shardckpt.dtypes import aligned_empty as aligned_empty

Box = tuple[slice, ...]
"""A rectangular region of an array: one `slice(start, stop)` per dimension."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ArraySpec:
    """Shape and dtype of one array in a checkpoint, known without reading it.

    Attributes:
        shape: The array's global shape.
        dtype: The array's numpy dtype (bfloat16 etc. through ml_dtypes).
    """

    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


@runtime_checkable
class Reader(Protocol):
    """Read access to the arrays of one checkpoint: what every format implements.

    `load_sharded`, `convert`, `verify` and `inspect` need nothing more. A
    format whose storage allows faster paths also declares one of the
    capabilities below by subclassing it (`class H5Reader(MappedReader)`);
    restore and convert choose their read strategy by `isinstance`:

    - `MappedReader`: arrays are byte ranges of memory-mapped files, so a box
      is a view with no copy (h5, safetensors);
    - `ChunkedReader`: arrays are stored in chunks that are decoded whole
      (compressed zarr chunks in Orbax), so reads align to chunks and may
      decode straight into the caller's buffers.

    A reader opens its files in `__init__` and raises the typed errors of
    `shardckpt.errors` there (`CheckpointNotFoundError`,
    `CorruptCheckpointError` naming the file); `read` raises
    `CorruptCheckpointError` naming the key when data cannot be decoded.

    Attributes:
        path: What was opened (for Orbax: the step folder).
        format: The format's name as `LoadReport.format` shows it; it also
            selects the key naming (`shardckpt.restore.keys.keys_for`).
    """

    path: str
    format: str

    def keys(self) -> list[str]:
        """Returns every array key, '/'-separated, in storage order."""
        ...

    def spec(self, key: str) -> ArraySpec:
        """Returns shape and dtype of `key` without reading its data."""
        ...

    def read(self, key: str, box: Box) -> np.ndarray:
        """Returns a new C-contiguous array holding `box` of array `key`.

        The caller owns the result: restore hands it to devices without a
        copy where it can, so it must not alias a file mapping or a cache.
        """
        ...

    def close(self) -> None:
        """Releases files and memory maps."""
        ...


@runtime_checkable
class MappedReader(Reader, Protocol):
    """A reader whose arrays are byte ranges of files (`storage.ByteSource`).

    Restore reads such a format through `view` in slabs of whole rows and
    copies each device's part straight into its buffer (one copy in all);
    convert streams views into the writer. Where the file is memory-mapped
    (`is_mapped`), a view holds no memory and no budget is held for it; in a
    bucket, a view is a fresh read of just its bytes, held like any read.
    """

    def is_mapped(self, key: str) -> bool:
        """True when `view` of `key` is a view of a memory map (no bytes read, no memory held)."""
        ...

    def view(self, key: str, box: Box) -> np.ndarray:
        """Returns `box` of `key`, a read-only view of the mapping where possible.

        Arrays stored otherwise (an h5 dataset that is chunked or compressed)
        may come back as a fresh read.
        """
        ...


@runtime_checkable
class ChunkedReader(Reader, Protocol):
    """A reader whose arrays are stored in chunks that are decoded whole.

    Restore uses these to decode each chunk once: pieces of a variable whose
    chunks fit the budget are filled by one `read_pieces` call; larger arrays
    are read in slabs aligned to `chunk_rows`; on accelerators, pieces that
    are exactly one chunk go to their devices as decoded (`is_chunk`).
    """

    def chunk_rows(self, key: str) -> int | None:
        """Rows (along axis 0) of one stored chunk, or None (scalars)."""
        ...

    def chunk_bytes(self, key: str) -> int:
        """Decoded bytes of one stored chunk of `key`."""
        ...

    def is_chunk(self, key: str, box: Box) -> bool:
        """True when `box` is exactly one stored chunk of `key`.

        `read` of such a box may hand back the decoder's own buffer, with no
        copy into a second one.
        """
        ...

    def read_pieces(self, key: str, boxes: list[Box], outs: list[np.ndarray]) -> None:
        """Fills `outs[i]` (stored dtype, C order) with `boxes[i]` of `key`.

        All pieces in one call: a chunk they share is decoded once.
        """
        ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class Unread:
    """Stored arrays that none of a `RemappedReader`'s keys is made of.

    Attributes:
        unexpected: Arrays of the model's own modules that no variable reads
            (the folder holds more than its config describes): unexpected
            keys, refused by `strict=True` as those of any format.
        skipped: Arrays the model never has a variable for: buffers its
            framework recomputes, heads of another class, an output
            embedding its tied embedding stands for. Listed, never refused.
        fix: What to do about `unexpected` ones (the error's advice).
    """

    unexpected: list[str] = dataclasses.field(default_factory=list)
    skipped: list[str] = dataclasses.field(default_factory=list)
    fix: str | None = None


@runtime_checkable
class RemappedReader(Reader, Protocol):
    """A reader whose keys are variables made of stored arrays under other names.

    A Hugging Face folder read as a model's variables: its keys are the
    variables, so stored arrays that no variable is made of never appear among
    them. `unread` names those, for the load's report (`unexpected` /
    `skipped`), as a reader keyed by stored names would show them.
    """

    def unread(self) -> Unread:
        """The stored arrays no key is made of, sorted into unexpected and skipped."""
        ...


def strided(flat: np.ndarray, first: int, shape: tuple[int, ...], strides: tuple[int, ...]) -> np.ndarray:
    """`flat[first + i . strides]` for every index `i` of `shape`: a view, no copy.

    Args:
        flat: A 1-D array (a stored tensor, flat).
        first: The element at index 0.
        shape: The view's shape.
        strides: Its strides, in elements (negative ones included).
    """
    itemsize = flat.dtype.itemsize
    # np.ndarray checks that every element lies inside `flat`.
    return np.ndarray(
        shape, flat.dtype, buffer=flat, offset=first * itemsize, strides=tuple(st * itemsize for st in strides)
    )


def region(array: np.ndarray, box: Box) -> np.ndarray:
    """`array[box]`, always an array (a view where `array[box]` is one).

    numpy indexes a 0-d array with the empty box `()` into a scalar, which
    is a copy and cannot be written into; the trailing `...` keeps a 0-d view.
    """
    index: tuple[slice | EllipsisType, ...] = (*box, Ellipsis)
    return array[index]


def full_box(shape: tuple[int, ...]) -> Box:
    """The box that covers a whole array of `shape`."""
    return tuple(slice(0, n) for n in shape)


# Dtype names of safetensors headers.
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64),
    "U32": np.dtype(np.uint32),
    "U16": np.dtype(np.uint16),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}


# Tile of a transposing copy, in elements along the source's contiguous axis
# and the destination's: small enough that a tile's source lines and
# destination lines stay in cache. A 46 MB float32 (5632, 2048) transpose
# took 0.17-0.20 s element-ordered and 0.08 s in 128 x 512 tiles.
_TILE = (128, 512)


def copy_into(dst: np.ndarray, src: np.ndarray) -> None:
    """`dst[...] = src`, in cache-sized tiles when `src` is a transposed view.

    A view whose contiguous axis is not the last one (a Hugging Face weight
    read as a Keras kernel, see `shardckpt.formats.hf_remap`) copied element
    by element in `dst`'s order reads one element per cache line; tiling the
    two contiguous axes reads each line once.
    """
    axes = [d for d in range(src.ndim) if src.shape[d] > 1]
    last = dst.ndim - 1
    if dst.size < _TILE[0] * _TILE[1] or len(axes) < 2 or src.shape[last] <= 1:
        dst[...] = src
        return
    fast = min(axes, key=lambda d: abs(src.strides[d]))
    if fast == last or abs(src.strides[last]) == src.itemsize:
        dst[...] = src
        return
    index = [slice(None)] * src.ndim
    for i in range(0, src.shape[fast], _TILE[0]):
        index[fast] = slice(i, i + _TILE[0])
        for j in range(0, src.shape[last], _TILE[1]):
            index[last] = slice(j, j + _TILE[1])
            box = tuple(index)
            dst[box] = src[box]
