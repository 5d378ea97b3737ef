"""`OrbaxCheckpoint(save_freq="auto")`: saves at the smallest interval whose writes finish in the background."""

from __future__ import annotations

import logging
import re

import keras
import numpy as np
import pytest

from shardckpt.conversion.info import inspect
from shardckpt.training import OrbaxCheckpoint
from shardckpt.training.autofreq import MARGIN, interval_for
from tests.zoo import small_regressor


def test_interval_is_the_fewest_batches_that_outlast_the_write_with_the_margin():
    assert MARGIN == 1.2
    assert interval_for(1.0, 0.1) == 12  # 1.2 s of batches of 0.1 s
    assert interval_for(1.0, 0.11) == 11
    assert interval_for(0.001, 1.0) == 1  # a write shorter than a batch: every batch
    assert interval_for(0.5, 0.0) >= 1


def test_auto_never_waits_for_a_save_and_logs_its_interval(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="shardckpt")
    model = small_regressor(0, width=64)
    x = np.random.default_rng(1).standard_normal((8, 6)).astype("float32")
    y = np.random.default_rng(2).standard_normal((8, 1)).astype("float32")
    ckpt = OrbaxCheckpoint(str(tmp_path), save_freq="auto", max_to_keep=None)

    class StopAfterThreeSaves(keras.callbacks.Callback):
        # Batches take milliseconds here and a write tens or hundreds: train until three saves happened.
        def on_train_batch_end(self, batch, logs=None):
            if len(ckpt.save_blocking_s) >= 3:
                self.model.stop_training = True

    def batches():
        while True:
            yield x[:8], y[:8]

    model.fit(batches(), steps_per_epoch=100_000, epochs=1, callbacks=[ckpt, StopAfterThreeSaves()], verbose=0)
    # A save falls due only once the previous write is done: none ever waited.
    assert ckpt.save_waits_s == []
    assert len(ckpt.save_writes_s) == len(ckpt.save_blocking_s) == 3
    lines = [r.getMessage() for r in caplog.records if "save_freq='auto'" in r.getMessage()]
    assert lines, [r.getMessage() for r in caplog.records]
    intervals = [int(re.search(r"a save every (\d+) batches", line).group(1)) for line in lines]
    assert all(n >= 1 for n in intervals)
    steps = sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit())
    assert steps[0] == 1  # the first after batch 1, then as the writes allowed
    assert len(steps) == len(ckpt.save_blocking_s)  # every save committed (max_to_keep=None)
    info = inspect(str(tmp_path))
    assert info.metadata["save_freq"] == "auto" and info.metadata["step"] == steps[-1]
    # The interval said at the second save (from the first write) held until the third.
    assert steps[2] - steps[1] >= intervals[0], (steps, lines)


def test_bad_save_freq_is_refused_with_keras_message():
    # Keras' callback: "Unrecognized save_freq: ... Expected save_freq are 'epoch' or integer values".
    with pytest.raises(ValueError, match="Unrecognized save_freq: sometimes. Expected save_freq are 'epoch' or "
                                         "integer values"):
        OrbaxCheckpoint("/tmp/never", save_freq="sometimes")
