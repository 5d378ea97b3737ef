"""Files in buckets: `.weights.h5`, `.keras`, sharded `.weights.json`, safetensors,
keras-hub presets and Hugging Face folders read from fake GCS / S3 servers by byte ranges.

Each file is written by the library users write it with, uploaded, and
restored on 8 CPU devices: values bit-equal and shardings equal to the
restore of the same local file. `remote.TRAFFIC` counts the bytes this
module's ranged reads ask for, to show no object is downloaded whole.
"""

from __future__ import annotations

import os

import keras
import numpy as np
import pytest

import shardckpt
from shardckpt import errors
from shardckpt.formats import open_reader, remote, storage
from tests.zoo import build_zoo, lazy_zoo, randomize


def _upload(local: str, url: str) -> str:
    """Copies a local file, or every file of a local folder, to `url`; returns `url`."""
    if os.path.isdir(local):
        for root, _, files in os.walk(local):
            for name in files:
                rel = os.path.relpath(os.path.join(root, name), local)
                _upload(os.path.join(root, name), f"{url}/{rel}")
        return url
    with open(local, "rb") as f:
        storage.write_bytes(storage.parse(url), f.read())
    return url


def _values(model):
    return {v.path: np.asarray(v.value) for v in model.weights}


def _assert_same_restore(local_model, remote_model):
    """Bit-equal values and the same sharding, variable by variable."""
    local = {v.path: v for v in local_model.weights}
    assert set(local) == {v.path for v in remote_model.weights}
    for v in remote_model.weights:
        want = local[v.path]
        np.testing.assert_array_equal(np.asarray(v.value), np.asarray(want.value), err_msg=v.path)
        assert v.value.dtype == want.value.dtype, v.path
        assert v.value.sharding.is_equivalent_to(want.value.sharding, v.ndim), (v.path, v.value.sharding)


@pytest.fixture
def zoo_h5(tmp_path):
    keras.backend.clear_session()
    model = build_zoo()
    randomize(model, 5)
    path = str(tmp_path / "zoo.weights.h5")
    model.save_weights(path)
    return path, _values(model)


def _load_both(local: str, url: str):
    model, _ = lazy_zoo(mesh_shape=(2, 4))
    local_report = shardckpt.load_sharded(model, local)
    remote_model, _ = lazy_zoo(mesh_shape=(2, 4))
    remote_report = shardckpt.load_sharded(remote_model, url)
    assert remote_report.path == url and remote_report.format == local_report.format
    return model, remote_model


def test_weights_h5_from_bucket_equals_local_restore(zoo_h5, bucket):
    path, expected = zoo_h5
    url = _upload(path, f"{bucket}/ck/zoo.weights.h5")
    local_model, remote_model = _load_both(path, url)
    _assert_same_restore(local_model, remote_model)
    for v in remote_model.weights:
        np.testing.assert_array_equal(np.asarray(v.value), expected[v.path], err_msg=v.path)
