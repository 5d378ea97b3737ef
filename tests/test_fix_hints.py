"""Every "Fix:" that suggests an action is followed here, and the action works.

Each test provokes one error, checks that its message suggests the action,
does what it says, and shows the result: a hint that names an option which
then raises the same error (strict=False for a shape mismatch), or advice
for another format (layer names for a Hugging Face folder), is a defect.
Hints of other modules are followed beside their own tests:
`tests/test_layout_mesh_guard.py` (allow_other_mesh, a mesh over every
device), `tests/test_convert.py` (force=True, model=), and the storage tests.
"""

from __future__ import annotations

import os
import re

import keras
import numpy as np
import pytest
import safetensors.numpy as stnp

import shardckpt
from shardckpt import errors
from shardckpt.natsort import natural_sorted


def _seq(units=8, extra=False, names=False):
    """Input(4) -> Dense(units) -> Dense(2) [-> Dense(2)]; the model and its layers
    named with `names`."""
    layers = [
        keras.layers.Dense(units, name="up" if names else None),
        keras.layers.Dense(2, name="out" if names else None),
    ]
    if extra:
        layers.append(keras.layers.Dense(2, name="extra" if names else None))
    return keras.Sequential([keras.Input((4,)), *layers], name="tiny" if names else None)


def _values(model):
    return {v.path: np.asarray(v.value) for v in model.weights}


def _saved_h5(tmp_path, units=8):
    keras.backend.clear_session()
    model = _seq(units)
    path = str(tmp_path / "m.weights.h5")
    model.save_weights(path)
    values = [np.asarray(v.value) for v in model.weights]
    keras.backend.clear_session()
    return path, values


def _fix(error: BaseException) -> str:
    return str(error).split("Fix: ", 1)[1]


def test_missing_keys_hint_strict_false_loads_what_matches(tmp_path):
    path, values = _saved_h5(tmp_path)
    model = _seq(extra=True)
    before = np.asarray(model.layers[2].kernel.value)
    with pytest.raises(errors.CheckpointMismatchError) as e:
        shardckpt.load_sharded(model, path)
    assert "pass strict=False to load what matches" in _fix(e.value)
    assert "clear_session" not in _fix(e.value)  # h5 keys follow the object graph, not names

    report = shardckpt.load_sharded(model, path, strict=False)  # the hint, followed
    assert report.missing == [f"{v.path} (key 'layers/dense_2/vars/{i}')" for i, v in enumerate(model.layers[2].weights)]
    for v, want in zip(model.weights[:4], values):
        np.testing.assert_array_equal(np.asarray(v.value), want, err_msg=v.path)
    np.testing.assert_array_equal(np.asarray(model.layers[2].kernel.value), before)  # kept its value


def test_shape_mismatch_hint_does_not_offer_strict_false_and_its_fix_works(tmp_path):
    path, values = _saved_h5(tmp_path, units=8)
    model = _seq(units=16)
    with pytest.raises(errors.CheckpointMismatchError) as e:
        shardckpt.load_sharded(model, path)
    fix = _fix(e.value)
    assert "strict=False does not skip them" in fix and "pass strict=False" not in fix
    assert "configuration that wrote the checkpoint" in fix
    # strict=False indeed does not help: the same error.
    with pytest.raises(errors.CheckpointMismatchError) as again:
        shardckpt.load_sharded(model, path, strict=False)
    assert again.value.mismatched == e.value.mismatched

    keras.backend.clear_session()
    model = _seq(units=8)  # the hint, followed: the checkpoint's configuration
    shardckpt.load_sharded(model, path)
    for v, want in zip(model.weights, values):
        np.testing.assert_array_equal(np.asarray(v.value), want, err_msg=v.path)


def test_path_keyed_hint_clear_session_or_named_layers_works(tmp_path):
    keras.backend.clear_session()
    src = _seq()
    path = str(tmp_path / "m.safetensors")
    stnp.save_file(_values(src), path)
    want = _values(src)
    model = _seq()  # the second model of the process: dense_2, dense_3
    with pytest.raises(errors.CheckpointMismatchError) as e:
        shardckpt.load_sharded(model, path)
    assert "name the model and its layers" in _fix(e.value)  # layer names alone keep "sequential_1/"
    assert "call keras.backend.clear_session()" in _fix(e.value)

    keras.backend.clear_session()  # the hint, followed
    model = _seq()
    shardckpt.load_sharded(model, path)
    assert _values(model).keys() == want.keys()
    for key, value in _values(model).items():
        np.testing.assert_array_equal(value, want[key], err_msg=key)

    # The other half: a named model with named layers matches whatever was built before.
    named = _seq(names=True)
    path = str(tmp_path / "named.safetensors")
    stnp.save_file(_values(named), path)
    _seq()
    again = _seq(names=True)
    shardckpt.load_sharded(again, path)
    for key, value in _values(again).items():
        np.testing.assert_array_equal(value, _values(named)[key], err_msg=key)


def _named(first: str, second: str) -> keras.Model:
    """A model whose layers (and itself) all carry names the user gave."""
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, name=first), keras.layers.Dense(2, name=second)],
                            name="tiny")


@pytest.mark.parametrize("fmt", ["safetensors", "orbax"])
def test_path_keyed_hint_names_the_differing_names_when_every_layer_is_named(tmp_path, fmt):
    """Every layer named already: "name the model and its layers" is no fix; the advice names the
    layer names only the checkpoint has and those only the model has, and renaming works."""
    src = _named("encoder", "head")
    shardckpt.export(src, tmp_path / "out", format=fmt)
    path = str(tmp_path / "out" / "model.safetensors") if fmt == "safetensors" else str(tmp_path / "out")
    with pytest.raises(errors.CheckpointMismatchError) as e:
        shardckpt.load_sharded(_named("enc", "head"), path)
    fix = _fix(e.value)
    assert "name the model and its layers" not in fix and "clear_session" not in fix
    assert "the checkpoint names layers the model lacks (encoder)" in fix
    assert "the model names layers the checkpoint lacks (enc)" in fix
    assert e.value.names == (["encoder"], ["enc"])
    # strict=False would fill only the head (18 of 58 values): refused, with the same names first.
    with pytest.raises(errors.CheckpointMismatchError) as e:
        shardckpt.load_sharded(_named("enc", "head"), path, strict=False)
    fix = _fix(e.value)
    assert fix.startswith("rename the model's layers") and "the checkpoint names layers the model lacks (encoder)" in fix
    assert "strict=False is for a few differing variables" in fix and e.value.names == (["encoder"], ["enc"])

    model = _named("encoder", "head")  # the hint, followed
    shardckpt.load_sharded(model, path)
    for key, value in _values(model).items():
        np.testing.assert_array_equal(value, _values(src)[key], err_msg=key)


def test_missing_hugging_face_tensor_gets_advice_for_hf_folders(tmp_path):
    pytest.importorskip("keras_hub")
    from tests.hf_fixtures import make_folder

    folder = str(tmp_path / "llama")
    make_folder("llama", folder)
    weights = os.path.join(folder, "model.safetensors")
    tensors = stnp.load_file(weights)
    dropped = "model.layers.1.mlp.down_proj.weight"
    stnp.save_file({k: v for k, v in tensors.items() if k != dropped}, weights, metadata={"format": "pt"})
    with pytest.raises(errors.CheckpointMismatchError) as e:
        shardckpt.from_preset(folder)
    assert dropped in str(e.value)
    fix = _fix(e.value)
    assert "Hugging Face folder" in fix and "Re-download the complete folder" in fix
    assert "clear_session" not in fix and "strict=False" not in fix and "name your layers" not in fix

    keras.backend.clear_session()
    keras.distribution.set_distribution(None)
    make_folder("llama", folder)  # the hint, followed: the complete folder again
    model = shardckpt.from_preset(folder)
    assert len(model.weights) > 0


def test_keras_hub_preset_mismatch_hint_resave_works(tmp_path):
    keras_hub = pytest.importorskip("keras_hub")
    kw = dict(
        vocabulary_size=32, num_layers=1, num_query_heads=2, num_key_value_heads=1, hidden_dim=8,
        intermediate_dim=16,
    )
    backbone = keras_hub.models.LlamaBackbone(**kw)
    folder = str(tmp_path / "preset")
    backbone.save_to_preset(folder)
    other = str(tmp_path / "other")
    keras_hub.models.LlamaBackbone(**{**kw, "hidden_dim": 16, "intermediate_dim": 32}).save_to_preset(other)
    os.replace(os.path.join(other, "config.json"), os.path.join(folder, "config.json"))  # edited config
    keras.backend.clear_session()
    with pytest.raises(errors.CheckpointMismatchError) as e:
        shardckpt.from_preset(folder)
    fix = _fix(e.value)
    assert "re-save it with save_to_preset" in fix and "strict=False" not in fix

    backbone.save_to_preset(folder)  # the hint, followed
    keras.backend.clear_session()
    keras.distribution.set_distribution(None)
    model = shardckpt.from_preset(folder)
    for v, want in zip(model.weights, backbone.weights):
        np.testing.assert_array_equal(np.asarray(v.value), np.asarray(want.value), err_msg=v.path)


def test_unloaded_variable_hint_load_sharded_first_works(tmp_path):
    path, values = _saved_h5(tmp_path)
    with shardckpt.lazy_init():
        model = _seq()
    x = np.ones((2, 4), "float32")
    with pytest.raises(errors.UnloadedVariableError) as e:
        model.predict(x, verbose=0)
    assert "call shardckpt.load_sharded(model, path) before using the model" in _fix(e.value)
    # The hint, followed (on a host of several devices, with a distribution:
    # a lazily built model is never loaded onto one device by default).
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    shardckpt.load_sharded(model, path)
    keras.backend.clear_session()
    reference = _seq()
    for v, want in zip(reference.weights, values):
        v.assign(want)
    np.testing.assert_array_equal(model.predict(x, verbose=0), reference.predict(x, verbose=0))


def test_indivisible_layout_hint_replicate_or_divide_works(tmp_path):
    path, values = _saved_h5(tmp_path, units=6)  # 6 columns on a model axis of 8
    mesh = keras.distribution.DeviceMesh((1, 8), ["data", "model"])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["sequential.*/dense/kernel"] = (None, "model")
    model = _seq(units=6)
    with pytest.raises(errors.IndivisibleLayoutError) as e:
        shardckpt.load_sharded(model, path, layout=layout_map)
    assert "replicate this dimension in the layout (None)" in _fix(e.value)
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["sequential.*/dense/kernel"] = (None, None)  # the hint, followed
    shardckpt.load_sharded(model, path, layout=layout_map)
    for v, want in zip(model.weights, values):
        np.testing.assert_array_equal(np.asarray(v.value), want, err_msg=v.path)
    # Its other half: a mesh axis size that divides 6.
    mesh = keras.distribution.DeviceMesh((4, 2), ["data", "model"])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["sequential.*/dense/kernel"] = (None, "model")
    shardckpt.load_sharded(model, path, layout=layout_map)
    assert model.layers[0].kernel.value.sharding.shard_shape((4, 6)) == (4, 3)


def test_orbax_source_of_convert_hint_load_it_directly_works(tmp_path):
    path, values = _saved_h5(tmp_path)
    keras.backend.clear_session()
    orbax = str(tmp_path / "orbax")
    shardckpt.convert(path, orbax, model=_seq())
    with pytest.raises(errors.UnknownFormatError, match="Fix: load it directly"):
        shardckpt.convert(orbax, str(tmp_path / "again"))
    keras.backend.clear_session()
    model = _seq()
    shardckpt.load_sharded(model, orbax)  # the hint, followed
    for v, want in zip(model.weights, values):
        np.testing.assert_array_equal(np.asarray(v.value), want, err_msg=v.path)


def test_layout_rule_hints_work():
    model = _seq()
    mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "tp"])
    with pytest.raises(errors.LayoutError) as e:
        shardckpt.auto_layout(model, mesh)
    assert re.search(r"Fix: pass model_axis= one of \('batch', 'tp'\)", str(e.value))
    plan = shardckpt.auto_layout(model, mesh, model_axis="tp")  # followed
    assert plan.model_axis == "tp"

    mesh = keras.distribution.DeviceMesh((2, 4), ["data", "model"])
    with pytest.raises(errors.LayoutError, match="Fix: give one axis \\(or None\\) per dimension"):
        shardckpt.auto_layout(model, mesh, rules={".*/dense/kernel": ("model",)})
    plan = shardckpt.auto_layout(model, mesh, rules={".*/dense/kernel": (None, "model")})  # followed
    assert plan.sharding_for(model.layers[0].kernel).spec == keras.distribution.TensorLayout(
        (None, "model"), mesh
    ).backend_layout.spec

    with pytest.raises(errors.LayoutError, match="Fix: use one of them"):
        shardckpt.auto_layout(model, mesh, rules={".*/dense/kernel": (None, "tp")})
    shardckpt.auto_layout(model, mesh, rules={".*/dense/kernel": (None, "data")})  # followed

    with pytest.raises(errors.LayoutError, match="Fix: escape literal dots and brackets"):
        shardckpt.auto_layout(model, mesh, rules={"dense[kernel": (None, "model")})
    plan = shardckpt.auto_layout(model, mesh, rules={re.escape("dense[kernel"): (None, "model")})  # followed
    assert len(plan) == 4

    with pytest.raises(errors.LayoutError, match="Fix: use one of"):
        plan.bytes_per_device(optimizer="lion2")
    assert plan.bytes_per_device(optimizer="adam")  # followed

    with pytest.raises(errors.LayoutError, match="Fix: pass the text written by LayoutPlan.to_json"):
        shardckpt.LayoutPlan.from_json('{"not": "a plan"}')
    assert shardckpt.LayoutPlan.from_json(plan.to_json()).placements == plan.placements  # followed

    with pytest.raises(errors.LayoutError, match="Fix: use a shape whose product is 8"):
        shardckpt.auto_layout(model, (2, 2))
    assert shardckpt.auto_layout(model, (2, 4)).mesh.shape == (2, 4)  # followed


def test_unbuilt_model_hint_build_it_first_works():
    model = keras.Sequential([keras.layers.Dense(8), keras.layers.Dense(2)])
    with pytest.raises(errors.LayoutError, match="Fix: build it first"):
        shardckpt.auto_layout(model, (1, 8))
    model.build((None, 4))  # followed
    assert len(shardckpt.auto_layout(model, (1, 8))) == 4


def test_hugging_face_folder_inspects_and_verifies_without_a_model(tmp_path):
    """inspect and verify of an HF folder were refused with "Fix: pass model=", an
    argument neither takes; they read the stored tensors now."""
    pytest.importorskip("keras_hub")
    from tests.hf_fixtures import make_folder

    folder = str(tmp_path / "llama")
    make_folder("llama", folder)
    stored = stnp.load_file(os.path.join(folder, "model.safetensors"))
    info = shardckpt.inspect(folder)
    assert info.format == "hf" and [a.key for a in info.arrays] == natural_sorted(stored)
    assert {a.key: a.shape for a in info.arrays} == {k: v.shape for k, v in stored.items()}
    report = shardckpt.verify(folder)
    assert report.ok and report.arrays == len(stored)
    assert report.bytes_read == sum(v.nbytes for v in stored.values())


@keras.saving.register_keras_serializable("shardckpt_tests")
class _Table(keras.layers.Layer):
    """A lookup table of `table_dtype` (int8: a quantized table)."""

    def __init__(self, table_dtype="int8", **kwargs):
        super().__init__(**kwargs)
        self.table_dtype = table_dtype

    def build(self, input_shape):
        self.table = self.add_weight(
            shape=(4, 2), dtype=self.table_dtype, initializer="zeros", trainable=False, name="table"
        )

    def call(self, x):
        return x


def test_dtype_hint_build_the_variable_with_the_stored_dtype_works(tmp_path):
    path = str(tmp_path / "table.safetensors")
    table = np.linspace(-2, 2, 8, dtype="float32").reshape(4, 2)
    stnp.save_file({"t/table": table}, path)

    def build(dtype):
        layer = _Table(dtype, name="t")
        layer.build((None, 2))
        return layer

    with pytest.raises(errors.DtypeMismatchError) as e:
        shardckpt.load_sharded(build("int8"), path)
    assert "Fix: build the variable with dtype float32" in str(e.value)
    assert "convert" not in _fix(e.value)  # convert casts floats only: no way out there
    layer = build("float32")  # the hint, followed
    shardckpt.load_sharded(layer, path)
    np.testing.assert_array_equal(np.asarray(layer.table.value), table)


def test_missing_shard_hint_copy_it_beside_the_index_works(tmp_path):
    keras.backend.clear_session()
    src = _seq()
    index = str(tmp_path / "m.weights.json")
    src.save_weights(index, max_shard_size=2e-7)  # 215 bytes: a shard per layer
    values = [np.asarray(v.value) for v in src.weights]
    shards = sorted(n for n in os.listdir(tmp_path) if n.endswith(".weights.h5"))
    assert len(shards) >= 2
    os.replace(tmp_path / shards[-1], tmp_path / "elsewhere.bin")
    keras.backend.clear_session()
    model = _seq()
    with pytest.raises(errors.CheckpointNotFoundError) as e:
        shardckpt.load_sharded(model, index)
    assert repr(shards[-1]) in str(e.value)
    assert "copy (or upload) every *.weights.h5 shard listed in the index next to it" in _fix(e.value)
    os.replace(tmp_path / "elsewhere.bin", tmp_path / shards[-1])  # the hint, followed
    shardckpt.load_sharded(model, index)
    for v, want in zip(model.weights, values):
        np.testing.assert_array_equal(np.asarray(v.value), want, err_msg=v.path)
