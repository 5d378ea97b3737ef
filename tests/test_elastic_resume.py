"""Elastic resume: a step saved by 1 process resumes in 2 (tests/_elastic_worker.py),
and the step those 2 save resumes here in 1, each on another mesh, with every
model, optimizer and metric value bit-exact. Per-process data-iterator
positions never cross process counts silently: `IteratorCountError` by
default, or `on_process_count_change="restart_iterators"`."""

from __future__ import annotations

import json

import keras
import numpy as np
import pytest

from shardckpt.conversion.info import inspect
from shardckpt.errors import IteratorCountError
from shardckpt.training import OrbaxCheckpoint, restore_latest
from tests._train_worker import ShuffledIterator, build_model
from tests.mp import run_pair

pytestmark = pytest.mark.multiprocess


def groups(model) -> dict:
    """`{"<group>/<path>": variable}` of every model, optimizer and metric variable."""
    return {
        f"{group}/{v.path}": v
        for group, variables in (
            ("trainable_variables", model.trainable_variables),
            ("non_trainable_variables", model.non_trainable_variables),
            ("optimizer_variables", model.optimizer.variables),
            ("metrics_variables", model.metrics_variables),
        )
        for v in variables
    }


def _one_process_model(mesh_shape, seed):
    keras.backend.clear_session()
    mesh = keras.distribution.DeviceMesh(mesh_shape, ["data", "model"])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["up/kernel"] = (None, "model")
    layout_map["down/kernel"] = ("model", None)
    distribution = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="data")
    keras.distribution.set_distribution(distribution)
    keras.utils.set_random_seed(seed)
    return build_model(), distribution


def _check_restored(model, distribution, expected) -> None:
    for key, v in groups(model).items():
        assert v.value.sharding.is_equivalent_to(distribution.get_variable_layout(v).backend_layout, v.ndim), key
        np.testing.assert_array_equal(np.asarray(v.value), expected[key], err_msg=key)


def test_resume_one_to_two_and_two_to_one_processes_bit_exact(tmp_path):
    # 1 process, 8 devices, (4, 2) mesh: one epoch, saved with its iterator position.
    model, _ = _one_process_model((4, 2), seed=1234)
    ckpt = OrbaxCheckpoint(str(tmp_path / "ckpt"), data_iterator=ShuffledIterator(seed=3), max_to_keep=3)
    model.fit(ckpt.batches(), steps_per_epoch=2, epochs=1, callbacks=[ckpt], verbose=0)
    ckpt.wait_until_finished()
    np.savez(tmp_path / "expected1.npz", **{k: np.asarray(v.value) for k, v in groups(model).items()})

    run_pair("_elastic_worker.py", str(tmp_path))
    results = [json.loads((tmp_path / f"result{i}.json").read_text()) for i in range(2)]
    for r in results:
        # 1 -> 2: the iterator position of 1 process is refused, by restore_latest
        # and by fit(resume=True), before any value moved.
        for error in (r["error"], r["fit_error"]):
            assert error is not None and "positions of 1 process(es); this run has 2" in error, r
            assert "on_process_count_change='restart_iterators'" in error, r
        assert r["untouched"], r
        # With "restart_iterators": every shard bit-exact; the iterators keep their place.
        assert r["step"] == 0 and r["shards"] > 0 and r["iterator_state"] is None, r
        assert r["iterator"] == {"pass": 0, "index": 0}, r
        assert r["resumed_step"] == 0 and r["epochs"] == [1], r
        # The restarted iterators trained the remaining epoch's 2 batches from their start.
        assert r["saved_iterator"] == {"pass": 0, "index": 32}, r
    info = inspect(str(tmp_path / "ckpt"))
    assert info.steps == [0, 1] and info.metadata["layout"]["process_count"] == 2
    assert info.iterator_state == [results[0]["saved_iterator"], results[1]["saved_iterator"]]

    # 2 -> 1 process, on a (1, 8) mesh: refused, then restored bit-exact.
    expected = dict(np.load(tmp_path / "expected2.npz", allow_pickle=False))
    model, distribution = _one_process_model((1, 8), seed=99)
    model.fit(np.zeros((8, 12), "float32"), np.zeros((8, 1), "float32"), batch_size=8, verbose=0)
    before = {k: np.asarray(v.value) for k, v in groups(model).items()}
    data = ShuffledIterator(seed=3)
    with pytest.raises(IteratorCountError, match=r"positions of 2 process\(es\); this run has 1"):
        restore_latest(model, str(tmp_path / "ckpt"), data_iterator=data)
    _check_restored(model, distribution, before)  # nothing moved
    info = restore_latest(model, str(tmp_path / "ckpt"), data_iterator=data,
                          on_process_count_change="restart_iterators")
    assert info.step == 1 and info.iterator_state is None and data.get_state() == {"pass": 0, "index": 0}
    _check_restored(model, distribution, expected)
    assert model.optimizer.iterations.numpy() == 4
    # fit(resume=True) refuses too, unless told what to do with the positions.
    model, _ = _one_process_model((1, 8), seed=99)
    ckpt = OrbaxCheckpoint(str(tmp_path / "ckpt"), data_iterator=ShuffledIterator(seed=3), resume=True)
    with pytest.raises(IteratorCountError, match="restart_iterators"):
        model.fit(ckpt.batches(), steps_per_epoch=2, epochs=3, callbacks=[ckpt], verbose=0)


def test_on_process_count_change_is_checked_when_built():
    with pytest.raises(ValueError, match="on_process_count_change must be one of"):
        OrbaxCheckpoint("unused", on_process_count_change="merge")
