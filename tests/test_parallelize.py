"""parallelize(model): one call, variables moved in place, fit/predict sharded, 8 CPU devices."""

from __future__ import annotations

import jax
import keras
import numpy as np
import pytest

import shardckpt
from shardckpt.errors import LayoutError
from shardckpt.layout import choose, parallel
from shardckpt.layout.parallel import parallelize
from tests import stacks as models

SHAPE = models.Shape(vocab=64, seq=8, dim=32, heads=8, ff=64, blocks=2, gated=True, kv_heads=2)
STEPS = 20


def _data():
    rng = np.random.default_rng(3)
    x = rng.integers(0, SHAPE.vocab, size=(STEPS, 8, SHAPE.seq)).astype("int32")
    y = rng.integers(0, SHAPE.vocab, size=(STEPS, 8, SHAPE.seq)).astype("int32")
    return x, y


def _compiled(model):
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def _train(model, x, y):
    return [float(model.train_on_batch(x[i], y[i])) for i in range(STEPS)]


def _check_placed(model, plan):
    for v in model.variables:
        assert v.value.sharding == plan.sharding_for(v), v.path
    paths = {p.path.replace("/", "_"): p for p in plan.placements}
    slots = 0
    for v in model.optimizer.variables:
        stem = v.path.split("/", 1)[1].rsplit("_", 1)[0]
        if stem in paths:
            slots += 1
            want = jax.sharding.NamedSharding(plan.mesh.backend_mesh, jax.sharding.PartitionSpec(*paths[stem].axes))
            assert v.value.sharding == want, v.path
        else:
            assert v.value.sharding.is_fully_replicated, v.path
    assert slots == 2 * len(model.trainable_variables)  # Adam's momentum and velocity


def test_twenty_steps_match_one_device_with_built_optimizer():
    x, y = _data()
    keras.utils.set_random_seed(0)
    single = _compiled(models.build_transformer(SHAPE))
    weights = single.get_weights()
    losses_one = _train(single, x, y)
    final_one = [np.asarray(v.value) for v in single.variables]

    keras.backend.clear_session()
    model = _compiled(models.build_transformer(SHAPE))
    model.set_weights(weights)
    model.optimizer.build(model.trainable_variables)  # slots exist before parallelize
    plan = parallelize(model, (1, 8))
    assert tuple(plan.mesh.shape) == (1, 8) and plan.sharded_fraction() >= 0.9
    assert keras.distribution.distribution().device_mesh is plan.mesh
    _check_placed(model, plan)
    losses_tp = _train(model, x, y)
    np.testing.assert_allclose(losses_tp, losses_one, rtol=2e-5)
    # Sharded matmuls sum in another order; Adam's m / sqrt(v) magnifies that
    # rounding for gradients near zero. 20 steps at lr 1e-2 move weights by up
    # to 0.2; the largest difference measured was 1.3e-5.
    # The key bias is left out: it adds q.b_k, the same for every key, which
    # softmax cancels, so its exact gradient is zero and Adam turns pure
    # rounding noise into +-lr steps in both runs.
    for v, want in zip(model.variables, final_one):
        if v.path.endswith("key/bias"):
            continue
        np.testing.assert_allclose(np.asarray(v.value), want, rtol=1e-4, atol=5e-5, err_msg=v.path)
    _check_placed(model, plan)  # still in place after 20 sharded steps


def test_lazy_model_loaded_then_parallelized(tmp_path):
    model = models.build_transformer(SHAPE)
    path = str(tmp_path / "m.weights.h5")
    model.save_weights(path)
    x, _ = _data()
    want = np.asarray(model.predict(x[0], verbose=0))
    keras.backend.clear_session()
    with shardckpt.lazy_init():
        lazy = models.build_transformer(SHAPE)
    # Onto device 0 on purpose (a lazily built model is never put there by default).
    one = keras.distribution.DeviceMesh((1,), ["batch"], [jax.devices()[0]])
    shardckpt.load_sharded(lazy, path, layout=keras.distribution.LayoutMap(one), allow_other_mesh=True)
    plan = parallelize(lazy, (2, 4))
    assert plan.batch_axis == "data" and tuple(plan.mesh.shape) == (2, 4)
    for v, src in zip(lazy.variables, model.variables):
        np.testing.assert_array_equal(np.asarray(v.value), np.asarray(src.value))
        assert v.value.sharding == plan.sharding_for(v), v.path
    got = np.asarray(lazy.predict(x[0], verbose=0))
    assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want))


def test_still_unloaded_variables_get_layout_only():
    with shardckpt.lazy_init():
        lazy = models.build_transformer(SHAPE)
    plan = parallelize(lazy, (1, 8))
    for v in lazy.variables:
        assert v._value is None
        assert tuple(v._layout.axes) == plan[v.path].axes


def test_twice_replans_and_moves():
    model = _compiled(models.build_transformer(SHAPE))
    x, y = _data()
    first = parallelize(model, (1, 8))
    model.train_on_batch(x[0], y[0])
    mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "tp"], jax.devices())
    second = parallelize(model, mesh, model_axis="tp")
    assert keras.distribution.distribution().batch_dim_name == "batch"
    assert second["dense/kernel"].axes == (None, "tp") and first["dense/kernel"].axes == (None, "model")
    _check_placed(model, second)
    loss = model.train_on_batch(x[1], y[1])
    assert np.isfinite(loss)
    history = model.fit(x[2:4].reshape(16, SHAPE.seq), y[2:4].reshape(16, SHAPE.seq), batch_size=8, verbose=0)
    assert np.isfinite(history.history["loss"][0])
    assert np.isfinite(model.evaluate(x[4], y[4], verbose=0))
    _check_placed(model, second)
    with pytest.raises(LayoutError, match="no model axis"):
        parallelize(model, mesh)
    # A failed call leaves the previous distribution in force.
    assert keras.distribution.distribution().device_mesh is second.mesh


def test_peak_device_memory_is_model_plus_one_variable(monkeypatch):
    model = _compiled(models.build_transformer(SHAPE))
    model.optimizer.build(model.trainable_variables)
    state = model.variables + model.optimizer.variables
    largest = max(int(np.prod(v.shape)) * v.value.dtype.itemsize for v in state)

    def device_bytes() -> int:
        # A shard's `.data` is itself a live array: count each buffer once.
        buffers = {}
        for arr in jax.live_arrays():
            for shard in arr.addressable_shards:
                buffers[(shard.device, shard.data.unsafe_buffer_pointer())] = shard.data.nbytes
        per_device: dict = {}
        for (device, _), nbytes in buffers.items():
            per_device[device] = per_device.get(device, 0) + nbytes
        return max(per_device.values())

    before = device_bytes()
    peaks = []
    real_put = parallel._device_put

    def measured_put(value, sharding):
        out = real_put(value, sharding)
        peaks.append(device_bytes())  # old and new copies of this variable both alive here
        return out

    monkeypatch.setattr(parallel, "_device_put", measured_put)
    plan = parallelize(model, (1, 8))
    assert len(peaks) == len(state) + len(model.metrics_variables)
    assert max(peaks) <= before + largest
    # Afterwards each device holds its share: the plan's weights + Adam slots + scalars.
    # (measured: before 263,824, peak 264,848, largest variable 8,192, after 48,112).
    after = device_bytes()
    assert plan.bytes_per_device("adam") <= after <= plan.bytes_per_device("adam") + 64  # + scalars


def test_memory_table_per_device_count():
    """Weights and weights + Adam per device on (1, n) meshes, pinned (the note's table)."""
    model = models.build_transformer(SHAPE)
    sizes, key_axes = {}, {}
    for n in (1, 2, 4, 8):
        mesh = keras.distribution.DeviceMesh((1, n), ["data", "model"], jax.devices()[:n])
        plan = shardckpt.layout.auto_layout(model, mesh)
        sizes[n] = (plan.bytes_per_device(), plan.bytes_per_device("adam"))
        key_axes[n] = plan["grouped_query_attention/key/kernel"].axes
    total = sum(int(np.prod(v.shape)) * 4 for v in model.variables)
    assert sizes[1] == (total, 3 * total) == (87936, 263808)
    assert sizes == {1: (87936, 263808), 2: (44736, 134208), 4: (26304, 78912), 8: (16032, 48096)}
    # 2 key/value heads split 2 ways, and are replicated on 4 and 8 devices.
    assert key_axes[2] == (None, "model", None)
    assert key_axes[4] == key_axes[8] == (None, None, None)


# One device's memory between the (4, 2) mesh's weights (44,736 bytes) and its
# weights plus Adam's two slots (134,208): see test_memory_table_per_device_count.
_LIMIT = 100_000


def test_auto_mesh_counts_the_compiled_optimizers_slots(monkeypatch):
    # CPU devices report no memory: the device's report is the one part simulated.
    monkeypatch.setattr(choose, "device_limit", lambda devices: _LIMIT)
    keras.backend.clear_session()
    model = _compiled(models.build_transformer(SHAPE))
    plan = parallelize(model)
    notes = "\n".join(plan.notes)
    # Weights alone, (4, 2) fits and is chosen; with the slots it does not.
    assert "(4, 2): 44,736 bytes/device" in notes and "does not fit (state 134,208 bytes)" in notes
    # No fitting shape is clean then: the fewest bytes.
    assert tuple(plan.mesh.shape) == (1, 8)
    assert plan.bytes_per_device(model.optimizer) == 48_096 <= _LIMIT
    assert "(1, 8): 16,032 bytes/device" in notes and "fits (state 48,096 bytes)" in notes
    x, y = _data()
    model.train_on_batch(x[0], y[0])
    _check_placed(model, plan)


class _OwnOptimizer(keras.optimizers.SGD):
    """A user's optimizer: shardckpt knows no slot count for it."""


def test_auto_mesh_with_optimizer_of_unknown_slots_says_it_counts_weights_alone(monkeypatch):
    monkeypatch.setattr(choose, "device_limit", lambda devices: _LIMIT)
    keras.backend.clear_session()
    model = models.build_transformer(SHAPE)
    model.compile(optimizer=_OwnOptimizer(), loss="mse")
    with pytest.warns(UserWarning, match=r"slot count of _OwnOptimizer is not known.*weights alone.*Fix: pass mesh="):
        plan = parallelize(model)
    assert tuple(plan.mesh.shape) == (4, 2)  # the weights-only choice, as before
