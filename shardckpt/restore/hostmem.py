"""Giving the host memory of replaced values back to the operating system.

Loading into a model built normally frees each variable's old value once the
new one is in place. On CPU devices those values are XLA buffers from malloc,
and glibc keeps freed blocks in its heaps for reuse instead of unmapping
them, so the process kept the whole old model, as it does after Keras' own
`load_weights`, although only the new arrays were alive. Our new pieces do
not reuse those blocks (buffers of 4 MiB and more are maps of their own, see
`formats.base.aligned_empty`), so nothing ever would.

`load_sharded` counts the host bytes of the values it replaced (`host_bytes`)
and calls `trim` (glibc's `malloc_trim`) every quarter of its budget, while
the worker threads go on; the process then ends holding about its state
(figures: README, CHANGELOG). `malloc_trim` only hands back memory that is
free; where it does not exist (macOS, musl) nothing is done.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import jax


def _find_malloc_trim() -> Callable[[int], int] | None:
    try:
        trim = ctypes.CDLL(None).malloc_trim  # glibc; ctypes drops the GIL while it runs
    except (AttributeError, OSError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


_MALLOC_TRIM = _find_malloc_trim()


def trim() -> bool:
    """Gives the heap's free memory back to the OS now.

    Returns:
        Whether it could (False where glibc's `malloc_trim` does not exist).
    """
    if _MALLOC_TRIM is None:
        return False
    _MALLOC_TRIM(0)
    return True


def host_bytes(value: object) -> int:
    """Bytes a jax array holds in host memory (its shards on CPU devices), else 0."""
    if not isinstance(value, jax.Array):
        return 0
    return sum(s.data.nbytes for s in value.addressable_shards if s.device.platform == "cpu")
