"""Training-loop checkpoints: the `OrbaxCheckpoint` callback and exact resume."""

from shardckpt.training.callback import OrbaxCheckpoint
from shardckpt.training.iterators import DataIteratorState
from shardckpt.training.resume import ResumeInfo, restore_latest

__all__ = ["DataIteratorState", "OrbaxCheckpoint", "ResumeInfo", "restore_latest"]
