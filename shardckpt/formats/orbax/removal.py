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

Both are the commit protocol's `withdraw` (`shardckpt.storage.commit`).
A kill at any point leaves either the whole step or a folder that
`ondisk.leftovers` names; `remove_leftovers` removes those at the next start,
one log line each.
"""

from __future__ import annotations

import logging
import shutil

from shardckpt import storage
from shardckpt.formats.orbax import ondisk
from shardckpt.storage import commit

_log = logging.getLogger("shardckpt")


def delete_step(root: str | storage.Location, step: int | str) -> None:
    """Deletes step `step` of the Orbax root `root`: out of the committed set first, then its files.

    The commit protocol's `withdraw` (`storage.commit`): renamed out of the
    integer names locally, commit marker deleted first in a bucket. A step
    that is not there is no error (a retried delete).
    """
    commit.withdraw(storage.parse(root).join(str(step)), marker=ondisk.COMMIT_MARKER)


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
        if name.isdigit():
            # Withdrawn (renamed out, or marker first), so a kill now leaves no folder taken for a step.
            commit.withdraw(location.join(name), marker=ondisk.COMMIT_MARKER)
        else:
            shutil.rmtree(location.join(name).path)  # a temporary name: never taken for a step
        _log.warning("%s: removed %s from %s: %s (never a committed step; nothing restored from it).",
                     who, name, location.url, why)
        removed.append(name)
    return removed
