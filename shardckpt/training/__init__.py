"""Training-loop checkpoints: the `OrbaxCheckpoint` callback and exact resume."""

from shardckpt.training.callback import OrbaxCheckpoint
from shardckpt.training.resume import ResumeInfo, restore_latest

__all__ = ["OrbaxCheckpoint", "ResumeInfo", "restore_latest"]
