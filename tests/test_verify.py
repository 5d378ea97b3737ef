"""verify(): checksums catch a flipped byte; checkpoints without checksums are read back."""

from __future__ import annotations

import os
import zlib

import jax
import keras
import numpy as np
import orbax.checkpoint.experimental.v1 as ocp
import pytest

import shardckpt
from shardckpt import errors
from shardckpt.cli import main
from shardckpt.convert import integrity
from shardckpt.convert.converter import convert
from shardckpt.convert.integrity import read_checksums, verify
from tests.damage import flip_byte_of
from tests.zoo import build_zoo, randomize, saved_zoo_h5


def test_crc32_is_zlibs_continued_piece_by_piece():
    # ISA-L computes it (7x faster); the values stay zlib's, so every checkpoint
    # converted before verifies the same. A transposed view is hashed in C order.
    data = np.random.default_rng(0).standard_normal((64, 300)).astype(np.float32)
    assert integrity._crc32 is not zlib.crc32  # isal is a dependency
    whole = zlib.crc32(data.tobytes())
    assert integrity.crc32(data[40:], integrity.crc32(data[:40])) == integrity.crc32(data) == whole
    assert integrity.crc32(data.T) == zlib.crc32(np.ascontiguousarray(data.T).tobytes())


def _converted(tmp_path):
    src, values = saved_zoo_h5(str(tmp_path / "m.weights.h5"), 0)
    with shardckpt.lazy_init():
        arch = build_zoo()
    dst = str(tmp_path / "orbax")
    convert(src, dst, model=arch, progress=False)
    return dst, values


def test_intact_checkpoint_verifies_with_every_checksum(tmp_path):
    dst, expected = _converted(tmp_path)
    report = verify(dst)
    sums = read_checksums(dst)
    assert report.ok and report.checksummed == report.arrays == len(sums) == len(expected) + 1  # + seed state
    assert report.bytes_read == sum(v.nbytes for v in expected.values()) + 8


def test_flipped_byte_is_named(tmp_path, capsys):
    dst, expected = _converted(tmp_path)
    flip_byte_of(os.path.join(dst, "pytree"), expected["head/kernel"])
    report = verify(dst)
    assert len(report.damaged) == 1
    # The chunk's crc32c fails as tensorstore decodes it, before the array's CRC-32 is compared.
    assert report.damaged[0].startswith("trainable_variables/head/kernel: chunk checksum crc32c does not match")
    with pytest.raises(errors.ChecksumMismatchError, match="trainable_variables/head/kernel"):
        report.raise_if_damaged()
    assert main(["verify", dst, "--quiet"]) == 1
    out = capsys.readouterr().out
    assert "DAMAGED" in out and "trainable_variables/head/kernel" in out and "Fix:" in out


def test_keras_written_orbax_and_h5_are_read_back_without_checksums(tmp_path):
    keras.backend.clear_session()
    model = build_zoo()
    randomize(model, 1)
    model.compile(optimizer="adam", loss="mse")
    step = str(tmp_path / "keras_orbax" / "0")
    ocp.save_checkpointables(step, {"pytree": model.get_state_tree()})
    report = verify(step)
    leaves = jax.tree.leaves(model.get_state_tree())
    assert report.ok and report.checksummed == 0 and report.arrays == len(leaves)
    assert report.bytes_read == sum(np.asarray(x).nbytes for x in leaves)
    h5 = str(tmp_path / "m.weights.h5")
    model.save_weights(h5)
    report = verify(h5)
    assert report.ok and report.checksummed == 0 and report.format == "h5"
    assert report.bytes_read == sum(np.asarray(v.value).nbytes for v in model.weights) + sum(
        np.asarray(v.value).nbytes for v in model.optimizer.variables
    )


def test_missing_array_is_reported(tmp_path):
    dst, _ = _converted(tmp_path)
    # Drop one array from Orbax's tree metadata: Orbax no longer lists it.
    import json

    meta_path = os.path.join(dst, "pytree", "_METADATA")
    meta = json.load(open(meta_path))
    key = "('trainable_variables', 'conv', 'bias')"
    del meta["tree_metadata"][key]
    json.dump(meta, open(meta_path, "w"))
    report = verify(dst)
    assert report.damaged == [
        "trainable_variables/conv/bias: listed in the checksums but missing from the checkpoint"
    ]


def test_damaged_index_names_every_array_without_stray_tracebacks(tmp_path, capfd):
    """A flipped byte in the OCDBT manifest makes every array unreachable: verify
    names each of them in its one error line, and nothing else is printed."""
    dst, _ = _converted(tmp_path)
    keys = sorted(read_checksums(dst))
    manifest = os.path.join(dst, "pytree", "manifest.ocdbt")
    blob = bytearray(open(manifest, "rb").read())
    blob[len(blob) // 2] ^= 0xFF
    open(manifest, "wb").write(bytes(blob))
    capfd.readouterr()
    assert main(["verify", dst, "--quiet"]) == 1
    out, err = capfd.readouterr()
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("shardckpt verify: error: The index of"), err
    assert f"none of its {len(keys)} array(s) can be located" in lines[0]
    for key in keys:
        assert repr(key) in lines[0], key
    assert "Fix: restore from another step." in lines[0]
    with pytest.raises(errors.CorruptCheckpointError):
        verify(dst)
    assert "Traceback" not in capfd.readouterr().err
