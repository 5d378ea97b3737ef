"""The `shardckpt` command: exit codes, one-line errors, --json output."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import keras
import numpy as np
import pytest

import shardckpt
from shardckpt.cli import main
from tests.zoo import build_zoo, saved_zoo_h5

MODEL = "tests.zoo:build_zoo"  # --model package.module:function


@pytest.fixture
def h5(tmp_path):
    return saved_zoo_h5(str(tmp_path / "m.weights.h5"), 0)


def _one_error_line(capsys, *needles):
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert "Traceback" not in captured.err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_convert_then_inspect_json_and_verify(tmp_path, h5, capsys):
    src, expected = h5
    dst = str(tmp_path / "out")
    assert main(["convert", src, dst, "--model", MODEL, "--quiet"]) == 0
    assert "Converted" in capsys.readouterr().out
    keras.backend.clear_session()
    with shardckpt.lazy_init():
        model = build_zoo()
    shardckpt.load_sharded(model, dst, layout=keras.distribution.DataParallel())
    for v in model.weights:
        np.testing.assert_array_equal(np.asarray(v.value), expected[v.path])

    assert main(["inspect", dst, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["format"] == "orbax" and data["items"] == ["pytree"]
    arrays = {a["key"]: a for a in data["arrays"]}
    head = arrays["trainable_variables/head/kernel"]
    assert head["shape"] == list(expected["head/kernel"].shape) and head["dtype"] == "float32"
    assert head["nbytes"] == expected["head/kernel"].nbytes
    assert all(a["checksum"].startswith("crc32:") for a in arrays.values())

    assert main(["inspect", dst]) == 0
    table = capsys.readouterr().out
    assert "trainable_variables/head/kernel" in table and "crc32" in table

    assert main(["verify", dst, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["checksummed"] == len(arrays) and report["damaged"] == []


def test_inspect_json_of_h5_and_safetensors(tmp_path, h5, capsys):
    src, expected = h5
    assert main(["inspect", src, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["format"] == "h5" and len(data["arrays"]) == len(expected)
    assert all(a["checksum"] is None for a in data["arrays"])
    import safetensors.numpy as stnp

    st = str(tmp_path / "m.safetensors")
    stnp.save_file(expected, st)
    assert main(["inspect", st, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {a["key"]: tuple(a["shape"]) for a in data["arrays"]} == {k: v.shape for k, v in expected.items()}


def test_bad_inputs_exit_1_with_one_line_and_write_nothing(tmp_path, h5, capsys):
    src, _ = h5
    dst = tmp_path / "out"
    assert main(["convert", str(tmp_path / "nope.weights.h5"), str(dst)]) == 1
    _one_error_line(capsys, "No checkpoint at", "Fix:")

    text = tmp_path / "notes.txt"
    text.write_text("hello")
    assert main(["convert", str(text), str(dst)]) == 1
    _one_error_line(capsys, "not a checkpoint shardckpt reads")

    assert main(["convert", src, str(dst)]) == 1
    _one_error_line(capsys, "--model package.module:function")

    assert main(["convert", src, str(dst), "--model", "tests.zoo:no_such_fn"]) == 1
    _one_error_line(capsys, "no function 'no_such_fn'")

    truncated = tmp_path / "t.weights.h5"
    truncated.write_bytes(open(src, "rb").read()[: os.path.getsize(src) // 2])
    assert main(["convert", str(truncated), str(dst), "--model", MODEL]) == 1
    _one_error_line(capsys, "truncated", "Fix:")

    assert not dst.exists()
    assert sorted(os.listdir(tmp_path)) == ["m.weights.h5", "notes.txt", "t.weights.h5"]

    dst.mkdir()
    assert main(["convert", src, str(dst), "--model", MODEL]) == 1
    _one_error_line(capsys, "already exists", "--force")
    assert os.listdir(dst) == []
    assert main(["convert", src, str(dst), "--model", MODEL, "--force", "--quiet"]) == 0

    assert main(["verify", str(tmp_path / "missing")]) == 1
    _one_error_line(capsys, "No checkpoint at")
    assert main(["inspect", str(text)]) == 1
    _one_error_line(capsys, "not a checkpoint")


def test_usage_errors_exit_2(capsys):
    for argv in (["bogus"], ["convert", "only-src"], ["convert", "a", "b", "--compression", "lz4"], []):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
    assert "usage: shardckpt" in capsys.readouterr().err


def test_console_entry_point_help_runs():
    """The installed `shardckpt` script (pip's console entry point), not `python -m`."""
    from importlib.metadata import entry_points

    (entry,) = entry_points(group="console_scripts", name="shardckpt")
    assert entry.value == "shardckpt.cli:main"
    script = shutil.which("shardckpt", path=os.path.dirname(sys.executable))
    assert script is not None, f"no shardckpt script beside {sys.executable}: pip install -e ."
    out = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for command in ("convert", "inspect", "verify", "plan", "demo"):
        assert command in out.stdout
    # `python -m shardckpt.cli` is the same command.
    same = subprocess.run([sys.executable, "-m", "shardckpt.cli", "--help"], capture_output=True, text=True, timeout=120)
    assert same.returncode == 0 and same.stdout == out.stdout
