"""Chunks of the checkpoints shardckpt writes: `convert` and `OrbaxCheckpoint` store CHUNK_BYTES chunks.

The sizes were chosen by `tools/bench_chunks.py`; these tests check that both
writers store them (an 8 MiB kernel: one chunk uncompressed, two 4 MiB chunks
with zstd; Orbax 0.12 makes each chunk its own zarr shard) and that the
result restores bit-equal onto a mesh.
"""

from __future__ import annotations

import json
import os

import jax
import keras
import numpy as np
import pytest
import tensorstore as ts

import shardckpt
from shardckpt.conversion import convert
from shardckpt.formats.orbax.writer import CHUNK_BYTES
from shardckpt.training import OrbaxCheckpoint

IN, OUT = 1024, 2048  # an 8 MiB float32 kernel: two chunks


def _one_wide_dense() -> keras.Model:
    return keras.Sequential([keras.Input((IN,)), keras.layers.Dense(OUT, use_bias=False, name="big")], name="m")


def _kernel_chunks(step_dir: str) -> tuple[list[int], list[int], str]:
    """The kernel's outer (written block) and inner (read chunk) shapes, and its codecs."""
    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{step_dir}/pytree/"}).result()
    [name] = [k for k in kv.list().result() if k.endswith(b"kernel/zarr.json")]
    meta = json.loads(kv.read(name).result().value)
    outer = meta["chunk_grid"]["configuration"]["chunk_shape"]
    [sharding] = [c for c in meta["codecs"] if c["name"] == "sharding_indexed"]
    inner = sharding["configuration"]["chunk_shape"]
    return outer, inner, json.dumps(sharding["configuration"]["codecs"])


def _assert_chunked(outer: list[int], inner: list[int], codecs: str, compression: str) -> None:
    assert outer == inner  # Orbax 0.12 stores each chosen chunk as its own zarr shard
    assert ("zstd" in codecs) == (compression == "zstd"), codecs
    if compression == "zstd":  # two chunks of the 8 MiB kernel
        assert CHUNK_BYTES["zstd"] // 2 < np.prod(inner) * 4 <= CHUNK_BYTES["zstd"] < IN * OUT * 4
        assert IN % inner[0] == 0 and OUT % inner[1] == 0
    else:  # the kernel is below the cap: one chunk
        assert inner == [IN, OUT] and IN * OUT * 4 < CHUNK_BYTES["none"]


def _restore_on_mesh(path: str, expected: np.ndarray) -> None:
    keras.backend.clear_session()
    mesh = keras.distribution.DeviceMesh((2, 4), ["data", "model"])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["m/big/kernel"] = (None, "model")
    with shardckpt.lazy_init():
        model = _one_wide_dense()
    shardckpt.load_sharded(model, path, layout=layout_map, progress=False)
    [kernel] = model.weights
    np.testing.assert_array_equal(np.asarray(kernel.value), expected)
    assert kernel.value.sharding.spec == jax.sharding.PartitionSpec(None, "model")


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_convert_stores_chunk_bytes_chunks(tmp_path, compression):
    keras.backend.clear_session()
    src = _one_wide_dense()
    expected = np.random.default_rng(3).standard_normal((IN, OUT), dtype=np.float32)
    src.weights[0].assign(expected)
    path = str(tmp_path / "m.weights.h5")
    src.save_weights(path)
    keras.backend.clear_session()
    with shardckpt.lazy_init():
        arch = _one_wide_dense()
    dst = str(tmp_path / "orbax")
    convert(path, dst, model=arch, compression=compression, progress=False)
    _assert_chunked(*_kernel_chunks(dst), compression)
    _restore_on_mesh(dst, expected)


def test_orbax_checkpoint_stores_chunk_bytes_chunks_compressed_or_not(tmp_path):
    for compression in (False, True):
        keras.backend.clear_session()
        model = _one_wide_dense()
        expected = np.random.default_rng(4).standard_normal((IN, OUT), dtype=np.float32)
        model.weights[0].assign(expected)
        model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
        directory = str(tmp_path / f"ck-{compression}")
        callback = OrbaxCheckpoint(directory, save_weights_only=True, save_on_background=False,
                                   compression=compression)
        model.fit(np.zeros((8, IN), "float32"), np.zeros((8, OUT), "float32"), epochs=1, verbose=0,
                  callbacks=[callback])
        [step] = [d for d in os.listdir(directory) if d.isdigit()]
        _assert_chunked(*_kernel_chunks(os.path.join(directory, step)), "zstd" if compression else "none")
        _restore_on_mesh(directory, expected)
