"""Checkpoints in buckets: convert into, load_sharded / inspect / verify from fake GCS and S3 servers."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import shardckpt
from shardckpt import errors
from shardckpt.formats import storage
from tests.zoo import build_zoo, randomize, zoo_layout_map


def _source(tmp_path):
    keras.backend.clear_session()
    model = build_zoo()
    randomize(model, 3)
    path = str(tmp_path / "src.weights.h5")
    model.save_weights(path)
    return path, {v.path: np.asarray(v.value) for v in model.weights}


def _lazy_sharded():
    keras.backend.clear_session()
    mesh = keras.distribution.DeviceMesh((2, 4), ["data", "model"])
    dist = keras.distribution.ModelParallel(layout_map=zoo_layout_map(mesh))
    keras.distribution.set_distribution(dist)
    with shardckpt.lazy_init():
        model = build_zoo()
    return model, dist


def _assert_loaded(model, dist, expected):
    assert {v.path for v in model.weights} == set(expected)
    for v in model.weights:
        np.testing.assert_array_equal(np.asarray(v.value), expected[v.path], err_msg=v.path)
        want = dist.get_variable_layout(v).backend_layout
        assert v.value.sharding.is_equivalent_to(want, v.ndim), (v.path, v.value.sharding, want)


def test_convert_into_bucket_then_load_sharded_inspect_verify(tmp_path, bucket):
    src, expected = _source(tmp_path)
    model, _ = _lazy_sharded()
    root = f"{bucket}/ckpts"
    report = shardckpt.convert(src, f"{root}/7", model=model)
    assert report.dst == f"{root}/7"
    # Keras' h5 has no seed-generator state: convert writes its initial value.
    assert report.initialized == ["seed_generator/seed_generator_state"]
    assert report.arrays == len(expected) + 1
    keys = storage.list_keys(storage.parse(root))
    assert "7/commit_success.txt" in keys and "7/pytree/_METADATA" in keys
    assert not any("tmp" in k for k in keys)

    model, dist = _lazy_sharded()
    loaded = shardckpt.load_sharded(model, root)  # the root: its latest committed step
    assert loaded.path == f"{root}/7"
    _assert_loaded(model, dist, expected)

    info = shardckpt.inspect(f"{root}/7")
    assert info.format == "orbax" and info.step == 7 and info.steps == [7]
    assert len(info.arrays) == report.arrays
    assert info.total_bytes == report.bytes_read + 8  # + the uint32[2] seed state

    checked = shardckpt.verify(root)
    assert checked.ok and checked.checksummed == report.arrays == checked.arrays


def test_existing_destination_in_bucket_is_refused_then_replaced_with_force(tmp_path, bucket):
    src, expected = _source(tmp_path)
    model, _ = _lazy_sharded()
    dst = f"{bucket}/m"
    shardckpt.convert(src, dst, model=model)
    with pytest.raises(errors.DestinationExistsError):
        shardckpt.convert(src, dst, model=model)
    storage.write_bytes(storage.parse(dst).join("stale.bin"), b"x")
    shardckpt.convert(src, dst, model=model, force=True)
    assert "stale.bin" not in storage.list_keys(storage.parse(dst))
    model, dist = _lazy_sharded()
    shardckpt.load_sharded(model, dst)
    _assert_loaded(model, dist, expected)


def test_step_without_commit_marker_is_refused(tmp_path, bucket):
    src, _ = _source(tmp_path)
    model, _ = _lazy_sharded()
    root = storage.parse(f"{bucket}/ck")
    shardckpt.convert(src, root.join("3").url, model=model)
    storage.write_bytes(root.join("3", "commit_success.txt"), b"")  # still committed
    # Step 5 is a full copy of step 3 minus its marker: a save killed before its last write.
    for key in storage.list_keys(root.join("3")):
        if key != "commit_success.txt":
            storage.write_bytes(root.join("5", key), storage.read_bytes(root.join("3", key)))
    with pytest.raises(errors.IncompleteCheckpointError, match="commit_success.txt"):
        shardckpt.inspect(root.join("5").url)
    assert shardckpt.inspect(root.url).step == 3  # the root skips it
