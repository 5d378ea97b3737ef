"""Snapshot modes of `OrbaxCheckpoint`: the on-device copy, the bounded copy to
host memory, and "auto"'s choice; each restores bit-exact with its sharding."""

from __future__ import annotations

import logging

import jax
import keras
import numpy as np
import pytest

from shardckpt.conversion.info import inspect
from shardckpt.training import OrbaxCheckpoint, restore_latest
from shardckpt.training import snapshot as snapshot_lib
from tests.support import column_then_row_parallel
from tests.zoo import small_regressor


def _small_regressor_32(seed: int = 0) -> keras.Model:
    return small_regressor(seed, width=32, optimizer=keras.optimizers.Adam(name="adam"))


def _values(model) -> dict:
    return {f"{g}/{v.path}": v.value for g in ("trainable_variables", "non_trainable_variables", "metrics_variables")
            for v in getattr(model, g)} | {f"optimizer_variables/{v.path}": v.value for v in model.optimizer.variables}


def test_host_snapshot_is_in_host_memory_in_the_same_sharding():
    keras.distribution.set_distribution(column_then_row_parallel("hidden", "head"))
    model = _small_regressor_32()
    model.fit(np.ones((16, 6), "float32"), np.ones((16, 1), "float32"), batch_size=8, verbose=0)
    tree, used = snapshot_lib.snapshot_state(model, mode="host", budget_bytes=512)
    assert used.mode == "host"
    kernel = tree["trainable_variables"]["hidden"]["kernel"]
    source = model.get_layer("hidden").kernel.value
    assert kernel.sharding.memory_kind == "pinned_host" and source.sharding.memory_kind == "device"
    assert kernel.sharding.spec == source.sharding.spec == jax.sharding.PartitionSpec(None, "model")
    np.testing.assert_array_equal(np.asarray(kernel), np.asarray(source))
    copy, used = snapshot_lib.snapshot_state(model, mode="device")
    assert used.mode == "device" and copy["trainable_variables"]["hidden"]["kernel"].sharding == source.sharding


def test_auto_takes_the_device_copy_on_cpu_devices():
    # A CPU device's memory is the host's: a host copy costs the same memory
    # and blocks training, so "auto" takes the on-device copy, and says why.
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "model"))
    source = jax.device_put(np.arange(24, dtype="float32").reshape(3, 8), sharding)
    assert {d.platform for d in source.sharding.device_set} == {"cpu"} and len(source.sharding.device_set) == 8
    choice = snapshot_lib.choose([source], "auto", 1 << 40)  # however large the margin asked
    assert choice.mode == "device" and choice.reason.startswith("CPU devices: device memory is host memory")
    assert snapshot_lib.choose_mode([source], "auto", 1) == "device"
    assert snapshot_lib.choose([source], "host", 1) == ("host", "snapshot='host' was asked for")



def test_the_room_auto_asks_of_each_device_is_what_its_shards_hold():
    # "auto" on accelerators compares each device's free memory with its share of the state,
    # read from the shardings (no array per shard on the training thread): split, partly
    # replicated, replicated and scalar arrays, as the shards themselves count them.
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    P = jax.sharding.PartitionSpec
    values = [
        jax.device_put(np.zeros((8, 16), dtype), jax.sharding.NamedSharding(mesh, spec))
        for dtype, spec in [("float32", P("data", "model")), ("bfloat16", P(None, "model")),
                            ("float32", P()), ("int8", P("model", None))]
    ] + [jax.device_put(np.float32(1), jax.sharding.NamedSharding(mesh, P()))]
    expected: dict = {}
    for value in values:
        for shard in value.addressable_shards:
            expected[shard.device] = expected.get(shard.device, 0) + shard.data.nbytes
    assert snapshot_lib._per_device_bytes(values) == expected
    assert expected[jax.devices()[0]] == 8 * 16 * 4 // 8 + 8 * 16 * 2 // 4 + 8 * 16 * 4 + 8 * 16 // 4 + 4

@pytest.mark.parametrize("mode, expected", [("auto", "device"), ("host", "host"), ("device", "device")])
def test_each_snapshot_mode_saves_and_resumes_bit_exact(tmp_path, caplog, mode, expected):
    caplog.set_level(logging.INFO, logger="shardckpt")
    keras.distribution.set_distribution(column_then_row_parallel("hidden", "head"))
    model = _small_regressor_32()
    x = np.random.default_rng(1).standard_normal((32, 6)).astype("float32")
    y = np.random.default_rng(2).standard_normal((32, 1)).astype("float32")
    # A budget of 1 KiB: the host copy goes in many pieces.
    ckpt = OrbaxCheckpoint(str(tmp_path), save_freq=2, snapshot=mode, snapshot_budget_bytes=1024)
    model.fit(x, y, batch_size=8, epochs=2, callbacks=[ckpt], verbose=0, shuffle=False)
    ckpt.wait_until_finished()
    assert ckpt.snapshot_modes == [expected] * 4 and ckpt.snapshot_mode_used == expected
    saves = [r.getMessage() for r in caplog.records if "training blocked" in r.getMessage()]
    reason = "CPU devices: device memory is host memory" if mode == "auto" else f"snapshot={mode!r} was asked for"
    assert len(saves) == 4 and all(f"snapshot {expected!r}: {reason}" in m for m in saves), saves
    meta = inspect(str(tmp_path)).metadata
    assert meta["snapshot"] == expected and meta["step"] == 8
    trained = {k: np.asarray(v) for k, v in _values(model).items()}
    shardings = {k: v.sharding for k, v in _values(model).items()}

    keras.backend.clear_session()
    keras.distribution.set_distribution(column_then_row_parallel("hidden", "head"))
    fresh = _small_regressor_32(seed=7)
    fresh.evaluate(x[:8], y[:8], verbose=0)  # builds the metrics variables
    restore_latest(fresh, str(tmp_path))
    got = _values(fresh)
    assert sorted(got) == sorted(trained)
    for key, value in got.items():
        np.testing.assert_array_equal(np.asarray(value), trained[key], err_msg=key)
        assert value.sharding == shardings[key], key
        assert value.sharding.memory_kind == "device", key


def test_bad_snapshot_arguments(tmp_path):
    with pytest.raises(ValueError, match="snapshot must be one of"):
        OrbaxCheckpoint(str(tmp_path), snapshot="gpu")
    with pytest.raises(ValueError, match="snapshot_budget_bytes"):
        OrbaxCheckpoint(str(tmp_path), snapshot_budget_bytes=0)


def _copy_compiles(model, caplog) -> list[str]:
    """Messages of the compiles a device snapshot of `model` triggers."""
    caplog.clear()
    with jax.log_compiles(True), caplog.at_level(logging.DEBUG):
        tree, _ = snapshot_lib.snapshot_state(model, mode="device")
        jax.block_until_ready(tree)
    return [r.getMessage() for r in caplog.records if "_copy_leaves" in r.getMessage() and "ompil" in r.getMessage()]


def test_prepare_compiles_the_copy_so_the_first_save_compiles_nothing(caplog):
    # Widths no other test uses: jit's cache lives as long as the process.
    keras.distribution.set_distribution(column_then_row_parallel("hidden", "head"))
    model = small_regressor(0, width=37 * 8, optimizer=keras.optimizers.Adam(name="adam"))
    model.fit(np.ones((16, 6), "float32"), np.ones((16, 1), "float32"), batch_size=8, verbose=0)
    assert _copy_compiles(model, caplog)  # unprepared: the snapshot compiles its copy itself
    keras.backend.clear_session()
    model = small_regressor(1, width=41 * 8, optimizer=keras.optimizers.Adam(name="adam"))
    model.fit(np.ones((16, 6), "float32"), np.ones((16, 1), "float32"), batch_size=8, verbose=0)
    compiled = snapshot_lib.prepare(model, mode="auto")
    assert compiled is not None  # "auto" is "device" on CPU devices
    compiled.result()
    assert _copy_compiles(model, caplog) == []
    assert snapshot_lib.prepare(model, mode="host") is None  # nothing to compile for a host copy
