"""Quantized models (int8, int4 sub-channel and per-channel, float8) load lazily and sharded.

Each model is quantized with Keras' own `quantize()` and saved by Keras; the
lazily built model takes its quantization from the user's policy (`.weights.h5`,
Orbax) or from the checkpoint's config (`.keras` through `convert`, a keras-hub
preset's `config.json`). Every round trip is bit-equal and every variable sits
in the sharding `auto_layout` planned for it.
"""

from __future__ import annotations

import jax
import keras
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import shardckpt
from shardckpt.lazy import is_unloaded

MODES = {
    # mode: (quantize() arguments, the policy a user builds the layers with)
    "int8": ({"mode": "int8"}, "int8_from_float32"),
    "int4_subchannel": ({"mode": "int4"}, "int4/128_from_float32"),  # Keras' int4 default: block_size 128
    "int4_per_channel": (
        {"mode": "int4", "config": keras.quantizers.Int4QuantizationConfig(block_size=None)},
        "int4_from_float32",
    ),
    "float8": ({"mode": "float8"}, "float8_from_float32"),
}


def _build(policy: str | None = None) -> keras.Model:
    """Dense (column- then row-parallel) and EinsumDense layers, each quantizable, 256 inputs
    so that int4's sub-channel groups of 128 are more than one."""
    inputs = keras.Input((256,))
    x = keras.layers.Dense(64, name="up", dtype=policy)(inputs)
    x = keras.layers.Dense(256, name="down", dtype=policy)(x)
    x = keras.layers.EinsumDense("ab,bc->ac", output_shape=32, name="proj", dtype=policy)(x)
    return keras.Model(inputs, x, name="q")


@pytest.fixture(scope="module", params=list(MODES))
def saved(request, tmp_path_factory):
    """One quantized model per mode: its values, `.weights.h5`, `.keras`, and the Orbax
    checkpoint `convert` writes from the `.keras` (architecture and policy from its config)."""
    name = request.param
    args, policy = MODES[name]
    keras.backend.clear_session()
    folder = tmp_path_factory.mktemp(name)
    model = _build()
    rng = np.random.default_rng(0)
    for v in model.weights:
        v.assign(rng.standard_normal(v.shape).astype(np.float32))
    model.quantize(**args)
    if name == "float8":
        # Give the scales and amax histories non-default values (training would).
        for v in model.weights:
            if "scale" in v.path or "amax" in v.path:
                v.assign(rng.uniform(0.5, 2.0, v.shape).astype(np.float32))
    values = {v.path: np.asarray(v) for v in model.weights}
    h5, keras_file = str(folder / "m.weights.h5"), str(folder / "m.keras")
    model.save_weights(h5)
    model.save(keras_file)
    orbax = str(folder / "orbax")
    shardckpt.convert(keras_file, orbax, progress=False)
    keras.backend.clear_session()
    return name, policy, values, {"h5": h5, "keras": keras_file, "orbax": orbax}


def _assert_loaded(model: keras.Model, values: dict[str, np.ndarray], plan) -> None:
    assert sorted(v.path for v in model.weights) == sorted(values)
    for v in model.weights:
        got = v.value
        np.testing.assert_array_equal(np.asarray(got), values[v.path], err_msg=v.path)
        assert np.asarray(got).dtype == values[v.path].dtype, v.path
        assert got.sharding.is_equivalent_to(plan.sharding_for(v), v.ndim), (v.path, got.sharding)
        if v.ndim == 0:
            assert got.sharding.is_fully_replicated, (v.path, got.sharding)


@pytest.mark.parametrize("mesh", [(1, 8), (2, 4)])
@pytest.mark.parametrize("fmt", ["h5", "keras", "orbax"])
def test_quantized_round_trip_lazy_and_sharded(saved, mesh, fmt):
    name, policy, values, paths = saved
    with shardckpt.lazy_init():
        model = _build(policy)  # the user's policy: the variable set of the saved model
    assert all(is_unloaded(v) for v in model.weights)
    plan = shardckpt.auto_layout(model, mesh)
    keras.distribution.set_distribution(plan.distribution())
    report = shardckpt.load_sharded(model, paths[fmt], layout=plan)
    assert not report.missing and not report.unexpected
    _assert_loaded(model, values, plan)
    if name == "int4_subchannel":
        assert model.get_layer("up").kernel_scale.shape == (2, 64)  # 256 inputs in groups of 128
    if name == "int4_per_channel":
        assert model.get_layer("up").kernel_scale.shape == (64,)


def test_orbax_from_keras_file_takes_the_policy_from_its_config(saved, tmp_path):
    """`convert` built the architecture from the `.keras` config: its Orbax arrays are the
    quantized variables (int8 / packed int4 kernels, scales), not float kernels."""
    name, _, values, paths = saved
    info = shardckpt.inspect(paths["orbax"])
    stored = {a.key.split("/", 1)[1]: a for a in info.arrays}
    assert set(stored) == set(values)
    for path, value in values.items():
        assert stored[path].dtype == str(value.dtype) and tuple(stored[path].shape) == value.shape, path


def test_a_different_policy_is_refused_naming_the_kernel(saved):
    """Built with another scheme than the checkpoint's (or none), the load is refused, never
    filled by default; int kernels are refused for a float model even with strict=False."""
    name, _, _, paths = saved
    refused = (shardckpt.errors.CheckpointMismatchError, shardckpt.errors.DtypeMismatchError)
    for other in (None, "int8_from_float32" if name != "int8" else "int4_from_float32"):
        keras.backend.clear_session()
        with shardckpt.lazy_init():
            model = _build(other)  # None: the float model Keras builds by default
        for fmt in ("h5", "orbax"):
            # float8 keeps float kernels: only its scale keys tell it apart, as unexpected keys.
            with pytest.raises(refused, match="kernel" if name != "float8" or other else "not in the model"):
                shardckpt.load_sharded(model, paths[fmt])
            # h5 keys pair the int8 kernel with the float one: never loaded as float weights
            # (int4: the packed shapes differ; Orbax: the int8 kernel is non-trainable, another key).
            if other is None and name == "int8" and fmt == "h5":
                with pytest.raises(shardckpt.errors.CheckpointMismatchError, match="quantized kernel"):
                    shardckpt.load_sharded(model, paths[fmt], strict=False)


@pytest.mark.parametrize(
    "name",
    ["int8", "int4_subchannel", "int4_per_channel", "float8"],
)
def test_scales_follow_their_kernels_output_dimension(name):
    """A kernel's scale (and int4 zero point) is split like the kernel's output dimension;
    float8's 0-d scales and amax histories are replicated."""
    with shardckpt.lazy_init():
        model = _build(MODES[name][1])
    plan = shardckpt.auto_layout(model, (1, 8))
    if name == "float8":
        for v in model.weights:
            if "amax_history" in v.path or v.ndim == 0:
                assert not any(plan.axes_for(v)), (v.path, plan.axes_for(v))
        return
    # Column-parallel "up": its kernel (int4: packed two values per int8 along the output) is
    # split over its output features, not replicated with its scales.
    assert plan.axes_for(model.get_layer("up")._kernel)[-1] == "model", plan["up/kernel"].reason
    for layer_name in ("up", "down", "proj"):
        layer = model.get_layer(layer_name)
        if hasattr(layer, "g_idx"):
            assert not any(plan.axes_for(layer.g_idx)), (layer.g_idx.path, plan.axes_for(layer.g_idx))
        kernel_out = plan.axes_for(layer._kernel)[-1]
        for scale in (layer.kernel_scale, getattr(layer, "kernel_zero", None)):
            if scale is not None:
                assert plan.axes_for(scale)[-1] == kernel_out, (scale.path, plan.axes_for(layer._kernel))


def test_quantized_keras_hub_preset_through_from_preset(tmp_path):
    """keras-hub 0.32's own `from_preset` cannot read this preset back (keras#21378)."""
    keras_hub = pytest.importorskip("keras_hub")
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=64, num_layers=1, num_query_heads=8, num_key_value_heads=8,
        hidden_dim=32, intermediate_dim=64,
    )
    rng = np.random.default_rng(1)
    for v in backbone.weights:
        v.assign(rng.standard_normal(v.shape).astype(np.float32))
    backbone.quantize("int8")
    values = {v.path: np.asarray(v) for v in backbone.weights}
    assert any(v.dtype == np.int8 for v in values.values())
    preset = str(tmp_path / "preset")
    backbone.save_to_preset(preset)
    keras.backend.clear_session()
    model = shardckpt.from_preset(preset, mesh=(2, 4))
    assert sorted(v.path for v in model.weights) == sorted(values)
    dist = keras.distribution.distribution()
    for v in model.weights:
        np.testing.assert_array_equal(np.asarray(v.value), values[v.path], err_msg=v.path)
        want = jax.sharding.NamedSharding(dist.device_mesh.backend_mesh, P(*dist.get_variable_layout(v).axes))
        assert v.value.sharding.is_equivalent_to(want, v.ndim), (v.path, v.value.sharding, want)
    kernels = [v for v in model.weights if v.dtype == "int8" and v.ndim >= 2]
    assert any(any(a is not None for a in v.value.sharding.spec) for v in kernels), "no int8 kernel was split"
