"""Per-chunk crc32c in shardckpt's Orbax writers: every restore that reads a damaged chunk fails.

`convert` and `OrbaxCheckpoint` store a zarr3 `crc32c` codec on every chunk;
tensorstore checks it as it decodes, so `load_sharded` raises
`ChecksumMismatchError` without a `verify` pass. Keras' own `OrbaxCheckpoint`
(other folders) is left as Orbax writes it.
"""

from __future__ import annotations

import json
import os

import keras
import numpy as np
import pytest
import tensorstore as ts

import shardckpt
from shardckpt import errors
from shardckpt.conversion.integrity import verify
from shardckpt.training import OrbaxCheckpoint
from tests.damage import flip_byte_of
from tests.zoo import build_zoo, saved_zoo_h5


def _chunk_codecs(tree: str, name: str) -> list[str]:
    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{tree}/"}).result()
    meta = json.loads(kv.read(f"{name}/zarr.json".encode()).result().value)
    [sharding] = [c for c in meta["codecs"] if c["name"] == "sharding_indexed"]
    return [c["name"] for c in sharding["configuration"]["codecs"]]


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_converted_chunks_are_checked_on_every_restore(tmp_path, compression):
    src, values = saved_zoo_h5(str(tmp_path / "m.weights.h5"), 0)
    with shardckpt.lazy_init():
        arch = build_zoo()
    dst = str(tmp_path / "orbax")
    shardckpt.convert(src, dst, model=arch, compression=compression, progress=False)
    want = ["bytes", "zstd", "crc32c"] if compression == "zstd" else ["bytes", "crc32c"]
    assert _chunk_codecs(f"{dst}/pytree", "trainable_variables.head.kernel") == want

    # Intact: Keras' own loader and load_sharded read the checksummed chunks bit-equal.
    keras.backend.clear_session()
    model = build_zoo()
    model.compile(optimizer="adam", loss="mse")
    model.load_weights(dst)
    for v in model.weights:
        if v.path in values:
            np.testing.assert_array_equal(np.asarray(v), values[v.path], err_msg=v.path)
    if compression == "zstd":
        return  # the raw bytes are not findable in compressed chunks

    flip_byte_of(f"{dst}/pytree", values["head/kernel"])
    keras.backend.clear_session()
    with shardckpt.lazy_init():
        model = build_zoo()
    with pytest.raises(errors.ChecksumMismatchError, match=r"trainable_variables/head/kernel.*crc32c") as info:
        shardckpt.load_sharded(model, dst, layout=shardckpt.auto_layout(model, (2, 4)))
    assert dst in str(info.value) and "Digest mismatch" in str(info.value)
    report = verify(dst)
    assert len(report.damaged) == 1 and report.damaged[0].startswith("trainable_variables/head/kernel:")


def test_callback_saves_carry_chunk_checksums_and_keras_callback_saves_do_not(tmp_path):
    keras.utils.set_random_seed(1)  # a kernel over 1 KiB: OCDBT stores smaller values inline in its index
    inputs = keras.Input((16,), name="x")
    outputs = keras.layers.Dense(64, name="hidden")(inputs)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="adam", loss="mse")
    x, y = np.ones((8, 16), "float32"), np.ones((8, 64), "float32")
    ours, theirs = str(tmp_path / "ours"), str(tmp_path / "keras")
    model.fit(x, y, epochs=1, verbose=0, callbacks=[keras.callbacks.OrbaxCheckpoint(theirs)])
    ckpt = OrbaxCheckpoint(ours)
    model.fit(x, y, epochs=1, verbose=0, callbacks=[ckpt])
    ckpt.wait_until_finished()
    kernel = np.asarray(model.get_layer("hidden").kernel)
    [step] = os.listdir(ours)
    assert _chunk_codecs(f"{ours}/{step}/pytree", "trainable_variables.hidden.kernel") == ["bytes", "crc32c"]
    [kstep] = [s for s in os.listdir(theirs) if s.isdigit()]
    assert "crc32c" not in _chunk_codecs(f"{theirs}/{kstep}/pytree", "trainable_variables.hidden.kernel")

    flip_byte_of(f"{ours}/{step}/pytree", kernel)
    keras.backend.clear_session()
    with shardckpt.lazy_init():
        inputs = keras.Input((16,))
        again = keras.Model(inputs, keras.layers.Dense(64, name="hidden")(inputs))
    with pytest.raises(errors.ChecksumMismatchError, match="hidden.kernel|hidden/kernel"):
        shardckpt.load_sharded(again, ours, strict=False, layout=keras.distribution.DataParallel())
