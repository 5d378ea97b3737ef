"""Helpers several test files share, one definition each (a helper one file uses stays there,
named for what it checks or builds)."""

from __future__ import annotations

from collections.abc import Sequence

import keras
import numpy as np


def rss_anon() -> int:
    """This process's anonymous resident memory in bytes (`RssAnon` of /proc/self/status):
    what freed buffers kept in malloc's heaps count in, unlike mapped files."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


def column_then_row_parallel(
    first: str, second: str, shape: tuple[int, int] = (2, 4)
) -> keras.distribution.ModelParallel:
    """Two stacked Dense layers split Megatron-style on a ("data", "model") mesh: `first`'s kernel
    by columns, `second`'s by rows over "model" (on (2, 4) every shard is held by two devices,
    replicated over "data"); batches split over "data"."""
    mesh = keras.distribution.DeviceMesh(shape, ["data", "model"])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[f"{first}/kernel"] = (None, "model")
    layout_map[f"{second}/kernel"] = ("model", None)
    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="data")


def assert_arrays_equal(got: Sequence[np.ndarray], want: Sequence[np.ndarray], label: str) -> None:
    """Two lists of arrays, of the same length, bit-equal pairwise (the message names the index)."""
    assert len(got) == len(want), (label, len(got), len(want))
    for i, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(g, w, err_msg=f"{label}: variable {i}")


def training_state(model: keras.Model) -> dict[str, np.ndarray]:
    """Every variable a training checkpoint holds, by its state-tree key (`trainable_variables/...`,
    `non_trainable_variables/...`, `metrics_variables/...`, `optimizer_variables/...`)."""
    out = {}
    for group in ("trainable_variables", "non_trainable_variables", "metrics_variables"):
        for v in getattr(model, group):
            out[f"{group}/{v.path}"] = np.asarray(v.value)
    for v in model.optimizer.variables:
        out[f"optimizer_variables/{v.path}"] = np.asarray(v.value)
    return out


def assert_training_state_equal(
    model: keras.Model, expected: dict[str, np.ndarray], keys: Sequence[str] | None = None
) -> None:
    """The model's `training_state` bit-equal to `expected` (at `keys`, or at all of its keys)."""
    got = training_state(model)
    for key in keys or expected:
        np.testing.assert_array_equal(got[key], expected[key], err_msg=key)


def device_bytes(variables) -> int:
    """Bytes of `variables` on the most loaded device: the addressable shards' own sizes."""
    per_device: dict = {}
    for v in variables:
        for shard in v.value.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return max(per_device.values())
