"""What `OrbaxCheckpoint` says: little at default verbosity, and what matters once.

Issue 29: a WARNING at every save for an 8 ms wait, absl's "Skipping merge of
OCDBT checkpoints" at every save, `keep_best` silently doing nothing when its
monitor is absent at save time, nothing saying where a resume started or that
a rerun of a finished job trains nothing.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
import warnings

import keras
import numpy as np
import pytest

from shardckpt import storage
from shardckpt.training import OrbaxCheckpoint, saving


def _sgd_dense_regressor() -> keras.Model:
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, name="d")], name="m")
    model.compile(optimizer=keras.optimizers.SGD(0.1, name="sgd"), loss="mse")
    return model


def _data(n: int = 16):
    rng = np.random.default_rng(1)
    return rng.standard_normal((n, 4)).astype("float32"), rng.standard_normal((n, 2)).astype("float32")


def test_a_fit_with_five_saves_logs_at_most_five_lines_and_nothing_from_absl(tmp_path, caplog, capfd):
    """Default verbosity (WARNING): records of every logger and the process's stderr (C++ included)."""
    caplog.set_level(logging.WARNING)
    ckpt = OrbaxCheckpoint(str(tmp_path), max_to_keep=2)
    _sgd_dense_regressor().fit(*_data(), batch_size=8, epochs=5, callbacks=[ckpt], verbose=0)
    ckpt.wait_until_finished()
    assert len(ckpt.snapshot_modes) == 5, "five saves"
    ours = [r for r in caplog.records if r.name.startswith("shardckpt")]
    assert len(ours) <= 5, [r.getMessage() for r in ours]
    others = [f"{r.name}: {r.getMessage()}" for r in caplog.records if not r.name.startswith("shardckpt")]
    assert others == []
    err = capfd.readouterr().err
    assert "Skipping merge" not in err and "tensorstore" not in err.lower(), err
    # The filter is only there during fit: absl's own lines are untouched elsewhere.
    logging.getLogger("absl").warning("Skipping merge of OCDBT checkpoints: outside fit")
    assert [r.getMessage() for r in caplog.records if r.name == "absl"] == [
        "Skipping merge of OCDBT checkpoints: outside fit"]


@pytest.mark.parametrize("argument", ["keep_best", "save_best_only"])
def test_a_monitor_missing_at_save_time_warns_once_naming_it_and_the_keys(tmp_path, argument):
    """README's example: keep_best=1, monitor="val_loss", an integer save_freq: the logs of a
    batch-end save never hold val_loss. Before, keep_best said nothing and save_best_only warned
    at every save."""
    kwargs = {"keep_best": 1} if argument == "keep_best" else {"save_best_only": True}
    ckpt = OrbaxCheckpoint(str(tmp_path), monitor="val_loss", save_freq=1, max_to_keep=3, **kwargs)
    x, y = _data()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _sgd_dense_regressor().fit(x, y, batch_size=8, epochs=2, validation_data=(x, y), callbacks=[ckpt], verbose=0)
    ckpt.wait_until_finished()
    ours = [str(w.message) for w in caught if "val_loss" in str(w.message)]
    assert len(ours) == 1, ours
    assert "Can save best model only with val_loss available" in ours[0]
    assert "['loss']" in ours[0], "names the keys the logs held"
    assert argument in ours[0]


def test_rerunning_a_finished_job_says_so_in_one_line(tmp_path, caplog):
    x, y = _data()
    first = OrbaxCheckpoint(str(tmp_path), resume=True)
    _sgd_dense_regressor().fit(x, y, batch_size=8, epochs=2, callbacks=[first], verbose=0)
    assert first.resumed is None
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="shardckpt"):
        again = OrbaxCheckpoint(str(tmp_path), resume=True)
        model = _sgd_dense_regressor()
        model.fit(x, y, batch_size=8, epochs=2, callbacks=[again], verbose=0)
    assert model.history.epoch == [] and again.resumed is not None and again.resumed.step == 1
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "shardckpt"]
    assert len(lines) == 1, lines
    level, line = lines[0]
    assert level == logging.WARNING, "a rerun that trains nothing is said at default verbosity"
    # 1-based like Keras' progress bar ("Epoch 2/2"): the second of two epochs, both trained.
    assert "resumed from step 1" in line and "(epoch 2/2 complete)" in line and "all 2 epochs are trained" in line

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="shardckpt"):
        more = OrbaxCheckpoint(str(tmp_path), resume=True)
        _sgd_dense_regressor().fit(x, y, batch_size=8, epochs=3, callbacks=[more], verbose=0)
    resumed = [r.getMessage() for r in caplog.records if "resumed" in r.getMessage()]
    assert len(resumed) == 1 and "resumed from step 1" in resumed[0] and "(epoch 2/3 complete)" in resumed[0]
    assert "fit continues at epoch 3/3." in resumed[0]
    assert all(r.levelno == logging.INFO for r in caplog.records if r.name == "shardckpt")


def _writer(tmp_path) -> saving.StepWriter:
    return saving.StepWriter(storage.parse(str(tmp_path)), policy=None, compression=False, background=True,
                             context=saving.json_context(compression=False), waits_s=[])


def _pending(writer: saving.StepWriter, seconds: float, started_ago: float, *, step: int = 0,
             off_devices: bool = False) -> None:
    """A save in flight that takes `seconds` more; `off_devices`: its snapshot is in host memory."""
    pool = concurrent.futures.ThreadPoolExecutor(1)
    done = pool.submit(time.sleep, seconds)
    writer._in_flight.append(saving._InFlight(done, step, time.perf_counter() - started_ago, None, off_devices))
    pool.shutdown(wait=False)


def test_a_wait_is_warned_about_only_when_it_is_a_real_share_of_the_training_time(tmp_path, caplog):
    """A 20 ms wait after 2 s of training is no news; a wait that is most of the
    interval between saves is warned about, once per writer (fit)."""
    writer = _writer(tmp_path)
    with caplog.at_level(logging.DEBUG, logger="shardckpt"):
        _pending(writer, 0.02, started_ago=2.0)
        writer.finish_pending(waiting_for=1)
        assert [r.levelno for r in caplog.records] == [logging.DEBUG]
        for step in (2, 3):
            _pending(writer, 0.05, started_ago=0.0)
            writer.finish_pending(waiting_for=step)
    levels = [r.levelno for r in caplog.records]
    assert levels == [logging.DEBUG, logging.WARNING, logging.DEBUG], levels
    warning = caplog.records[1].getMessage()
    assert "step 2 waited" in warning and "Fix: save less often" in warning
    assert len(writer.waits_s) == 3
    writer.close(None)


def test_a_save_queues_behind_a_write_in_flight_when_its_snapshot_left_the_devices(tmp_path):
    """A snapshot in host memory lets the next save return while the previous write runs
    (one queued, QUEUED_SAVES); one save more waits for the oldest; a snapshot left on the
    devices is always waited for (the devices never hold two)."""
    assert saving.QUEUED_SAVES == 1
    writer = _writer(tmp_path)
    assert writer.queue_depth == 1  # one process, background: the worker path
    _pending(writer, 0.5, started_ago=0.0, step=1, off_devices=True)
    writer.finish_pending(waiting_for=2)
    assert writer.waits_s == [] and writer.busy() and len(writer._in_flight) == 1
    _pending(writer, 0.5, started_ago=0.0, step=2, off_devices=True)
    writer.finish_pending(waiting_for=3)
    assert len(writer.waits_s) == 1 and writer.waits_s[0] > 0.3  # the oldest (step 1) waited for
    assert [s.step for s in writer._in_flight] == [2]
    writer.finish_pending()
    _pending(writer, 0.3, started_ago=0.0, step=3, off_devices=False)
    writer.finish_pending(waiting_for=4)
    assert len(writer.waits_s) == 2 and not writer._in_flight
    writer.close(None)
