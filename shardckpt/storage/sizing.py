"""Sizes of objects in a bucket, which TensorStore's kvstore API does not report: summed over
a prefix by range probes (`du`). One object's size comes from its own header, which the
format that opens it reads (a `Sizer` given to `storage.open_source`: storage knows no format)."""

from __future__ import annotations

from typing import Any, Protocol

import tensorstore as ts

from shardckpt.storage.location import Location


class Lister(Protocol):
    """What `du` asks of the object store it sizes (an `ObjectStore`), declared beside its user."""

    def open(self, location: Location) -> ts.KvStore:
        """TensorStore's kvstore of the folder `location`."""
        ...

    def list_keys(self, location: Location) -> list[str]:
        """Every object key under `location`, relative to it."""
        ...

    def wait(self, future: Any, location: Location, action: str) -> Any:
        """The result of a kvstore `future`; failures typed."""
        ...

WINDOW = 64 * 1024
"""Objects up to this size are read whole to size them; larger ones are probed (see `du`)."""


def du(store: Lister, location: Location) -> int:
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
