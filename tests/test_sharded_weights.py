"""Keras' sharded `.weights.json` (index + shards): load, inspect, verify, convert, errors."""

from __future__ import annotations

import json
import os

import keras
import numpy as np
import pytest

import shardckpt
from shardckpt import errors
from tests.zoo import build_zoo, lazy_zoo, randomize

# GB, as Keras' max_shard_size takes it: ~5 KiB, so the 17 KiB zoo spans 4 shards.
SHARD_GB = 5e-6


def _save(tmp_path, dtype="float32", seed=0):
    """A zoo model saved by Keras as a sharded index; returns (index path, values)."""
    keras.backend.clear_session()
    model = build_zoo(dtype=dtype)
    randomize(model, seed)
    path = str(tmp_path / "m.weights.json")
    model.save_weights(path, max_shard_size=SHARD_GB * (2 if dtype == "bfloat16" else 4) / 4)
    return path, [np.asarray(v.value) for v in model.weights]




def _shards(folder):
    return sorted(n for n in os.listdir(folder) if n.endswith(".weights.h5"))


@pytest.mark.parametrize("mesh", [(1, 8), (2, 4)], ids=["1x8", "2x4"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sharded_index_loads_bit_exact_like_keras(tmp_path, mesh, dtype):
    path, values = _save(tmp_path, dtype)
    assert len(_shards(tmp_path)) >= 3  # the test is about several shard files
    # Keras' own loading of the same index agrees with the saved values.
    keras.backend.clear_session()
    reference = build_zoo(dtype=dtype)
    reference.load_weights(path)
    for v, want in zip(reference.weights, values):
        np.testing.assert_array_equal(np.asarray(v.value), want, err_msg=v.path)

    model, dist = lazy_zoo(dtype, mesh)
    report = shardckpt.load_sharded(model, path)
    assert report.format == "h5-sharded" and report.missing == [] and report.unexpected == []
    assert report.arrays == len(values)
    # Keras' h5 has no seed-generator state (the GRU's, float32 only): it gets its initial value.
    assert report.initialized == ["seed_generator/seed_generator_state"] * (dtype == "float32")
    for v, want in zip(model.weights, values):
        np.testing.assert_array_equal(np.asarray(v.value), want, err_msg=v.path)
        expected = dist.get_variable_layout(v).backend_layout
        assert v.value.sharding.is_equivalent_to(expected, v.ndim), (v.path, v.value.sharding)
    up = next(v for v in model.weights if v.path == "block/up/kernel")
    assert up.value.sharding.spec == jax_spec(None, "model")


def jax_spec(*axes):
    import jax

    return jax.sharding.PartitionSpec(*axes)


def test_inspect_verify_and_convert_read_the_index(tmp_path):
    path, values = _save(tmp_path, seed=2)
    info = shardckpt.inspect(path)
    single = tmp_path / "single.weights.h5"
    keras.backend.clear_session()
    src = build_zoo()
    src.load_weights(path)
    src.save_weights(single)
    assert [a.key for a in info.arrays] and sorted(a.key for a in info.arrays) == sorted(
        a.key for a in shardckpt.inspect(str(single)).arrays
    )  # the same keys as the single file Keras writes
    assert info.total_bytes == sum(v.nbytes for v in values)
    report = shardckpt.verify(path)
    assert report.ok and report.arrays == len(info.arrays)

    arch, _ = lazy_zoo()
    dst = str(tmp_path / "orbax")
    shardckpt.convert(path, dst, model=arch, progress=False)
    model, _ = lazy_zoo(mesh_shape=(2, 4))
    shardckpt.load_sharded(model, dst)
    for v, want in zip(model.weights, values):
        if "seed_generator" not in v.path:
            np.testing.assert_array_equal(np.asarray(v.value), want, err_msg=v.path)


def _edit_index(path, edit):
    with open(path) as f:
        index = json.load(f)
    edit(index["weight_map"])
    with open(path, "w") as f:
        json.dump(index, f)


def _untouched(model):
    for v in model.weights:
        with pytest.raises(errors.UnloadedVariableError):
            v.numpy()


def test_missing_shard_names_group_and_file_and_loads_nothing(tmp_path):
    path, _ = _save(tmp_path)
    victim = _shards(tmp_path)[1]
    os.remove(tmp_path / victim)
    model, _ = lazy_zoo(mesh_shape=(1, 8))
    with pytest.raises(errors.CheckpointNotFoundError, match=victim) as e:
        shardckpt.load_sharded(model, path)
    assert "/vars" in str(e.value)  # the group the shard holds
    _untouched(model)
    with pytest.raises(errors.CheckpointNotFoundError, match=victim):
        shardckpt.verify(path)


def test_index_path_outside_the_folder_is_refused(tmp_path):
    inner = tmp_path / "inner"
    inner.mkdir()
    path, _ = _save(inner)
    first = _shards(inner)[0]
    os.rename(inner / first, tmp_path / first)  # exists, but outside the index's folder

    def escape(weight_map):
        for group, names in weight_map.items():
            names = [names] if isinstance(names, str) else names  # Keras writes either
            weight_map[group] = [f"../{first}" if n == first else n for n in names]

    _edit_index(path, escape)
    model, _ = lazy_zoo(mesh_shape=(1, 8))
    with pytest.raises(errors.CorruptCheckpointError, match=r"outside the index's folder"):
        shardckpt.load_sharded(model, path)
    _untouched(model)
    with pytest.raises(errors.CorruptCheckpointError):
        shardckpt.inspect(path)


def test_group_not_in_the_named_shard_is_refused(tmp_path):
    path, _ = _save(tmp_path)
    shards = _shards(tmp_path)
    moved = {}

    def misplace(weight_map):
        group = next(g for g, names in weight_map.items() if names not in ([shards[0]], shards[0]))
        weight_map[group] = [shards[0]]
        moved["group"] = group

    _edit_index(path, misplace)
    model, _ = lazy_zoo(mesh_shape=(1, 8))
    with pytest.raises(errors.CorruptCheckpointError, match=shards[0]) as e:
        shardckpt.load_sharded(model, path)
    assert moved["group"] in str(e.value)
    _untouched(model)


def test_index_that_is_not_json_is_corrupt(tmp_path):
    path, _ = _save(tmp_path)
    with open(path, "w") as f:
        f.write("{not json")
    with pytest.raises(errors.CorruptCheckpointError, match="m.weights.json"):
        shardckpt.load_sharded(lazy_zoo()[0], path)
