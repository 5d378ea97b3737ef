"""Orbax checkpoints written by Keras' own OrbaxCheckpoint, restored onto other meshes."""

from __future__ import annotations

import os

import jax
import keras
import numpy as np
import pytest

import shardckpt
from tests.zoo import build_zoo, randomize, zoo_layout_map


def _session(mesh_shape=None):
    keras.backend.clear_session()
    if mesh_shape is None:
        return None
    mesh = keras.distribution.DeviceMesh(mesh_shape, ["data", "model"])
    dist = keras.distribution.ModelParallel(layout_map=zoo_layout_map(mesh))
    keras.distribution.set_distribution(dist)
    return dist


def _train_and_save(directory, mesh_shape):
    """Trains the zoo one epoch under `mesh_shape`; Keras' callback writes the full state."""
    _session(mesh_shape)
    model = build_zoo(rnn=False)
    randomize(model, seed=21)
    model.compile(optimizer="adam", loss="mse")
    x = np.arange(64, dtype="int32").reshape(8, 8) % 32
    y = np.ones((8, 8, 32), "float32")
    callback = keras.callbacks.OrbaxCheckpoint(str(directory), save_freq="epoch")
    model.fit(x, y, epochs=1, batch_size=8, verbose=0, callbacks=[callback])
    callback.wait_until_finished()
    state = {v.path: np.asarray(v.value) for v in model.weights}
    opt = {v.path: np.asarray(v.value) for v in model.optimizer.variables}
    return state, opt


@pytest.fixture(scope="module")
def keras_orbax(tmp_path_factory):
    directory = tmp_path_factory.mktemp("orbax") / "ckpt"
    state, opt = _train_and_save(directory, (2, 4))  # saved sharded on a 2x4 mesh
    return str(directory), state, opt


@pytest.mark.parametrize("mesh", [(1, 8), (8, 1), (4, 2)])
def test_keras_orbax_root_onto_other_meshes(keras_orbax, mesh):
    directory, state, _ = keras_orbax
    dist = _session(mesh)
    with shardckpt.lazy_init():
        model = build_zoo(rnn=False)
    report = shardckpt.load_sharded(model, directory)
    assert report.format == "orbax" and os.path.basename(report.path) == "0"
    assert report.unexpected == [] and report.missing == []
    assert len(report.skipped) > 0  # optimizer + metrics state; the model has none
    for v in model.weights:
        np.testing.assert_array_equal(np.asarray(v.value), state[v.path], err_msg=v.path)
        want = dist.get_variable_layout(v).backend_layout
        assert v.value.sharding.is_equivalent_to(want, v.ndim), v.path


def test_full_state_with_optimizer_from_step_folder(keras_orbax):
    directory, state, opt = keras_orbax
    dist = _session((1, 8))
    model = build_zoo(rnn=False)
    model.compile(optimizer="adam", loss="mse")
    model.optimizer.build(model.trainable_variables)
    report = shardckpt.load_sharded(model, os.path.join(directory, "0"))
    assert report.skipped == [] and report.unexpected == []
    for v in model.weights:
        np.testing.assert_array_equal(np.asarray(v.value), state[v.path], err_msg=v.path)
        assert v.value.sharding.is_equivalent_to(dist.get_variable_layout(v).backend_layout, v.ndim)
    for v in model.optimizer.variables:
        np.testing.assert_array_equal(np.asarray(v.value), opt[v.path], err_msg=v.path)
    assert int(np.asarray(model.optimizer.iterations.value)) == 1


def test_keras_load_weights_agrees_on_one_device(keras_orbax):
    directory, state, _ = keras_orbax
    _session(None)
    reference = build_zoo(rnn=False)
    reference.compile(optimizer="adam", loss="mse")
    reference.optimizer.build(reference.trainable_variables)
    reference.load_weights(directory)
    _session(None)
    with shardckpt.lazy_init():
        model = build_zoo(rnn=False)
    # Onto device 0 on purpose, where the reference is (a lazily built model is never put there by default).
    one = keras.distribution.DeviceMesh((1,), ["batch"], [jax.devices()[0]])
    shardckpt.load_sharded(model, directory, layout=keras.distribution.LayoutMap(one), allow_other_mesh=True)
    for v, w in zip(model.weights, reference.weights):
        np.testing.assert_array_equal(np.asarray(v.value), np.asarray(w.value), err_msg=v.path)


def test_training_after_orbax_load_matches_keras(keras_orbax):
    """Pieces adopted as views of one read stay private per device under donation."""
    directory, _, _ = keras_orbax
    x = np.arange(64, dtype="int32").reshape(8, 8) % 32
    y = np.linspace(-1, 1, 8 * 8 * 32, dtype="float32").reshape(8, 8, 32)

    def trained(use_shardckpt):
        _session((1, 8))
        if use_shardckpt:
            with shardckpt.lazy_init():
                model = build_zoo(rnn=False)
            shardckpt.load_sharded(model, directory)
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        else:
            model = build_zoo(rnn=False)
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
            model.load_weights(directory)
        model.fit(x, y, epochs=2, batch_size=4, verbose=0, shuffle=False)
        return [np.asarray(v.value) for v in model.weights]

    for a, b in zip(trained(True), trained(False)):
        np.testing.assert_array_equal(a, b)


def test_accelerator_path_sends_whole_chunks_as_decoded(tmp_path):
    """`strategies.by_chunk` is what accelerators use when every piece is one
    stored chunk (a one-device save restored onto one device: the H100 case of
    tools/bench_restore.py). CI has no accelerator, so it runs here on a CPU
    device: same values, same placement."""
    from shardckpt.budget import default_max_inflight_bytes
    from shardckpt.formats import open_reader
    from shardckpt.restore import engine, strategies
    from shardckpt.restore.targets import resolve_layout

    _session(None)
    src = build_zoo(rnn=False)
    randomize(src, seed=29)
    src.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    callback = keras.callbacks.OrbaxCheckpoint(str(tmp_path / "ck"), save_freq="epoch", save_weights_only=True)
    src.fit(np.zeros((8, 8), "int32"), np.zeros((8, 8, 32)), epochs=1, verbose=0, callbacks=[callback])
    callback.wait_until_finished()
    state = {v.path: np.asarray(v.value) for v in src.weights}

    def plan(model):
        reader = open_reader(str(tmp_path / "ck"))  # the chunk cache load_sharded uses
        report = engine.LoadReport(path=reader.path, format=reader.format)
        jobs, _ = engine.match_jobs(model, reader, report, True, resolve_layout(None))
        return reader, [strategies.Load.of(job, reader) for job in jobs]

    _session(None)
    with shardckpt.lazy_init():
        model = build_zoo(rnn=False)
    reader, loads = plan(model)
    budget = strategies.Budget(default_max_inflight_bytes())
    for load in loads:
        assert all(reader.is_chunk(load.job.key, p.box) for p in load.parts), load.job.key
        # On a CPU device the dispatcher decodes into pieces (the copy is what
        # the device adopts); with a budget below one chunk it reads in slabs.
        assert load.on_host and strategies.choose(load, reader, budget) is strategies.into_pieces
        assert strategies.choose(load, reader, strategies.Budget(1)) is strategies.by_slabs
        strategies.by_chunk(load, reader, budget, lambda n: None)
    reader.close()
    assert budget.used == 0 and len(loads) == len(model.weights)
    for v in model.weights:
        np.testing.assert_array_equal(np.asarray(v.value), state[v.path], err_msg=v.path)
        assert v.value.sharding.device_set == {jax.devices()[0]}, v.path
    # Sharded over 8 devices, a kernel's pieces cut across its one stored chunk.
    _session((1, 8))
    with shardckpt.lazy_init():
        other = build_zoo(rnn=False)
    reader, loads = plan(other)
    cut = [load.job.key for load in loads if not all(reader.is_chunk(load.job.key, p.box) for p in load.parts)]
    reader.close()
    assert "trainable_variables/block/up/kernel" in cut
