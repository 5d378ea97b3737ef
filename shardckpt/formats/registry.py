"""The table of formats: detection by declared rules, readers and writers by name.

Filled from `catalog` (every format shardckpt has) when this module is
imported, and by `register` for a format added from outside (README,
"Adding a format"). Detection, opening, `inspect`, `export`, the CLI and
every error message that lists what shardckpt reads use this one table, for
local paths and buckets alike.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from shardckpt import storage
from shardckpt.errors import CheckpointNotFoundError, UnknownFormatError
from shardckpt.formats.catalog import CATALOG
from shardckpt.formats.declaration import Format, Probe

FORMATS: dict[str, Format] = {}
"""Every format by name (the order carries no meaning: `Format.priority` decides)."""


def register(fmt: Format) -> None:
    """Adds `fmt` to the table: detection, `open_reader`, `load_sharded`, `inspect`,
    `export` and error messages take it from then on.

    Raises:
        ValueError: a format of that name exists, or one with rules has the same
            `priority` (detection would depend on order).
    """
    if fmt.name in FORMATS:
        raise ValueError(
            f"A format named {fmt.name!r} is registered already. Fix: pick another name, or "
            f"unregister({fmt.name!r}) first. Received: {fmt!r}"
        )
    if fmt.detectable:
        for other in FORMATS.values():
            if other.detectable and other.priority == fmt.priority:
                raise ValueError(
                    f"Format {fmt.name!r} has priority {fmt.priority}, as {other.name!r} has: which one a path "
                    f"matching both is would depend on order. Fix: give it another priority (taken: "
                    f"{sorted(f.priority for f in FORMATS.values() if f.detectable)})."
                )
    FORMATS[fmt.name] = fmt


def unregister(name: str) -> Format:
    """Removes format `name` from the table; returns it.

    Raises:
        KeyError: no format of that name.
    """
    return FORMATS.pop(name)


def _by_priority() -> list[Format]:
    return sorted((f for f in FORMATS.values() if f.detectable), key=lambda f: -f.priority)


def detect(path: str | storage.Location) -> Format:
    """The format of `path`, local or in a bucket, by the formats' declared rules.

    A name ending in a format's suffix is that format (once its `confirm`
    agrees); else a folder is the highest-priority folder format whose marker
    files it holds and whose `confirm` agrees; else a file is told by its
    first bytes.

    Raises:
        CheckpointNotFoundError: nothing at `path`.
        UnknownFormatError: something at `path` that no format's rules identify.
        CorruptCheckpointError: a file a rule reads (a folder's config.json) is damaged.
        UnsupportedURLError: `path` is a URL of a scheme shardckpt does not read.
    """
    location = storage.parse(path)
    local = location.local_path
    if local is not None and not os.path.exists(local):
        raise CheckpointNotFoundError(f"No checkpoint at {local!r}. Fix: check the path. Supported: {supported()}.")
    probe = Probe(location)
    ordered = _by_priority()
    for fmt in ordered:
        if fmt.suffixes and location.endswith(fmt.suffixes) and (fmt.confirm is None or fmt.confirm(probe)):
            return fmt
    for fmt in ordered:
        if not fmt.folder:
            continue
        # A folder format with marker files needs the listing; one without (Orbax) is its
        # `confirm` alone, which lists what it needs itself (one request in a bucket).
        if (fmt.markers or fmt.one_of) and not (probe.is_folder and fmt.listing_matches(probe.names)):
            continue
        if fmt.confirm is None or fmt.confirm(probe):
            return fmt
    if probe.is_folder:
        raise _unknown(location, _near_misses(probe, ordered))
    if local is None and not storage.exists(location):
        raise storage.not_found(location, what=f"a checkpoint. Supported: {supported()}")
    for fmt in ordered:
        if fmt.magic and probe.head.startswith(fmt.magic) and (fmt.confirm is None or fmt.confirm(probe)):
            return fmt
    raise _unknown(location, [])


def _near_misses(probe: Probe, ordered: list[Format]) -> list[str]:
    """What a folder lacks of each format whose marker files it holds (some of them)."""
    out = []
    for fmt in ordered:
        if not fmt.folder or not fmt.markers or not set(fmt.markers) <= probe.names:
            continue
        if fmt.one_of and not probe.names & set(fmt.one_of):
            out.append(f"as {fmt.description} it lacks {' or '.join(fmt.one_of)}")
        elif fmt.confirms:
            out.append(f"as {fmt.description} it lacks {fmt.confirms}")
    return out


def _unknown(location: storage.Location, misses: list[str]) -> UnknownFormatError:
    found = f" ({'; '.join(misses)})" if misses else ""
    formats = "; ".join(f"{f.description}: {f.rule()}" for f in _by_priority() if f.reader is not None)
    return UnknownFormatError(
        f"{location.url!r} is not a checkpoint shardckpt reads{found}. Supported: {formats}. "
        "Fix: pass a checkpoint of one of these formats (a folder with what its rule names, or a file "
        "with its suffix)."
    )


def writer_for(name: str) -> Callable[..., Any]:
    """The writer of format `name` (or of the format `name` is an alias of).

    Raises:
        ValueError: no such format, or one shardckpt only reads.
    """
    for fmt in FORMATS.values():
        if name == fmt.name or name in fmt.aliases:
            if fmt.writer is not None:
                return fmt.writer
    raise ValueError(f"format must be one of {', '.join(writable())}. Received: format={name!r}")


def writable() -> list[str]:
    """The names `writer_for` takes: a format's own, or its first alias where it has one."""
    return [(fmt.aliases or (fmt.name,))[0] for fmt in FORMATS.values() if fmt.writer is not None]


def supported() -> str:
    """Every format shardckpt reads, as a sentence for error messages."""
    return "; ".join(fmt.description for fmt in _by_priority() if fmt.reader is not None)


for _fmt in CATALOG:
    register(_fmt)
