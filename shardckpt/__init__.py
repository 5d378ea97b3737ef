"""shardckpt: load, save and convert sharded checkpoints of Keras 3 models on JAX.

The public API, re-exported here (internals live in one module per concept):

- pretrained models: `from_preset` (keras-hub presets, Hugging Face folders);
- restore: `lazy_init`, `load_sharded` -> `LoadReport`;
- layouts: `auto_layout` -> `LayoutPlan`, `parallelize`;
- training: `OrbaxCheckpoint`, `restore_latest` -> `ResumeInfo`;
- files: `convert` -> `ConvertReport` (to Orbax; `to="hf" | "keras-hub" |
  "safetensors"` -> `ExportReport`), `inspect` -> `CheckpointInfo`,
  `verify` -> `VerifyReport`;
- the way out: `export` -> `ExportReport` (Hugging Face folders, keras-hub
  presets, safetensors; each process writes its own pieces);
- `errors`: every typed error shardckpt raises;
- below the top level, one public name: `shardckpt.storage.deadline` (the
  timeouts and retries of bucket requests, for a block of code).
"""

import os

# shardckpt is JAX-only; Keras picks its backend at first import, so choose JAX
# unless the user already chose (a different choice fails loudly below, with
# `errors.BackendError`).
os.environ.setdefault("KERAS_BACKEND", "jax")

from shardckpt import errors  # noqa: E402


def _require_jax_backend() -> None:
    """Raises `BackendError` unless Keras runs on JAX (checked once, at import)."""
    import keras

    backend = keras.backend.backend()
    if backend != "jax":
        raise errors.BackendError(
            f"shardckpt needs Keras on the JAX backend, but Keras runs on {backend!r} "
            f"(KERAS_BACKEND={os.environ.get('KERAS_BACKEND')!r}). Its sharded arrays, layouts "
            "and checkpoints are JAX arrays. Fix: set KERAS_BACKEND=jax before anything imports "
            "keras (or keras_hub), e.g. `KERAS_BACKEND=jax python train.py`, or put "
            '`"backend": "jax"` in ~/.keras/keras.json. Received: backend=' + repr(backend)
        )


_require_jax_backend()

from shardckpt._version import __version__  # noqa: E402
from shardckpt.conversion import (  # noqa: E402
    CheckpointInfo,
    ConvertReport,
    VerifyReport,
    inspect,
    verify,
)
from shardckpt.exporting import ExportReport, export  # noqa: E402
from shardckpt.layout import LayoutPlan, auto_layout, parallelize  # noqa: E402
from shardckpt.pipeline import convert  # noqa: E402
from shardckpt.presets import from_preset  # noqa: E402
from shardckpt.restore import LoadReport, lazy_init, load_sharded  # noqa: E402
from shardckpt.training import OrbaxCheckpoint, ResumeInfo, restore_latest  # noqa: E402

__all__ = [
    "CheckpointInfo",
    "ConvertReport",
    "ExportReport",
    "LayoutPlan",
    "LoadReport",
    "OrbaxCheckpoint",
    "ResumeInfo",
    "VerifyReport",
    "__version__",
    "auto_layout",
    "convert",
    "errors",
    "export",
    "from_preset",
    "inspect",
    "lazy_init",
    "load_sharded",
    "parallelize",
    "restore_latest",
    "verify",
]
