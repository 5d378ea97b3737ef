"""`tools/bench_save.py --smoke` runs and reports every row it is asked for, with the plain-write ratio."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_save_smoke_reports_blocking_and_peak_memory_per_mode():
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("XLA_FLAGS", None)
    runs = "keras_async,shardckpt_auto"  # two runs keep it short (device mode: test_callback_snapshot)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_save.py"), "--smoke", "--only", runs],
                          capture_output=True, text=True, timeout=400, env=env, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines() if line.split()}
    assert "peak above state from RssAnon" in proc.stdout  # CPU: no device memory statistics
    assert rows["shardckpt_auto"][1] == "device"  # CPU devices: their memory is the host's, auto copies on them
    for name in runs.split(","):
        assert rows[name][2] == "2", rows[name]  # 4 steps, a save every 2
        assert "MiB" in rows[name] and "GB/s" in rows[name]  # peak memory; device-to-host bandwidth
    assert "plain write" in proc.stdout and "ratio" in proc.stdout
    # shardckpt's background write over the plain fsynced write of the same bytes, per save:
    ratio = rows["shardckpt_auto"][rows["shardckpt_auto"].index("GB/s") - 2]
    assert ratio.endswith("x") and float(ratio[:-1]) > 0, rows["shardckpt_auto"]
    assert rows["keras_async"][rows["keras_async"].index("GB/s") - 2] == "nanx"  # Keras' writes are not timed
    assert "shardckpt_auto: background writes" in proc.stdout
    # ... and over the plain write of the same bytes while the same model trains beside it (the last column):
    beside = rows["shardckpt_auto"][-1]
    assert "plain beside training" in proc.stdout and beside.endswith("x") and float(beside[:-1]) > 0, rows
    assert rows["keras_async"][-1] == "nanx"
    assert "; beside training 0." in proc.stdout
