"""Optimizer state matches by its path under the optimizer, whatever name Keras generated.

A process that created another optimizer first names its own `adam_1`; a
full-state checkpoint keys optimizer variables `optimizer_variables/adam/...`.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import shardckpt
from shardckpt import errors
from tests.zoo import build_zoo, model_parallel, randomize, zoo_layout_map

X = np.arange(64, dtype="int32").reshape(8, 8) % 32
Y = np.linspace(-1, 1, 8 * 8 * 32, dtype="float32").reshape(8, 8, 32)


def _rules():
    mesh = keras.distribution.DeviceMesh((2, 4), ["data", "model"])
    return {k: v.axes for k, v in zoo_layout_map(mesh).items()}


def _under_optimizer(optimizer):
    """{path below the optimizer's name: value} of every optimizer variable."""
    return {v.path.split("/", 1)[1]: np.asarray(v.value) for v in optimizer.variables}


def _train(directory, writer):
    """Trains 2 epochs with Adam and a full-state checkpoint; returns what was saved."""
    model_parallel(_rules(), (2, 4))
    model = build_zoo(rnn=False)
    randomize(model, seed=21)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    if writer == "keras":
        callback = keras.callbacks.OrbaxCheckpoint(str(directory), save_freq="epoch", save_weights_only=False)
    else:
        callback = shardckpt.OrbaxCheckpoint(str(directory), save_freq="epoch")
    model.fit(X, Y, epochs=2, batch_size=4, verbose=0, shuffle=False, callbacks=[callback])
    callback.wait_until_finished()
    assert model.optimizer.name == "adam"
    return {v.path: np.asarray(v.value) for v in model.weights}, _under_optimizer(model.optimizer)


def _renamed_model():
    """The same model and optimizer in a session that made an optimizer first."""
    dist = model_parallel(_rules(), (2, 4))
    keras.optimizers.Adam()  # takes the name "adam"
    model = build_zoo(rnn=False)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    assert model.optimizer.name == "adam_1"
    return model, dist


@pytest.mark.parametrize("writer", ["keras", "shardckpt"])
def test_restore_latest_matches_a_renamed_optimizer_bit_exact(tmp_path, writer):
    weights, slots = _train(tmp_path / "ckpt", writer)
    assert any("momentum" in k for k in slots) and any("velocity" in k for k in slots)
    model, dist = _renamed_model()
    info = shardckpt.restore_latest(model, tmp_path / "ckpt")
    assert info.report.missing == [] and info.report.unexpected == []
    for v in model.weights:
        np.testing.assert_array_equal(np.asarray(v.value), weights[v.path], err_msg=v.path)
        assert v.value.sharding.is_equivalent_to(dist.get_variable_layout(v).backend_layout, v.ndim), v.path
    got = _under_optimizer(model.optimizer)
    assert set(got) == set(slots)
    for key, value in slots.items():
        np.testing.assert_array_equal(got[key], value, err_msg=key)
    assert int(model.optimizer.iterations) == 4


def test_load_sharded_reports_a_different_optimizer_key_by_key(tmp_path):
    """Adam's state is not SGD's: no renaming, every key is named once."""
    _train(tmp_path / "ckpt", "shardckpt")
    model_parallel(_rules(), (2, 4))
    model = build_zoo(rnn=False)
    model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9), loss="mse")
    model.optimizer.build(model.trainable_variables)
    step = shardckpt.inspect(tmp_path / "ckpt").path
    adam_keys = sorted(
        a.key for a in shardckpt.inspect(step).arrays if a.key.startswith("optimizer_variables/")
    )
    with pytest.raises(errors.CheckpointMismatchError) as e:
        shardckpt.load_sharded(model, step)
    assert model.optimizer.name == "sgd"
    assert e.value.missing == [f"{v.path} (key 'optimizer_variables/{v.path}')" for v in model.optimizer.variables]
    assert e.value.unexpected == adam_keys and e.value.mismatched == []
