"""The `Backend` protocol: what a storage backend offers the formats above it."""

from __future__ import annotations

from typing import Any, Protocol

from shardckpt.storage.bytesource import ByteSource, Sizer
from shardckpt.storage.location import Location


class Backend(Protocol):
    """A place checkpoints live: the local disk, an object store.

    Readers and writers never ask where a `Location` is: they ask its backend
    for what they need: the bytes of one file come from `source` (a memory
    map where `mappable`, ranged reads otherwise). Every backend gives TensorStore a kvstore spec of a location
    (`kvstore`), which is how the Orbax arrays are read and written.

    Attributes:
        scheme: The URL scheme it serves ("local" for paths).
        mappable: Whether its files are local and can be memory-mapped.
        renames: Whether a folder can be renamed atomically (Orbax's commit of
            a step); where not, a step is committed by a marker written last.
    """

    scheme: str
    mappable: bool
    renames: bool

    def kvstore(self, location: Location, *, directory: bool = True) -> dict[str, Any]:
        """TensorStore's kvstore spec of `location` (a "directory" spec ends in "/")."""
        ...

    def read(self, location: Location) -> bytes | None:
        """The bytes of one file or object, or None when it does not exist."""
        ...

    version_label: str
    """What the store calls a file's version, for messages ("generation", "ETag")."""

    def read_version(self, location: Location) -> tuple[bytes | None, bytes]:
        """The bytes of one file or object (None if it does not exist) and the version they are of."""
        ...

    def changed(self, location: Location, version: bytes) -> str | None:
        """None while `location` is still at `version`; else its version now, as `version_text` shows it."""
        ...

    def version_text(self, generation: bytes) -> str:
        """A version as the store shows it, for messages."""
        ...

    def source(self, location: Location, sizer: Sizer | None = None) -> ByteSource:
        """The bytes of one file or object (`sizer`: how an object learns its size)."""
        ...

    def write(self, location: Location, data: bytes) -> None:
        """Writes one file or object whole."""
        ...

    def list_keys(self, location: Location) -> list[str]:
        """Every key under the folder `location`, relative to it, sorted."""
        ...

    def listdir(self, location: Location) -> list[str]:
        """Names directly under the folder `location`."""
        ...

    def isdir(self, location: Location) -> bool:
        """Whether `location` is a folder (a prefix holding objects)."""
        ...

    def exists(self, location: Location) -> bool:
        """Whether `location` is a file, object, folder or non-empty prefix."""
        ...

    def delete_tree(self, location: Location) -> None:
        """Deletes everything under `location`."""
        ...

    def delete_object(self, location: Location) -> None:
        """Deletes one file or object; a missing one is no error."""
        ...

    def size(self, location: Location) -> int:
        """Total bytes under `location`."""
        ...

    def translate(self, error: BaseException, location: Location, *, action: str = "reading") -> BaseException:
        """A typed error for a failed request, or `error` itself when it is none of the store's."""
        ...

    def not_found(self, location: Location, *, what: str) -> BaseException:
        """The error for nothing at `location` where `what` was expected (a missing bucket too)."""
        ...

    def missing(self, location: Location, *, what: str) -> BaseException:
        """The error for a missing object (without listing first)."""
        ...
