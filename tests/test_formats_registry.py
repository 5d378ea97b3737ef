"""The formats' registry is the one authority: declared rules, explicit registration, one error.

README's "Adding a format" block is run here as written (it is also a piece of
tests/test_readme.py): a toy format registered in a few lines is detected,
loaded bit-equal into sharded variables and listed by the unknown-format error.
"""

from __future__ import annotations

import json
import os
import subprocess

import keras
import numpy as np
import pytest

import shardckpt
from shardckpt import errors, formats, storage
from shardckpt.formats import catalog, registry
from shardckpt.formats.declaration import Lazy
from tests.test_readme import pieces

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme_block() -> str:
    [piece] = [p for p in pieces() if p.section == "Adding a format" and p.kind == "python"]
    return piece.code


def _sharded_model() -> keras.Model:
    mesh = keras.distribution.DeviceMesh((2, 4), ["data", "model"])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["up/kernel"] = (None, "model")
    layout_map["down/kernel"] = ("model", None)
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map))
    inputs = keras.Input((8,), name="x")
    hidden = keras.layers.Dense(16, name="up")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(8, name="down")(hidden))
    rng = np.random.default_rng(3)
    for v in model.weights:
        v.assign(rng.standard_normal(v.shape).astype("float32"))
    return model


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    keras.backend.clear_session()
    before = keras.distribution.distribution()
    yield tmp_path
    keras.distribution.set_distribution(before)
    formats.FORMATS.pop("npz", None)


def test_readme_toy_format_is_detected_loaded_bit_equal_and_listed(in_tmp):
    model = _sharded_model()
    saved = {v.path: np.asarray(v.value).copy() for v in model.weights}
    shardings = {v.path: v.value.sharding for v in model.weights}
    exec(compile(_readme_block(), "README.md (Adding a format)", "exec"), {"model": model})  # noqa: S102

    assert formats.detect_format("model.npz") == "npz"
    for v in model.weights:  # the README saved them; a load must bring them back
        v.assign(np.zeros(v.shape, "float32"))
    report = shardckpt.load_sharded(model, "model.npz")
    assert report.format == "npz"
    for v in model.weights:
        np.testing.assert_array_equal(np.asarray(v.value), saved[v.path], err_msg=v.path)
        assert v.value.sharding == shardings[v.path], v.path
    assert not any(v.value.sharding.is_fully_replicated for v in model.weights if v.path.endswith("kernel"))
    with pytest.raises(errors.UnknownFormatError) as e:
        formats.detect_format(in_tmp)  # a folder of none of the formats
    assert "numpy `.npz` archives: named *.npz" in str(e.value)
    registry.unregister("npz")
    assert formats.detect_format("model.npz") != "npz"
    assert "numpy" not in formats.supported()


def _toy(name: str, priority: int) -> formats.Format:
    return formats.Format(name=name, description=f"{name} files", suffixes=(".toy",), priority=priority,
                          reader=lambda location, **_: name)


@pytest.mark.parametrize("order", [("low", "high"), ("high", "low")])
def test_the_declared_priority_decides_not_the_order_of_registration(tmp_path, order):
    (tmp_path / "a.toy").write_bytes(b"x")
    priorities = {"low": 11, "high": 12}
    try:
        for name in order:
            registry.register(_toy(name, priorities[name]))
        assert formats.detect_format(tmp_path / "a.toy") == "high"
    finally:
        for name in order:
            formats.FORMATS.pop(name, None)


def test_registering_a_taken_priority_or_name_is_refused():
    with pytest.raises(ValueError, match="priority 90, as 'orbax' has.*Fix: give it another priority"):
        registry.register(_toy("clash", 90))
    with pytest.raises(ValueError, match="named 'h5' is registered already"):
        registry.register(_toy("h5", 13))
    assert "clash" not in formats.FORMATS and formats.FORMATS["h5"].magic


def test_every_callable_the_catalog_names_resolves():
    # Lazy names are text: a moved or renamed module fails here, not at a user's first export.
    named = [(fmt.name, slot, getattr(fmt, slot)) for fmt in catalog.CATALOG
             for slot in ("reader", "writer", "architecture") if isinstance(getattr(fmt, slot), Lazy)]
    assert {(name, slot) for name, slot, _ in named} >= {("hf", "reader"), ("hf", "writer"), ("preset", "writer")}
    for name, slot, lazy in named:
        assert callable(lazy.resolve()), (name, slot, lazy.target)


def test_the_table_is_the_catalog_and_nothing_provides_at_import():
    # Every format's slots come from its one declaration: no module fills them in when imported.
    assert all(registry.FORMATS[fmt.name] is fmt for fmt in catalog.CATALOG)
    assert set(registry.FORMATS) == {fmt.name for fmt in catalog.CATALOG}
    slots = {n: (f.reader is not None, f.writer is not None) for n, f in registry.FORMATS.items()}
    assert slots["hf"] == (True, True) and slots["preset"] == (True, True) and slots["peft"] == (False, True)
    assert slots["orbax"] == (True, True) and slots["h5"] == (True, False)
    found = subprocess.run(["grep", "-rn", "provide(", os.path.join(ROOT, "shardckpt")], capture_output=True, text=True)
    assert found.stdout == "", found.stdout


def _folder_of_no_format(where: str, tmp_path, request) -> str:
    if where == "bucket":
        root = request.getfixturevalue("gcs_server").new_bucket() + "/folder"
    else:
        root = str(tmp_path / "folder")
        os.makedirs(root)
    storage.write_bytes(storage.parse(root).join("config.json"), json.dumps({"hello": 1}).encode())
    storage.write_bytes(storage.parse(root).join("notes.txt"), b"hello")
    return root


def test_one_unknown_format_error_locally_and_in_a_bucket(tmp_path, request):
    messages = {}
    for where in ("local", "bucket"):
        root = _folder_of_no_format(where, tmp_path, request)
        for path in (root, storage.parse(root).join("notes.txt").url):
            with pytest.raises(errors.UnknownFormatError) as e:
                shardckpt.inspect(path)
            text = str(e.value)
            assert path in text and "Fix:" in text, text
            for fmt in formats.FORMATS.values():
                assert (fmt.description in text) == (fmt.reader is not None), (fmt.name, text)
            messages[where, path == root] = text.replace(path, "PATH")
        # preset_kind (from_preset) asks the same registry, with the same error.
        with pytest.raises(errors.UnknownFormatError) as e:
            shardckpt.presets.preset_kind(root)
        assert str(e.value).replace(root, "PATH") == messages[where, True]
    assert messages["local", True] == messages["bucket", True]
    assert messages["local", False] == messages["bucket", False]
    assert "it lacks model.weights.h5 or model.weights.json" in messages["local", True]


def test_preset_kind_of_a_checkpoint_that_names_no_model_says_how_to_load_it(tmp_path):
    keras.backend.clear_session()
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, name="d")])
    path = str(tmp_path / "m.weights.h5")
    model.save_weights(path)
    with pytest.raises(errors.UnknownFormatError, match=r"format 'h5'.*Fix: build the model and load it with "
                       r"shardckpt.load_sharded"):
        shardckpt.presets.preset_kind(path)
