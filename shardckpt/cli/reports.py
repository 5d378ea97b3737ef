"""The JSON `shardckpt convert --json` prints for its report.

A load through the transfer pipeline records every read and transfer
(`LoadReport.timeline`): on an accelerator, thousands of entries for a large
model. The command prints their counts, bytes and span instead
(`timeline_summary`), and the entries only when asked (`--timeline`). The
Python report objects keep their whole timeline either way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the command imports JAX only once it runs one
    from shardckpt.restore.pipeline import Event


def timeline_summary(events: Sequence[Event]) -> dict[str, Any]:
    """Counts and bytes of the reads and transfers of `events`, and the seconds they span."""
    reads = [e for e in events if e.kind == "read"]
    transfers = [e for e in events if e.kind == "transfer"]
    return {
        "events": len(events),
        "reads": len(reads),
        "read_bytes": sum(e.nbytes for e in reads),
        "transfers": len(transfers),
        "transfer_bytes": sum(e.nbytes for e in transfers),
        "seconds": max(e.end for e in events) - min(e.start for e in events) if events else 0.0,
    }


def convert_json(report: Any, *, timeline: bool = False) -> dict[str, Any]:
    """`report` (a `ConvertReport`, or an `ExportReport` with the `LoadReport` of its model's load) as
    JSON-ready data: the load's `timeline` becomes `timeline_summary`, the entries stay under
    `timeline` only with `timeline=True`."""
    load = getattr(report, "load", None)
    if load is None:
        return dataclasses.asdict(report)
    # Copies without the events, so that they are not all turned into dicts to be dropped.
    data = dataclasses.asdict(dataclasses.replace(report, load=dataclasses.replace(load, timeline=[])))
    del data["load"]["timeline"]
    data["load"]["timeline_summary"] = timeline_summary(load.timeline)
    if timeline:
        data["load"]["timeline"] = [dataclasses.asdict(e) for e in load.timeline]
    return data
