"""2 real processes x 4 CPU devices: features tested in one process, on a mesh over both.

A `.weights.h5` loaded into a lazily built model with a hand-built Adam (its
slots follow their variables' sharding), an adapted `Normalization` restored,
`EarlyStopping`'s counters through an `OrbaxCheckpoint` resume, and lines that
every process would say alike said by process 0 alone.
"""

from __future__ import annotations

import json

import keras
import numpy as np
import pytest

from tests.mp import run_pair

pytestmark = pytest.mark.multiprocess


def _source(tmp_path) -> None:
    """The model the workers rebuild (`_mp_features_worker.build_normalized`), adapted far from
    Normalization's initial mean 0 / variance 1, saved as `m.weights.h5` on the workers' (1, 8)
    layout; its values and outputs in `expected.npz`."""
    keras.backend.clear_session()
    layout_map = keras.distribution.LayoutMap(keras.distribution.DeviceMesh((1, 8), ["batch", "model"]))
    layout_map["up/kernel"] = (None, "model")
    layout_map["down/kernel"] = ("model", None)
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map,
                                                                         batch_dim_name="batch"))
    keras.utils.set_random_seed(3)
    inputs = keras.Input((8,), name="x")
    norm = keras.layers.Normalization(name="norm")
    x = keras.layers.Dense(16, name="up")(norm(inputs))
    model = keras.Model(inputs, keras.layers.Dense(8, name="down")(x), name="m")
    norm.adapt(np.random.default_rng(7).normal(5.0, 3.0, (64, 8)).astype("float32"))
    x = np.random.default_rng(8).standard_normal((8, 8)).astype("float32")
    model.save_weights(tmp_path / "m.weights.h5")
    np.savez(tmp_path / "expected.npz", x=x, outputs=np.asarray(model(x)),
             **{v.path: np.asarray(v.value) for v in model.weights})
    keras.distribution.set_distribution(None)


def test_restore_features_on_two_processes(tmp_path):
    _source(tmp_path)
    run_pair("_mp_features_worker.py", str(tmp_path), timeout=480)
    results = [json.loads((tmp_path / f"result{i}.json").read_text()) for i in range(2)]
    expected = np.load(tmp_path / "expected.npz")

    # 1: every slot on its variable's sharding, the same slots moved on both processes.
    for r in results:
        assert r["slots"]["split"] == ["down/kernel", "up/kernel"], r["slots"]
        assert r["slots"]["wrong"] == [], r["slots"]
        assert r["slots"]["shards"] > 0
    moved = results[0]["slots"]["moved"]
    assert results[1]["slots"]["moved"] == moved
    assert sorted(moved) == sorted(f"adam/{p}_{k}" for p in ("down_kernel", "up_kernel")
                                   for k in ("momentum", "velocity")), moved

    # 2: the adapted Normalization computes as saved: bit-equal to Keras' own load in the same 2 processes,
    # and to the saving process's outputs up to the order of the row-parallel sum (1 process, 8 devices).
    for r in results:
        outputs = np.asarray(r["normalization"], "float32")
        np.testing.assert_array_equal(outputs, np.asarray(r["normalization_by_keras"], "float32"))
        np.testing.assert_allclose(outputs, expected["outputs"], rtol=1e-6, atol=1e-6)

    # 3: EarlyStopping's counters resumed, the same on both processes; the resumed fit is the unbroken one.
    stops = [r["early_stopping"] for r in results]
    assert stops[0]["counters"] == stops[1]["counters"], stops
    for s in stops:
        assert s["unbroken_epochs"] == [0, 1, 2], s
        assert s["resumed_epochs"] == [2], s
        assert s["differ"] == [], s

    # 4: lines about the checkpoint or the fit, the same on every process, are said by process 0 alone:
    # the newer uncommitted folder passed over, strict=False's skipped arrays, the resume.
    for said in ("passed over 1 newer step folder(s)", "load_sharded(strict=False)", "resumed from step 1"):
        assert [line for line in results[1]["log"] if said in line] == [], (said, results[1]["log"])
        assert len([line for line in results[0]["log"] if said in line]) == 1, (said, results[0]["log"])
