"""Removing steps and leftovers so that a step is there whole or not at all.

Orbax commits a step atomically (a rename, or in a bucket the commit marker
written last) but deletes it in place: `shutil.rmtree` in directory order,
so a kill in between leaves an integer-named folder missing some of its
files. Here a step leaves the set of committed steps in one atomic operation
before any of its files is removed:

- locally, it is renamed to `<step>.shardckpt-deleting-<id>` (a name no
  listing takes for a step: not an integer), the rename is made durable, then
  the renamed folder is removed;
- in a bucket, its commit marker is deleted first (listing by marker is what
  commits there), then its other objects.

A kill at any point leaves either the whole step or a folder that
`ondisk.leftovers` names; `remove_leftovers` removes those at the next start,
one log line each.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid

from shardckpt import storage
from shardckpt.formats.orbax import ondisk

_log = logging.getLogger("shardckpt")


def delete_step(root: str | storage.Location, step: int | str) -> None:
    """Deletes step `step` of the Orbax root `root`: out of the committed set first, then its files.

    A step that is not there is no error (a retried delete).
    """
    location = storage.parse(root)
    name = str(step)
    if location.is_remote:
        step_loc = location.join(name)
        storage.delete_object(step_loc.join(ondisk.COMMIT_MARKER))
        storage.delete_tree(step_loc)
        return
    path = os.path.join(location.path, name)
    if not os.path.lexists(path):
        return
    doomed = _rename_out(location.path, name)
    shutil.rmtree(doomed)


def _rename_out(root: str, name: str) -> str:
    """Renames `root/name` to a name no listing takes for a step; returns the new path."""
    doomed = os.path.join(root, f"{name}{ondisk.DELETING_MARK}-{uuid.uuid4().hex[:12]}")
    os.rename(os.path.join(root, name), doomed)
    _sync_dir(root)  # the rename reaches the disk before any file of the step is removed
    return doomed


def _sync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_leftovers(root: str | storage.Location, *, who: str = "OrbaxCheckpoint") -> list[str]:
    """Removes what interrupted saves and deletes left under an Orbax root; one log line each.

    Half-written steps (`*.orbax-checkpoint-tmp*`, or in a bucket steps
    without their commit marker), steps whose delete was interrupted
    (`*.shardckpt-deleting-*`) and integer-named folders that are not whole
    steps (an in-place delete interrupted: `ondisk.missing_part`). None of
    them is a committed step, so removing them changes no result. Call it
    from one process, before any step of the run is written.

    Args:
        root: The checkpoint root (local or a bucket URL).
        who: Names the caller in the log lines.

    Returns:
        The names removed.
    """
    location = storage.parse(root)
    if not storage.isdir(location):
        return []
    removed = []
    for name, why in ondisk.leftovers(location):
        if location.is_remote:
            storage.delete_tree(location.join(name))
        else:
            path = os.path.join(location.path, name)
            # An integer name is renamed out first, so a kill now leaves no folder taken for a step.
            shutil.rmtree(_rename_out(location.path, name) if name.isdigit() else path)
        _log.warning("%s: removed %s from %s: %s (never a committed step; nothing restored from it).",
                     who, name, location.url, why)
        removed.append(name)
    return removed


def remove_convert_leftovers(dst: str, *, keep: str | None = None) -> list[str]:
    """Removes hidden temporaries that killed `convert` runs left beside a local destination.

    They are named `.<basename of dst>.shardckpt-tmp-<pid>-*` (`<pid>`: the
    process that wrote it); those of a process still alive on this machine
    are kept (a convert to the same destination running now), as is `keep`
    (the caller's own).

    Returns:
        The names removed (one log line each).
    """
    parent = os.path.dirname(os.path.abspath(dst)) or "."
    prefix = f".{os.path.basename(os.path.normpath(dst))}{ondisk.CONVERT_TMP_MARK}"
    removed = []
    for name in sorted(os.listdir(parent)):
        if not name.startswith(prefix) or name == keep or _alive(name[len(prefix):].split("-", 1)[0]):
            continue
        try:
            shutil.rmtree(os.path.join(parent, name))
        except FileNotFoundError:
            continue  # another run removed it meanwhile
        _log.warning("convert: removed %s from %s: the temporary folder of a convert that was interrupted.",
                     name, parent)
        removed.append(name)
    return removed


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
