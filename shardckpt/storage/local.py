"""Paths on this machine's file system: `os` calls, and memory maps for the readers."""

from __future__ import annotations

import os
import shutil
from typing import Any

from shardckpt.errors import CheckpointNotFoundError
from shardckpt.storage.bytesource import ByteSource, MappedFile, Sizer
from shardckpt.storage.location import LOCAL, Location


def sync_and_drop(fd: int) -> None:
    """Writes a file's dirty pages back, then drops its pages from the page cache.

    For streaming writers (export, `convert`): the page cache then recycles a
    few warm pages instead of taking a fresh one for every page written, and
    on VMs that take freed memory back (this project's) each first touch of
    a page costs a host fault. Only clean pages can be dropped, hence the sync.
    """
    (getattr(os, "fdatasync", None) or os.fsync)(fd)
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


class Local:
    """The local file system (see `shardckpt.storage.Backend`)."""

    scheme = LOCAL
    mappable = True
    """Its files' bytes are memory maps (`source` gives a `MappedFile`)."""
    renames = True
    """A folder is renamed atomically: Orbax commits a step by renaming its temporary folder."""

    def kvstore(self, location: Location, *, directory: bool = True) -> dict[str, Any]:
        return {"driver": "file", "path": location.path + ("/" if directory else "")}

    def list_keys(self, location: Location) -> list[str]:
        """Every file under the folder, relative to it, sorted; a missing folder lists as empty."""
        keys = []
        for root, _, files in os.walk(location.path):
            rel = os.path.relpath(root, location.path)
            keys += [name if rel == "." else f"{rel}/{name}" for name in files]
        return sorted(keys)

    def listdir(self, location: Location) -> list[str]:
        return sorted(os.listdir(location.path))

    def isdir(self, location: Location) -> bool:
        return os.path.isdir(location.path)

    def exists(self, location: Location) -> bool:
        return os.path.exists(location.path)

    def read(self, location: Location) -> bytes | None:
        try:
            with open(location.path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    version_label = "file stamp"
    """What a file's version is called in messages: modification time (ns), size and inode."""

    def read_version(self, location: Location) -> tuple[bytes | None, bytes]:
        """The bytes of one file (None if it does not exist) and its stamp, for `changed`."""
        try:
            with open(location.path, "rb") as f:
                stamp = _stamp(os.fstat(f.fileno()))
                return f.read(), stamp
        except FileNotFoundError:
            return None, b""

    def changed(self, location: Location, version: bytes) -> str | None:
        """None while the file still has the stamp `version`; else its stamp now.

        A file rewritten in place or replaced (a rename over it) gets another
        modification time or inode.
        """
        try:
            stamp = _stamp(os.stat(location.path))
        except FileNotFoundError:
            return "none (deleted)"
        return None if stamp == version else self.version_text(stamp)

    def version_text(self, generation: bytes) -> str:
        return generation.decode("ascii", "replace")

    def write(self, location: Location, data: bytes) -> None:
        with open(location.path, "wb") as f:
            f.write(data)

    def delete_tree(self, location: Location) -> None:
        shutil.rmtree(location.path, ignore_errors=True)

    def delete_object(self, location: Location) -> None:
        try:
            os.remove(location.path)
        except FileNotFoundError:
            pass

    def size(self, location: Location) -> int:
        total = 0
        for root, _, files in os.walk(location.path):
            total += sum(os.path.getsize(os.path.join(root, name)) for name in files)
        return total

    def source(self, location: Location, sizer: Sizer | None = None) -> ByteSource:
        """A memory map of the file (its size is the file system's: `sizer` is not needed)."""
        return MappedFile(location.path)

    def translate(self, error: BaseException, location: Location, *, action: str = "reading") -> BaseException:
        return error  # OSErrors of local files already name the path

    def not_found(self, location: Location, *, what: str) -> BaseException:
        return CheckpointNotFoundError(f"No checkpoint at {location.url!r}. Fix: check the path ({what}).")

    missing = not_found


def _stamp(st: os.stat_result) -> bytes:
    """A file's version as `Local.read_version` reports it: mtime (ns), size, inode."""
    return f"mtime_ns={st.st_mtime_ns} size={st.st_size} inode={st.st_ino}".encode()
