"""Orbax checkpoints on disk: the reader and shardckpt's streaming step writer."""

from shardckpt.formats.orbax.reader import OrbaxReader, committed_steps, is_orbax_dir, resolve_step
from shardckpt.formats.orbax.writer import COMPRESSIONS, OrbaxStepWriter

__all__ = [
    "COMPRESSIONS",
    "OrbaxReader",
    "OrbaxStepWriter",
    "committed_steps",
    "is_orbax_dir",
    "resolve_step",
]
