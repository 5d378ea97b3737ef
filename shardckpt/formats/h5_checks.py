"""Consistency checks of a Keras `.weights.h5` header, before any array byte is read.

`H5Reader` serves a contiguous dataset from `dataset.id.get_offset()` for
`shape x itemsize` bytes, trusting the header. HDF5 itself (2.0) refuses a
data address past the file's end, but not a damaged size, shape or address
inside the file: a dataset whose shape grew reads its neighbour's bytes, and
two datasets pointed at the same bytes load one's values as the other's,
silently, through Keras' own loader too. These checks use metadata only
(offsets, storage sizes, shapes, link names): one pass over the datasets, no
data read.

Keras' `H5IOStore` writes each layer's variables into a `vars` group as
datasets named `0`..`n-1`, and its loader asks for exactly those names. A
numbered name outside that run, or a numbered member that is not a dataset,
is a damaged link. Other names stay allowed: Keras' own `IndexLookup` stores
`idf_weights`, `TorchModuleWrapper` stores state-dict names (and a layer kept
in an attribute named `vars` has a group of that name).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from shardckpt.errors import CorruptCheckpointError

_FIX = "Fix: re-create the file from its source (re-save the weights, or copy it again)."


@dataclasses.dataclass(frozen=True)
class Extent:
    """Where a contiguous dataset's bytes lie in its file, per its header.

    Attributes:
        key: The dataset's path (`layers/dense/vars/0`).
        offset: Absolute offset of its first byte in the file.
        nbytes: `shape x itemsize`: what the reader reads.
        stored: The storage size the header records (`get_storage_size()`).
    """

    key: str
    offset: int
    nbytes: int
    stored: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


def check_extent(path: str, extent: Extent, file_size: int) -> None:
    """Raises `CorruptCheckpointError` if `extent`'s header contradicts itself or the file."""
    if extent.stored != extent.nbytes:
        raise CorruptCheckpointError(
            f"Array {extent.key!r} in {path!r}: its header records {extent.stored} stored bytes, "
            f"but its shape and dtype need {extent.nbytes}; the header (shape or size) is "
            f"damaged, so the bytes read for it could be another array's. {_FIX}"
        )
    if extent.end > file_size:
        raise CorruptCheckpointError(
            f"Array {extent.key!r} in {path!r} needs bytes {extent.offset}..{extent.end} but "
            f"the file has {file_size}: it is truncated. {_FIX}"
        )


def check_no_overlap(path: str, extents: Iterable[Extent]) -> None:
    """Raises `CorruptCheckpointError` if two datasets' byte ranges share a byte.

    Keras writes each dataset's bytes once; a shared byte means a damaged
    address, which would load one array's values as another's.
    """
    ordered = sorted((e for e in extents if e.nbytes), key=lambda e: e.offset)
    for before, after in zip(ordered, ordered[1:]):
        if after.offset < before.end:
            raise CorruptCheckpointError(
                f"Arrays {before.key!r} (bytes {before.offset}..{before.end}) and {after.key!r} "
                f"(bytes {after.offset}..{after.end}) in {path!r} share bytes: a damaged header "
                f"points {after.key!r} into another array's data. {_FIX}"
            )


def check_vars_member(path: str, name: str, is_dataset: bool) -> None:
    """Raises `CorruptCheckpointError` if `name`, a numbered member of a `vars` group, is not a dataset."""
    parent, _, last = name.rpartition("/")
    if not is_dataset and last.isdigit() and parent.rpartition("/")[2] == "vars":
        raise CorruptCheckpointError(
            f"{name!r} in {path!r} is not a dataset, but Keras stores only datasets (one per "
            f"variable) in a 'vars' group: its link is damaged. {_FIX}"
        )


def check_vars_numbering(path: str, keys: Iterable[str]) -> None:
    """Raises `CorruptCheckpointError` if a `vars` group's numbered datasets are not `0..n-1`.

    Args:
        path: The file (or sharded index) named in the error.
        keys: Every dataset path of the checkpoint; for sharded weights, of
            all shards together (Keras may split one `vars` group across shards).
    """
    numbers: dict[str, list[int]] = {}
    for key in keys:
        group, _, last = key.rpartition("/")
        if group.rpartition("/")[2] == "vars" and last.isdigit():
            numbers.setdefault(group, []).append(int(last))
    for group, found in numbers.items():
        found.sort()
        if found != list(range(len(found))):
            expected = list(range(len(found)))
            raise CorruptCheckpointError(
                f"The group {group!r} in {path!r} holds variables numbered {found}, but Keras "
                f"numbers a layer's variables {expected}: a link name is damaged (or a dataset "
                f"was added or removed by hand). {_FIX}"
            )
