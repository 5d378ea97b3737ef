"""Checkpoints in buckets: convert into, load_sharded / inspect / verify from fake GCS and S3 servers."""

from __future__ import annotations

import os

import keras
import numpy as np
import pytest

import shardckpt
from shardckpt import errors, storage
from tests.zoo import CountingIterator, build_zoo, randomize, saved_zoo_h5, zoo_layout_map


def _source(tmp_path):
    return saved_zoo_h5(str(tmp_path / "src.weights.h5"), 3)


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


def _upload(local: str, url: str) -> None:
    """Copies a local folder into a bucket object by object, as `gcloud storage cp -r` does."""
    src, dst = storage.parse(local), storage.parse(url)
    for key in storage.list_keys(src):
        storage.write_bytes(dst.join(key), storage.read_bytes(src.join(key)))


def _trainable(seed: int) -> keras.Model:
    keras.backend.clear_session()
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6,))
    outputs = keras.layers.Dense(1, name="head")(keras.layers.Dense(16, name="hidden")(inputs))
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="adam", loss="mse")
    return model


def test_restore_latest_and_inspect_from_a_bucket(tmp_path, bucket):
    """A root trained locally by OrbaxCheckpoint and copied into a bucket resumes from there."""
    model, it = _trainable(3), CountingIterator(rows=32)
    ckpt = shardckpt.OrbaxCheckpoint(str(tmp_path / "ck"), save_freq=3, max_to_keep=2, data_iterator=it,
                                      metadata={"run": "b"})
    model.fit(ckpt.batches(), steps_per_epoch=4, epochs=2, callbacks=[ckpt], verbose=0)
    ckpt.wait_until_finished()
    _upload(str(tmp_path / "ck"), f"{bucket}/ck")

    local, remote = shardckpt.inspect(str(tmp_path / "ck")), shardckpt.inspect(f"{bucket}/ck")
    assert remote.steps == local.steps == [3, 6] and remote.step == 6
    assert remote.metadata == local.metadata and remote.metadata["user"] == {"run": "b"}
    assert remote.iterator_state == local.iterator_state == [{"n": 6}]
    assert remote.items == local.items

    states = []
    for root in (str(tmp_path / "ck"), f"{bucket}/ck"):
        fresh, fresh_it = _trainable(11), CountingIterator(rows=32)
        fresh.fit(fresh_it.x[:8], fresh_it.y[:8], epochs=1, verbose=0)  # builds optimizer variables
        info = shardckpt.restore_latest(fresh, root, data_iterator=fresh_it)
        assert info.step == 6 and fresh_it.n == 6 and info.path == f"{root}/6"
        states.append({v.path: np.asarray(v.value) for v in fresh.variables})
    assert states[0].keys() == states[1].keys()
    for path, value in states[0].items():
        np.testing.assert_array_equal(states[1][path], value, err_msg=path)


def test_cli_convert_inspect_verify_with_bucket_urls(tmp_path, bucket, capsys):
    from shardckpt.cli.main import main as cli_main

    keras.backend.clear_session()
    model = build_zoo()
    randomize(model, 5)
    src = str(tmp_path / "zoo.keras")
    model.save(src)
    url = f"{bucket}/cli/0"
    assert cli_main(["convert", src, url, "--quiet"]) == 0
    assert cli_main(["inspect", url]) == 0
    assert cli_main(["verify", f"{bucket}/cli"]) == 0
    out = capsys.readouterr().out
    assert f"to Orbax {url!r}" in out and f"orbax checkpoint {url}" in out and "OK:" in out


def test_bytes_on_disk_of_a_bucket_destination_is_its_objects_sizes(tmp_path, bucket):
    """`bytes_on_disk` in a bucket: exactly the objects' sizes, and what the same conversion takes locally."""
    keras.backend.clear_session()
    inputs = keras.Input((256,))
    model = keras.Model(inputs, keras.layers.Dense(700, name="wide")(inputs))  # 700 KiB kernel
    randomize(model, 1)
    src = str(tmp_path / "wide.keras")
    model.save(src)
    # Small transactions: several OCDBT data files, some over du's 64 KiB probing window.
    local = shardckpt.convert(src, str(tmp_path / "out"), max_inflight_bytes=1 << 20).bytes_on_disk
    remote = f"{bucket}/out"
    in_bucket = shardckpt.convert(src, remote, max_inflight_bytes=1 << 20).bytes_on_disk
    root = storage.parse(remote)
    sizes = {k: len(storage.read_bytes(root.join(k))) for k in storage.list_keys(root)}  # whole, here only
    assert in_bucket == sum(sizes.values()) and max(sizes.values()) > 64 * 1024
    files = storage.list_keys(storage.parse(str(tmp_path / "out")))
    assert local == sum(os.path.getsize(tmp_path / "out" / k) for k in files)
    # Same arrays and metadata; OCDBT packs its b-tree nodes and data files by
    # commit timing, so the two differ by at most a few hundred bytes of index.
    assert abs(in_bucket - local) < 4096 and in_bucket > 256 * 700 * 4


def test_du_sizes_objects_at_the_probing_window_edges(bucket):
    root = storage.parse(f"{bucket}/sizes")
    sizes = [0, 1, 65535, 65536, 65537, 131072, 200_001, (1 << 20) + 3]
    for i, size in enumerate(sizes):
        storage.write_bytes(root.join(f"o{i}"), bytes(size))
    assert storage.du(root) == sum(sizes)
    assert storage.du(root.join("nothing")) == 0
