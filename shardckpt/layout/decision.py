"""`Decision`: how the planner splits one variable over the model axis, and why."""

from __future__ import annotations

import dataclasses
from typing import Final


@dataclasses.dataclass(frozen=True)
class Decision:
    """How one variable is split over the model axis.

    Attributes:
        dim: The split dimension, or None (replicated).
        reason: Why, in words, for `LayoutPlan.explain()`.
        fallback: The preferred split did not divide (or could not be
            kept): replicated, or split on the next dimension that works.
        gather_output: An embedding table split along its rows' width: the
            output of its lookup is to be gathered right away (the plan's
            layout map relays the owning layer's output), so the split does
            not spread through the model.
    """

    dim: int | None
    reason: str
    fallback: bool = False
    gather_output: bool = False
    use: str = "contract"


# The reason of a variable that reaches the split value only as the indices
# of a lookup into another variable (int4's group indices `g_idx`).
INDICES_ONLY: Final = "used as lookup indices of another variable (e.g. int4 group indices): replicated"
