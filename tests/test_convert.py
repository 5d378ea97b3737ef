"""convert(): h5 / .keras / safetensors -> Orbax, read back by Keras and load_sharded bit-exact."""

from __future__ import annotations

import gc
import json
import os
import threading
import time

import h5py
import jax
import keras
import ml_dtypes
import numpy as np
import orbax.checkpoint.experimental.v1 as ocp
import pytest
import safetensors.numpy as stnp
import tensorstore as ts

import shardckpt
from shardckpt import errors
from shardckpt.conversion.boxes import write_boxes
from shardckpt.conversion.converter import convert
from shardckpt.conversion.integrity import read_checksums
from shardckpt.restore import hostmem
from tests.support import rss_anon
from tests.zoo import build_zoo, lazy_zoo, model_parallel, randomize


class _PeakRssAnon:
    """Samples this process's anonymous memory every millisecond; `.value` is the peak."""

    def __enter__(self):
        self.value = rss_anon()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.value = max(self.value, rss_anon())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.value = max(self.value, rss_anon())


def _source(tmp_path, dtype="float32", seed=0):
    """A zoo model with random values, saved by Keras; returns (path, {variable.path: value})."""
    keras.backend.clear_session()
    model = build_zoo(dtype=dtype)
    randomize(model, seed)
    path = str(tmp_path / "src.weights.h5")
    model.save_weights(path)
    return path, {v.path: np.asarray(v.value) for v in model.weights}




def _assert_values(model, expected, dist=None):
    assert {v.path for v in model.weights} == set(expected)
    for v in model.weights:
        got = np.asarray(v.value)
        assert got.dtype == expected[v.path].dtype, v.path
        np.testing.assert_array_equal(got, expected[v.path], err_msg=v.path)
        if dist is not None:
            want = dist.get_variable_layout(v).backend_layout
            assert v.value.sharding.is_equivalent_to(want, v.ndim), (v.path, v.value.sharding, want)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_h5_round_trip_through_keras_load_weights_and_load_sharded(tmp_path, dtype):
    """The zoo (nested subclassed model, int8 variable, BatchNorm stats) in float32 and bfloat16."""
    src, expected = _source(tmp_path, dtype)
    assert any(v.dtype == np.int8 for v in expected.values())
    arch, _ = lazy_zoo(dtype)
    dst = str(tmp_path / "orbax")
    report = convert(src, dst, model=arch, progress=False)
    # Keras' h5 has no key for the GRU's seed-generator state: its initial value is written.
    seeds = [v.path for v in arch.non_trainable_variables if "seed_generator" in v.path]
    assert report.initialized == seeds and len(seeds) == (dtype == "float32")
    assert report.arrays == len(expected) + len(seeds) and report.format == "h5"

    # Keras' own reader, on a normally built (differently initialised) model.
    keras.backend.clear_session()
    model = build_zoo(dtype=dtype)
    randomize(model, seed=1)
    model.compile(optimizer="adam", loss="mse")
    model.load_weights(dst)
    _assert_values(model, expected)

    # shardckpt onto a 2x4 mesh, from a lazily built model.
    model, dist = lazy_zoo(dtype, (2, 4))
    shardckpt.load_sharded(model, dst)
    _assert_values(model, expected, dist)
    got = {v.path: np.asarray(v.value) for v in model.non_trainable_variables}
    for path in seeds:  # a fresh state: a (random) seed and a zero counter, as Keras builds it
        assert got[path].dtype == np.uint32 and got[path].shape == (2,) and got[path][1] == 0

    # Trainable / non-trainable split is the model's.
    tree = ocp.pytree_metadata(dst, checkpointable_name="pytree").metadata
    assert set(tree) == {"trainable_variables", "non_trainable_variables"}
    assert set(tree["non_trainable_variables"]) == {"bn", "int8_table"} | {p.split("/")[0] for p in seeds}
    assert set(tree["trainable_variables"]["bn"]) == {"gamma", "beta"}


def test_keras_archive_converts_without_a_model_and_keras_reads_it_under_a_distribution(tmp_path):
    keras.backend.clear_session()
    model = build_zoo()
    randomize(model, 3)
    model.compile(optimizer="adam", loss="mse")  # the archive then holds a compile config
    src = str(tmp_path / "m.keras")
    model.save(src)
    expected = [np.asarray(v.value) for v in model.weights]
    dst = str(tmp_path / "orbax")
    # As in a fresh `shardckpt convert` process: the GRU's seed generator has
    # an auto-generated name, which counts up within a Keras session.
    keras.backend.clear_session()
    report = convert(src, dst, compression="zstd", progress=False)
    assert report.format == "keras" and report.skipped  # the optimizer state is left out

    # Keras deserialises the nested subclassed model with other variable paths
    # ("up/kernel") than building it in code ("block/up/kernel"); the output
    # follows the architecture stored in the file, as Keras' load_model does.
    dist = model_parallel({"up/kernel": (None, "model"), "embed/embeddings": ("model", None)})
    model = keras.saving.load_model(src)
    randomize(model, 4)
    model.load_weights(dst)  # Keras reshards with Orbax onto the layout
    assert len(model.weights) == len(expected)
    for v, want in zip(model.weights, expected):
        np.testing.assert_array_equal(np.asarray(v.value), want, err_msg=v.path)
        assert v.value.sharding.is_equivalent_to(dist.get_variable_layout(v).backend_layout, v.ndim), v.path
    assert model.get_layer("embed").embeddings.value.sharding.spec == jax.sharding.PartitionSpec("model", None)


def test_metadata_files_match_what_orbax_writes_for_the_same_tree(tmp_path):
    src, expected = _source(tmp_path)
    arch, _ = lazy_zoo()
    dst = str(tmp_path / "orbax")
    convert(src, dst, model=arch, progress=False)
    tree = {"trainable_variables": {}, "non_trainable_variables": {}}
    for v in [*arch.trainable_variables, *arch.non_trainable_variables]:  # incl. the seed state
        node = tree["trainable_variables" if v.trainable else "non_trainable_variables"]
        for part in v.path.split("/")[:-1]:
            node = node.setdefault(part, {})
        node[v.path.split("/")[-1]] = expected.get(v.path, np.zeros(v.shape, v.dtype))
    ref = str(tmp_path / "ref")
    ocp.save_checkpointables(ref, {"pytree": tree})
    with open(os.path.join(dst, "pytree", "_METADATA")) as f:
        ours = json.load(f)
    with open(os.path.join(ref, "pytree", "_METADATA")) as f:
        theirs = json.load(f)
    assert ours == theirs
    with open(os.path.join(dst, "_CHECKPOINT_METADATA")) as f:
        ours = json.load(f)
    with open(os.path.join(ref, "_CHECKPOINT_METADATA")) as f:
        theirs = json.load(f)
    assert ours["item_handlers"] == theirs["item_handlers"]
    assert set(ours) == set(theirs)
    assert sorted(os.listdir(dst)) == sorted(os.listdir(ref))


def test_dtype_casts_floats_only_and_checksums_the_stored_bytes(tmp_path):
    src, expected = _source(tmp_path)
    arch, _ = lazy_zoo()
    dst = str(tmp_path / "orbax")
    report = convert(src, dst, model=arch, dtype="bfloat16", progress=False)
    model, _ = lazy_zoo("bfloat16", rnn=True)  # lazily: no bfloat16 QR init; int8 table stays int8
    # casts back where a variable is float32 (the nested block's)
    shardckpt.load_sharded(model, dst, layout=keras.distribution.DataParallel())
    want = {}
    for v in model.weights:
        value = expected[v.path]
        want[v.path] = value if value.dtype == np.int8 else value.astype(ml_dtypes.bfloat16).astype(v.dtype)
    _assert_values(model, want)
    assert len(report.casts) == len(expected) - 1
    sums = read_checksums(dst)
    assert sums["non_trainable_variables/int8_table/table"]["dtype"] == "int8"
    assert sums["trainable_variables/head/kernel"]["dtype"] == "bfloat16"
    with pytest.raises(errors.DtypeMismatchError, match="floating-point"):
        convert(src, str(tmp_path / "x"), model=arch, dtype="int8")


def test_dtype_leaves_int4_group_indices_float32_as_keras_keeps_them(tmp_path):
    """int4 sub-channel `g_idx` is the group of each input row, float32 under every Keras policy. Cast
    to bfloat16, 257 became 256 (128 rows read the wrong group's scale: outputs 17% off, against
    2% for the scales' own rounding); it is kept float32 and said."""
    inputs = 257 * 128 + 128  # 258 groups of 128 rows: indices up to 257, past bfloat16's exact 256
    keras.backend.clear_session()
    model = keras.Sequential([keras.Input((inputs,)), keras.layers.Dense(8, name="down")])
    model.layers[0].kernel.assign(np.random.default_rng(0).standard_normal((inputs, 8)).astype("float32"))
    model.quantize("int4")
    src = str(tmp_path / "q.keras")
    model.save(src)
    names = [v.name for v in model.weights]  # bias, kernel, kernel_scale, kernel_zero, g_idx
    saved = [np.asarray(v.value) for v in model.weights]
    assert names[-1] == "g_idx" and saved[-1].max() == 257
    report = convert(src, str(tmp_path / "orbax"), dtype="bfloat16", progress=False)
    keras.backend.clear_session()
    back = keras.saving.load_model(src)
    shardckpt.load_sharded(back, str(tmp_path / "orbax"))
    assert [v.name for v in back.weights] == names
    for v, want in zip(back.weights, saved, strict=True):
        if v.name in ("bias", "kernel_scale"):  # cast, as asked
            want = want.astype(ml_dtypes.bfloat16).astype(want.dtype)
        np.testing.assert_array_equal(np.asarray(v.value), want, err_msg=v.path)
    assert report.uncast == ["layers/dense/vars/4: float32"]
    assert not any(c.startswith("layers/dense/vars/4:") for c in report.casts)
    assert "not cast (indices, float32 as Keras keeps them): layers/dense/vars/4: float32" in str(report)


def test_safetensors_index_set(tmp_path):
    keras.backend.clear_session()
    model = build_zoo()
    randomize(model, 5)
    expected = {v.path: np.asarray(v.value) for v in model.weights}
    keys = sorted(expected)
    halves = {"a.safetensors": keys[::2], "b.safetensors": keys[1::2]}
    weight_map = {}
    for name, part in halves.items():
        stnp.save_file({k: expected[k] for k in part}, str(tmp_path / name))
        weight_map.update({k: name for k in part})
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    arch, _ = lazy_zoo()
    dst = str(tmp_path / "orbax")
    convert(str(index), dst, model=arch, progress=False)
    model, dist = lazy_zoo(mesh_shape=(1, 8))
    shardckpt.load_sharded(model, dst)
    _assert_values(model, expected, dist)


def test_large_tensors_stream_in_pieces_within_the_budget(tmp_path):
    """A budget far below one kernel: pieces, outer chunks and inner chunks all bounded;
    and the memory a conversion holds stays near the budget (`_rss_anon_peak`)."""
    src, expected = _source(tmp_path)
    arch, _ = lazy_zoo()
    dst = str(tmp_path / "orbax")
    budget = 4096
    convert(src, dst, model=arch, max_inflight_bytes=budget, progress=False)
    model, dist = lazy_zoo(mesh_shape=(2, 4))
    shardckpt.load_sharded(model, dst)
    _assert_values(model, expected, dist)
    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{dst}/pytree/"}).result()
    zarr = json.loads(kv.read(b"trainable_variables.embed.embeddings/zarr.json").result().value)
    outer = zarr["chunk_grid"]["configuration"]["chunk_shape"]
    assert np.prod(outer) * 4 <= budget // 4 < expected["embed/embeddings"].nbytes

    # Memory: one 64 MiB kernel converted with an 8 MiB budget. Anonymous
    # memory (mapped source pages are file-backed, not counted) may grow by
    # the budget plus slack for tensorstore's own state, never by the kernel.
    keras.backend.clear_session()
    big = keras.Sequential([keras.Input((4096,)), keras.layers.Dense(4096, use_bias=False, name="big")])
    big_src = str(tmp_path / "big.weights.h5")
    big.save_weights(big_src)
    kernel_bytes = 4096 * 4096 * 4
    del big
    keras.backend.clear_session()
    with shardckpt.lazy_init():
        arch = keras.Sequential([keras.Input((4096,)), keras.layers.Dense(4096, use_bias=False, name="big")])
    gc.collect()
    hostmem.trim()
    base = rss_anon()
    with _PeakRssAnon() as peak:
        convert(big_src, str(tmp_path / "big_orbax"), model=arch, max_inflight_bytes=8 << 20, progress=False)
    assert peak.value - base < kernel_bytes // 2, (peak.value - base) / 2**20


@pytest.mark.parametrize(
    "shape,shard,budget",
    [((64, 32), (64, 4), 1024), ((3, 5, 7), (3, 5, 7), 40), ((10,), (10,), 8), ((), (), 64), ((1, 9), (1, 9), 8)],
)
def test_planned_boxes_tile_the_array_in_c_order_on_whole_outer_chunks(shape, shard, budget):
    write_shape, boxes = write_boxes(shape, 4, shard, budget)
    seen = np.zeros(shape, np.int64)
    order = []
    flat = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
    for box in boxes:
        seen[box] += 1
        order.extend(np.ravel(flat[box]).tolist())
        n = int(np.prod([s.stop - s.start for s in box]))
        assert n * 4 <= budget or n == 1 or len(shape) == 0
        for s, w in zip(box, write_shape):  # whole outer chunks (the last one may be cut by the edge)
            assert s.start % w == 0
    assert (seen == 1).all()
    assert order == list(range(int(np.prod(shape))))  # C order: checksums continue piece by piece
    assert all(w <= s for w, s in zip(write_shape, shard))


def test_mesh_aligns_outer_chunks_to_the_auto_layout_shards(tmp_path):
    src, _ = _source(tmp_path)
    arch, _ = lazy_zoo()
    dst = str(tmp_path / "orbax")
    convert(src, dst, model=arch, mesh=(1, 8), progress=False)
    plan = shardckpt.layout.auto_layout(arch, (1, 8))
    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{dst}/pytree/"}).result()
    checked = 0
    for v in arch.trainable_variables:
        if not any(plan.axes_for(v)):
            continue
        shard = plan.sharding_for(v).shard_shape(tuple(v.shape))
        name = f"trainable_variables.{v.path.replace('/', '.')}/zarr.json".encode()
        outer = json.loads(kv.read(name).result().value)["chunk_grid"]["configuration"]["chunk_shape"]
        assert all(o <= s for o, s in zip(outer, shard)), (v.path, outer, shard)
        checked += 1
    assert checked > 0


def test_h5_without_model_names_the_fix(tmp_path):
    src, _ = _source(tmp_path)
    dst = tmp_path / "orbax"
    with pytest.raises(errors.ModelRequiredError, match="--model package.module:function"):
        convert(src, str(dst))
    assert not dst.exists()


def test_model_may_be_a_function_that_builds_it(tmp_path):
    """model=build_model converts as model=build_model() does; other callables get a typed error."""
    src, expected = _source(tmp_path)
    dst = str(tmp_path / "orbax")
    report = convert(src, dst, model=build_zoo, progress=False)
    assert report.arrays == len(expected) + 1  # (+ the GRU's seed state, see the round-trip test)
    model, dist = lazy_zoo("float32", (2, 4))
    shardckpt.load_sharded(model, dst)
    _assert_values(model, {**expected, **{v.path: np.asarray(v.value) for v in model.weights
                                          if "seed_generator" in v.path}}, dist)

    with pytest.raises(errors.ModelRequiredError, match=r"needs arguments .*Fix: pass model=lambda: "):
        convert(src, str(tmp_path / "o2"), model=lambda width: build_zoo(dim=width), progress=False)
    with pytest.raises(errors.ModelRequiredError, match="returned dict, not a Keras model. Fix: return"):
        convert(src, str(tmp_path / "o3"), model=lambda: {}, progress=False)
    with pytest.raises(errors.ModelRequiredError, match="a zero-argument function that builds one"):
        convert(src, str(tmp_path / "o4"), model="zoo", progress=False)
    assert sorted(os.listdir(tmp_path)) == ["orbax", "src.weights.h5"]


def test_existing_destination_is_refused_then_replaced_with_force(tmp_path):
    src, expected = _source(tmp_path)
    arch, _ = lazy_zoo()
    dst = tmp_path / "orbax"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    with pytest.raises(errors.DestinationExistsError, match="force"):
        convert(src, str(dst), model=arch)
    assert (dst / "keep.txt").read_text() == "mine"
    convert(src, str(dst), model=arch, force=True, progress=False)
    assert not (dst / "keep.txt").exists()
    assert sorted(os.listdir(tmp_path)) == ["orbax", "src.weights.h5"]


def _damage_last_dataset(path: str) -> str:
    """Rewrites the last dataset gzip-compressed and breaks its compressed bytes.

    The file still opens and every other array reads; the failure comes while
    streaming, after earlier arrays were written.
    """
    with h5py.File(path, "r+") as f:
        names = []
        f.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
        name = names[-1]  # the last in storage order: converted after all others
        data, attrs = f[name][()], dict(f[name].attrs)
        del f[name]
        ds = f.create_dataset(name, data=data, chunks=data.shape, compression="gzip")
        ds.attrs.update(attrs)
        offset = ds.id.get_chunk_info(0).byte_offset
    with open(path, "r+b") as f:
        f.seek(offset + 8)
        f.write(b"\xff" * 64)
    return name


def test_failure_while_streaming_leaves_nothing_and_keeps_an_old_destination(tmp_path):
    src, _ = _source(tmp_path)
    arch, _ = lazy_zoo()
    _damage_last_dataset(src)
    dst = tmp_path / "orbax"
    with pytest.raises(errors.CorruptCheckpointError):
        convert(src, str(dst), model=arch, progress=False)
    assert sorted(os.listdir(tmp_path)) == ["src.weights.h5"]  # no dst, no temporary folder
    dst.mkdir()
    (dst / "keep.txt").write_text("old")
    with pytest.raises(errors.CorruptCheckpointError):
        convert(src, str(dst), model=arch, force=True, progress=False)
    assert os.listdir(dst) == ["keep.txt"]
    assert sorted(os.listdir(tmp_path)) == ["orbax", "src.weights.h5"]


def test_truncated_source_is_refused_and_nothing_is_written(tmp_path):
    src, _ = _source(tmp_path)
    arch, _ = lazy_zoo()
    size = os.path.getsize(src)
    with open(src, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(errors.CorruptCheckpointError, match="truncated"):
        convert(src, str(tmp_path / "orbax"), model=arch)
    assert sorted(os.listdir(tmp_path)) == ["src.weights.h5"]


def test_mismatched_architecture_lists_every_problem(tmp_path):
    src, expected = _source(tmp_path)
    keras.backend.clear_session()
    with shardckpt.lazy_init():
        other = build_zoo(dim=24)
    with pytest.raises(errors.CheckpointMismatchError, match="embed/embeddings") as info:
        convert(src, str(tmp_path / "orbax"), model=other)
    assert sorted(os.listdir(tmp_path)) == ["src.weights.h5"]
    # Every variable whose shape differs is named, each once, and nothing else.
    differ = {v.path for v in other.weights if tuple(v.shape) != expected[v.path].shape}
    assert len(differ) > 5
    named = [line.split(":", 1)[0] for line in info.value.mismatched]
    assert sorted(named) == sorted(differ)
    assert info.value.missing == [] and info.value.unexpected == []
    for path in differ:
        assert path in str(info.value)
