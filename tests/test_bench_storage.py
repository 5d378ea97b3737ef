"""tools/bench_storage.py --smoke: a tiny restore from local disk, fake GCS and fake S3 runs end to end."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_storage_smoke():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the bench sets its own devices
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "bench_storage.py"), "--smoke"],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    rows = {line.split()[0] + " " + line.split()[1] for line in lines if line.startswith(("local", "fake"))}
    assert rows == {"local disk", "fake GCS", "fake S3"}
    assert "same values from every source: True" in proc.stdout
    assert all("'model', None)" in line for line in lines if line.startswith(("local", "fake")))
