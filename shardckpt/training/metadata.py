"""The JSON metadata item saved beside the arrays of every step, and its assembly.

A step's metadata is assembled in two parts: `step_metadata` on the training
thread (counters move on while the save runs), `complete` on the save thread
(turning logs into numbers waits for the step that produced them).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import keras
import numpy as np

from shardckpt._version import __version__
from shardckpt.formats.orbax.ondisk import METADATA_ITEM
from shardckpt.training import hostrng, retention
from shardckpt.training.counting import BatchCount

FORMAT = "shardckpt.training/1"


def json_number(value: Any) -> Any:
    """Converts a log value (jax/numpy scalar) to a JSON number; NaN/inf to str."""
    try:
        number = float(np.asarray(value))
    except (TypeError, ValueError):
        return str(value)
    return number if math.isfinite(number) else str(number)


def jsonable(value: Any) -> Any:
    """Returns `value` with numpy/jax arrays and scalars turned into JSON values."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return json_number(value)
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        array = np.asarray(value)
        return json_number(array) if array.ndim == 0 else jsonable(array.tolist())
    if isinstance(value, np.generic):
        return json_number(value)
    return value  # anything else: Orbax's JSON handler reports it


def json_logs(logs: dict[str, Any] | None) -> dict[str, Any]:
    return {str(k): json_number(v) for k, v in (logs or {}).items()}


def versions() -> dict[str, str]:
    import orbax.checkpoint

    return {
        "keras": keras.__version__,
        "jax": jax.__version__,
        "orbax_checkpoint": orbax.checkpoint.__version__,
        "shardckpt": __version__,
    }


def layout_of(model: Any) -> dict[str, Any]:
    """Mesh shape/axes of the active distribution and each variable's spec.

    The plan is what the arrays were saved from; `load_sharded` can put them
    on any other mesh, so this is a record, not a requirement.
    """
    distribution = keras.distribution.distribution()
    mesh = getattr(distribution, "device_mesh", None)
    specs: dict[str, Any] = {}
    for variable in model.weights:
        sharding = getattr(variable.value, "sharding", None)
        spec = getattr(sharding, "spec", None)
        specs[variable.path] = None if spec is None else [
            list(axis) if isinstance(axis, tuple) else axis for axis in spec
        ]
    return {
        "distribution": type(distribution).__name__ if distribution is not None else None,
        "mesh_shape": list(mesh.shape) if mesh is not None else None,
        "mesh_axes": list(mesh.axis_names) if mesh is not None else None,
        "process_count": jax.process_count(),
        "device_count": jax.device_count(),
        "variables": specs,
    }


def step_metadata(count: BatchCount, step: int, *, epoch_complete: bool, save_freq: str | int, monitor: str,
                  weights_only: bool, layout: dict[str, Any], snapshot: str | None,
                  preemption: bool = False) -> dict[str, Any]:
    """The metadata item without logs, user metadata and best value (see `complete`).

    `preemption`: saved on a preemption notice alone (`retention.PREEMPTION_METRIC`).
    """
    return {
        "format": FORMAT,
        "step": int(step),
        "epoch": int(count.epoch),
        "epoch_complete": epoch_complete,
        "preemption": preemption,
        "batch": int(count.steps_per_epoch if epoch_complete and count.steps_per_epoch else count.in_epoch),
        "steps_per_epoch": count.steps_per_epoch,
        "total_batches": int(count.total),
        "batches_since_save": int(count.since_save),  # of the integer save_freq's count
        "save_freq": save_freq,
        "monitor": monitor,
        "save_weights_only": weights_only,
        "versions": versions(),
        "layout": layout,
        "snapshot": snapshot,
        # fit's shuffling of arrays and PyDatasets draws from these (see hostrng).
        "host_rng": hostrng.capture(),
    }


def complete(payload: dict[str, Any], meta: dict[str, Any], logs: dict[str, Any], user: Any, best: Any) -> dict:
    """Adds logs, user metadata and best value to the metadata item of `payload`.

    Returns:
        The numeric logs, which Orbax stores as the step's metrics (BestN ranks
        steps by them), whether the step holds a whole epoch
        (`retention.EPOCH_COMPLETE_METRIC`) and, on a preemption step alone,
        `retention.PREEMPTION_METRIC`.
    """
    logs_json = json_logs(logs)
    meta = dict(meta, logs=logs_json, user=jsonable(user), best=None if best is None else json_number(best))
    payload[METADATA_ITEM] = meta
    metrics = {k: v for k, v in logs_json.items() if isinstance(v, float)}
    metrics[retention.EPOCH_COMPLETE_METRIC] = 1.0 if meta["epoch_complete"] else 0.0
    if meta.get("preemption"):
        metrics[retention.PREEMPTION_METRIC] = 1.0
    return metrics
