"""A `rich` table that also prints as plain text with `print()`.

`print(table)` on a plain `rich.table.Table` shows its repr; this subclass
renders itself in `__str__`, so `print(plan.explain())` and
`rich.print(plan.explain())` both show the table.
"""

from __future__ import annotations

import io
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

# Wide enough that no cell folds in logs and captured output (paths of deep
# models run past 100 characters); rich does not pad a table to the width.
_UNFOLDED = 1000


class ExplainTable(Table):
    """A `rich.table.Table` whose `str()` is its rendering as text."""

    def __str__(self) -> str:
        width = None if sys.stdout.isatty() else _UNFOLDED
        buffer = io.StringIO()
        Console(width=width, file=buffer, color_system=None, highlight=False).print(self)
        return buffer.getvalue().rstrip("\n")


def explain_table(plan: Any) -> ExplainTable:
    """`LayoutPlan.explain()`: path, shape, dtype, axes, bytes per device, why; notes and problems as the caption."""
    table = ExplainTable(
        title=(
            f"Layout plan: mesh {dict(zip(plan.mesh.axis_names, plan.mesh.shape))}, "
            f"model axis {plan.model_axis!r}, batch axis {plan.batch_axis!r}; "
            f"{plan.sharded_fraction():.1%} of parameter bytes split, balance "
            f"{plan.balance():.2f}" + (", FSDP" if plan.fsdp else "")
        ),
        caption="\n".join([*plan.notes, *(f"problem: {line}" for line in plan.problems)]) or None,
    )
    for column in ("path", "shape", "dtype", "axes", "bytes/device", "why"):
        table.add_column(column, overflow="fold", justify="right" if column == "bytes/device" else "left")
    for p in plan.placements:
        why = p.reason if p.source == "auto" else f"[{p.source}] {p.reason}"
        table.add_row(p.path, str(p.shape), p.dtype, str(p.axes), f"{p.nbytes // plan.split_factor(p.axes):,}", why)
    return table
