"""`Location`: a path argument classified once, where it enters the public API.

A `Location` names a local path or an object-store prefix (`gs://`, `s3://`).
Below the API edge, functions take and pass `Location` objects; `parse` of a
`Location` returns it unchanged, so a helper that accepts either costs nothing.
"""

from __future__ import annotations

import dataclasses
import os

LOCAL = "local"
"""The scheme of paths on this machine's file system."""


@dataclasses.dataclass(frozen=True)
class Location:
    """A classified path argument.

    Attributes:
        scheme: "local", or an object store's URL scheme ("gs", "s3").
        path: For "local": the absolute local path. For buckets: the key
            prefix inside the bucket, without leading or trailing "/".
        bucket: The bucket name (None for local paths).
        given: A local path as the user wrote it (relative, say), which
            messages and reports name; None for URLs and for locations derived
            by `join` / `parent`. Not part of the location's identity.
    """

    scheme: str
    path: str
    bucket: str | None = None
    given: str | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def is_remote(self) -> bool:
        """True for an object store (the backend decides what that allows)."""
        return self.scheme != LOCAL

    @property
    def local_path(self) -> str | None:
        """The path on this machine's file system, or None for an object in a store."""
        return None if self.is_remote else self.path

    @property
    def url(self) -> str:
        """The path as the user would write it (`gs://b/k` or `/abs/path`)."""
        if not self.is_remote:
            return self.path
        return f"{self.scheme}://{self.bucket}/{self.path}".rstrip("/")

    @property
    def shown(self) -> str:
        """How messages and reports name it: the local path as given, else `url`."""
        return self.url if self.given is None else self.given

    @property
    def name(self) -> str:
        """The last path component."""
        return self.path.rstrip("/").rsplit("/", 1)[-1]

    @property
    def parent(self) -> Location:
        """The folder (or key prefix) holding this location."""
        if not self.is_remote:
            return dataclasses.replace(self, path=os.path.dirname(self.path), given=None)
        head = self.path.rsplit("/", 1)[0] if "/" in self.path else ""
        return dataclasses.replace(self, path=head, given=None)

    def join(self, *names: str) -> Location:
        """The location of `names` under this one ("a/b" names are split on "/")."""
        if not self.is_remote:
            return dataclasses.replace(self, path=os.path.join(self.path, *names), given=None)
        parts = [p for p in (self.path, *names) if p]
        return dataclasses.replace(self, path="/".join(p.strip("/") for p in parts), given=None)

    def endswith(self, suffixes: str | tuple[str, ...]) -> bool:
        """Whether the path ends with one of `suffixes` (a file's kind by its name)."""
        return self.path.endswith(suffixes)

    def __str__(self) -> str:
        return self.url
