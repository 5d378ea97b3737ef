"""verify(): checksums catch a flipped byte; checkpoints without checksums are read back."""

from __future__ import annotations

import json
import os
import zlib

import h5py
import jax
import keras
import numpy as np
import orbax.checkpoint.experimental.v1 as ocp
import pytest

import shardckpt
from shardckpt import errors
from shardckpt.cli import main
from shardckpt.conversion import integrity
from shardckpt.conversion.converter import convert
from shardckpt.conversion.integrity import read_checksums, verify
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


def test_variable_length_strings_in_h5_are_skipped_and_named(tmp_path, capsys):
    # Keras writes no such dataset as a weight; other writers (or hand edits) add them. Their
    # stored bytes are heap references, not values: verify names them instead of a bare TypeError.
    h5, saved = saved_zoo_h5(str(tmp_path / "m.weights.h5"), 0)
    with h5py.File(h5, "r+") as f:
        f["layers/embedding/vars/1"] = np.array(["a", "bc"], dtype=h5py.string_dtype())
        f["notes"] = "written by hand"
    report = verify(h5)
    assert report.ok and report.skipped == ["layers/embedding/vars/1", "notes"]
    assert report.arrays == len(saved) and report.bytes_read == sum(v.nbytes for v in saved.values())
    text = str(report)
    assert "2 variable-length dataset(s) skipped, not checked" in text
    assert "  skipped: layers/embedding/vars/1 (variable-length data, not checked)" in text
    assert main(["verify", h5, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["skipped"] == ["layers/embedding/vars/1", "notes"]


def test_missing_array_is_reported(tmp_path):
    dst, _ = _converted(tmp_path)
    # Drop one array from Orbax's tree metadata: Orbax no longer lists it.
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


_ORBAX_MALFORMED = "TensorStore data files not found"


def test_a_callback_step_reports_its_chunk_checksums_and_no_malformed_warning(tmp_path, caplog, capsys):
    """OrbaxCheckpoint stores a crc32c on every chunk: verify counts them, and Orbax's
    "malformed checkpoint" warning (about the strings-only model_config item) stays out."""
    import shutil

    from shardckpt.training import OrbaxCheckpoint
    from tests.zoo import small_regressor

    model = small_regressor(3, width=16)
    x, y = np.ones((16, 6), "float32"), np.ones((16, 1), "float32")
    ours, theirs = str(tmp_path / "ours"), str(tmp_path / "keras")
    ckpt = OrbaxCheckpoint(ours)
    model.fit(x, y, epochs=1, verbose=0, callbacks=[ckpt])
    ckpt.wait_until_finished()
    model.fit(x, y, epochs=1, verbose=0, callbacks=[keras.callbacks.OrbaxCheckpoint(theirs)])
    caplog.clear()
    with caplog.at_level("WARNING"):
        report = verify(f"{ours}/0")
        assert main(["verify", f"{ours}/0", "--quiet"]) == 0
    # 18 arrays of this model, each one chunk (the largest is 6x16 float32).
    assert report.ok and report.arrays == 18 and report.chunks_checksummed == 18 and report.checksummed == 0
    assert "(18 chunks, crc32c verified by tensorstore)" in str(report)
    assert "(18 chunks, crc32c verified by tensorstore)" in capsys.readouterr().out
    assert not [r for r in caplog.records if _ORBAX_MALFORMED in r.getMessage()]
    # Keras' callback stores none: said as before.
    report = verify(f"{theirs}/0")
    assert report.ok and report.chunks_checksummed == 0 and "(no checksums stored; read back)" in str(report)

    # A step whose array item lost its data files: an error naming every array the
    # step records (the reader reads `_METADATA` itself, so Orbax's metadata call and
    # its warning are not what tells the damage).
    broken = str(tmp_path / "broken")
    shutil.copytree(f"{ours}/0", broken)
    for name in ("manifest.ocdbt", "ocdbt.process_0", "d"):  # (a one-process save has no process store)
        path = os.path.join(broken, "pytree", name)
        if os.path.lexists(path):
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    with pytest.raises(errors.CorruptCheckpointError, match=(
            rf"18 array\(s\) of '{broken}/pytree' cannot be opened although the checkpoint lists them: "
            r".*its data files are damaged .*Fix: restore from another step")):
        verify(broken)


def test_converted_chunks_are_counted_beside_the_array_checksums(tmp_path):
    dst, expected = _converted(tmp_path)
    report = verify(dst)
    assert report.checksummed == report.arrays == report.chunks_checksummed == len(expected) + 1
    assert f"crc32 checksums of {report.arrays}; {report.arrays} chunks, crc32c verified by tensorstore" in str(report)


def test_a_root_whose_newest_save_is_uncommitted_names_it(tmp_path, caplog, capsys):
    """A save killed before its commit leaves a newer step folder that is passed over:
    verify of the root names it and exits 1; restore_latest and load_sharded warn once."""
    import shutil

    from shardckpt.training import OrbaxCheckpoint
    from tests.zoo import small_regressor

    model = small_regressor(3, width=16)
    root = tmp_path / "ckpts"
    ckpt = OrbaxCheckpoint(str(root), max_to_keep=None)
    model.fit(np.ones((16, 6), "float32"), np.ones((16, 1), "float32"), epochs=2, verbose=0, callbacks=[ckpt])
    ckpt.wait_until_finished()
    # Orbax's temporary folder of a killed save, and an integer folder killed before its metadata.
    shutil.copytree(root / "1", root / "2.orbax-checkpoint-tmp-123")
    shutil.copytree(root / "1", root / "3")
    os.remove(root / "3" / "_CHECKPOINT_METADATA")
    os.makedirs(root / "0.shardckpt-deleting-ab12")  # an older step being deleted: not a lost save

    with caplog.at_level("WARNING", logger="shardckpt"):
        report = verify(str(root))
    assert report.path == str(root / "1") and not report.damaged and not report.ok
    assert report.newer_uncommitted == [
        f"{root}/2.orbax-checkpoint-tmp-123 (a step whose save was interrupted)",
        f"{root}/3 (a step without its _CHECKPOINT_METADATA (a save or delete of it was interrupted, or damage))",
    ]
    assert str(report).splitlines()[0].startswith("NEWER STEP NOT COMMITTED: 18 arrays")
    assert str(report).splitlines()[1:] == [f"  not committed, not verified: {s}" for s in report.newer_uncommitted]
    capsys.readouterr()
    assert main(["verify", str(root), "--quiet"]) == 1
    out = capsys.readouterr().out
    assert f"not committed, not verified: {root}/3 " in out and "Fix: if a save is still running" in out
    assert verify(str(root / "1")).ok and main(["verify", str(root / "1"), "--quiet"]) == 0  # a step: as before
    warned = [r.getMessage() for r in caplog.records if "passed over" in r.getMessage()]
    assert warned == [
        f"{str(root)!r}: using step 1, the latest committed one; passed over 2 newer step folder(s) that are not "
        "committed: 2.orbax-checkpoint-tmp-123 (a step whose save was interrupted); 3 (a step without its "
        "_CHECKPOINT_METADATA (a save or delete of it was interrupted, or damage)). A save of them was "
        "interrupted (or is still running): what they hold is not restored. Fix: if a save is running, let it "
        "finish and load again; else the run resumes from step 1 (OrbaxCheckpoint removes such folders when it "
        "starts)."
    ]

    # restore_latest and load_sharded (each on its own copy: said once per root) warn once, naming the step.
    for name, load in (("a", shardckpt.restore_latest), ("b", shardckpt.load_sharded)):
        copy = tmp_path / name
        shutil.copytree(root, copy)
        caplog.clear()
        with caplog.at_level("WARNING", logger="shardckpt"):
            load(model, str(copy))
        warned = [r.getMessage() for r in caplog.records if "passed over" in r.getMessage()]
        assert len(warned) == 1 and warned[0].startswith(f"{str(copy)!r}: using step 1, the latest committed one;")
        assert "2.orbax-checkpoint-tmp-123 (a step whose save was interrupted); 3 (" in warned[0]
