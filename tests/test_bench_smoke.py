"""Every benchmark in tools/ runs at its `--smoke` size, in a fresh process, so none can rot.

Smoke sizes are tiny: the figures mean nothing; the scripts' code paths
(every cell, every loader, the result line) are what is checked.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

from shardckpt.budget import default_max_inflight_bytes

TOOLS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools")
BENCHES = sorted(os.path.basename(p) for p in glob.glob(os.path.join(TOOLS, "bench_*.py")))
# bench_layout.py and bench_save.py run at --smoke in test_layout_hub.py and
# test_bench_save.py, which check their own rows.


def _smoke(name: str, tmp_path) -> dict:
    proc = subprocess.run(
        [sys.executable, os.path.join(TOOLS, name), "--smoke"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, f"{name} --smoke failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    results = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert results, f"{name} --smoke printed no RESULT line:\n{proc.stdout[-3000:]}"
    return json.loads(results[-1][len("RESULT "):])


def test_every_bench_is_covered():
    assert {"bench_convert.py", "bench_restore.py"} <= set(BENCHES)
    for name in BENCHES:
        source = open(os.path.join(TOOLS, name)).read()
        assert "--smoke" in source, f"{name} has no --smoke size"


@pytest.mark.slow
def test_bench_restore_smoke(tmp_path):
    result = _smoke("bench_restore.py", tmp_path)
    cells = {(r["format"], r["loader"]) for r in result["rows"]}
    assert cells == {
        ("h5", "keras"), ("h5", "shardckpt"), ("h5", "shardckpt-built"),
        ("orbax", "keras"), ("orbax", "shardckpt"), ("safetensors", "shardckpt"),
    }
    for row in result["rows"]:
        if row["loader"] != "keras" or row["format"] != "safetensors":
            assert row["load_s"] > 0, row
        assert row["sharding"] == "P('model', None)", row  # the down kernel, row-sharded
        if row["format"] == "orbax":
            assert row["ts_read_s"] > 0 and row["ts_pread_s"] > 0, row


@pytest.mark.slow
def test_bench_convert_smoke(tmp_path):
    result = _smoke("bench_convert.py", tmp_path)
    assert set(result["convert"]) == set(result["restore"]) == {"none", "zstd"}
    assert result["keras"]["seconds"] > 0 and result["h5_bytes"] > 0
    for compression in ("none", "zstd"):
        assert result["convert"][compression]["disk_bytes"] > 0
        assert result["restore"][compression]["seconds"] > 0


@pytest.mark.slow
def test_bench_chunks_smoke(tmp_path):
    result = _smoke("bench_chunks.py", tmp_path)
    cells = {(r["writer"], r["chunks"], r["compression"]) for r in result["rows"]}
    assert cells == {(w, c, "zstd") for w in ("convert", "callback") for c in ("shard", "1")}
    for row in result["rows"]:
        assert row["disk_bytes"] > 0 and len(row["save_s"]) == len(row["restore_s"]) == 1, row
        assert row["restore_s"][0] > 0 and row["keras_s"][0] > 0, row
        assert row["sharding"] == "P('model', None)", row  # the down kernel, row-sharded
        assert row["budget"] == default_max_inflight_bytes(), row


@pytest.mark.slow
def test_bench_hf_smoke(tmp_path):
    result = _smoke("bench_hf.py", tmp_path)
    assert result["equal"] is True  # keras-hub's and shardckpt's values and shardings
    assert {(r["dtype"], r["loader"]) for r in result["rows"]} == {("float32", "keras-hub"), ("float32", "shardckpt")}
    for row in result["rows"]:
        assert row["ready_s"] > 0 and row["sharding"] == "P('model', 'batch', None)", row


def test_bench_storage_smoke(tmp_path):
    """Orbax, .weights.h5 and safetensors from local disk, fake GCS and fake S3 (started by
    the bench itself on 127.0.0.1) all load the same values."""
    result = _smoke("bench_storage.py", tmp_path)
    assert [r["source"] for r in result["rows"]] == [
        f"{fmt} {where}" for fmt in ("orbax", "h5", "safetensors") for where in ("local disk", "fake GCS", "fake S3")
    ]
    assert len({r["checksum"] for r in result["rows"]}) == 1
    for row in result["rows"]:
        assert row["load_s"] > 0 and row["bytes_read"] > 0, row
        assert row["sharding"] == "P('model', None)", row  # the down kernel, row-sharded


@pytest.mark.slow
def test_bench_export_smoke(tmp_path):
    pytest.importorskip("keras_hub")
    rows = _smoke("bench_export.py", tmp_path)["rows"]
    assert set(rows) == {"shardckpt-hf", "keras-hub-hf", "shardckpt-preset", "keras-hub-preset"}
    for cell, row in rows.items():
        assert row["seconds"] > 0 and row["written_gb"] > 0 and row["state_gb"] > 0, (cell, row)
