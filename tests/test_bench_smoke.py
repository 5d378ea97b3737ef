"""Every benchmark in tools/ runs at its `--smoke` size, in a fresh process, so none can rot.

Smoke sizes are tiny: the figures mean nothing; the scripts' code paths
(every cell, every loader, the result line) are what is checked. A smoke runs
its cells in one shared child process (`tools/_bench.py`, `share_children`),
not one fresh process each as a real run does: one start-up per script.
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
RUN_ELSEWHERE = {
    # Run at --smoke by these tests, with the arguments and row checks of their own.
    "bench_layout.py": "test_layout_hub.py::test_bench_layout_smoke_runs_both_plans",
    "bench_save.py": "test_bench_save.py::test_bench_save_smoke_reports_blocking_and_peak_memory_per_mode",
    "bench_preset.py": "test_bench_preset.py::test_bench_preset_smoke",
}


def _smoke(name: str, tmp_path, *extra: str) -> dict:
    proc = subprocess.run(
        [sys.executable, os.path.join(TOOLS, name), "--smoke", *extra],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, f"{name} --smoke failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    results = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert results, f"{name} --smoke printed no RESULT line:\n{proc.stdout[-3000:]}"
    return json.loads(results[-1][len("RESULT "):])


@pytest.mark.slow
@pytest.mark.parametrize("name", [b for b in BENCHES if b not in RUN_ELSEWHERE])
def test_every_bench_runs_at_its_smoke_size(name, tmp_path):
    """Every bench in tools/ (a new one too: the list is globbed) runs at --smoke in a fresh
    process and prints its RESULT; the benches' own rows are checked where a check is known."""
    result = _smoke(name, tmp_path)
    check = CHECKS.get(name)
    if check is not None:
        check(result)


def test_benches_run_elsewhere_are_run_there():
    """The benches left out above are run by the tests named for them (as pytest collects them)."""
    here = os.path.dirname(os.path.abspath(__file__))
    assert set(RUN_ELSEWHERE) <= set(BENCHES)
    paths = sorted({os.path.join(here, test.split("::")[0]) for test in RUN_ELSEWHERE.values()})
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:xdist", "-o", "addopts=", *paths],
        capture_output=True, text=True, timeout=300, cwd=os.path.dirname(here),
    )
    for test in RUN_ELSEWHERE.values():
        assert f"tests/{test}" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]


@pytest.mark.slow
def test_bench_restore_checksums_smoke(tmp_path):
    """bench_restore --checksums restores convert's output with and without per-chunk crc32c."""
    result = _smoke("bench_restore.py", tmp_path, "--checksums")["checksums"]
    assert result["compression"] == "none"
    assert set(result["load_s"]) == {"orbax-crc32c", "orbax-no-checksum"}
    assert all(len(t) == 1 and t[0] > 0 for t in result["load_s"].values()), result
    # tensorstore takes plain chunks in place from the mapped file and copies
    # every checksummed one (README "Damage": why the checksum costs a copy).
    plain, crc = result["decoded"]["orbax-no-checksum"], result["decoded"]["orbax-crc32c"]
    assert crc["zero_copy_gb"] == 0 and crc["copied_gb"] > 0, result
    assert plain["zero_copy_gb"] > 100 * plain["copied_gb"], result


def _check_restore(result: dict) -> None:
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


def _check_convert(result: dict) -> None:
    assert set(result["convert"]) == set(result["restore"]) == {"none", "zstd"}
    assert result["keras"]["seconds"] > 0 and result["h5_bytes"] > 0
    assert result["cli"]["seconds"] > 0 and result["cli"]["disk_bytes"] > 0
    for compression in ("none", "zstd"):
        assert result["convert"][compression]["disk_bytes"] > 0
        assert result["restore"][compression]["seconds"] > 0


def _check_chunks(result: dict) -> None:
    cells = {(r["writer"], r["chunks"], r["compression"]) for r in result["rows"]}
    assert cells == {(w, c, "zstd") for w in ("convert", "callback") for c in ("shard", "1")}
    for row in result["rows"]:
        assert row["disk_bytes"] > 0 and len(row["save_s"]) == len(row["restore_s"]) == 1, row
        assert row["restore_s"][0] > 0 and row["keras_s"][0] > 0, row
        assert row["sharding"] == "P('model', None)", row  # the down kernel, row-sharded
        assert row["budget"] == default_max_inflight_bytes(), row


def _check_hf(result: dict) -> None:
    assert result["equal"] is True  # keras-hub's and shardckpt's values and shardings
    assert {(r["dtype"], r["loader"]) for r in result["rows"]} == {("float32", "keras-hub"), ("float32", "shardckpt")}
    for row in result["rows"]:
        assert row["ready_s"] > 0 and row["sharding"] == "P('model', 'batch', None)", row


def _check_storage(result: dict) -> None:
    """Orbax, .weights.h5 and safetensors from local disk, fake GCS and fake S3 (started by
    the bench itself on 127.0.0.1) all load the same values."""
    assert [r["source"] for r in result["rows"]] == [
        f"{fmt} {where}" for fmt in ("orbax", "h5", "safetensors") for where in ("local disk", "fake GCS", "fake S3")
    ]
    assert len({r["checksum"] for r in result["rows"]}) == 1
    for row in result["rows"]:
        assert row["load_s"] > 0 and row["bytes_read"] > 0, row
        assert row["sharding"] == "P('model', None)", row  # the down kernel, row-sharded
    # Saves from 1 and 2 processes into each server: one row per process, each
    # writing and reading its share; both processes' parts add up to the same values.
    saves = result["save_rows"]
    assert [(r["source"], r["processes"], r["process"]) for r in saves] == [
        (f"fake {cloud}", n, i) for cloud in ("GCS", "S3") for n in (1, 2) for i in range(n)]
    for row in saves:
        assert row["save_s"] > 0 and row["written_gb"] > 0 and row["read_gb"] > 0 and row["blocking_s"] > 0, row
        assert row["peak_over_state_gb"] <= 1.1 * row["budget_gb"], row
    for cloud in ("GCS", "S3"):
        parts = {n: sum(r["checksum_part"] for r in saves if r["source"] == f"fake {cloud}" and r["processes"] == n)
                 for n in (1, 2)}
        assert parts[1] == pytest.approx(parts[2]), parts


def _check_export(result: dict) -> None:
    rows = result["rows"]
    assert set(rows) == {"shardckpt-hf", "keras-hub-hf", "shardckpt-preset", "keras-hub-preset"}
    for cell, row in rows.items():
        assert row["seconds"] > 0 and row["written_gb"] > 0 and row["state_gb"] > 0, (cell, row)


def _check_gpu(result: dict) -> None:
    """bench_gpu's CPU dry path: bench_restore at --smoke for every format, GB/s beside each load."""
    rows = result["sizes"]["smoke"]["rows"]
    cells = {(r["format"], r["loader"]) for r in rows}
    for fmt in ("h5", "orbax", "orbax-crc32c"):
        assert {(fmt, "keras"), (fmt, "shardckpt")} <= cells, cells
    assert ("safetensors", "shardckpt") in cells
    for row in rows:
        if row["load_s"]:
            assert row["load_gb_per_s"] == row["state_gb"] / row["load_s"] > 0
    # Issue 35's save run and the transfer probe ride along in the same command.
    assert [r["name"] for r in result["save"]["results"]] == ["keras_sync", "shardckpt_auto"]
    assert {r["way"] for r in result["transfer"]} == {"view", "view-64m", "slot-pinned", "slot", "fresh"}
    assert result["failed"] == []


CHECKS = {
    "bench_gpu.py": _check_gpu,
    "bench_restore.py": _check_restore,
    "bench_convert.py": _check_convert,
    "bench_chunks.py": _check_chunks,
    "bench_hf.py": _check_hf,
    "bench_storage.py": _check_storage,
    "bench_export.py": _check_export,
}
