"""Per-array checksums: computed while converting, checked by `verify`.

A checksum is CRC-32 (zlib's, computed by ISA-L where installed) of the
array's bytes in C order, as stored (after any dtype cast). CRC-32 is several
times faster than BLAKE2b or SHA-256 (figures: CHANGELOG); it is for catching
damage (flipped or lost bytes), not tampering. Because CRC-32 can be
continued piece by piece, an array is checksummed in `boxes.c_order_boxes`
pieces, never whole.

The checksums live in the Orbax step's own `custom_metadata` (in
`_CHECKPOINT_METADATA`) under the key "shardckpt", readable with Orbax's
public `ocp.metadata(step)`; Keras and Orbax ignore it.
"""

from __future__ import annotations

import dataclasses
import os
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

try:
    # ISA-L's CRC-32 is zlib's (same polynomial, same values) computed with
    # carry-less multiplication, several times faster, and it releases the GIL
    # as zlib does (figures: CHANGELOG).
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # no isal wheel for this platform: zlib, same values, slower
    _crc32 = zlib.crc32

from shardckpt import budget as budgets
from shardckpt import storage
from shardckpt.conversion.boxes import c_order_boxes
from shardckpt.errors import ChecksumMismatchError, CorruptCheckpointError
from shardckpt.formats import open_reader
from shardckpt.formats.orbax import ondisk
from shardckpt.formats.orbax.reader import OrbaxReader
from shardckpt.natsort import natural_sorted
from shardckpt.progress import ReadTally, format_bytes

METADATA_KEY = "shardckpt"
ALGORITHM = "crc32"


def crc32(data: np.ndarray, value: int = 0) -> int:
    """Continues CRC-32 `value` over the C-order bytes of `data`."""
    return _crc32(np.ascontiguousarray(data).view(np.uint8).reshape(-1).data, value)


def hex32(value: int) -> str:
    return f"{value:08x}"


def read_checksums(step_dir: str) -> dict[str, dict[str, Any]] | None:
    """Returns `{key: {"crc32", "shape", "dtype"}}` of a converted step, or None.

    Args:
        step_dir: An Orbax step folder.

    Raises:
        CorruptCheckpointError: `_CHECKPOINT_METADATA` is not valid JSON.
    """
    # The step's own JSON, not `ocp.metadata(step)`: that one also validates
    # every item, and warns "TensorStore data files not found ... malformed
    # checkpoint" for the strings-only items (model_config) of a healthy
    # OrbaxCheckpoint step. The array items are checked when they are read.
    location = storage.parse(step_dir)
    step = storage.read_json(
        location.join(ondisk.STEP_METADATA), fix="restore another step or re-convert.", missing_ok=True
    )
    if step is None:
        return None
    if not isinstance(step, dict):
        raise CorruptCheckpointError(
            f"The step metadata of {step_dir!r} is not a JSON object. Fix: restore another step or re-convert."
        )
    meta = step.get("custom_metadata") or {}
    ours = meta.get(METADATA_KEY) if isinstance(meta, dict) else None
    if not isinstance(ours, dict) or ours.get("algorithm") != ALGORITHM:
        return None
    return ours.get("arrays") or {}


@dataclasses.dataclass(kw_only=True)
class VerifyReport(ReadTally):
    """What `verify` found.

    Attributes:
        path, format, arrays, bytes_read: What was read back (see
            `shardckpt.progress.ReadTally`).
        checksummed: Arrays whose checksum was compared (0: none stored).
        chunks_checksummed: Stored chunks read back whose own `crc32c`
            tensorstore checked as it decoded them (Orbax steps written by
            shardckpt: `convert` and `OrbaxCheckpoint`; 0: none stored).
        damaged: One line per damaged array: key, what was expected, found.
        skipped: Keys of datasets that hold no numbers (variable-length
            strings in an h5 file, which Keras does not write as weights):
            neither read back nor checksummed, and not counted in `arrays`.
        newer_uncommitted: Given an Orbax root: one line per step folder
            newer than the step verified that is not committed (a save
            killed before its commit), passed over, not verified. The newest
            save is not restorable, so the report is not `ok`.
    """

    checksummed: int = 0
    chunks_checksummed: int = 0
    damaged: list[str] = dataclasses.field(default_factory=list)
    skipped: list[str] = dataclasses.field(default_factory=list)
    newer_uncommitted: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Nothing damaged and no newer step passed over."""
        return not self.damaged and not self.newer_uncommitted

    def raise_if_damaged(self) -> None:
        """Raises `ChecksumMismatchError` listing every damaged array."""
        if self.damaged:
            raise ChecksumMismatchError(
                f"{len(self.damaged)} damaged array(s) in {self.path!r}: " + "; ".join(self.damaged)
                + ". Fix: re-create the checkpoint from its source (re-convert or restore another step)."
            )

    def __str__(self) -> str:
        checks = []
        if self.checksummed:
            checks.append(f"{ALGORITHM} checksums of {self.checksummed}")
        if self.chunks_checksummed:
            checks.append(f"{self.chunks_checksummed} chunks, crc32c verified by tensorstore")
        how = "; ".join(checks) or "no checksums stored; read back"
        if self.skipped:
            how += f"; {len(self.skipped)} variable-length dataset(s) skipped, not checked"
        state = "DAMAGED" if self.damaged else "NEWER STEP NOT COMMITTED" if self.newer_uncommitted else "OK"
        head = f"{state}: {self.arrays} arrays, {format_bytes(self.bytes_read)} of {self.format} {self.path!r} ({how})"
        lines = [f"  damaged: {d}" for d in self.damaged]
        lines += [f"  not committed, not verified: {s}" for s in self.newer_uncommitted]
        lines += [f"  skipped: {k} (variable-length data, not checked)" for k in self.skipped]
        return "\n".join([head] + lines)


def verify(
    path: str | os.PathLike,
    *,
    max_inflight_bytes: int | None = None,
    advance: Callable[[int], None] | None = None,
) -> VerifyReport:
    """Re-reads every array of a checkpoint and checks it.

    Given an Orbax root, its latest committed step is verified, and step
    folders newer than it that are not committed (a save killed before its
    commit) are named in `report.newer_uncommitted` (the report is then not `ok`).
    Arrays of a checkpoint written by `shardckpt.convert` are checked against
    the shapes, dtypes and CRC-32 checksums stored at conversion. Orbax steps
    written by shardckpt (`convert`, `OrbaxCheckpoint`) also carry a `crc32c`
    on every stored chunk, which tensorstore checks as it decodes it; the
    report counts them. Other checkpoints (Keras-written Orbax steps, h5,
    safetensors) carry no checksums: each array is read back in full, which
    catches truncation and undecodable chunks. Every array is checked; all
    damage is reported at once. Variable-length datasets (strings) of an h5
    file are skipped and listed in `report.skipped`.

    Example:

    ```python
    report = shardckpt.verify("model_orbax/")
    report.raise_if_damaged()
    ```

    Args:
        path: Anything `shardckpt.inspect` reads.
        max_inflight_bytes: Most bytes read into memory at once (None: the
            host's default, `shardckpt.budget.default_max_inflight_bytes`).
        advance: Called with the bytes of each piece read (progress bars).

    Returns:
        A `VerifyReport`; `report.damaged` names each damaged array,
        `report.newer_uncommitted` each newer step that is not committed.

    Raises:
        CheckpointNotFoundError, UnknownFormatError: nothing readable at `path`.
        CorruptCheckpointError: the checkpoint's index or metadata is damaged
            (no array can be located).
    """
    max_inflight_bytes = budgets.resolve(max_inflight_bytes)
    location = storage.parse(path, what="path")
    reader = open_reader(location, cache_bytes=budgets.chunk_cache_bytes(max_inflight_bytes))
    try:
        report = VerifyReport(path=reader.path, format=reader.format)
        if reader.format == "orbax" and reader.path != location.url:  # a root: its latest committed step
            report.newer_uncommitted = [f"{location.join(name).url} ({why})" for name, why in ondisk.newer_uncommitted(location)]
        expected = read_checksums(reader.path) if reader.format == "orbax" else None
        keys = reader.keys()
        if expected is not None:
            for key in natural_sorted(set(expected) - set(keys)):
                report.damaged.append(f"{key}: listed in the checksums but missing from the checkpoint")
        for key in natural_sorted(keys):
            if reader.spec(key).dtype.hasobject:  # heap references: no bytes of their own to check
                report.skipped.append(key)
                continue
            problem = _check_array(reader, key, (expected or {}).get(key), max_inflight_bytes, report, advance)
            if problem:
                report.damaged.append(f"{key}: {problem}")
            report.arrays += 1
    finally:
        reader.close()
    return report


def _check_array(
    reader: Any,
    key: str,
    expected: dict[str, Any] | None,
    max_bytes: int,
    report: VerifyReport,
    advance: Callable[[int], None] | None,
) -> str | None:
    spec = reader.spec(key)
    if expected is not None:
        if tuple(expected["shape"]) != tuple(spec.shape) or expected["dtype"] != str(spec.dtype):
            return (
                f"expected {expected['dtype']}{list(expected['shape'])}, found "
                f"{spec.dtype}{list(spec.shape)}"
            )
    value = 0
    try:
        for box in c_order_boxes(tuple(spec.shape), spec.dtype.itemsize, max_bytes):
            piece = reader.read(key, box)
            value = crc32(piece, value)
            report.bytes_read += piece.nbytes
            if advance is not None:
                advance(piece.nbytes)
    except ChecksumMismatchError as e:  # a chunk's crc32c (shardckpt's writers store one per chunk)
        return f"chunk checksum crc32c does not match ({e})"
    except CorruptCheckpointError as e:
        return f"cannot be read back ({e})"
    if isinstance(reader, OrbaxReader):
        report.chunks_checksummed += reader.chunk_checksums(key)
    if expected is not None:
        report.checksummed += 1
        if hex32(value) != expected["crc32"]:
            return f"checksum {ALGORITHM} expected {expected['crc32']}, found {hex32(value)}"
    return None
