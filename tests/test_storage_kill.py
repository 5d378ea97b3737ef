"""A conversion into a bucket killed with SIGKILL never looks committed; a forced rerun replaces it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import keras
import numpy as np
import pytest

import shardckpt
from shardckpt import errors, storage

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Tiny TensorStore transactions: thousands of commits, so the save is still
# running for seconds after its first objects appear (the kill lands mid-save).
_WORKER = """
import sys
import shardckpt
shardckpt.convert(sys.argv[1], sys.argv[2], max_inflight_bytes=64 * 1024)
print("finished")
"""


def _wide_dense() -> keras.Model:
    keras.backend.clear_session()
    inputs = keras.Input((1024,))
    return keras.Model(inputs, keras.layers.Dense(4096, name="wide")(inputs))


def test_sigkill_during_save_to_bucket_leaves_no_committed_step(tmp_path, bucket):
    model = _wide_dense()
    model.layers[1].kernel.assign(np.random.default_rng(0).standard_normal((1024, 4096), dtype=np.float32))
    src = str(tmp_path / "wide.keras")  # 16 MiB, architecture included
    model.save(src)
    root = storage.parse(f"{bucket}/ckpts")
    step = root.join("1")
    env = dict(os.environ, PYTHONPATH=_ROOT, JAX_PLATFORMS="cpu")
    proc = subprocess.Popen([sys.executable, "-c", _WORKER, src, step.url], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        deadline = time.monotonic() + 120
        while not any(k.startswith("pytree/d/") for k in storage.list_keys(step)):
            assert proc.poll() is None, "the conversion ended before writing array data"
            assert time.monotonic() < deadline, "no array data appeared in the bucket"
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    keys = storage.list_keys(step)
    assert any(k.startswith("pytree/d/") for k in keys)
    assert "commit_success.txt" not in keys  # killed mid-save, never committed

    with pytest.raises(errors.IncompleteCheckpointError, match="commit_success.txt"):
        shardckpt.inspect(root.url)
    with pytest.raises(errors.IncompleteCheckpointError, match="never committed"):
        shardckpt.load_sharded(_wide_dense(), step.url)
    with pytest.raises(errors.DestinationExistsError):
        shardckpt.convert(src, step.url)

    shardckpt.convert(src, step.url, force=True)
    restored = _wide_dense()
    shardckpt.load_sharded(restored, root.url)
    np.testing.assert_array_equal(np.asarray(restored.layers[1].kernel.value), np.asarray(model.layers[1].kernel.value))
    assert shardckpt.inspect(root.url).steps == [1]
