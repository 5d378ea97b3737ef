"""shardckpt: load, save and convert sharded checkpoints of Keras 3 models on JAX."""

import os

# shardckpt is JAX-only; Keras picks its backend at first import, so choose JAX
# unless the user already chose (a different choice fails loudly below).
os.environ.setdefault("KERAS_BACKEND", "jax")

from shardckpt import errors  # noqa: E402
from shardckpt.lazy import lazy_init  # noqa: E402
from shardckpt.restore import LoadReport, load_sharded  # noqa: E402

__version__ = "0.1.0"

__all__ = ["LoadReport", "errors", "lazy_init", "load_sharded", "__version__"]
