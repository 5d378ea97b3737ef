"""One commit protocol: a folder appears at its destination whole, or not at all.

Every writer of a folder (`convert`, `export`, `OrbaxCheckpoint`'s bucket
writer) writes into a `Stage` from `begin` and then commits it:

- where the backend renames (a file system): the files go into a temporary
  folder beside the destination; `Stage.commit` syncs them, renames the
  folder to `dst` (an existing `dst` being replaced is first renamed aside
  to `<dst>.shardckpt-old`, removed after) and syncs the parent folder, so a
  kill at any instant leaves the old `dst`, the new one, or none;
- in a bucket (no rename): the objects are written under `dst` itself and
  the stage's marker object is written LAST; a reader takes the folder as
  committed only once its marker exists. Replacing or deleting a folder
  deletes its marker FIRST, then its other objects (`withdraw`).

`withdraw` takes a committed folder out as atomically as `commit` put it
there: renamed out of its name before any of its files is removed, or its
marker deleted first. What a killed writer left beside a local destination
(a temporary folder, a folder renamed aside or being withdrawn) is removed
by the next `begin` for that destination, one WARNING line each.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import shutil
import uuid

from shardckpt import storage  # through the module: a test's fault hook replaces its functions
from shardckpt.errors import DestinationExistsError
from shardckpt.storage.location import Location

_log = logging.getLogger("shardckpt")

PRIVATE_MARK = ".shardckpt-tmp-"
"""In the name of one process's temporary folder: `.<dst name>.shardckpt-tmp-<pid>-<id>`
(the pid tells a killed writer's folder from a live one's)."""
SHARED_SUFFIX = ".shardckpt-partial"
"""`<dst>.shardckpt-partial`: the temporary folder several processes write into (one name they all know)."""
OLD_SUFFIX = ".shardckpt-old"
"""`<dst>.shardckpt-old`: an existing `dst` while a commit replaces it."""
WITHDRAW_MARK = ".shardckpt-deleting"
"""`<dst>.shardckpt-deleting-<id>`: a folder renamed out of its name before its files are removed."""


@dataclasses.dataclass
class Stage:
    """A folder being written: where its files go until `commit` puts it at `dst`.

    Attributes:
        dst: The destination.
        location: Where the files are written now: a temporary folder beside
            `dst`, or (in a bucket) `dst` itself.
        marker: In a bucket, the object written last at commit (the folder
            is committed exactly when it exists); locally, the same file is
            written into the folder before the rename. None: no marker
            (local destinations only).
        overwrite: Whether an existing `dst` is replaced.
        fix: How to get past an existing `dst`, for the error message.
    """

    dst: Location
    location: Location
    marker: str | None
    overwrite: bool
    fix: str

    def commit(self, marker: bytes = b"") -> None:
        """Puts the folder at `dst`: marker last in a bucket; locally sync, then rename.

        Args:
            marker: The marker's contents.

        Raises:
            DestinationExistsError: locally, `dst` appeared while it was
                written and `overwrite` is False.
        """
        if self.marker is not None:
            storage.write_bytes(self.location.join(self.marker), marker)
        if not renames(self.dst):
            return  # the marker, written last, was the commit
        _sync_tree(self.location.path)
        old = None
        if os.path.lexists(self.dst.path):
            if not self.overwrite:
                raise _exists(self.dst, self.fix, " while it was being written")
            old = self.dst.path + OLD_SUFFIX
            shutil.rmtree(old, ignore_errors=True)
            os.rename(self.dst.path, old)
        os.rename(self.location.path, self.dst.path)
        sync_dir(os.path.dirname(self.dst.path))
        if old is not None:
            shutil.rmtree(old)

    def discard(self) -> None:
        """Removes what a failed write left (never a committed folder: its marker, or rename, is missing).

        In a bucket it is a best effort: the caller is raising the write's own
        error, and what a failed delete leaves has no marker either.
        """
        if renames(self.dst):
            shutil.rmtree(self.location.path, ignore_errors=True)
            return
        try:
            storage.delete_tree(self.dst)
        except (OSError, ValueError) as e:
            _log.warning("could not remove the uncommitted objects under %s (%s): no reader takes them for a "
                         "folder (no %s); the next overwrite removes them.", self.dst.url, e, self.marker)


def renames(location: Location) -> bool:
    """Whether a folder at `location` is committed by renaming it (else: by a marker written last)."""
    return storage.backend(location).renames


def begin(dst: str | Location, *, overwrite: bool, marker: str | None = None, shared: bool = False,
          who: str, fix: str = "pass overwrite=True", temporary: str | None = None) -> Stage:
    """Starts writing a folder that `Stage.commit` will put at `dst`.

    Locally, first removes what killed writers left beside `dst` (one
    WARNING line each), then creates the temporary folder. In a bucket an
    existing `dst` is withdrawn (marker first) when `overwrite` is set.

    Args:
        dst: The destination folder (local path or bucket URL).
        overwrite: Replace an existing `dst` (locally only at commit).
        marker: The marker object's name (required in a bucket).
        shared: Several processes write the stage: its local name is
            `<dst>.shardckpt-partial`, which they all know (`shared_location`);
            else a name private to this process.
        who: The writer, for log lines ("convert", "export").
        fix: What to pass to replace `dst`, for the error message.
        temporary: Locally, the temporary folder's name beside `dst` (not
            `shared`), for writers whose readers already know their
            leftovers by name (Orbax's `<step>.orbax-checkpoint-tmp-*`);
            None: a name private to this process.

    Raises:
        DestinationExistsError: `dst` exists and `overwrite` is False.
        NotADirectoryError: locally, the parent of `dst` is a file.
    """
    dst = storage.parse(dst, what="dst")
    present = storage.exists(dst)
    if present and not overwrite:
        raise _exists(dst, fix)
    if not renames(dst):
        if marker is None:
            raise ValueError(f"A folder in a bucket is committed by a marker object; none given for {dst.url!r}.")
        if present:
            withdraw(dst, marker=marker)
        return Stage(dst, dst, marker, overwrite, fix)
    parent = os.path.dirname(dst.path)
    if os.path.lexists(parent) and not os.path.isdir(parent):  # (makedirs would say "File exists")
        raise NotADirectoryError(errno.ENOTDIR, f"{os.strerror(errno.ENOTDIR)} (the parent of {dst.url!r})", parent)
    os.makedirs(parent, exist_ok=True)
    remove_leftovers(dst.path, who=who)
    if shared:
        path = shared_location(dst).path
    elif temporary is not None:
        path = os.path.join(os.path.dirname(dst.path), temporary)
    else:
        path = os.path.join(os.path.dirname(dst.path), f".{os.path.basename(dst.path)}{PRIVATE_MARK}"
                            f"{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.makedirs(path)
    return Stage(dst, storage.parse(path), marker, overwrite, fix)


def shared_location(dst: str | Location) -> Location:
    """Where the processes of a `shared` stage write (`begin` in process 0 creates it)."""
    dst = storage.parse(dst, what="dst")
    return storage.parse(dst.path + SHARED_SUFFIX) if renames(dst) else dst


def withdraw(dst: str | Location, *, marker: str | None = None) -> None:
    """Deletes a folder so that it is whole or gone: renamed out (or its marker deleted) first.

    A folder that is not there is no error (a retried delete).
    """
    dst = storage.parse(dst)
    if not renames(dst):
        if marker is not None:
            storage.delete_object(dst.join(marker))
        storage.delete_tree(dst)
        return
    if os.path.lexists(dst.path):
        shutil.rmtree(rename_out(dst.path))


def rename_out(path: str) -> str:
    """Renames `path` to `<path>.shardckpt-deleting-<id>` durably; returns the new path."""
    doomed = f"{path}{WITHDRAW_MARK}-{uuid.uuid4().hex[:12]}"
    os.rename(path, doomed)
    sync_dir(os.path.dirname(path))  # the rename reaches the disk before any file is removed
    return doomed


def sync_dir(path: str) -> None:
    """Makes the entries of folder `path` (renames, new names) durable."""
    _fsync(path or ".")


def _fsync(path: str) -> None:
    """fsync of a file or a folder by its path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sync_tree(path: str) -> None:
    """Makes every file and folder under `path` durable (files already synced cost one call each)."""
    for root, _folders, files in os.walk(path):
        for name in files:
            _fsync(os.path.join(root, name))
        sync_dir(root)


def remove_leftovers(dst: str, *, who: str) -> list[str]:
    """Removes what killed writers left beside the local destination `dst`; one WARNING line each.

    Temporary folders of processes no longer alive on this machine (a live
    one is a writer of the same destination running now), the shared
    temporary folder, a folder renamed aside by an interrupted replacement
    and a folder whose withdrawal was interrupted. None of them is ever
    taken for `dst`.

    Returns:
        The paths removed.
    """
    parent, base = os.path.split(os.path.abspath(dst).rstrip("/"))
    private = f".{base}{PRIVATE_MARK}"
    removed = []
    for name in sorted(os.listdir(parent)):
        if name.startswith(private):
            if _alive(name[len(private):].split("-", 1)[0]):
                continue
            why = f"the temporary folder of a {who} that was interrupted"
        elif name == base + SHARED_SUFFIX:
            why = f"the folder of a {who} that was interrupted before its commit"
        elif name == base + OLD_SUFFIX:
            why = "the folder an interrupted overwrite had replaced already"
        elif name.startswith(f"{base}{WITHDRAW_MARK}-"):
            why = "a folder whose delete was interrupted"
        else:
            continue
        path = os.path.join(parent, name)
        try:
            shutil.rmtree(path)
        except FileNotFoundError:
            continue  # another run removed it meanwhile
        _log.warning("%s: removed %s: %s.", who, path, why)
        removed.append(path)
    return removed


def refuse_existing(dst: Location, *, fix: str) -> None:
    """Refuses an existing `dst` before any work, in `begin`'s words (which checks again when it starts).

    For writers that load or read for a long time before `begin` (`convert`).

    Raises:
        DestinationExistsError: `dst` exists; `fix` says what to pass to replace it.
    """
    if storage.exists(dst):
        raise _exists(dst, fix)


def _exists(dst: Location, fix: str, when: str = "") -> DestinationExistsError:
    return DestinationExistsError(
        f"{dst.url!r} already exists{when}. Fix: choose another destination, remove it, or {fix} to replace "
        f"it once the new one is complete. Received: dst={dst.url!r}"
    )


def _alive(pid: str) -> bool:
    if not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
