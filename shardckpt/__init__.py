"""shardckpt: load, save and convert sharded checkpoints of Keras 3 models on JAX.

The public API, re-exported here (internals live in one module per concept):

- restore: `lazy_init`, `load_sharded` -> `LoadReport`;
- layouts: `auto_layout` -> `LayoutPlan`, `parallelize`;
- training: `OrbaxCheckpoint`, `restore_latest` -> `ResumeInfo`;
- files: `convert` -> `ConvertReport`, `inspect` -> `CheckpointInfo`,
  `verify` -> `VerifyReport`;
- `errors`: every typed error shardckpt raises.
"""

import os

# shardckpt is JAX-only; Keras picks its backend at first import, so choose JAX
# unless the user already chose (a different choice fails loudly below).
os.environ.setdefault("KERAS_BACKEND", "jax")

from shardckpt import errors  # noqa: E402
from shardckpt._version import __version__  # noqa: E402
from shardckpt.convert import (  # noqa: E402
    CheckpointInfo,
    ConvertReport,
    VerifyReport,
    convert,
    inspect,
    verify,
)
from shardckpt.layout import LayoutPlan, auto_layout, parallelize  # noqa: E402
from shardckpt.restore import LoadReport, lazy_init, load_sharded  # noqa: E402
from shardckpt.training import OrbaxCheckpoint, ResumeInfo, restore_latest  # noqa: E402

__all__ = [
    "CheckpointInfo",
    "ConvertReport",
    "LayoutPlan",
    "LoadReport",
    "OrbaxCheckpoint",
    "ResumeInfo",
    "VerifyReport",
    "__version__",
    "auto_layout",
    "convert",
    "errors",
    "inspect",
    "lazy_init",
    "load_sharded",
    "parallelize",
    "restore_latest",
    "verify",
]
