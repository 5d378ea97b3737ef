"""`OrbaxCheckpoint` driven by a training loop of the user's own (`CallbackList` hooks, no `fit`).

What only `fit` gives the callback (the other callbacks of the fit, whose counters each step
holds; fit's `initial_epoch`; the input's length) is missing there. The steps are still
written, and the callback says once what it cannot do, rather than saving steps that silently
lack the other callbacks' state.
"""

from __future__ import annotations

import logging

import keras
import numpy as np

from shardckpt.training import OrbaxCheckpoint
from shardckpt.training.callback import NOT_FROM_FIT
from tests.zoo import small_regressor


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "shardckpt" and r.levelno == logging.WARNING]


def test_hooks_called_by_a_loop_of_ones_own_save_and_say_once_what_fit_alone_gives(tmp_path, caplog):
    model = small_regressor(3, width=8)
    model.optimizer.build(model.trainable_variables)
    ckpt = OrbaxCheckpoint(str(tmp_path), save_freq=1, save_on_background=False, max_to_keep=2)
    callbacks = keras.callbacks.CallbackList([ckpt, keras.callbacks.EarlyStopping(monitor="loss")], model=model)
    x, y = np.ones((4, 6), "float32"), np.ones((4, 1), "float32")
    with caplog.at_level(logging.WARNING, logger="shardckpt"):
        callbacks.on_train_begin()
        callbacks.on_epoch_begin(0)
        for batch in range(2):
            callbacks.on_train_batch_begin(batch)
            logs = model.train_on_batch(x, y, return_dict=True)
            callbacks.on_train_batch_end(batch, logs)
        callbacks.on_epoch_end(0, logs)
        callbacks.on_train_end()
    said = _warnings(caplog)
    assert said.count(f"OrbaxCheckpoint: {NOT_FROM_FIT}") == 1, said
    assert sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()) == [1, 2]


def test_fit_says_nothing_of_a_loop_of_ones_own(tmp_path, caplog):
    model = small_regressor(3, width=8)
    ckpt = OrbaxCheckpoint(str(tmp_path), save_freq=1, save_on_background=False, max_to_keep=2)
    x, y = np.ones((8, 6), "float32"), np.ones((8, 1), "float32")
    with caplog.at_level(logging.WARNING, logger="shardckpt"):
        model.fit(x, y, batch_size=4, epochs=1, callbacks=[ckpt, keras.callbacks.EarlyStopping(monitor="loss")],
                  verbose=0)
    assert not [m for m in _warnings(caplog) if NOT_FROM_FIT in m]
    assert sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()) == [1, 2]
