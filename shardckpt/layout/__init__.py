"""Tensor-parallel layouts: `auto_layout(model, mesh) -> LayoutPlan`."""

from shardckpt.layout.auto import auto_layout
from shardckpt.layout.plan import LayoutPlan, Placement

__all__ = ["LayoutPlan", "Placement", "auto_layout"]
