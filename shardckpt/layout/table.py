"""A `rich` table that also prints as plain text with `print()`.

`print(table)` on a plain `rich.table.Table` shows its repr; this subclass
renders itself in `__str__`, so `print(plan.explain())` and
`rich.print(plan.explain())` both show the table.
"""

from __future__ import annotations

import io
import sys

from rich.console import Console
from rich.table import Table

# Wide enough that no cell folds in logs and captured output (paths of deep
# models run past 100 characters); rich does not pad a table to the width.
_UNFOLDED = 1000


class ExplainTable(Table):
    """A `rich.table.Table` whose `str()` is its rendering as text."""

    def __str__(self) -> str:
        width = None if sys.stdout.isatty() else _UNFOLDED
        console = Console(width=width, file=io.StringIO(), color_system=None, highlight=False)
        console.print(self)
        return console.file.getvalue().rstrip("\n")
