"""Subprocess for test_callback's background-error test; see that test.

Breaks the checkpoint root before step 2 is written (moves it away and puts a
plain file in its place, a real OS error inside Orbax on the save thread),
records what `fit` raised, prints the results as one JSON line and leaves with
`os._exit` (Orbax's stranded signal threads would hold a normal exit 300 s).
"""

from __future__ import annotations

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["KERAS_BACKEND"] = "jax"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import keras  # noqa: E402
import numpy as np  # noqa: E402

from shardckpt.conversion.info import inspect  # noqa: E402
from shardckpt.training import OrbaxCheckpoint  # noqa: E402


class BreakDirectory(keras.callbacks.Callback):
    def __init__(self, directory: str, epoch: int, ckpt: OrbaxCheckpoint) -> None:
        super().__init__()
        self.directory, self.epoch, self.ckpt = directory, epoch, ckpt

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.epoch:
            self.ckpt.wait_until_finished()  # earlier steps are committed first
            os.rename(self.directory, self.directory + "_kept")
            with open(self.directory, "w") as f:
                f.write("not a folder")


def scenario(root: str, epochs: int) -> dict:
    keras.backend.clear_session()
    inputs = keras.Input((6,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="adam", loss="mse")
    ckpt = OrbaxCheckpoint(root, save_on_background=True, max_to_keep=None)
    out: dict = {"error": None}
    try:
        # The breaker runs before the callback's own on_epoch_end (list order).
        model.fit(np.ones((16, 6), "float32"), np.ones((16, 1), "float32"), batch_size=8,
                  epochs=epochs, callbacks=[BreakDirectory(root, 2, ckpt), ckpt], verbose=0)
    except Exception as e:  # recorded and checked by the test
        out = {
            "error": type(e).__name__,
            "message": str(e),
            "step": getattr(e, "step", None),
            "original": type(getattr(e, "original", None)).__name__,
        }
    out["saves_started"] = len(ckpt.save_blocking_s)
    out["kept_steps"] = inspect(root + "_kept").steps
    return out


if __name__ == "__main__":
    base = sys.argv[1]
    results = {
        "fails_at_last_save": scenario(os.path.join(base, "a"), 3),
        "fails_before_next_save": scenario(os.path.join(base, "b"), 4),
    }
    print(json.dumps(results), flush=True)
    sys.stderr.flush()
    os._exit(0)
