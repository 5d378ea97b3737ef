"""shardckpt: load, save and convert sharded checkpoints of Keras 3 models on JAX."""

from shardckpt import errors
from shardckpt.lazy import lazy_init

__version__ = "0.1.0"

__all__ = ["errors", "lazy_init", "__version__"]
