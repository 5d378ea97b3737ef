"""Tensor-parallel layouts: `auto_layout(model, mesh) -> LayoutPlan`, `parallelize(model)`."""

from shardckpt.layout.auto import auto_layout
from shardckpt.layout.parallel import parallelize
from shardckpt.layout.plan import LayoutPlan, Placement

__all__ = ["LayoutPlan", "Placement", "auto_layout", "parallelize"]
