"""Dtype rules shared by restore and convert (what counts as a float, which casts are allowed),
and the aligned host buffers every reader fills.

numpy files bfloat16 and float8 (from ml_dtypes) under kind "V", so a plain
`dtype.kind` check would call them opaque; these functions ask ml_dtypes.
"""

from __future__ import annotations

import mmap
from typing import Any

import ml_dtypes
import numpy as np

from shardckpt.errors import DtypeMismatchError
from shardckpt.progress import some

# Casts Keras' own loading would make without losing meaning: float width
# changes, integer width changes, and integers or booleans into floats. A float
# checkpoint loaded into an integer variable is a mistake, not a cast.
_CASTS = {"f": "f", "i": "iuf", "u": "iuf", "b": "bf"}


def kind(dtype: np.dtype) -> str:
    """numpy's dtype kind, with ml_dtypes' bfloat16/float8 (kind "V") as "f" (or "i")."""
    if dtype.kind != "V":
        return dtype.kind
    try:
        ml_dtypes.finfo(dtype)
        return "f"
    except ValueError:
        pass
    try:
        ml_dtypes.iinfo(dtype)
        return "i"
    except ValueError:
        return "V"


def is_float(dtype: np.dtype) -> bool:
    """True for floating-point dtypes, bfloat16 and float8 included."""
    return kind(np.dtype(dtype)) == "f"


# What a non-numeric array holds, by numpy kind, for the error: no cast makes
# numbers of these, so "build the variable with that dtype" would be no fix.
_NOT_NUMBERS = {
    "O": "variable-length data (strings or other objects)",
    "S": "byte-string data",
    "U": "string data",
    "V": "opaque or compound records",
    "M": "dates",
    "m": "time spans",
}


def check_cast(path: str, key: str, stored: np.dtype, target: np.dtype, source: str = "") -> None:
    """Raises unless a `stored` array may be loaded into a `target` variable.

    Args:
        path: The variable's path.
        key: The array's key in the checkpoint.
        stored: The array's dtype in the checkpoint.
        target: The variable's dtype.
        source: The checkpoint file, named in the error of a non-numeric array.

    Raises:
        DtypeMismatchError: naming variable `path` and checkpoint `key`.
    """
    if stored == target:
        return
    held = _NOT_NUMBERS.get(kind(stored))
    if held is not None and kind(target) in "fiub":
        where = f" of {source!r}" if source else ""
        raise DtypeMismatchError(
            f"Variable {path!r}: checkpoint array {key!r}{where} holds {held}, numpy dtype {stored}, where "
            f"the numeric {target} variable is expected; no cast makes numbers of it. The file is not a "
            "weights file of this model, or something other than Keras wrote that array. Fix: load the "
            "weights this model saved, or re-save them with Keras (model.save_weights)."
        )
    if kind(target) not in _CASTS.get(kind(stored), ""):
        # Floats into an integer variable: a quantized layer's kernel (int8, packed int4) given
        # a float checkpoint; Keras quantizes float weights only through `quantize()`.
        quantized = (
            " An integer variable where the checkpoint holds floats is a quantized layer's kernel: "
            "build the model with its float policy, load the float checkpoint, then call "
            "model.quantize(mode) (before planning it), or load a checkpoint of the quantized model."
            if kind(stored) == "f" and kind(target) in "iu" else ""
        )
        raise DtypeMismatchError(
            f"Variable {path!r}: checkpoint {key!r} holds {stored}, which does not "
            f"cast to the variable's {target} without losing meaning. Fix: build "
            f"the variable with dtype {stored} (or a wider one of the same kind).{quantized}"
        )


def float_dtype(dtype: Any) -> np.dtype | None:
    """Resolves a requested cast dtype (`convert(dtype=...)`); None stays None.

    Raises:
        DtypeMismatchError: `dtype` is unknown or not a floating-point dtype.
    """
    if dtype is None:
        return None
    from keras import backend

    try:
        resolved = np.dtype(backend.standardize_dtype(dtype) if isinstance(dtype, str) else dtype)
    except (TypeError, ValueError) as e:
        raise DtypeMismatchError(f"Unknown dtype. Fix: use e.g. bfloat16 or float16. Received: dtype={dtype!r}") from e
    if not is_float(resolved):
        raise DtypeMismatchError(
            "dtype= casts floating-point arrays and must be a floating-point dtype (e.g. "
            f"bfloat16, float16, float32). Received: dtype={dtype!r}"
        )
    return resolved


def narrows_range(source: Any, target: Any) -> bool:
    """True where a cast of float `source` into float `target` can turn finite values into inf (or NaN).

    float32 or bfloat16 into float16 (largest finite 65504) does; float32
    into bfloat16 only beyond 3.39e38; into float8_e4m3fn, which has no inf,
    beyond 448 values become NaN.
    """
    source, target = np.dtype(source), np.dtype(target)
    if source == target or not (is_float(source) and is_float(target)):
        return False
    return largest(target) < largest(source)


def largest(dtype: Any) -> float:
    """The largest finite value of float `dtype` (bfloat16 included)."""
    return float(ml_dtypes.finfo(np.dtype(dtype)).max)


def overflowed(source: np.ndarray, cast: np.ndarray) -> int:
    """How many finite values of `source` are not finite in `cast` (its cast into a narrower float).

    inf where the target has one; NaN where it has none (float8_e4m3fn and
    the other `fn` float8 types: ml_dtypes and XLA cast what is beyond their
    largest value into NaN).
    """
    return int(np.count_nonzero(~np.isfinite(cast) & np.isfinite(source)))


def has_inf(dtype: Any) -> bool:
    """Whether float `dtype` holds an inf (float8_e4m3fn and the `fnuz` types do not)."""
    with np.errstate(invalid="ignore", over="ignore"):
        return bool(np.isinf(np.array(np.inf, np.float32).astype(np.dtype(dtype)).astype(np.float32)))


class Overflows:
    """Values a narrowing cast turned into inf (or NaN), by variable: said once, after the whole write.

    NaN where the target has no inf (float8_e4m3fn). numpy's own "overflow encountered in cast" names nothing and repeats per
    block; callers cast under `np.errstate(over="ignore")` and count here.
    """

    def __init__(self, target: np.dtype | None) -> None:
        self.target = target
        self.counts: dict[str, int] = {}

    def add(self, name: str, count: int) -> None:
        if count:
            self.counts[name] = self.counts.get(name, 0) + count

    def message(self, what: str) -> str | None:
        """The warning's text, or None when nothing overflowed."""
        if not self.counts:
            return None
        total = sum(self.counts.values())
        names = some([f"{n!r} ({c})" for n, c in self.counts.items()])
        bound = largest(self.target) if self.target is not None else float("nan")
        into = (f"inf (beyond +-{bound:g})" if self.target is None or has_inf(self.target)
                else f"NaN ({self.target} has no inf; beyond +-{bound:g})")
        return (
            f"{what}: casting to {self.target} turned {total} finite value(s) into {into} in "
            f"{len(self.counts)} variable(s): {names}. Fix: store a dtype of wider range (dtype='bfloat16' "
            "or 'float32'), or rescale those weights before the cast."
        )


ALIGNMENT = 64
"""Byte alignment at which XLA's CPU client adopts a numpy buffer without copying."""


# From this size on, buffers are anonymous private maps of 4 KiB pages (numpy
# asks for transparent huge pages from 4 MiB on, the same threshold). On VMs
# that hand free memory back to their host (virtio-balloon free page
# reporting), touching a huge page costs host faults; 4 KiB pages cost the
# same on idle and warm machines, and the worst case matters more than the
# best (figures: CHANGELOG).
_MAPPED_MIN_BYTES = 4 * 1024 * 1024


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on `ALIGNMENT` bytes.

    `jax.device_put` onto a CPU device aliases such a buffer instead of
    copying it, which saves a full pass over the restored state. Large
    buffers are page-aligned anonymous maps (see `_MAPPED_MIN_BYTES`), freed
    when the last array using them is.
    """
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes >= _MAPPED_MIN_BYTES and hasattr(mmap, "MAP_PRIVATE"):
        # Private, not mmap's default shared map: shared anonymous memory is
        # shmem (a tmpfs file), accounted and swapped as such.
        region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        return np.frombuffer(region, dtype, count=nbytes // dtype.itemsize).reshape(shape)
    raw = np.empty(nbytes + ALIGNMENT, np.uint8)
    start = (-raw.ctypes.data) % ALIGNMENT
    return raw[start : start + nbytes].view(dtype).reshape(shape)
