"""The host's default `max_inflight_bytes`: the rule, the host's figures, where it reaches."""

from __future__ import annotations

import importlib

import keras
import numpy as np
import pytest

import shardckpt
from shardckpt import budget

MIB, GIB, GB = 2**20, 2**30, 10**9
cli = importlib.import_module("shardckpt.cli.main")  # the module (shardckpt.cli.main is the function)


@pytest.mark.parametrize(
    ("cores", "memory", "expected"),
    [
        (2, 24 * GB, 256 * MIB),  # the CI machine keeps the former fixed default
        (16, 128 * GB, 1 * GIB),  # an H100 host: 64 MiB per core
        (8, 64 * GIB, 512 * MIB),
        (64, 512 * GIB, 4 * GIB),  # cap
        (256, 4096 * GIB, 4 * GIB),  # cap
        (64, 16 * GIB, 512 * MIB),  # memory / 32
        (16, 4 * GIB, 256 * MIB),  # low memory: the floor wins over memory / 32 (128 MiB)
        (1, 1 * GIB, 256 * MIB),  # floor
        (0, 0, 256 * MIB),  # nothing known: the floor
    ],
)
def test_rule(cores, memory, expected):
    assert budget.inflight_bytes_for(cores, memory) == expected


@pytest.mark.parametrize(
    ("cores", "memory", "accelerators", "expected"),
    [
        (16, 125 * GB, 1, 125 * GB // 32 // MIB * MIB),  # one H200's host: memory / 32, not the cores' 1 GiB
        (16, 256 * GIB, 1, 4 * GIB),  # 4 GiB per accelerator
        (96, 2048 * GIB, 8, 32 * GIB),  # eight GPUs: past the core rule's 4 GiB cap
        (96, 512 * GIB, 8, 16 * GIB),  # memory / 32 still bounds it
        (2, 24 * GB, 1, 24 * GB // 32 // MIB * MIB),
        (64, 512 * GIB, 0, 4 * GIB),  # no accelerator: the core rule
        (16, 4 * GIB, 1, 256 * MIB),  # never below the core rule (its floor here)
    ],
)
def test_accelerator_rule(cores, memory, accelerators, expected):
    assert budget.inflight_bytes_for_accelerators(cores, memory, accelerators) == expected
    assert expected >= budget.inflight_bytes_for(cores, memory)


def test_report_says_how_the_budget_was_chosen(tmp_path):
    from tests.zoo import build_zoo, lazy_zoo

    keras.backend.clear_session()
    path = str(tmp_path / "m.weights.h5")
    build_zoo().save_weights(path)
    model, _ = lazy_zoo()
    report = shardckpt.load_sharded(model, path, layout=keras.distribution.DataParallel())
    assert report.budget_rule.startswith(f"host default: {budget.usable_cores()} cores")
    assert report.max_inflight_bytes == budget.default_max_inflight_bytes()  # CPU devices: no accelerator
    model, _ = lazy_zoo()
    report = shardckpt.load_sharded(model, path, max_inflight_bytes=3 * MIB, layout=keras.distribution.DataParallel())
    assert report.budget_rule == "given"


def test_rule_rounds_to_whole_mib():
    # 48 cores, 40 GB: memory / 32 = 1.25e9 bytes, not a whole number of MiB.
    assert budget.inflight_bytes_for(48, 40 * GB) == (40 * GB // 32) // MIB * MIB


def test_default_is_the_rule_on_this_hosts_figures():
    cores, memory = budget.usable_cores(), budget.host_memory_bytes()
    assert cores >= 1 and memory > 0
    assert budget.default_max_inflight_bytes() == budget.inflight_bytes_for(cores, memory)
    assert budget.resolve(None) == budget.default_max_inflight_bytes()
    assert budget.resolve(12345) == 12345


def test_cgroup_limit_below_physical_memory_wins(tmp_path, monkeypatch):
    limit = tmp_path / "memory.max"
    monkeypatch.setattr(budget, "_CGROUP_MEMORY_MAX", str(limit))
    monkeypatch.setattr(budget, "_CGROUP_V1_LIMIT", str(tmp_path / "absent"))
    limit.write_text("max\n")  # cgroup v2: no limit
    physical = budget.host_memory_bytes()
    limit.write_text(f"{2 * GIB}\n")
    assert budget.host_memory_bytes() == min(2 * GIB, physical)
    limit.write_text(f"{physical * 4}\n")  # above physical memory: physical memory wins
    assert budget.host_memory_bytes() == physical


def test_chunk_cache_keeps_its_cap_under_large_budgets():
    assert budget.chunk_cache_bytes(4 * GIB) == budget.chunk_cache_bytes(1 * GIB) == 32 * MIB
    assert budget.chunk_cache_bytes(8 * MIB) == 8 * MIB


def test_default_budget_reaches_restore_and_explicit_wins(tmp_path):
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    expected = [np.asarray(v.value) for v in model.weights]
    path = str(tmp_path / "m.weights.h5")
    model.save_weights(path)
    report = shardckpt.load_sharded(model, path, progress=False)
    assert report.max_inflight_bytes == budget.default_max_inflight_bytes()
    report = shardckpt.load_sharded(model, path, max_inflight_bytes=64, progress=False)
    assert report.max_inflight_bytes == 64
    for v, want in zip(model.weights, expected, strict=True):
        np.testing.assert_array_equal(np.asarray(v.value), want)


def test_cli_default_and_help_show_the_hosts_budget(capsys):
    mib = budget.default_max_inflight_bytes() // MIB
    with pytest.raises(SystemExit):
        cli.main(["convert", "--help"])
    assert f"memory/32): {mib};" in " ".join(capsys.readouterr().out.split())
    # Not passed down: the library resolves it where it knows what the call feeds (accelerators).
    assert cli._parser().parse_args(["convert", "a.h5", "b"]).max_inflight_mb is None


def test_every_entry_point_has_the_same_lower_bound(tmp_path):
    """load_sharded, convert and verify refuse the same budgets and accept the same (64 bytes)."""

    def build():  # named: Orbax keys hold the names
        return keras.Sequential([keras.Input((8,)), keras.layers.Dense(4, name="d")], name="s")

    model = build()
    path = str(tmp_path / "m.weights.h5")
    model.save_weights(path)
    entry_points = {
        "load_sharded": lambda b: shardckpt.load_sharded(model, path, max_inflight_bytes=b, progress=False),
        "convert": lambda b: shardckpt.convert(
            path, str(tmp_path / f"out_{b}"), model=model, max_inflight_bytes=b, progress=False
        ),
        "verify": lambda b: shardckpt.verify(path, max_inflight_bytes=b),
    }
    for name, call in entry_points.items():
        for bad in (0, -1, 1.5, True):
            with pytest.raises(ValueError, match=r"max_inflight_bytes must be a positive number of bytes"):
                call(bad)
        assert call(np.int64(64)) is not None, name  # one row of 8 floats at a time
    restored = build()
    shardckpt.load_sharded(restored, str(tmp_path / "out_64"), progress=False)
    for v, want in zip(restored.weights, model.weights, strict=True):
        np.testing.assert_array_equal(np.asarray(v.value), np.asarray(want.value))
