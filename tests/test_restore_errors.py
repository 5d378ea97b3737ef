"""Bad input: every case raises a typed error naming the problem, and leaves the model untouched."""

from __future__ import annotations

import json
import os
import shutil

import h5py
import keras
import numpy as np
import pytest
import safetensors.numpy as stnp

import shardckpt
from shardckpt import errors
from shardckpt.cli import main
from tests.zoo import build_zoo, randomize, zoo_layout_map


def _lazy(dim=16, mesh=None, layout_map=None):
    keras.backend.clear_session()
    if mesh is not None:
        keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map))
    with shardckpt.lazy_init():
        return build_zoo(dim=dim, rnn=False)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    keras.backend.clear_session()
    model = build_zoo(rnn=False)
    randomize(model, seed=1)
    model.save_weights(root / "m.weights.h5")
    stnp.save_file({v.path: np.asarray(v.value) for v in model.weights}, str(root / "m.safetensors"))
    return root


def _untouched(model):
    for v in model.weights:
        with pytest.raises(errors.UnloadedVariableError, match=v.path):
            v.numpy()


def test_missing_file(tmp_path):
    model = _lazy()
    with pytest.raises(errors.CheckpointNotFoundError, match="nothing.weights.h5"):
        shardckpt.load_sharded(model, tmp_path / "nothing.weights.h5")
    assert isinstance(errors.CheckpointNotFoundError("x"), FileNotFoundError)


def test_unknown_format(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("hello")
    with pytest.raises(errors.UnknownFormatError, match="notes.txt"):
        shardckpt.load_sharded(_lazy(), path)


@pytest.mark.parametrize("name", ["m.weights.h5", "m.safetensors"])
def test_truncated_file(files, tmp_path, name):
    data = (files / name).read_bytes()
    bad = tmp_path / name
    bad.write_bytes(data[: len(data) - 700])
    model = _lazy()
    with pytest.raises(errors.CorruptCheckpointError, match="truncated"):
        shardckpt.load_sharded(model, bad)
    _untouched(model)


def test_corrupt_safetensors_header(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes((20).to_bytes(8, "little") + b"{not json at all!!!}" + b"\0" * 64)
    with pytest.raises(errors.CorruptCheckpointError, match="not valid JSON"):
        shardckpt.load_sharded(_lazy(), bad)


@pytest.mark.parametrize("dtype", ["C64", "F8_E8M0", "F4"])
def test_safetensors_dtype_not_read_is_unknown_format_naming_the_tensor(tmp_path, capsys, dtype):
    """A dtype of the safetensors spec that shardckpt has no numpy type for: not "damaged", but named."""
    header = json.dumps({"ok": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                         "odd": {"dtype": dtype, "shape": [2], "data_offsets": [8, 24]}}).encode()
    path = tmp_path / "odd.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 24)
    message = (f"Array 'odd' of '{path}' has safetensors dtype '{dtype}', which shardckpt does not read (it reads "
               "F64, F32, F16, BF16, F8_E4M3, F8_E5M2, I64, I32, I16, I8, U64, U32, U16, U8, BOOL). Fix: convert that "
               "tensor to one of these dtypes (for example with the safetensors package), or leave it out of the "
               f"file. Received: dtype='{dtype}'")
    for call in (shardckpt.inspect, lambda p: shardckpt.load_sharded(_lazy(), p)):
        with pytest.raises(errors.UnknownFormatError) as e:
            call(str(path))
        assert str(e.value) == message
    assert main(["inspect", str(path)]) == 1
    assert message in capsys.readouterr().err


def test_shape_mismatch_lists_every_variable(files):
    model = _lazy(dim=24)  # checkpoint was written with dim=16
    with pytest.raises(errors.CheckpointMismatchError) as info:
        shardckpt.load_sharded(model, files / "m.weights.h5")
    message = str(info.value)
    assert "block/up/kernel" in message and "(16, 32)" in message and "(24, 48)" in message
    assert len(info.value.mismatched) >= 5
    _untouched(model)


def test_dtype_mismatch(files, tmp_path):
    keras.backend.clear_session()
    model = build_zoo(rnn=False)
    values = {v.path: np.asarray(v.value) for v in model.weights}
    values["int8_table/table"] = values["int8_table/table"].astype("float32")
    path = tmp_path / "float_table.safetensors"
    stnp.save_file(values, str(path))
    lazy = _lazy()
    with pytest.raises(errors.DtypeMismatchError, match="int8_table/table.*float32.*int8"):
        shardckpt.load_sharded(lazy, path)
    _untouched(lazy)


def test_string_dataset_where_weights_belong_says_so(files, tmp_path):
    # A valid HDF5 file whose array for a float variable holds variable-length
    # strings: no cast helps, so the fix must not be "build it with dtype object".
    path = tmp_path / "strings.weights.h5"
    shutil.copy(files / "m.weights.h5", path)
    with h5py.File(path, "r+") as f:
        group = f["layers/embedding/vars"]
        shape = group["0"].shape
        del group["0"]
        group.create_dataset("0", data=np.full(shape, "x", dtype=object), dtype=h5py.string_dtype())
    lazy = _lazy()
    with pytest.raises(errors.DtypeMismatchError) as info:
        shardckpt.load_sharded(lazy, path)
    message = str(info.value)
    assert "'embed/embeddings'" in message and "'layers/embedding/vars/0'" in message
    assert repr(str(path)) in message
    assert "variable-length data (strings" in message and "numeric float32 variable" in message
    assert "Fix: load the weights this model saved, or re-save them with Keras" in message
    assert "with dtype object" not in message
    _untouched(lazy)


def test_missing_and_unexpected_keys_in_one_error(files, tmp_path):
    keras.backend.clear_session()
    model = build_zoo(rnn=False)
    values = {v.path: np.asarray(v.value) for v in model.weights}
    del values["head/bias"]
    values["extra/weight"] = np.zeros((3,), "float32")
    path = tmp_path / "keys.safetensors"
    stnp.save_file(values, str(path))
    lazy = _lazy()
    with pytest.raises(errors.CheckpointMismatchError) as info:
        shardckpt.load_sharded(lazy, path)
    assert info.value.missing == ["head/bias (key 'head/bias')"]
    assert info.value.unexpected == ["extra/weight"]
    _untouched(lazy)
    report = shardckpt.load_sharded(lazy, path, strict=False, layout=keras.distribution.DataParallel())
    assert report.unexpected == ["extra/weight"] and report.initialized == ["head/bias"]


def test_indivisible_layout(files):
    mesh = keras.distribution.DeviceMesh((1, 8), ["data", "model"])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["head/bias"] = ("model",)  # 32 divides; make one that does not:
    layout_map["block/norm/gamma"] = ("model",)
    keras.backend.clear_session()
    with shardckpt.lazy_init():
        model = build_zoo(dim=12, rnn=False)
    keras.backend.clear_session()
    src = build_zoo(dim=12, rnn=False)
    path = files / "dim12.weights.h5"
    src.save_weights(path)
    with pytest.raises(errors.IndivisibleLayoutError, match="block/norm/gamma.*12.*8"):
        shardckpt.load_sharded(model, path, layout=layout_map)
    _untouched(model)


@pytest.mark.parametrize(
    ("key", "axes", "shape"),
    [("head/bias", (None, "model"), "(32,)"), ("head/kernel", (None, "model", None), "(8, 32)")],
)
def test_layout_map_entry_of_another_rank_is_named(files, key, axes, shape):
    """Longer than the rank: JAX raises a bare IndexError mid-load (a bias), or
    keeps a sharding of another rank on the array (a kernel); refused before any read."""
    layout_map = keras.distribution.LayoutMap(keras.distribution.DeviceMesh((1, 8), ["data", "model"]))
    layout_map[key] = axes
    model = _lazy()
    with pytest.raises(errors.LayoutError) as info:
        shardckpt.load_sharded(model, files / "m.weights.h5", layout=layout_map)
    message = str(info.value)
    assert f"Variable '{key}' of shape {shape}" in message and f"its layout {axes}" in message
    assert "one mesh axis or None per dimension" in message
    _untouched(model)


def _keras_orbax(path):
    keras.backend.clear_session()
    model = build_zoo(rnn=False)
    model.compile(optimizer="sgd", loss="mse")
    callback = keras.callbacks.OrbaxCheckpoint(str(path), save_freq="epoch")
    model.fit(np.zeros((8, 8), "int32"), np.zeros((8, 8, 32)), epochs=1, verbose=0, callbacks=[callback])
    callback.wait_until_finished()


def test_half_written_orbax_step(tmp_path):
    _keras_orbax(tmp_path / "ck")
    # A save killed mid-way leaves only Orbax's temporary folder behind.
    shutil.move(tmp_path / "ck" / "0", tmp_path / "ck" / "1.orbax-checkpoint-tmp-1234")
    lazy = _lazy()
    with pytest.raises(errors.IncompleteCheckpointError, match="half-written"):
        shardckpt.load_sharded(lazy, tmp_path / "ck")
    with pytest.raises(errors.IncompleteCheckpointError, match="never committed"):
        shardckpt.load_sharded(lazy, tmp_path / "ck" / "1.orbax-checkpoint-tmp-1234")
    os.remove(tmp_path / "ck" / "1.orbax-checkpoint-tmp-1234" / "pytree" / "_METADATA")
    shutil.move(tmp_path / "ck" / "1.orbax-checkpoint-tmp-1234", tmp_path / "ck" / "1")
    with pytest.raises(errors.IncompleteCheckpointError, match="_METADATA"):
        shardckpt.load_sharded(lazy, tmp_path / "ck")
    _untouched(lazy)


def test_truncated_orbax_data_file(tmp_path):
    # The reader maps data files into memory; reading past the end of a
    # truncated one must be an error, not SIGBUS.
    _keras_orbax(tmp_path / "ck")
    data_dir = tmp_path / "ck" / "0" / "pytree" / "ocdbt.process_0" / "d"
    for name in os.listdir(data_dir):  # array chunks; the OCDBT index stays intact
        os.truncate(data_dir / name, os.path.getsize(data_dir / name) // 2)
    with pytest.raises(errors.CorruptCheckpointError, match=r"Reading array '[\w/]+' .*restore from another step"):
        shardckpt.load_sharded(_lazy(), tmp_path / "ck", layout=keras.distribution.DataParallel())


def test_corrupt_orbax_chunk(tmp_path):
    _keras_orbax(tmp_path / "ck")
    data_dir = tmp_path / "ck" / "0" / "pytree" / "d"
    for name in os.listdir(data_dir):
        blob = bytearray((data_dir / name).read_bytes())
        blob[len(blob) // 2 : len(blob) // 2 + 64] = b"\xff" * 64
        (data_dir / name).write_bytes(bytes(blob))
    model = _lazy()
    tree = str(tmp_path / "ck" / "0" / "pytree")
    # Every data file is hit, so OCDBT's b-tree nodes (in the same files) may be the first damage met.
    damaged = rf"(array\(s\) of '{tree}' cannot be opened .*damaged|The index of '{tree}' .* is damaged)"
    with pytest.raises(errors.CorruptCheckpointError, match=rf"{damaged}.*Fix: restore from another step"):
        shardckpt.load_sharded(model, tmp_path / "ck")
    _untouched(model)  # every array's data is damaged: no variable got a value


def test_no_pickle_loaded(tmp_path):
    # A .keras file is read as zip + HDF5 only; a pickle in its place is refused.
    import pickle

    path = tmp_path / "evil.keras"
    path.write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(errors.CorruptCheckpointError, match="evil.keras"):
        shardckpt.load_sharded(_lazy(), path)
    with pytest.raises(errors.UnknownFormatError):
        shardckpt.load_sharded(_lazy(), path.rename(tmp_path / "evil.pkl"))


def test_lazy_model_with_no_layout_on_several_devices_is_refused(files):
    """No distribution, no layout=: never a silent load onto device 0 of 8."""
    model = _lazy()
    with pytest.raises(errors.LayoutError) as info:
        shardckpt.load_sharded(model, files / "m.weights.h5")
    message = str(info.value)
    assert "has no sharding yet" in message and "host of 8 devices" in message
    assert "pass layout=" in message and "keras.distribution.set_distribution" in message
    _untouched(model)
    # The fix, followed: a distribution set (here one that replicates).
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    shardckpt.load_sharded(model, files / "m.weights.h5")
    assert all(len(v.value.sharding.device_set) == 8 for v in model.weights)


def test_built_model_with_no_layout_keeps_each_variables_sharding(files):
    mesh = keras.distribution.DeviceMesh((2, 4), ["data", "model"])
    keras.backend.clear_session()
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=zoo_layout_map(mesh)))
    model = build_zoo(rnn=False)
    before = {v.path: v.value.sharding for v in model.weights}
    keras.distribution.set_distribution(None)
    shardckpt.load_sharded(model, files / "m.weights.h5")
    for v in model.weights:
        assert v.value.sharding == before[v.path], v.path
    assert any(not s.is_fully_replicated for s in before.values())
