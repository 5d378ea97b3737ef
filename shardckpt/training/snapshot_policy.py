"""`OrbaxCheckpoint`'s snapshot options and the copy each of its saves takes.

The copying itself is `snapshot`'s; this keeps the callback's choice (mode,
budget), the copy program compiled ahead of the first save, and the mode
each save used.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Any

from shardckpt.training import snapshot as snapshot_lib


@dataclasses.dataclass(kw_only=True, eq=False)
class SnapshotPolicy:
    """The copy a background save writes from.

    Attributes:
        mode: "device", "host" or "auto" (`snapshot`'s MODES; checked by `options`).
        budget_bytes: Host mode's piece size and "auto"'s margin.
        mode_used: The mode of the latest save, or None before the first.
        modes: The mode of every save, in order, over every `fit`.
    """

    mode: str = "auto"
    budget_bytes: int = snapshot_lib.DEFAULT_BUDGET_BYTES
    mode_used: str | None = dataclasses.field(default=None, init=False)
    modes: list[str] = dataclasses.field(default_factory=list, init=False)
    # `snapshot.prepare`'s future, until the first save.
    _compiled: concurrent.futures.Future | None = dataclasses.field(default=None, init=False, repr=False)

    def prepare(self, model: Any, *, weights_only: bool) -> None:
        """Compiles the copy of the arrays the saves will copy, on a thread (see `snapshot.prepare`)."""
        self._compiled = snapshot_lib.prepare(model, weights_only=weights_only, mode=self.mode,
                                              budget_bytes=self.budget_bytes)

    def take(self, model: Any, *, weights_only: bool) -> tuple[dict[str, Any], snapshot_lib.Choice]:
        """The state's copy and its `Choice` (see `snapshot.snapshot_state`).

        Raises:
            Exception: what compiling the copy raised, as the copy itself would.
        """
        if self._compiled is not None:
            self._compiled.result()
            self._compiled = None
        tree, choice = snapshot_lib.snapshot_state(
            model, weights_only=weights_only, mode=self.mode, budget_bytes=self.budget_bytes)
        self.mode_used = choice.mode
        self.modes.append(choice.mode)
        return tree, choice
