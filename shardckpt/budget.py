"""Host-memory budgets shared by restore, convert and verify.

`max_inflight_bytes` is the one knob of every streaming path: the most bytes
of array data a call holds in host memory at once beyond its result. Its
default, and the decoded-chunk cache that compressed formats get from it,
live here so the library, the CLI and the benchmarks agree.
"""

from __future__ import annotations

DEFAULT_MAX_INFLIGHT_BYTES = 256 * 1024 * 1024
"""Default of `load_sharded`, `convert`, `verify` and `--max-inflight-mb`."""

CHUNK_CACHE_BYTES = 32 * 1024 * 1024
"""Largest decoded-chunk cache of a compressed format's reader (Orbax)."""


def chunk_cache_bytes(max_inflight_bytes: int) -> int:
    """Size of the decoded-chunk cache of compressed formats (Orbax).

    Restore asks for every piece of a variable in one batch, which decodes a
    chunk shared by the pieces once for all of them, so the cache need not
    hold big chunks until every piece is read. It must hold the small things
    every read goes through (zarr shard indexes, OCDBT nodes): without any
    cache, reads of small chunks were about a third slower. A larger cache
    keeps consumed chunks alive, memory beyond the budget (see CHANGELOG for
    the figures that set 32 MiB).
    """
    return min(max_inflight_bytes, CHUNK_CACHE_BYTES)
