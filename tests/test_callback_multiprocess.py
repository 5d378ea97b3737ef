"""2 real processes x 4 CPU devices train with OrbaxCheckpoint on a (2, 4) mesh;
the checkpoint restores bit-exact in those 2 processes and, resharded, here in
1 process with 8 devices. A SIGTERM to one process makes both save the same
step and stop."""

from __future__ import annotations

import json

import keras
import numpy as np
import pytest

from shardckpt import load_sharded
from shardckpt.conversion.info import inspect
from tests._train_worker import build_model
from tests.mp import run_pair

pytestmark = pytest.mark.multiprocess


def test_two_process_training_checkpoint_restores_on_two_and_on_one_process(tmp_path):
    run_pair("_mp_train_worker.py", str(tmp_path))
    results = [json.loads((tmp_path / f"result{i}.json").read_text()) for i in range(2)]
    for i, r in enumerate(results):
        assert r["step"] == 6 and r["shards"] > 0, r
        assert r["iterator_restored"] == r["iterator_saved"], (i, r)
        assert r["kernel_spec"] == "P(None, 'model')"
    # The two processes read different data, so their positions differ.
    info = inspect(str(tmp_path / "ckpt"))
    assert info.steps == [4, 6]
    assert info.iterator_state == [results[0]["iterator_saved"], results[1]["iterator_saved"]]
    assert info.metadata["layout"]["mesh_shape"] == [2, 4] and info.metadata["layout"]["process_count"] == 2

    # Preemption: process 0 alone got a SIGTERM after its 3rd batch; through
    # JAX's preemption service both saved the same step and stopped there.
    pre = [r["preempt"] for r in results]
    assert [p["mode"] for p in pre] == ["jax", "jax"], pre
    assert pre[0]["step"] is not None and pre[0]["step"] == pre[1]["step"], pre
    assert pre[0]["batches"] == pre[1]["batches"] == pre[0]["step"] < 18, pre
    assert pre[0]["epochs"] == pre[1]["epochs"], pre
    preempt = inspect(str(tmp_path / "preempt"))
    assert preempt.step == pre[0]["step"] and preempt.incomplete == []
    assert preempt.metadata["total_batches"] == pre[0]["batches"]

    # One process, 8 devices, another mesh: every variable resharded, bit-exact.
    expected = dict(np.load(tmp_path / "expected.npz", allow_pickle=False))
    mesh = keras.distribution.DeviceMesh((4, 2), ["data", "model"])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["up/kernel"] = (None, "model")
    layout_map["down/kernel"] = ("model", None)
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="data"))
    model = build_model()
    model.fit(np.zeros((8, 12), "float32"), np.zeros((8, 1), "float32"), epochs=1, verbose=0)
    load_sharded(model, str(tmp_path / "ckpt"), progress=False)
    for group in ("trainable_variables", "non_trainable_variables", "metrics_variables"):
        for v in getattr(model, group):
            np.testing.assert_array_equal(np.asarray(v.value), expected[f"{group}/{v.path}"], err_msg=v.path)
    for v in model.optimizer.variables:
        np.testing.assert_array_equal(np.asarray(v.value), expected[f"optimizer_variables/{v.path}"], err_msg=v.path)
    kernel = model.get_layer("up").kernel.value.sharding
    assert kernel.spec == keras.src.backend.jax.core.jax.sharding.PartitionSpec(None, "model")
    assert kernel.mesh.devices.shape == (4, 2)
