"""Damaged `.weights.h5` headers end in a typed error naming the file and the array, never in other values.

The reader serves each contiguous dataset from its header's byte offset, so a
header that points an array at the wrong bytes would load them as values
(Keras' own `load_weights` does, for two arrays pointed at the same bytes).
Each case damages a file Keras wrote, the way a bad disk or a torn copy would.
"""

from __future__ import annotations

import json
import os

import h5py
import keras
import numpy as np
import pytest
from keras import layers

import shardckpt
from shardckpt.cli import main
from shardckpt.conversion.integrity import verify
from shardckpt.errors import CorruptCheckpointError
from tests.damage import rewrite_h5_layout, rewrite_h5_shape

KERNEL, BIAS = "layers/dense/vars/0", "layers/dense/vars/1"


def _build() -> keras.Model:
    # Shapes unique in the file, so a dataspace is found by its dimensions.
    return keras.Sequential([keras.Input((6,)), layers.Dense(10, name="a"), layers.Dense(12, name="b")])


def _saved(path: str, **save) -> dict[str, np.ndarray]:
    model = _build()
    rng = np.random.default_rng(0)
    for v in model.weights:
        v.assign(rng.standard_normal(v.shape).astype("float32"))
    model.save_weights(path, **save)
    values = {v.path: np.asarray(v.value) for v in model.weights}
    keras.backend.clear_session()
    return values


def _load(path: str) -> keras.Model:
    keras.backend.clear_session()
    keras.distribution.set_distribution(keras.distribution.DataParallel())  # replicated on the 8 devices
    with shardckpt.lazy_init():
        model = _build()
    shardckpt.load_sharded(model, path, progress=False)
    return model


def _offset(path: str, key: str) -> int:
    with h5py.File(path, "r") as f:
        return int(f[key].id.get_offset())


def _move(path: str, old: str, new: str) -> None:
    with h5py.File(path, "r+") as f:
        f.move(old, new)


def _bias_into_a_group(path: str) -> None:
    with h5py.File(path, "r+") as f:
        data = f[BIAS][()]
        del f[BIAS]
        f.create_group(BIAS)["x"] = data


DAMAGE = {
    # The layout message's stored size halved: shape x itemsize no longer matches it.
    "stored size": (lambda p: rewrite_h5_layout(p, KERNEL, size=120), KERNEL, "records 120 stored bytes"),
    # The shape grown: the reader would read the kernel's bytes and its neighbours'.
    "shape": (lambda p: rewrite_h5_shape(p, KERNEL, (6, 20)), KERNEL, "need 480"),
    # HDF5 itself refuses it when the dataset is opened; the error names the array.
    "address past the end": (lambda p: rewrite_h5_layout(p, BIAS, offset=10**6), BIAS, "is damaged"),
    # The bias pointed into the kernel's bytes: Keras' loader reads them as the bias.
    "shared bytes": (lambda p: rewrite_h5_layout(p, BIAS, offset=_offset(p, KERNEL) + 40), BIAS, "share bytes"),
    "renumbered": (lambda p: _move(p, BIAS, "layers/dense/vars/5"), "layers/dense/vars", "numbered [0, 5]"),
    "gap": (lambda p: _move(p, KERNEL, "layers/dense/vars/2"), "layers/dense/vars", "numbered [1, 2]"),
    "member not a dataset": (_bias_into_a_group, BIAS, "is not a dataset"),
}


def test_intact_files_pass_the_checks_a_vars_group_split_across_shards_included(tmp_path):
    single = str(tmp_path / "m.weights.h5")
    expected = _saved(single)
    # 760 bytes a shard: the first layer (280 B) and the second kernel (480 B) fill one, the
    # second bias (48 B) starts the next, so one vars group spans two shards.
    index = str(tmp_path / "m.weights.json")
    _saved(index, max_shard_size=760 / 1024**3)
    weight_map = json.load(open(index))["weight_map"]
    assert isinstance(weight_map["/layers/dense_1/vars"], list)  # the split the numbering check must allow
    for path in (single, index):
        model = _load(path)
        for v in model.weights:
            np.testing.assert_array_equal(np.asarray(v.value), expected[v.path])
            assert v.value.sharding.is_fully_replicated and len(v.value.sharding.device_set) == 8
        assert verify(path).ok


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_damaged_header_is_a_typed_error_naming_file_and_array(tmp_path, kind, capsys):
    path = str(tmp_path / "m.weights.h5")
    _saved(path)
    damage, key, detail = DAMAGE[kind]
    damage(path)
    for attempt in (lambda: _load(path), lambda: verify(path)):
        with pytest.raises(CorruptCheckpointError) as caught:
            attempt()
        message = str(caught.value)
        assert path in message and repr(key) in message and detail in message and "Fix:" in message
    assert main(["verify", path, "--quiet"]) == 1
    assert repr(key) in capsys.readouterr().err


def test_sharded_weights_numbered_over_all_shards(tmp_path):
    index = str(tmp_path / "m.weights.json")
    _saved(index, max_shard_size=760 / 1024**3)
    shard = json.load(open(index))["weight_map"]["/layers/dense_1/vars"][-1]
    _move(os.path.join(tmp_path, shard), "layers/dense_1/vars/1", "layers/dense_1/vars/2")
    with pytest.raises(CorruptCheckpointError, match=r"'layers/dense_1/vars' in .*numbered \[0, 2\]"):
        _load(index)
