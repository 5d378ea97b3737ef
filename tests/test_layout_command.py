"""`shardckpt plan` behind the CLI: run_plan on a function and on a .keras file."""

from __future__ import annotations

import os
import sys

import keras
import pytest

from shardckpt.cli.plan import parse_mesh, run_plan
from shardckpt.errors import CheckpointNotFoundError, LayoutError, ModelRequiredError


def test_plan_from_function_prints_table_and_memory(capsys):
    assert run_plan("tests.stacks:build_default", "1x8", "adam") == 0
    out = capsys.readouterr().out
    assert "multi_head_attention/query/kernel" in out
    assert "per device (weights):" in out and "adam slots" in out
    from shardckpt import lazy_init
    from shardckpt.layout import auto_layout
    from tests import stacks

    keras.backend.clear_session()
    with lazy_init():
        model = stacks.build_default()
    plan = auto_layout(model, (1, 8))
    assert f"per device (weights + adam slots): {plan.bytes_per_device('adam'):,} bytes" in out


def test_plan_from_keras_file_reads_config_only(tmp_path, capsys):
    from tests import stacks

    model = stacks.build_default()
    path = str(tmp_path / "m.keras")
    model.save(path)
    keras.backend.clear_session()
    assert run_plan(path, "2x4", None) == 0
    out = capsys.readouterr().out
    assert "'data': 2" in out and "'model': 4" in out


def test_plan_bad_arguments():
    assert parse_mesh("2x4") == (2, 4)
    with pytest.raises(LayoutError, match="--mesh must look like"):
        parse_mesh("2by4")
    with pytest.raises(LayoutError, match="needs 4 devices but 8"):
        run_plan("tests.stacks:build_default", "1x4", None)
    # MODEL is read by the same loader as `convert --model`, with its errors.
    with pytest.raises(ModelRequiredError, match="package.module:function"):
        run_plan("tests.stacks", "1x8", None)
    with pytest.raises(ModelRequiredError, match="has no function 'nope'"):
        run_plan("tests.stacks:nope", "1x8", None)
    with pytest.raises(CheckpointNotFoundError, match="missing.keras"):
        run_plan(os.path.join(sys.prefix, "missing.keras"), "1x8", None)


def test_plan_auto_mesh_fsdp_and_device_memory(capsys):
    from shardckpt.cli.plan import parse_bytes

    assert parse_bytes("16GiB") == 16 * 2**30 and parse_bytes("80GB") == 80 * 10**9 and parse_bytes("123") == 123
    with pytest.raises(LayoutError, match="--device-memory must be a size"):
        parse_bytes("lots")
    assert run_plan("tests.stacks:build_default", "auto", "adam", devices=8, fsdp=True, device_memory="16GiB") == 0
    out = capsys.readouterr().out
    assert "mesh chosen for 8 devices with FSDP" in out and "with FSDP; balance" in out
    assert "per device (weights):" in out and "per device (weights + adam slots):" in out
    assert "fits in 16GiB (17,179,869,184 bytes) per device: yes" in out
    assert run_plan("tests.stacks:build_default", "1x8", "adam", device_memory="1KiB") == 1
    out = capsys.readouterr().out
    assert "fits in 1KiB (1,024 bytes) per device: no" in out and "more than --device-memory 1KiB" in out


@pytest.mark.parametrize(
    ("mesh", "fsdp"), [("8x1", False), ("8x1", True), ("1x8", False)], ids=["data-parallel", "fsdp", "tensor-parallel"]
)
def test_sharded_fraction_counts_bytes_split_across_devices(mesh, fsdp, capsys):
    """A data-parallel (8, 1) plan splits nothing: its placements over the size-1 model axis leave
    every device the whole variable (it reported 99% split). FSDP's data axis does split."""
    import json

    import numpy as np

    from shardckpt import lazy_init
    from shardckpt.cli.plan import parse_mesh
    from shardckpt.layout import auto_layout
    from tests import stacks

    assert run_plan("tests.stacks:build_default", mesh, None, fsdp=fsdp, as_json=True) == 0
    data = json.loads(capsys.readouterr().out)
    keras.backend.clear_session()
    with lazy_init():
        model = stacks.build_default()
    plan = auto_layout(model, parse_mesh(mesh), fsdp=fsdp)
    # What JAX itself says of each variable's sharding: split when not every device holds all of it.
    nbytes = {v.path: int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in model.variables}
    split = sum(nbytes[v.path] for v in model.variables if not plan.sharding_for(v).is_fully_replicated)
    total = sum(nbytes.values())
    assert data["parameter_bytes"] == total
    assert plan.sharded_fraction() == data["sharded_fraction"] == split / total
    if mesh == "8x1" and not fsdp:
        assert data["sharded_fraction"] == 0.0 and data["bytes_per_device"] == total
        assert "0.0% of parameter bytes split" in str(plan.explain())
        assert run_plan("tests.stacks:build_default", mesh, None) == 0
        assert "0.0% split" in capsys.readouterr().out
    else:
        assert data["sharded_fraction"] > 0.9 and data["bytes_per_device"] < total / 4
