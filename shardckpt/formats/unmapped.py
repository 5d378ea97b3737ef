"""`Unmapped`: a reader over objects read by byte ranges, as a plain `Reader` (no `view`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from shardckpt.formats.base import ArraySpec, Box, Reader


class Unmapped(Reader):
    """A reader of objects in a bucket, as a plain `Reader` (no `view`).

    The formats' readers take bucket URLs and then serve `view` as fresh
    reads; hiding `view` makes restore and convert hold budget for them
    (`shardckpt.restore.strategies.by_slabs`) as for any fresh read.
    """

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.path = inner.path
        self.format = inner.format

    def keys(self) -> list[str]:
        return self._inner.keys()

    def spec(self, key: str) -> ArraySpec:
        return self._inner.spec(key)

    def read(self, key: str, box: Box) -> np.ndarray:
        return self._inner.read(key, box)

    def close(self) -> None:
        self._inner.close()

    def __getattr__(self, name: str) -> Any:
        if name == "view":  # the point of this class: no mapped views
            raise AttributeError(name)
        return getattr(self._inner, name)
