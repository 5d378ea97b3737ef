"""What users of this ecosystem expect from a command: `python -m shardckpt`,
`--version`, `--json` on every command, names in natural order, readable rates."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

import shardckpt
from shardckpt.cli import main
from shardckpt.natsort import natural_key, natural_sorted
from shardckpt.progress import format_bytes, format_rate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def test_python_m_shardckpt_version():
    """One subprocess (each imports JAX and Keras): `python -m shardckpt.cli` is
    tested beside the console script in tests/test_cli.py."""
    done = subprocess.run(
        [sys.executable, "-m", "shardckpt", "--version"], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"shardckpt {shardckpt.__version__}"


def test_version_flag_in_process(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"shardckpt {shardckpt.__version__}"


def test_natural_key_orders_numbers_as_numbers():
    names = ["dense_10", "dense_2", "dense", "dense_1", "layers/dense_10/vars/0", "layers/dense_9/vars/10"]
    assert natural_sorted(names) == [
        "dense", "dense_1", "dense_2", "dense_10", "layers/dense_9/vars/10", "layers/dense_10/vars/0"
    ]
    assert natural_key("a10b2") == ["a", 10, "b", 2, ""]


@pytest.fixture
def eleven_layers(tmp_path):
    """A model whose layers Keras names dense, dense_1, ..., dense_10."""
    keras.backend.clear_session()
    model = keras.Sequential([keras.Input((8,)), *[keras.layers.Dense(8) for _ in range(11)]])
    path = str(tmp_path / "m.weights.h5")
    model.save_weights(path)
    with open(tmp_path / "models.py", "w") as f:
        f.write(
            "import keras\n\n\ndef build():\n"
            "    return keras.Sequential([keras.Input((8,)), *[keras.layers.Dense(8) for _ in range(11)]])\n"
        )
    sys.path.insert(0, str(tmp_path))
    yield path
    sys.path.remove(str(tmp_path))
    sys.modules.pop("models", None)


def test_inspect_lists_keys_in_natural_order(eleven_layers, tmp_path):
    keys = [a.key for a in shardckpt.inspect(eleven_layers).arrays]
    assert keys.index("layers/dense_2/vars/0") < keys.index("layers/dense_10/vars/0")
    assert keys == natural_sorted(keys)
    code, out, _ = _run(["inspect", eleven_layers])
    assert code == 0 and out.index("layers/dense_2/vars/0") < out.index("layers/dense_10/vars/0")
    # Orbax trees are flattened with sorted dict keys (dense_10 before dense_2): sorted here too.
    dst = str(tmp_path / "orbax")
    keras.backend.clear_session()  # the converter's build names its layers dense ... dense_10
    assert _run(["convert", eleven_layers, dst, "--model", "models:build", "--quiet"])[0] == 0
    keys = [a.key for a in shardckpt.inspect(dst).arrays]
    assert keys == natural_sorted(keys) and keys != sorted(keys), keys
    assert keys.index("trainable_variables/sequential/dense_2/kernel") < keys.index(
        "trainable_variables/sequential/dense_10/kernel"
    )


def test_convert_and_plan_print_json(eleven_layers, tmp_path):
    dst = str(tmp_path / "orbax")
    code, out, _ = _run(["convert", eleven_layers, dst, "--model", "models:build", "--quiet", "--json"])
    report = json.loads(out)
    assert code == 0 and report["arrays"] == 22 and report["dst"] == dst and report["format"] == "h5"
    assert report["bytes_read"] == 11 * (8 * 8 + 8) * 4

    code, out, _ = _run(["plan", "models:build", "--mesh", "1x8", "--optimizer", "adam", "--json"])
    data = json.loads(out)
    assert code == 0 and data["problems"] == [] and data["optimizer"] == "adam"
    assert data["parameter_bytes"] == 11 * (8 * 8 + 8) * 4
    assert data["bytes_per_device_with_optimizer"] == 3 * data["bytes_per_device"]
    assert shardckpt.LayoutPlan.from_json(json.dumps(data["plan"])).mesh.shape == (1, 8)


def test_plan_without_a_mesh_chooses_the_mesh_the_library_chooses(eleven_layers):
    """No --mesh, no --devices: the mesh auto_layout(model, "auto", devices=8) picks, as
    from_preset and parallelize do by default (not a fixed 1x8)."""
    code, out, _ = _run(["plan", "models:build", "--json"])
    data = json.loads(out)
    assert code == 0 and data["problems"] == []
    expected = tuple(shardckpt.auto_layout(importlib.import_module("models").build(), "auto", devices=8).mesh.shape)
    assert expected != (1, 8)  # the old fixed default would not pass
    assert tuple(data["mesh"]) == expected
    assert shardckpt.LayoutPlan.from_json(json.dumps(data["plan"])).mesh.shape == tuple(expected)


def test_plan_help_names_every_model_form():
    code = None
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as e:
        main(["plan", "--help"])
    code = e.value.code
    text = " ".join(out.getvalue().split())
    assert code == 0
    assert "package.module:function" in text and ".keras file" in text and "keras-hub preset folder" in text


@pytest.mark.parametrize(
    ("nbytes", "seconds", "want"),
    [
        (3_000, 1.0, "2.93 KiB/s"),
        (5 * 2**20, 2.0, "2.50 MiB/s"),
        (3 * 2**30, 1.0, "3.00 GiB/s"),
        (512, 1.0, "512 B/s"),
        (100, 0.0, "- B/s"),
    ],
)
def test_rates_have_a_unit_that_fits(nbytes, seconds, want):
    assert format_rate(nbytes, seconds) == want


def test_small_load_report_has_no_zero_rate(tmp_path):
    keras.backend.clear_session()
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    path = str(tmp_path / "m.weights.h5")
    model.save_weights(path)
    report = shardckpt.load_sharded(model, path)
    text = str(report)
    assert "0.00 GiB/s" not in text and "0.0 MiB" not in text
    assert f"({format_bytes(40)})" in text and "40 B" in text
    assert np.asarray(model.layers[0].kernel.value).shape == (4, 2)
