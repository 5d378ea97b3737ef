"""auto_layout on quantized models: int8, int4 (sub-channel and per-channel), float8; scales follow their kernel."""

from __future__ import annotations

import os
import sys

import jax
import keras
import numpy as np
import pytest

from shardckpt.layout import auto_layout
from shardckpt.structure import structural_paths

M = "model"
MODES = ["int8", "int4", "int4 per-channel", "float8"]


def _build(mode: str) -> keras.Model:
    keras.utils.set_random_seed(0)
    # The plain int4 policy builds Keras' per-channel int4 layout (kernel_scale (units,)).
    dtype = "int4_from_float32" if mode == "int4 per-channel" else None
    inputs = keras.Input((8,), dtype="int32")
    x = keras.layers.Embedding(256, 64, dtype=dtype)(inputs)
    x = keras.layers.Dense(256, activation="relu", dtype=dtype)(x)
    x = keras.layers.Dense(64, dtype=dtype)(x)
    x = keras.layers.LayerNormalization()(x)
    x = keras.layers.EinsumDense("bsf,fh->bsh", output_shape=(8, 128), bias_axes="h", dtype=dtype)(x)
    model = keras.Model(inputs, x)
    if dtype is None:
        model.quantize(mode)
    return model


def _layers(model):
    """(kernel-like weight, its smaller companions) per layer, grouped by structural key."""
    keys = structural_paths(model)
    groups: dict[str, list] = {}
    for v in model.variables:
        groups.setdefault(keys[id(v)].rsplit("/vars/", 1)[0], []).append(v)
    for members in groups.values():
        main = max(members, key=lambda v: int(np.prod(v.shape)))
        yield main, [v for v in members if v is not main]


@pytest.mark.parametrize(("mode", "mesh"), [(m, (1, 8)) for m in MODES] + [("int8", (2, 4)), ("int4", (2, 4)), ("float8", (2, 4))])
def test_quantized_scales_follow_their_kernel(mode, mesh):
    model = _build(mode)
    plan = auto_layout(model, mesh)
    assert plan.validate(model) == []
    names = {v.path.rsplit("/", 1)[-1] for v in model.variables}
    n = dict(zip(plan.mesh.axis_names, plan.mesh.shape))[M]
    companions = followed = 0
    for main, others in _layers(model):
        main_axes = plan[main.path].axes
        for v in others:
            axes, name = plan[v.path].axes, v.path.rsplit("/", 1)[-1]
            if "amax_history" in name or name == "g_idx":
                assert axes == (None,) * len(v.shape), v.path  # float8 statistics, int4 group indices: replicated
            elif name.endswith(("_scale", "_zero")) and v.shape:
                companions += 1
                if M in main_axes and not plan[main.path].reason.startswith("row-parallel"):
                    k = main_axes.index(M)
                    # Keras packs an int4 kernel's last dimension (two values per int8): the scale
                    # has the unpacked width there.
                    width = main.shape[k] * (2 if mode.startswith("int4") and k == len(main.shape) - 1 else 1)
                    aligned = len(v.shape) - (len(main.shape) - k)  # the scale is shaped like the output
                    if 0 <= aligned and v.shape[aligned] == width:
                        assert axes[aligned] == M, (v.path, axes)
                    else:  # an embedding's per-row scale
                        assert list(v.shape).count(width) == 1, (v.path, v.shape, width)
                        assert axes[list(v.shape).index(width)] == M, (v.path, axes)
                    followed += 1
                else:
                    assert M not in axes, (v.path, axes, main_axes)
    if mode != "float8":
        assert companions >= 4, names
        assert followed >= {"int8": 3, "int4": 6, "int4 per-channel": 3}[mode], (mode, followed)
    assert any(M in p.axes for p in plan.placements if p.path.endswith("kernel"))
    xs = np.random.default_rng(1).integers(0, 256, size=(n * 2, 8)).astype("int32")
    forward = jax.jit(lambda tv, ntv, x: model.stateless_call(tv, ntv, x)[0])
    want = np.asarray(forward([v.value for v in model.trainable_variables], [v.value for v in model.non_trainable_variables], xs))
    tv = [jax.device_put(v.value, plan.sharding_for(v)) for v in model.trainable_variables]
    ntv = [jax.device_put(v.value, plan.sharding_for(v)) for v in model.non_trainable_variables]
    got = np.asarray(forward(tv, ntv, xs))
    assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want))


def test_quantized_keras_hub_backbone_places_scales_with_kernels():
    pytest.importorskip("keras_hub")
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
    import bench_layout as B

    model = B.HUB_BACKBONES["Llama3"](1)
    model.quantize("int8")
    plan = auto_layout(model, (1, 8))
    assert plan.validate(model) == []
    followed = [p for p in plan.placements if p.path.endswith("kernel_scale") and M in p.axes]
    assert len(followed) >= 4, [(p.path, p.axes) for p in plan.placements if "scale" in p.path]
    for main, others in _layers(model):
        kernel = plan[main.path]
        for v in others:
            if v.path.endswith("kernel_scale") and M in kernel.axes and not kernel.reason.startswith("row-parallel"):
                # (1, 1, heads, head_dim) for a (hidden, heads, head_dim) kernel split over heads: dim 2.
                k = kernel.axes.index(M)
                assert plan[v.path].axes[len(v.shape) - (len(main.shape) - k)] == M, (v.path, plan[v.path].axes)
