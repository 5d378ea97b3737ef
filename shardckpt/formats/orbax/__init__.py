"""Orbax checkpoints: the on-disk names and rules (`ondisk`), the reader and the streaming step writer."""

from shardckpt.formats.orbax.ondisk import committed_steps, is_orbax_dir, resolve_step
from shardckpt.formats.orbax.reader import OrbaxReader
from shardckpt.formats.orbax.writer import COMPRESSIONS, DEFAULT_COMPRESSION, OrbaxStepWriter

__all__ = [
    "COMPRESSIONS",
    "DEFAULT_COMPRESSION",
    "OrbaxReader",
    "OrbaxStepWriter",
    "committed_steps",
    "is_orbax_dir",
    "resolve_step",
]
