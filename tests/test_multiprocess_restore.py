"""2 real processes x 4 CPU devices: each reads only its own shards, bit-exact."""

from __future__ import annotations

import json
import os

import keras
import numpy as np
import pytest

import shardckpt
from tests.mp import run_pair
from tests.zoo import build_zoo, randomize, zoo_layout_map

pytestmark = pytest.mark.multiprocess


def test_two_processes_restore_h5_sharded_index_and_resharded_orbax_and_agree_on_the_auto_mesh(tmp_path):
    keras.backend.clear_session()
    # The Orbax checkpoint is written by Keras on an 8x1 mesh in this process;
    # the workers restore it on a 2x4 mesh spanning two processes.
    mesh = keras.distribution.DeviceMesh((8, 1), ["data", "model"])
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=zoo_layout_map(mesh)))
    model = build_zoo(rnn=False)
    randomize(model, seed=31)
    model.compile(optimizer="sgd", loss="mse")
    callback = keras.callbacks.OrbaxCheckpoint(str(tmp_path / "orbax"), save_freq="epoch")
    model.fit(np.zeros((8, 8), "int32"), np.zeros((8, 8, 32)), epochs=1, verbose=0, callbacks=[callback])
    callback.wait_until_finished()
    model.save_weights(tmp_path / "m.weights.h5")  # same values as the Orbax step
    # Keras' sharded form of the same weights: an index and ~5 KiB shard files.
    model.save_weights(tmp_path / "m.weights.json", max_shard_size=5e-6)
    assert len([n for n in os.listdir(tmp_path) if n.startswith("m_0")]) >= 3
    auto_mesh = list(shardckpt.auto_layout(model, mesh="auto").mesh.shape)  # 8 devices of one process
    np.savez(tmp_path / "expected.npz", **{v.path: np.asarray(v.value) for v in model.weights})

    run_pair("_restore_worker.py", str(tmp_path))
    results = [json.loads((tmp_path / f"result{i}.json").read_text()) for i in range(2)]
    for r in results:
        # On the 1x8 mesh each process holds half of every sharded variable,
        # and reads only that half (plus the replicated variables).
        for name in ("h5", "sharded"):
            assert r[name]["bytes_read"] < 0.75 * r[name]["total"], r
        assert r["h5"]["shards"] > 0 and r["sharded"]["shards"] > 0 and r["orbax"]["shards"] > 0
    assert [r["auto_mesh"] for r in results] == [auto_mesh, auto_mesh]
    for name in ("h5", "sharded"):
        assert results[0][name]["bytes_read"] + results[1][name]["bytes_read"] < 1.5 * results[0][name]["total"]
