"""A byte-counting rich progress bar on stderr that can be switched off, and the
tally and wording of what a read reported (bytes, rates, lists of keys)."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable, Sequence
from types import TracebackType

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)


@dataclasses.dataclass(kw_only=True)
class ReadTally:
    """What every report of a checkpoint read counts (`LoadReport`, `VerifyReport` extend it).

    Attributes:
        path: The checkpoint read (for Orbax: the step folder).
        format: The format's name in `shardckpt.formats.FORMATS` ("h5", "orbax", ...).
        arrays: Arrays read.
        bytes_read: Bytes of array data read by this process.
    """

    path: str
    format: str
    arrays: int = 0
    bytes_read: int = 0


class ByteProgress:
    """Context manager: `advance(n)` adds `n` bytes; thread-safe; no-op when disabled."""

    def __init__(self, total: int, description: str, *, enabled: bool) -> None:
        self._enabled = enabled
        self._lock = threading.Lock()
        self._progress = (
            Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                DownloadColumn(),
                TransferSpeedColumn(),
                TimeRemainingColumn(),
                # stderr, the stream whose terminal decides whether to show it
                # (rich's default console is stdout, which may be piped output).
                console=Console(stderr=True),
                transient=True,
            )
            if enabled
            else None
        )
        self._task = self._progress.add_task(description, total=total) if self._progress is not None else None

    def __enter__(self) -> ByteProgress:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._progress is not None:
            self._progress.stop()

    def advance(self, n: int) -> None:
        if self._progress is not None and self._task is not None:
            with self._lock:
                self._progress.advance(self._task, n)


_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def format_bytes(nbytes: float) -> str:
    """`nbytes` in the largest binary unit that keeps the number >= 1: "512 B", "1.50 MiB".

    Three significant digits, so a small load does not read "0.0 MiB".
    """
    value, unit = float(nbytes), 0
    while abs(value) >= 1024 and unit < len(_UNITS) - 1:
        value, unit = value / 1024, unit + 1
    if unit == 0:
        return f"{int(value)} B"
    digits = 2 if abs(value) < 10 else 1 if abs(value) < 100 else 0
    return f"{value:.{digits}f} {_UNITS[unit]}"


def format_rate(nbytes: float, seconds: float) -> str:
    """A transfer rate with a unit that fits it ("3.41 MiB/s", "1.20 GiB/s");
    "-" when no time was measured."""
    if seconds <= 0:
        return "- B/s"
    return f"{format_bytes(nbytes / seconds)}/s"


def read_line(verb: str, arrays: int, nbytes: int, source: str, seconds: float) -> str:
    """The first line of a read's report: "Loaded 12 arrays (3.20 MiB) from h5 'm.h5' in 0.50 s (6.40 MiB/s)"."""
    return f"{verb} {arrays} arrays ({format_bytes(nbytes)}) from {source} in {seconds:.2f} s ({format_rate(nbytes, seconds)})"


def some(items: Sequence[str], shown: int = 8) -> str:
    """The first `shown` items, then the count: "a, b, ... (12 total)".

    Reports and messages stay readable when a whole optimizer state is named.
    """
    more = f", ... ({len(items)} total)" if len(items) > shown else ""
    return f"{', '.join(items[:shown])}{more}"


def key_lines(groups: Iterable[tuple[str, Sequence[str]]], shown: int = 8) -> list[str]:
    """One indented line per non-empty group of keys: "  label: a, b, ... (12 total)" (`some`)."""
    return [f"  {label}: {some(items, shown)}" for label, items in groups if items]
