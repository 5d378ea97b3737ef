"""load_sharded against Keras' own loading: bit-equal values and exact shardings."""

from __future__ import annotations

import logging
import mmap
import os

import jax
import keras
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy as stnp

import shardckpt
from shardckpt.restore import hostmem
from tests.support import rss_anon
from tests.zoo import build_zoo, model_parallel, randomize, save_as, zoo_layout_map

MESHES = {"1x8": (1, 8), "2x4": (2, 4), "8x1": (8, 1)}


def _fresh(build, mesh_shape=None, lazy=False, **kw):
    """Builds a model from a clean session (stable auto names), optionally sharded."""
    keras.backend.clear_session()  # also clears the distribution
    dist = None
    if mesh_shape is not None:
        mesh = keras.distribution.DeviceMesh(mesh_shape, ["data", "model"])
        dist = keras.distribution.ModelParallel(layout_map=zoo_layout_map(mesh))
        keras.distribution.set_distribution(dist)
    if lazy:
        with shardckpt.lazy_init():
            model = build(**kw)
    else:
        model = build(**kw)
    return model, dist


def _where(mesh):
    """`load_sharded` arguments: none under a mesh; with no distribution, device 0
    asked for explicitly (a lazily built model is never put on one device of 8 by default)."""
    if mesh is not None:
        return {}
    one = keras.distribution.DeviceMesh((1,), ["batch"], [jax.devices()[0]])
    return {"layout": keras.distribution.LayoutMap(one), "allow_other_mesh": True}


def _assert_bit_equal_and_placed(model, expected_values, dist):
    assert len(model.weights) == len(expected_values)
    for v, want in zip(model.weights, expected_values):
        got = np.asarray(v.value)
        assert got.dtype == want.dtype, v.path
        np.testing.assert_array_equal(got, want, err_msg=v.path)
        if dist is not None:
            expected = dist.get_variable_layout(v).backend_layout
            assert v.value.sharding.is_equivalent_to(expected, v.ndim), (
                v.path,
                v.value.sharding,
                expected,
            )


def _keras_loaded(path, dtype="float32", **kw):
    """What Keras' own `load_weights` produces for `path` (one device)."""
    model, _ = _fresh(build_zoo, dtype=dtype, **kw)
    model.load_weights(path)
    return [np.asarray(v.value) for v in model.weights]


@pytest.mark.parametrize("fmt", ["h5", "keras", "safetensors"])
def test_formats_bit_exact_on_1x8(tmp_path, fmt):
    src, _ = _fresh(build_zoo)
    randomize(src)
    path = save_as(src, tmp_path, fmt)
    want = [np.asarray(v.value) for v in src.weights]
    if fmt != "safetensors":
        for a, b in zip(_keras_loaded(path), want):
            np.testing.assert_array_equal(a, b)
    model, dist = _fresh(build_zoo, MESHES["1x8"], lazy=True)
    report = shardckpt.load_sharded(model, path)
    _assert_bit_equal_and_placed(model, want, dist)
    assert report.arrays == len(model.weights)
    assert report.missing == [] and report.unexpected == [] and report.casts == []
    assert report.format == {"h5": "h5", "keras": "keras", "safetensors": "safetensors"}[fmt]


@pytest.mark.parametrize("mesh", ["2x4", "8x1", None], ids=["2x4", "8x1", "one_device"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_meshes_and_dtypes_h5(tmp_path, mesh, dtype):
    src, _ = _fresh(build_zoo, dtype=dtype)
    randomize(src, seed=3)
    path = save_as(src, tmp_path, "h5")
    want = _keras_loaded(path, dtype)
    model, dist = _fresh(build_zoo, MESHES.get(mesh), lazy=True, dtype=dtype)
    shardckpt.load_sharded(model, path, **_where(mesh))
    _assert_bit_equal_and_placed(model, want, dist)
    if mesh is None:  # no distribution, device 0 asked for: everything there, like Keras
        for v in model.weights:
            assert v.value.sharding.device_set == {jax.devices()[0]}, v.path
    # The model runs after loading, sharded, and matches one device exactly.
    tokens = np.arange(16, dtype="int32").reshape(2, 8) % 32
    ref_model, _ = _fresh(build_zoo, dtype=dtype)
    ref_model.load_weights(path)
    np.testing.assert_allclose(
        np.asarray(model(tokens, training=False), "float32"),
        np.asarray(ref_model(tokens, training=False), "float32"),
        rtol=2e-2 if dtype == "bfloat16" else 1e-5,
        atol=2e-2 if dtype == "bfloat16" else 1e-5,
    )


def test_cast_float32_checkpoint_into_bfloat16_model_like_keras(tmp_path):
    src, _ = _fresh(build_zoo, rnn=False)
    randomize(src, seed=5)
    path = save_as(src, tmp_path, "h5")
    want = _keras_loaded(path, "bfloat16", rnn=False)
    model, dist = _fresh(build_zoo, MESHES["2x4"], lazy=True, dtype="bfloat16", rnn=False)
    report = shardckpt.load_sharded(model, path)
    _assert_bit_equal_and_placed(model, want, dist)
    cast = [v.path for v in model.weights if np.dtype(v.dtype) == np.dtype(ml_dtypes.bfloat16)]
    assert sorted(c.split(":")[0] for c in report.casts) == sorted(cast)


def test_normally_built_model_is_replaced_in_its_sharding(tmp_path):
    src, _ = _fresh(build_zoo)
    randomize(src, seed=7)
    path = save_as(src, tmp_path, "keras")
    want = [np.asarray(v.value) for v in src.weights]
    model, dist = _fresh(build_zoo, MESHES["2x4"], lazy=False)
    before = {v.path: np.asarray(v.value) for v in model.weights}
    shardckpt.load_sharded(model, path)
    _assert_bit_equal_and_placed(model, want, dist)
    assert any(not np.array_equal(before[v.path], np.asarray(v.value)) for v in model.weights)


@pytest.mark.skipif(hostmem._MALLOC_TRIM is None, reason="glibc's malloc_trim is not available")
def test_normally_built_model_gives_its_old_values_back(tmp_path):
    """The replaced values' memory goes back to the OS (shardckpt.restore.hostmem): glibc
    kept freed XLA buffers in its heaps, so the process held the old model too."""

    def build():
        inputs = keras.Input((1024,))
        x = inputs
        for i in range(8):
            x = keras.layers.Dense(1024 * 4, name=f"up{i}")(x)  # 16 MiB kernels
            x = keras.layers.Dense(1024, name=f"down{i}")(x)
        return keras.Model(inputs, x)

    src, _ = _fresh(build)
    randomize(src, seed=31)
    path = save_as(src, tmp_path, "h5")
    want = [np.asarray(v.value) for v in src.weights]
    model_bytes = sum(w.nbytes for w in want)  # 256 MiB, split over the devices
    del src
    dist = model_parallel({"up.*/kernel": (None, "model"), "down.*/kernel": ("model", None)})
    model = build()
    jax.block_until_ready([v.value for v in model.weights])
    hostmem.trim()  # what the build freed is not the load's
    before = rss_anon()
    shardckpt.load_sharded(model, path)
    grown = rss_anon() - before
    _assert_bit_equal_and_placed(model, want, dist)
    assert model.weights[0].value.sharding.spec == jax.sharding.PartitionSpec(None, "model")
    # Without trimming, the process grew by about the whole old model (214 MiB).
    assert grown < model_bytes // 4, f"anonymous memory grew by {grown / 2**20:.0f} MiB"


def test_explicit_layout_map_without_distribution(tmp_path):
    src, _ = _fresh(build_zoo)
    randomize(src, seed=9)
    path = save_as(src, tmp_path, "safetensors")
    model, _ = _fresh(build_zoo, lazy=True)
    mesh = keras.distribution.DeviceMesh((2, 4), ["data", "model"])
    layout_map = zoo_layout_map(mesh)
    shardckpt.load_sharded(model, path, layout=layout_map)
    dist = keras.distribution.ModelParallel(layout_map=zoo_layout_map(mesh))
    _assert_bit_equal_and_placed(model, [np.asarray(v.value) for v in src.weights], dist)


def test_small_inflight_budget_gives_same_result(tmp_path):
    src, _ = _fresh(build_zoo)
    randomize(src, seed=11)
    path = save_as(src, tmp_path, "h5")
    model, dist = _fresh(build_zoo, MESHES["1x8"], lazy=True)
    shardckpt.load_sharded(model, path, max_inflight_bytes=64)  # one row at a time
    _assert_bit_equal_and_placed(model, [np.asarray(v.value) for v in src.weights], dist)


def test_strict_false_initialises_missing_variables_in_their_sharding(tmp_path):
    src, _ = _fresh(build_zoo)
    randomize(src, seed=13)
    values = {v.path: np.asarray(v.value) for v in src.weights}
    dropped = "block/up/kernel"
    path = str(tmp_path / "partial.safetensors")
    stnp.save_file({k: v for k, v in values.items() if k != dropped}, path)
    model, dist = _fresh(build_zoo, MESHES["1x8"], lazy=True)
    with pytest.raises(shardckpt.errors.CheckpointMismatchError, match=dropped):
        shardckpt.load_sharded(model, path)
    report = shardckpt.load_sharded(model, path, strict=False)
    # The GRU's seed-generator state is no model weight, so safetensors never holds it.
    assert report.initialized == [dropped, "seed_generator/seed_generator_state"]
    assert report.missing == [f"{dropped} (key '{dropped}')"]
    for v in model.weights:
        assert v.value.sharding.is_equivalent_to(dist.get_variable_layout(v).backend_layout, v.ndim)
        if v.path != dropped:
            np.testing.assert_array_equal(np.asarray(v.value), values[v.path])
    kernel = next(v for v in model.weights if v.path == dropped)
    assert np.asarray(kernel.value).std() > 0  # glorot_uniform ran, not zeros


def test_strict_false_warns_once_naming_what_it_initialised_kept_and_left_unread(tmp_path, caplog):
    src, _ = _fresh(build_zoo)
    randomize(src, seed=13)
    values = {v.path: np.asarray(v.value) for v in src.weights}
    dropped = "block/up/kernel"
    path = str(tmp_path / "partial.safetensors")
    stnp.save_file({**{k: v for k, v in values.items() if k != dropped}, "extra/kernel": values[dropped]}, path)
    model, _ = _fresh(build_zoo, MESHES["1x8"], lazy=True)
    with caplog.at_level(logging.INFO, logger="shardckpt"):
        report = shardckpt.load_sharded(model, path, strict=False)
    said = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "shardckpt"]
    assert said == [(logging.WARNING, (
        f"load_sharded(strict=False) of {path!r}: 1 variable(s) the checkpoint lacks got the values a build "
        f"gives ({dropped}); 1 stored array(s) the model has no variable for were not loaded (extra/kernel). "
        "The model differs from the checkpoint there. Fix: load into the architecture that wrote the "
        "checkpoint; strict=True (the default) refuses such a load and lists each difference."
    ))]
    assert report.unexpected == ["extra/kernel"]

    # A normally built model keeps its value there: said so.
    built, _ = _fresh(build_zoo)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="shardckpt"):
        shardckpt.load_sharded(built, path, strict=False, layout=keras.distribution.DataParallel())
    said = [r.getMessage() for r in caplog.records if r.name == "shardckpt"]
    assert len(said) == 1 and f"1 variable(s) the checkpoint lacks keep their current values ({dropped})" in said[0]

    # Everything matches: nothing said, strict or not.
    full = str(tmp_path / "full.safetensors")
    stnp.save_file(values, full)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="shardckpt"):
        shardckpt.load_sharded(built, full, strict=False, layout=keras.distribution.DataParallel())
        shardckpt.load_sharded(built, full, layout=keras.distribution.DataParallel())
    assert not [r for r in caplog.records if r.name == "shardckpt"]


def test_progress_bar_runs(tmp_path, capsys, monkeypatch):
    src, _ = _fresh(build_zoo)
    path = save_as(src, tmp_path, "h5")
    model, _ = _fresh(build_zoo, MESHES["1x8"], lazy=True)
    monkeypatch.setenv("FORCE_COLOR", "1")  # rich draws on captured stderr as on a terminal
    report = shardckpt.load_sharded(model, path, progress=True)
    assert report.bytes_read == sum(int(np.asarray(v.value).nbytes) for v in model.weights)
    assert "Loaded" in str(report)
    err = capsys.readouterr().err
    assert f"loading {os.path.basename(path)}" in err
    # Without progress=True (and stderr not a terminal) nothing is drawn.
    model, _ = _fresh(build_zoo, MESHES["1x8"], lazy=True)
    shardckpt.load_sharded(model, path)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("mesh", ["2x4", None], ids=["2x4", "one_device"])
def test_training_after_load_matches_keras_load(tmp_path, mesh):
    """Restored buffers are owned per device: donated train steps stay exact."""
    src, _ = _fresh(build_zoo, rnn=False)
    randomize(src, seed=17)
    path = save_as(src, tmp_path, "h5")
    x = np.arange(64, dtype="int32").reshape(8, 8) % 32
    y = np.linspace(-1, 1, 8 * 8 * 32, dtype="float32").reshape(8, 8, 32)

    def train(model):
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        model.fit(x, y, epochs=3, batch_size=4, verbose=0, shuffle=False)
        return [np.asarray(v.value) for v in model.weights]

    reference, _ = _fresh(build_zoo, MESHES.get(mesh), rnn=False)
    reference.load_weights(path)
    want = train(reference)
    model, _ = _fresh(build_zoo, MESHES.get(mesh), lazy=True, rnn=False)
    shardckpt.load_sharded(model, path, **_where(mesh))
    got = train(model)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("fmt", ["h5", "orbax"])
def test_large_pieces_are_page_aligned_maps_each_device_owns(tmp_path, fmt):
    """Pieces of >= 4 MiB live in anonymous maps (formats.base.aligned_empty) that
    the devices adopt: one buffer per device, and donated train steps stay exact."""

    def build():
        return keras.Sequential([keras.Input((1024,)), keras.layers.Dense(2048, name="wide")])

    def session():
        # Two 4 MiB pieces, four replicas each.
        model_parallel({".*wide/kernel": (None, "model")}, (4, 2))

    keras.backend.clear_session()
    src = build()
    randomize(src, seed=23)
    x = np.linspace(-1, 1, 8 * 1024, dtype="float32").reshape(8, 1024)
    y = np.linspace(1, -1, 8 * 2048, dtype="float32").reshape(8, 2048)
    if fmt == "h5":
        path = str(tmp_path / "wide.weights.h5")
        src.save_weights(path)
    else:
        path = str(tmp_path / "ck")
        src.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
        callback = keras.callbacks.OrbaxCheckpoint(path, save_freq="epoch", save_weights_only=True)
        src.fit(x, y, epochs=1, batch_size=8, verbose=0, callbacks=[callback])
        callback.wait_until_finished()
    want = [np.asarray(v.value) for v in src.weights]

    def train(model):
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        model.fit(x, y, epochs=2, batch_size=4, verbose=0, shuffle=False)
        return [np.asarray(v.value) for v in model.weights]

    plain = path if fmt == "h5" else _orbax_as_h5(path, tmp_path, build)
    session()
    reference = build()
    reference.load_weights(plain)
    trained = train(reference)

    session()
    with shardckpt.lazy_init():
        model = build()
    shardckpt.load_sharded(model, path)
    kernel = model.weights[0]
    assert kernel.path.endswith("wide/kernel")
    assert kernel.value.sharding.spec == jax.sharding.PartitionSpec(None, "model")
    pointers = [s.data.unsafe_buffer_pointer() for s in kernel.value.addressable_shards]
    assert len(set(pointers)) == 8, "devices share a buffer"
    assert all(p % mmap.PAGESIZE == 0 for p in pointers), "not the page-aligned maps"
    for v, w in zip(model.weights, want):
        np.testing.assert_array_equal(np.asarray(v.value), w, err_msg=v.path)
    for got, w in zip(train(model), trained):
        np.testing.assert_array_equal(got, w)


def _orbax_as_h5(orbax_path, tmp_path, build):
    """Keras loads an Orbax root only into a compiled model; an h5 copy of the
    same values lets the reference load the plain way."""
    keras.backend.clear_session()
    model = build()
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    model.load_weights(orbax_path)
    path = str(tmp_path / "from_orbax.weights.h5")
    model.save_weights(path)
    return path


def test_readers_declare_their_capabilities(tmp_path):
    """Restore and convert pick their read strategy from these declarations."""
    from shardckpt.formats import (
        ChunkedReader,
        H5Reader,
        MappedReader,
        OrbaxReader,
        Reader,
        SafetensorsReader,
        open_reader,
    )
    from shardckpt.restore import strategies

    for cls, mapped, chunked in ((H5Reader, True, False), (SafetensorsReader, True, False), (OrbaxReader, False, True)):
        # Declared by subclassing (issubclass() does not take protocols with attributes).
        assert (MappedReader in cls.__mro__) is mapped and (ChunkedReader in cls.__mro__) is chunked, cls
    src, _ = _fresh(build_zoo)
    for fmt in ("h5", "keras", "safetensors"):
        reader = open_reader(save_as(src, tmp_path, fmt))
        try:
            assert isinstance(reader, Reader) and isinstance(reader, MappedReader) and not isinstance(reader, ChunkedReader)
            key = reader.keys()[0]
            job = strategies.Job(key, None, None)  # choose() looks at the reader only for mapped formats
            load = strategies.Load(job, reader.spec(key), (), reader.spec(key).dtype, [], True)
            assert strategies.choose(load, reader, strategies.Budget(1 << 20)) is strategies.by_slabs
        finally:
            reader.close()



def test_load_into_a_model_on_one_device_then_fit_builds_its_optimizer(tmp_path):
    """No distribution, optimizer not built yet: fit after the load builds Adam's
    slots from the loaded variables (their recorded layout once broke that)."""
    src, _ = _fresh(build_zoo, rnn=False)
    randomize(src)
    path = save_as(src, tmp_path, "h5")
    model, _ = _fresh(build_zoo, rnn=False)
    model.compile(optimizer="adam", loss="mse")
    shardckpt.load_sharded(model, path)
    x = np.arange(64, dtype="int32").reshape(8, 8) % 32
    model.fit(x, np.zeros((8, 8, 32), "float32"), epochs=1, batch_size=4, verbose=0)
    assert int(model.optimizer.iterations) == 2
