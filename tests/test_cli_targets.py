"""`shardckpt convert` does what its help says: a keras-hub preset folder to every target,
`shardckpt.convert(to=...)` beside it, `--model` found in the current directory, shell-speaking
help and errors."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
from safetensors.numpy import load_file

import shardckpt
from shardckpt import budget
from shardckpt.cli import main
from shardckpt.cli.reports import convert_json

keras_hub = pytest.importorskip("keras_hub")
LLAMA = dict(vocabulary_size=64, num_layers=1, num_query_heads=8, num_key_value_heads=8, hidden_dim=32,
             intermediate_dim=64)


def _run(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def preset(tmp_path_factory):
    """A keras-hub Llama preset folder (save_to_preset) with random values, and those values by path."""
    keras.backend.clear_session()
    backbone = keras_hub.models.Llama3Backbone(**LLAMA)
    rng = np.random.default_rng(0)
    for v in backbone.weights:
        v.assign(rng.standard_normal(v.shape).astype(np.float32))
    folder = tmp_path_factory.mktemp("cli_targets") / "preset"
    backbone.save_to_preset(str(folder))
    values = {v.path: np.asarray(v.value) for v in backbone.weights}
    keras.backend.clear_session()
    return str(folder), values


def _lazy_llama():
    keras.backend.clear_session()
    with shardckpt.lazy_init():
        return keras_hub.models.Llama3Backbone(**LLAMA)


def test_convert_a_keras_hub_preset_folder_to_orbax_reads_back_bit_equal(preset, tmp_path):
    folder, values = preset
    out = str(tmp_path / "orbax")
    code, stdout, err = _run(["convert", folder, out, "--quiet"])
    assert code == 0, err
    assert "to Orbax" in stdout
    model = _lazy_llama()
    mesh = keras.distribution.DeviceMesh((2, 4), ["data", "model"])
    plan = shardckpt.auto_layout(model, mesh)
    shardckpt.load_sharded(model, out, layout=plan)
    assert sorted(v.path for v in model.weights) == sorted(values)
    for v in model.weights:
        assert v.value.sharding == plan.sharding_for(v), v.path
        np.testing.assert_array_equal(np.asarray(v.value), values[v.path], err_msg=v.path)


@pytest.mark.parametrize("target", ["keras-hub", "hf", "safetensors"])
def test_convert_a_keras_hub_preset_folder_to_every_other_target(preset, tmp_path, target):
    folder, values = preset
    out = str(tmp_path / target)
    code, stdout, err = _run(["convert", folder, out, "--to", target, "--mesh", "2x4", "--quiet"])
    assert code == 0, err
    keras.backend.clear_session()
    if target == "safetensors":  # keyed by variable path
        _assert_safetensors_hold(out, values)
        return
    model = shardckpt.from_preset(out, mesh=(2, 4))
    keras.distribution.set_distribution(None)
    assert sorted(v.path for v in model.weights) == sorted(values)
    for v in model.weights:
        np.testing.assert_array_equal(np.asarray(v.value), values[v.path], err_msg=v.path)


@pytest.mark.parametrize("target", ["orbax", "hf", "keras-hub", "safetensors"])
def test_convert_dtype_lists_each_cast_in_text_and_json(preset, tmp_path, target):
    """`--dtype` lists every array it casts under "cast", in the text and in --json, for every
    target: the orbax one by source key, the others (exported) by variable path."""
    folder, values = preset
    out = str(tmp_path / "text")
    code, stdout, err = _run(["convert", folder, out, "--to", target, "--dtype", "bfloat16", "--quiet"])
    assert code == 0, err
    cast_lines = [line for line in stdout.splitlines() if line.startswith("  cast: ")]
    assert len(cast_lines) == 1, stdout
    assert "float32 -> bfloat16" in cast_lines[0] and f"({len(values)} total)" in cast_lines[0], stdout
    keras.distribution.set_distribution(None)
    code, stdout, err = _run(["convert", folder, str(tmp_path / "json"), "--to", target, "--dtype", "bfloat16",
                              "--quiet", "--json"])
    assert code == 0, err
    casts = json.loads(stdout)["casts"]
    named = sorted(c.split(": ")[0] for c in casts)
    assert all(c.endswith(": float32 -> bfloat16") for c in casts), casts
    if target == "orbax":  # source keys of the preset's model.weights.h5
        assert len(named) == len(values)
    else:
        assert named == sorted(values)
    keras.distribution.set_distribution(None)


@pytest.mark.parametrize("source", ["preset folder", "weights file and --model"])
def test_max_inflight_mb_bounds_the_models_load_too(preset, tmp_path, source):
    """`--max-inflight-mb` reaches the load of the model, not only the writing: the report the
    command prints names the load's budget, the one given; without the flag, load_sharded's default.
    Both ways a target loads the model: from_preset (a preset folder) and load_sharded (--model)."""
    folder, values = preset
    src = [folder] if source == "preset folder" else [os.path.join(folder, "model.weights.h5"), "--model", folder]
    out = str(tmp_path / "given")
    code, stdout, err = _run(["convert", *src, out, "--to", "safetensors", "--mesh", "2x4", "--max-inflight-mb", "3",
                              "--quiet"])
    assert code == 0, err
    lines = stdout.splitlines()
    assert lines[0].startswith(f"Loaded {len(values)} arrays"), stdout
    assert "Host-memory budget of the load: 3 MiB, given." in lines, stdout
    assert lines[-1].startswith(f"exported {len(values)} arrays"), stdout
    _assert_safetensors_hold(out, values)
    keras.distribution.set_distribution(None)
    code, stdout, err = _run(["convert", *src, str(tmp_path / "default"), "--to", "safetensors", "--mesh", "2x4",
                              "--quiet", "--json"])
    assert code == 0, err
    load = json.loads(stdout)["load"]
    assert load["max_inflight_bytes"] == budget.resolve(None, accelerators=0)  # CPU devices: no accelerator
    assert load["budget_rule"] == budget.describe_default(0)
    assert load["arrays"] == len(values) and not load["missing"] and not load["unexpected"]


def test_convert_json_summarises_the_loads_timeline_unless_timeline_is_asked(preset, tmp_path, capsys):
    """`convert --json` of a target that loads the model prints the load's transfer timeline as
    counts, bytes and seconds (`timeline_summary`), not one entry per read and transfer; `--timeline`
    adds the entries. The Python report keeps every entry either way."""
    folder, values = preset
    args = ["convert", folder, str(tmp_path / "a"), "--to", "safetensors", "--mesh", "2x4", "--quiet", "--json"]
    code, stdout, err = _run(args)
    assert code == 0, err
    load = json.loads(stdout)["load"]
    assert "timeline" not in load
    # CPU devices: pieces go to their devices directly, no pipeline, no events.
    assert load["transfer"] == "direct" and load["arrays"] == len(values)
    assert load["timeline_summary"] == {"events": 0, "reads": 0, "read_bytes": 0, "transfers": 0,
                                        "transfer_bytes": 0, "seconds": 0.0}
    keras.distribution.set_distribution(None)
    args[2] = str(tmp_path / "b")
    code, stdout, err = _run([*args, "--timeline"])
    assert code == 0, err
    load = json.loads(stdout)["load"]
    assert load["timeline"] == [] and load["timeline_summary"]["events"] == 0
    keras.distribution.set_distribution(None)
    for bad, said in ((["--to", "hf", "--timeline"], "pass --json too"),
                      (["--json", "--timeline"], "--timeline applies to --to hf, keras-hub and safetensors")):
        with pytest.raises(SystemExit) as e:
            main(["convert", folder, str(tmp_path / "c"), *bad])
        assert e.value.code == 2 and said in capsys.readouterr().err
    assert not (tmp_path / "c").exists()

    # A load through the transfer pipeline (forced on CPU devices: every piece is copied through
    # the ring), so the report has a timeline to summarise.
    model = _lazy_llama()
    plan = shardckpt.auto_layout(model, keras.distribution.DeviceMesh((2, 4), ["data", "model"]))
    ring = shardckpt.load_sharded(model, folder, layout=plan, transfer="ring")
    for v in model.weights:
        np.testing.assert_array_equal(np.asarray(v.value), values[v.path], err_msg=v.path)
    events = list(ring.timeline)
    reads = [e for e in events if e.kind == "read"]
    transfers = [e for e in events if e.kind == "transfer"]
    assert ring.transfer == "ring" and reads and transfers and len(reads) + len(transfers) == len(events)
    report = dataclasses.replace(shardckpt.export(model, tmp_path / "d", format="safetensors"), load=ring)
    data = convert_json(report)
    assert "timeline" not in data["load"]
    assert data["load"]["timeline_summary"] == {
        "events": len(events),
        "reads": len(reads),
        "read_bytes": sum(e.nbytes for e in reads),
        "transfers": len(transfers),
        "transfer_bytes": sum(e.nbytes for e in transfers),
        "seconds": max(e.end for e in events) - min(e.start for e in events),
    }
    # Every byte read went through the ring, and each device got its shard of every variable.
    assert data["load"]["timeline_summary"]["read_bytes"] == ring.bytes_read
    shards = sum(s.data.nbytes for v in model.weights for s in v.value.addressable_shards)
    assert data["load"]["timeline_summary"]["transfer_bytes"] == shards
    assert {k: v for k, v in data["load"].items() if k != "timeline_summary"} == {
        k: v for k, v in dataclasses.asdict(ring).items() if k != "timeline"}
    assert {k: v for k, v in data.items() if k != "load"} == {
        k: v for k, v in dataclasses.asdict(report).items() if k != "load"}
    json.dumps(data)
    full = convert_json(report, timeline=True)
    assert full["load"]["timeline"] == [dataclasses.asdict(e) for e in events]
    assert full["load"]["timeline_summary"] == data["load"]["timeline_summary"]
    assert report.load.timeline == events  # the Python report keeps every entry


def test_python_convert_takes_to_like_the_cli(preset, tmp_path):
    folder, values = preset
    report = shardckpt.convert(folder, tmp_path / "kh", to="keras-hub")
    assert isinstance(report, shardckpt.ExportReport) and report.arrays == len(values)
    keras.distribution.set_distribution(None)
    assert isinstance(shardckpt.convert(folder, tmp_path / "ob"), shardckpt.ConvertReport)
    with pytest.raises(ValueError, match="to must be one of orbax, hf, keras-hub, safetensors"):
        shardckpt.convert(folder, tmp_path / "x", to="onnx")
    with pytest.raises(ValueError, match="max_shard_size applies to"):
        shardckpt.convert(folder, tmp_path / "y", max_shard_size="1GB")
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_model_given_as_a_keras_hub_preset_folder(preset, tmp_path):
    """`--model preset_folder/` gives the architecture of a bare .weights.h5."""
    folder, values = preset
    out = str(tmp_path / "orbax")
    code, _, err = _run(["convert", os.path.join(folder, "model.weights.h5"), out, "--model", folder, "--quiet"])
    assert code == 0, err
    model = _lazy_llama()
    shardckpt.load_sharded(model, out, layout=keras.distribution.DataParallel())
    for v in model.weights:
        np.testing.assert_array_equal(np.asarray(v.value), values[v.path], err_msg=v.path)


def test_console_script_finds_model_modules_in_the_current_directory(preset, tmp_path):
    folder, values = preset
    (tmp_path / "mymodels.py").write_text(
        "import keras_hub\n\n\ndef build():\n"
        f"    return keras_hub.models.Llama3Backbone(**{LLAMA!r})\n"
    )
    script = os.path.join(os.path.dirname(sys.executable), "shardckpt")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [script, "convert", os.path.join(folder, "model.weights.h5"), "out", "--model", "mymodels:build", "--quiet"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env,
    )
    assert done.returncode == 0, done.stderr
    model = _lazy_llama()
    shardckpt.load_sharded(model, str(tmp_path / "out"), layout=keras.distribution.DataParallel())
    for v in model.weights:
        np.testing.assert_array_equal(np.asarray(v.value), values[v.path], err_msg=v.path)


def test_help_and_errors_speak_shell(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    top = " ".join(capsys.readouterr().out.split())
    assert "orbax | hf | keras-hub | safetensors" in top and "to an Orbax checkpoint" not in top
    with pytest.raises(SystemExit) as e:
        main(["plan", "mymodels:build", "--mesh", "2x4x1"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert "--mesh 2x4" in err and "Received: --mesh 2x4x1" in err
    assert "DeviceMesh" not in err and "axis_names" not in err
    with pytest.raises(SystemExit) as e:
        main(["convert", "a", "b", "--to", "hf", "--compression", "zstd"])
    assert e.value.code == 2 and "--compression applies to --to orbax" in capsys.readouterr().err


def _assert_safetensors_hold(folder: str, values: dict) -> None:
    """The `.safetensors` files of `folder` hold exactly `values` (variable path -> array), bit-equal."""
    stored = {}
    for name in os.listdir(folder):
        if name.endswith(".safetensors"):
            stored.update(load_file(os.path.join(folder, name)))
    assert sorted(stored) == sorted(values)
    for path, want in values.items():
        np.testing.assert_array_equal(stored[path], want, err_msg=path)


def test_max_shard_size_as_a_bare_number_is_gb_as_in_python(preset, tmp_path):
    """`--max-shard-size 0.00001` splits as `max_shard_size=0.00001` does (GB, keras-hub's unit); it used to
    end in a ValueError traceback after the model's load."""
    folder, values = preset
    cli, py = str(tmp_path / "cli"), str(tmp_path / "py")
    code, _, err = _run(["convert", folder, cli, "--to", "hf", "--max-shard-size", "0.00001", "--quiet"])
    assert code == 0, err
    keras.distribution.set_distribution(None)
    keras.backend.clear_session()
    shardckpt.convert(folder, py, to="hf", max_shard_size=0.00001)
    names = sorted(os.listdir(cli))
    assert names == sorted(os.listdir(py)) and "model.safetensors.index.json" in names
    for name in names:
        with open(os.path.join(cli, name), "rb") as a, open(os.path.join(py, name), "rb") as b:
            assert a.read() == b.read(), name


@pytest.mark.parametrize("size", ["banana", "1.5.2GB", "inf", "-1"])
def test_a_max_shard_size_that_does_not_parse_is_a_usage_error_before_anything_loads(tmp_path, capsys, size):
    """The source is a bare .weights.h5 with no --model: the load's first step would refuse it (exit 1);
    the size is refused before it (exit 2, one line), as in Python."""
    weights = str(tmp_path / "w.weights.h5")
    with open(weights, "wb"):
        pass
    with pytest.raises(SystemExit) as e:
        main(["convert", weights, str(tmp_path / "out"), "--to", "hf", "--max-shard-size", size])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--max-shard-size: max_shard_size must be" in err and "Traceback" not in err
    with pytest.raises(ValueError, match="max_shard_size must be"):
        shardckpt.convert(weights, tmp_path / "out", to="hf", max_shard_size=size)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("target", ["hf", "keras-hub", "safetensors"])
def test_an_existing_destination_is_refused_before_the_load_with_the_force_hint(tmp_path, target):
    """The refusal came from `export` after the model's load, and named `overwrite=True`, which
    neither the command (`--force`) nor `shardckpt.convert` (`force=True`) takes. The source is a bare
    .weights.h5 with no --model, which the load's first step would refuse: the destination comes first."""
    weights, out = str(tmp_path / "w.weights.h5"), tmp_path / "out"
    with open(weights, "wb"):
        pass
    out.mkdir()
    code, _, err = _run(["convert", weights, str(out), "--to", target, "--quiet"])
    assert code == 1 and "already exists" in err and "--force" in err and "overwrite" not in err, err
    with pytest.raises(shardckpt.errors.DestinationExistsError, match=r"force=True"):
        shardckpt.convert(weights, out, to=target)
    assert os.listdir(out) == []


def test_force_replaces_an_existing_destination(preset, tmp_path):
    """The hint, followed: `--force` replaces the folder with the export."""
    folder, values = preset
    out = tmp_path / "hf"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    code, _, err = _run(["convert", folder, str(out), "--to", "safetensors", "--force", "--quiet"])
    assert code == 0, err
    assert "stale.txt" not in os.listdir(out)
    _assert_safetensors_hold(str(out), values)
