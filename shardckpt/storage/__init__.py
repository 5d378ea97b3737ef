"""Where checkpoints live: `Location`, the `Backend` of each scheme, and small-file I/O.

Every public entry point passes its path arguments through `parse` once; below
that, `Location` objects travel. A `scheme://` other than those in `BACKENDS`
and `file` is refused with `UnsupportedURLError`: taken for a local path,
`s3://bucket/ck` became the local folder `s3:/bucket/ck` and a user who
believed the checkpoint was in the bucket lost it with the machine.

A new backend is one module (a class following `backend.Backend`) and one
line in `BACKENDS`.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from shardckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsupportedURLError
from shardckpt.storage import deadlines
from shardckpt.storage.backend import Backend
from shardckpt.storage.bytesource import ByteSource, MappedFile, Sizer
from shardckpt.storage.deadlines import Deadline, deadline
from shardckpt.storage.gcs import Gcs
from shardckpt.storage.local import Local, sync_and_drop
from shardckpt.storage.location import LOCAL, Location
from shardckpt.storage.s3 import S3

__all__ = [
    "BACKENDS",
    "Backend",
    "ByteSource",
    "MappedFile",
    "Sizer",
    "Deadline",
    "Location",
    "backend",
    "child",
    "deadline",
    "deadlines",
    "parse",
    "open_source",
    "read_json",
    "shown",
    "sync_and_drop",
]

BACKENDS: dict[str, Backend] = {
    LOCAL: Local(),
    "gs": Gcs(),
    "s3": S3(),
}
"""Every backend by its URL scheme ("local" serves paths and `file://` URLs)."""

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://(.*)$", re.DOTALL)


def schemes() -> list[str]:
    """The URL schemes shardckpt reads and writes, as a user writes them."""
    return [f"{s}://" for s in BACKENDS if s != LOCAL] + ["file://"]


def parse(path: str | os.PathLike | Location, *, what: str = "path") -> Location:
    """Classifies a path argument: a local path, a URL of a backend, or refused.

    Args:
        path: A local path, `file://` URL, `gs://bucket/...` / `s3://bucket/...`
            URL, or a `Location` (returned as it is).
        what: The argument's name, for error messages ("dst", "directory").

    Returns:
        A `Location`; local paths are made absolute.

    Raises:
        UnsupportedURLError: any other `scheme://`, or a bucket URL without a
            bucket name.
    """
    if isinstance(path, Location):
        return path
    text = os.fspath(path)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    match = _URL.match(text)
    if match is None:
        return Location(LOCAL, os.path.abspath(text), given=text)
    scheme, rest = match.group(1).lower(), match.group(2)
    if scheme == "file":
        return Location(LOCAL, os.path.abspath("/" + rest.lstrip("/")))
    if scheme not in BACKENDS or scheme == LOCAL:
        raise UnsupportedURLError(
            f"{what}={text!r} is a {scheme}:// URL, which shardckpt does not read or write; "
            f"it is not taken for a local folder. Fix: use a local path, a file:// URL, or a "
            f"gs://bucket/... or s3://bucket/... URL. Supported schemes: "
            f"{', '.join(schemes())}. Received: {what}={text!r}"
        )
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise UnsupportedURLError(
            f"{what}={text!r} names no bucket. Fix: write {scheme}://BUCKET/path. "
            f"Received: {what}={text!r}"
        )
    key = "/".join(p for p in key.split("/") if p and p != ".")
    return Location(scheme, key, bucket)


def backend(location: Location) -> Backend:
    """The backend serving `location`."""
    return BACKENDS[location.scheme]


# ---- one call per operation, whatever the backend -----------------------------


def kvstore(location: Location, *, directory: bool = True) -> dict[str, Any]:
    """TensorStore's kvstore spec of `location` (a "directory" ends in "/")."""
    return backend(location).kvstore(location, directory=directory)


def read_bytes(location: Location) -> bytes | None:
    """The bytes of one file or object, or None if it does not exist."""
    return backend(location).read(location)


def open_source(location: Location, sizer: Sizer | None = None) -> ByteSource:
    """The bytes of one file or object: a memory map locally, ranged reads in a bucket.

    Args:
        location: The file.
        sizer: How an object in a bucket learns its size from its own bytes
            (a format's header); see `shardckpt.storage.ranged.RemoteObject.size`.

    Raises:
        CheckpointNotFoundError: a local file does not exist (an object: on its first read).
    """
    return backend(location).source(location, sizer)


def child(folder: Location, name: str) -> Location | None:
    """The file `name` (relative, "/"-separated) inside `folder`, or None when it leads out.

    Out means: absolute, a URL, a ".." component, or (on the local disk) a
    path whose links resolve outside the folder.
    """
    if not name or name.startswith("/") or os.path.isabs(name) or "://" in name or ".." in name.split("/"):
        return None
    location = folder.join(name)
    local = location.local_path
    if local is not None:
        inside = os.path.realpath(folder.path)
        if os.path.commonpath([inside, os.path.realpath(local)]) != inside:
            return None
    return location


def shown(path: str | os.PathLike | Location, location: Location) -> str:
    """How a reader names what it opened: the path as the user gave it, else the URL."""
    if isinstance(path, Location):
        return path.shown
    text = os.fsdecode(os.fspath(path))
    return location.url if _URL.match(text) else text


def write_bytes(location: Location, data: bytes) -> None:
    """Writes one file or object (an object write is atomic: all or nothing)."""
    backend(location).write(location, data)


def list_keys(location: Location) -> list[str]:
    """Every file or object key under `location`, relative to it, sorted."""
    return backend(location).list_keys(location)


def listdir(location: Location) -> list[str]:
    """Names directly under `location`: files and folders (key prefixes)."""
    return backend(location).listdir(location)


def isdir(location: Location) -> bool:
    """True for a local folder, or a bucket prefix holding at least one object."""
    return backend(location).isdir(location)


def exists(location: Location) -> bool:
    """True if `location` is an existing file, folder, object or non-empty prefix."""
    return backend(location).exists(location)


def delete_tree(location: Location) -> None:
    """Deletes everything under `location`."""
    backend(location).delete_tree(location)


def delete_object(location: Location) -> None:
    """Deletes one file or object; a missing one is no error."""
    backend(location).delete_object(location)


def du(location: Location) -> int:
    """Total bytes of every file or object under `location`."""
    return backend(location).size(location)


def translate(error: BaseException, location: Location, *, action: str = "reading") -> BaseException:
    """A typed error naming the URL and the fix for a failed request, or `error` itself."""
    return backend(location).translate(error, location, action=action)


def not_found(location: Location, *, what: str) -> BaseException:
    """The error for nothing at `location` where `what` was expected (a missing bucket too)."""
    return backend(location).not_found(location, what=what)


def read_json(location: Location, *, fix: str, missing_ok: bool = False) -> Any:
    """A small JSON file (local or an object), read whole and parsed.

    Args:
        location: The file.
        fix: What to do when it is missing or damaged, for the error message.
        missing_ok: Return None for a missing file instead of raising.

    Raises:
        CheckpointNotFoundError: it does not exist (unless `missing_ok`).
        CorruptCheckpointError: it is no valid JSON.
        StorageCredentialsError, StorageAccessDeniedError, BucketNotFoundError,
        StorageTimeoutError: the store refused or did not answer.
    """
    data = read_bytes(location)
    if data is None:
        if missing_ok:
            return None
        raise CheckpointNotFoundError(f"No file at {location.url!r}. Fix: {fix}")
    try:
        return json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptCheckpointError(f"{location.url!r} is not valid JSON: {e}. Fix: {fix}") from e
