"""Dtype rules shared by restore and convert: what counts as a float, which casts are allowed.

numpy files bfloat16 and float8 (from ml_dtypes) under kind "V", so a plain
`dtype.kind` check would call them opaque; these functions ask ml_dtypes.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from shardckpt.errors import DtypeMismatchError

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


def check_cast(path: str, key: str, stored: np.dtype, target: np.dtype) -> None:
    """Raises unless a `stored` array may be loaded into a `target` variable.

    Raises:
        DtypeMismatchError: naming variable `path` and checkpoint `key`.
    """
    if stored == target:
        return
    if kind(target) not in _CASTS.get(kind(stored), ""):
        raise DtypeMismatchError(
            f"Variable {path!r}: checkpoint {key!r} holds {stored}, which does not "
            f"cast to the variable's {target} without losing meaning. Fix: build "
            f"the variable with dtype {stored} (or a wider one of the same kind)."
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
