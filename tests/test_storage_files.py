"""Files in buckets: `.weights.h5`, `.keras`, sharded `.weights.json`, safetensors,
keras-hub presets and Hugging Face folders read from fake GCS / S3 servers by byte ranges.

Each file is written by the library users write it with, uploaded, and
restored on 8 CPU devices: values bit-equal and shardings equal to the
restore of the same local file. `remote.TRAFFIC` counts the bytes this
module's ranged reads ask for, to show no object is downloaded whole.
"""

from __future__ import annotations

import json
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


@pytest.fixture
def gcs_bucket(gcs_server) -> str:
    """A fresh bucket on the fake GCS server (format checks need one server only)."""
    return gcs_server.new_bucket()


def test_keras_archive_and_sharded_weights_from_bucket(tmp_path, gcs_bucket):
    keras.backend.clear_session()
    model = build_zoo()
    randomize(model, 6)
    archive = str(tmp_path / "zoo.keras")
    model.save(archive)
    index = str(tmp_path / "sharded" / "zoo.weights.json")
    os.makedirs(os.path.dirname(index))
    model.save_weights(index, max_shard_size=5e-6)  # GB: ~5 KiB shards of the 17 KiB zoo
    shards = [n for n in os.listdir(os.path.dirname(index)) if n.endswith(".weights.h5")]
    assert len(shards) >= 3
    archive_url = _upload(archive, f"{gcs_bucket}/zoo.keras")
    folder_url = _upload(os.path.dirname(index), f"{gcs_bucket}/sharded")
    for local, url in ((archive, archive_url), (index, f"{folder_url}/zoo.weights.json")):
        local_model, remote_model = _load_both(local, url)
        _assert_same_restore(local_model, remote_model)


def _safetensors_files(tmp_path):
    from safetensors.numpy import save_file

    keras.backend.clear_session()
    model = build_zoo()
    randomize(model, 7)
    tensors = {v.path: np.asarray(v.value) for v in model.weights}
    single = str(tmp_path / "one" / "zoo.safetensors")
    os.makedirs(os.path.dirname(single))
    save_file(tensors, single)
    # A two-file set with its index, as Hugging Face writes them.
    folder = tmp_path / "set"
    os.makedirs(folder)
    keys = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((keys[::2], keys[1::2])):
        name = f"zoo-{i + 1:05d}-of-00002.safetensors"
        save_file({k: tensors[k] for k in part}, str(folder / name))
        weight_map.update({k: name for k in part})
    with open(folder / "zoo.safetensors.index.json", "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return single, str(folder / "zoo.safetensors.index.json"), tensors


def test_safetensors_file_and_index_set_from_bucket(tmp_path, gcs_bucket):
    single, index, tensors = _safetensors_files(tmp_path)
    single_url = _upload(single, f"{gcs_bucket}/one/zoo.safetensors")
    set_url = _upload(os.path.dirname(index), f"{gcs_bucket}/set")
    for local, url in ((single, single_url), (index, f"{set_url}/zoo.safetensors.index.json")):
        local_model, remote_model = _load_both(local, url)
        _assert_same_restore(local_model, remote_model)
        for v in remote_model.weights:
            np.testing.assert_array_equal(np.asarray(v.value), tensors[v.path], err_msg=v.path)


def _from_preset_both(local: str, url: str, **kw):
    """`from_preset` of the local folder and of its copy in a bucket."""
    keras.backend.clear_session()
    local_model = shardckpt.from_preset(local, **kw)
    keras.distribution.set_distribution(None)
    keras.backend.clear_session()
    remote_model = shardckpt.from_preset(url, **kw)
    assert type(remote_model) is type(local_model)
    return local_model, remote_model


def test_from_preset_of_a_keras_hub_preset_in_a_bucket(tmp_path, gcs_bucket):
    keras_hub = pytest.importorskip("keras_hub")
    keras.backend.clear_session()
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=128, num_layers=1, num_query_heads=8, num_key_value_heads=8, hidden_dim=64, intermediate_dim=128
    )
    randomize(backbone, 8)
    expected = _values(backbone)
    local = str(tmp_path / "preset")
    backbone.save_to_preset(local, max_shard_size=5e-5)  # GB: a sharded model.weights.json
    assert os.path.isfile(os.path.join(local, "model.weights.json"))
    url = _upload(local, f"{gcs_bucket}/presets/llama")
    mesh = keras.distribution.DeviceMesh((1, 8), ["batch", "model"])
    layout = keras_hub.models.LlamaBackbone.get_layout_map(mesh)
    local_model, remote_model = _from_preset_both(local, url, layout=layout)
    _assert_same_restore(local_model, remote_model)
    assert any(len(v.value.sharding.device_set) == 8 and not v.value.sharding.is_fully_replicated
               for v in remote_model.weights)
    for v in remote_model.weights:
        np.testing.assert_array_equal(np.asarray(v.value), expected[v.path], err_msg=v.path)


def test_from_preset_of_a_hugging_face_folder_in_a_bucket(tmp_path, gcs_bucket):
    pytest.importorskip("keras_hub")
    from tests.hf_fixtures import make_folder

    local = str(tmp_path / "mixtral")
    make_folder("mixtral", local, shards=2)  # stacked experts: variables made of several tensors
    assert os.path.isfile(os.path.join(local, "model.safetensors.index.json"))
    url = _upload(local, f"{gcs_bucket}/hf/mixtral")
    local_model, remote_model = _from_preset_both(local, url)  # auto_layout on 8 devices
    _assert_same_restore(local_model, remote_model)
    assert any(not v.value.sharding.is_fully_replicated for v in remote_model.weights)
