"""tools/bench_preset.py runs end to end at its --smoke size and prints its table."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("keras_hub")


@pytest.mark.slow
def test_bench_preset_smoke():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root}
    env.pop("XLA_FLAGS", None)  # each child sets its own 8 devices
    proc = subprocess.run(
        [sys.executable, os.path.join(root, "tools", "bench_preset.py"), "--smoke"],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    for form in ("single", "sharded"):
        for mode in ("keras-hub", "shardckpt", "shardckpt-auto"):
            assert any(line.split()[:2] == [form, mode] for line in lines), proc.stdout
        assert any(line.startswith(f"{form}: shardckpt / keras-hub time = ") for line in lines), proc.stdout
    # Both loaders placed the embedding as keras-hub's layout map says.
    assert sum("P('model', 'batch')" in line for line in lines) == 4, proc.stdout
