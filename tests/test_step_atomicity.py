"""What counts as a committed step, the same for every reader; leftovers cleaned by the next run.

No training here (see test_fault_injection.py for kills of real runs): steps
are written by `convert`, then taken apart as a kill would leave them.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess

import keras
import numpy as np
import pytest

import shardckpt
from shardckpt import storage
from shardckpt.errors import CheckpointNotFoundError, IncompleteCheckpointError
from shardckpt.formats.orbax import ondisk, removal


def _dense_4_to_3() -> keras.Model:
    keras.backend.clear_session()
    inputs = keras.Input((4,), name="x")
    model = keras.Model(inputs, keras.layers.Dense(3, name="d")(inputs))
    model.compile(optimizer="adam", loss="mse")
    return model


@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> tuple[str, np.ndarray]:
    model = _dense_4_to_3()
    kernel = np.arange(12, dtype="float32").reshape(4, 3)
    model.layers[1].kernel.assign(kernel)
    path = str(tmp_path_factory.mktemp("src") / "m.keras")
    model.save(path)
    return path, kernel


@pytest.fixture
def source(model_file, steps) -> tuple[str, np.ndarray, str]:
    """The `.keras` file, its kernel, and the root of steps written from it."""
    return (*model_file, steps)


@pytest.fixture(scope="module")
def steps(tmp_path_factory, model_file) -> str:
    """A root of two steps (2 and 4) written by `convert`, copied by each test."""
    root = str(tmp_path_factory.mktemp("steps") / "root")
    shardckpt.convert(model_file[0], os.path.join(root, "2"))
    shutil.copytree(os.path.join(root, "2"), os.path.join(root, "4"))
    return root


def _root(tmp_path, source, steps=(2, 4)) -> str:
    root = str(tmp_path / "root")
    os.makedirs(root)
    for step in steps:
        shutil.copytree(os.path.join(source[2], str(step)), os.path.join(root, str(step)))
    return root


def _three_readers(root: str):
    """The error (type, or None) `load_sharded`, `restore_latest` and `inspect` give for `root`."""
    out = []
    for call in (lambda: shardckpt.load_sharded(_dense_4_to_3(), root),
                 lambda: shardckpt.restore_latest(_dense_4_to_3(), root),
                 lambda: shardckpt.inspect(root)):
        try:
            call()
            out.append(None)
        except (CheckpointNotFoundError, IncompleteCheckpointError) as e:
            out.append(type(e))
    return out


@pytest.mark.parametrize("left", [".orbax-checkpoint-tmp-1795661092", ondisk.DELETING_MARK + "-0123456789ab"],
                         ids=["save_killed", "delete_killed"])
def test_readers_agree_on_a_root_left_with_only_leftovers(tmp_path, source, left):
    """A root a kill left with no committed step: all three raise IncompleteCheckpointError
    (restore_latest used to raise CheckpointNotFoundError there, load_sharded Incomplete...)."""
    root = _root(tmp_path, source, steps=(2,))
    os.rename(os.path.join(root, "2"), os.path.join(root, "2" + left))
    assert _three_readers(root) == [IncompleteCheckpointError] * 3
    with pytest.raises(IncompleteCheckpointError, match="save was interrupted" if "tmp" in left else "delete was"):
        shardckpt.restore_latest(_dense_4_to_3(), root)
    shutil.rmtree(os.path.join(root, os.listdir(root)[0]))
    with pytest.raises(CheckpointNotFoundError):  # nothing at all: not found
        shardckpt.restore_latest(_dense_4_to_3(), root)


@pytest.mark.parametrize("remove", [ondisk.STEP_METADATA, "pytree", "pytree/_METADATA", "pytree/manifest.ocdbt"])
def test_a_half_deleted_step_is_not_committed(tmp_path, source, remove):
    """An integer-named step missing part of what it was saved with is no committed step for
    any reader: the root resolves to the previous whole step, the step itself is refused."""
    root = _root(tmp_path, source)
    target = os.path.join(root, "4", remove)
    (shutil.rmtree if os.path.isdir(target) else os.remove)(target)
    assert ondisk.committed_steps(root) == [2]
    assert ondisk.incomplete_steps(root) == ["4"]
    assert ondisk.resolve_step(root) == os.path.join(root, "2")
    info = shardckpt.inspect(root)
    assert info.step == 2 and info.steps == [2] and info.incomplete == ["4"]
    model = _dense_4_to_3()
    shardckpt.load_sharded(model, root)
    np.testing.assert_array_equal(np.asarray(model.layers[1].kernel.value), source[1])
    with pytest.raises(IncompleteCheckpointError, match="not a whole step"):
        shardckpt.load_sharded(_dense_4_to_3(), os.path.join(root, "4"))


def test_a_recorded_item_missing_makes_the_step_incomplete(tmp_path, source):
    """`_CHECKPOINT_METADATA` records `shardckpt_metadata`, the folder is gone: incomplete,
    never "a step without shardckpt metadata"."""
    root = _root(tmp_path, source)
    meta_path = os.path.join(root, "4", ondisk.STEP_METADATA)
    with open(meta_path) as f:
        meta = json.load(f)
    meta["item_handlers"][ondisk.METADATA_ITEM] = ondisk.JSON_HANDLER
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    assert "shardckpt_metadata" in ondisk.missing_part(os.path.join(root, "4"))
    assert ondisk.committed_steps(root) == [2]


def test_delete_renames_the_step_out_before_removing_a_file(tmp_path, source, monkeypatch):
    """The first thing a delete does is one rename out of the integer names; if the removal
    after it fails (a kill), no integer-named folder is left, and the next start removes it."""
    root = _root(tmp_path, source)
    seen = []

    def fail(path, *args, **kwargs):
        seen.append(sorted(os.listdir(root)))
        raise OSError("killed")

    monkeypatch.setattr(removal.shutil, "rmtree", fail)
    with pytest.raises(OSError, match="killed"):
        removal.delete_step(root, 4)
    monkeypatch.undo()
    assert seen[0][0] == "2" and seen[0][1].startswith("4" + ondisk.DELETING_MARK + "-"), seen
    assert ondisk.committed_steps(root) == [2]
    assert [n for n, _ in ondisk.leftovers(root)] == [seen[0][1]]
    assert removal.remove_leftovers(root) == [seen[0][1]]
    assert sorted(os.listdir(root)) == ["2"]


def test_error_of_an_unreadable_item_leaves_out_orbax_registry(tmp_path, source):
    root = _root(tmp_path, source, steps=(2,))
    os.makedirs(os.path.join(root, "2", ondisk.METADATA_ITEM))
    with pytest.raises(shardckpt.errors.CorruptCheckpointError) as info:
        ondisk.read_json_item(os.path.join(root, "2"), ondisk.METADATA_ITEM)
    message = str(info.value)
    assert "Registry contents" not in message and "ProtoHandler" not in message and len(message) < 600, message


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_convert_removes_temporaries_of_killed_converts(tmp_path, source, caplog):
    """Each killed convert left a hidden `.out.shardckpt-tmp-*` beside the destination; the
    next successful one removes them (one log line each) and keeps a live run's."""
    parent = tmp_path / "converted"
    parent.mkdir()
    dst = str(parent / "out")
    dead = [f".out{ondisk.CONVERT_TMP_MARK}{_dead_pid()}-abc", f".out{ondisk.CONVERT_TMP_MARK}legacy1"]
    live = f".out{ondisk.CONVERT_TMP_MARK}{os.getppid()}-live"
    for name in [*dead, live]:
        os.makedirs(parent / name / "step" / "pytree")
        (parent / name / "step" / "pytree" / "_METADATA").write_text("{}")
    with caplog.at_level(logging.WARNING, logger="shardckpt"):
        shardckpt.convert(source[0], dst)
    assert sorted(os.listdir(parent)) == sorted([live, "out"])
    for name in dead:
        assert sum(name in r.getMessage() for r in caplog.records) == 1


def test_export_removes_what_a_killed_export_left(tmp_path, caplog):
    model = _dense_4_to_3()
    dst = str(tmp_path / "exported")
    for suffix in (".shardckpt-partial", ".shardckpt-old"):
        os.makedirs(dst + suffix)
        with open(os.path.join(dst + suffix, "model.safetensors"), "wb") as f:
            f.write(b"half")
    with caplog.at_level(logging.WARNING, logger="shardckpt"):
        shardckpt.export(model, dst, format="safetensors")
    assert sorted(os.listdir(tmp_path)) == ["exported"]
    for suffix in (".shardckpt-partial", ".shardckpt-old"):
        assert sum((dst + suffix) in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("where", ["local", "gs", "s3"])
def test_step_items_read_the_same_on_a_disk_and_in_a_bucket(tmp_path, where, request):
    """`items`, `tree_dir` and `read_json_item` answer from one code path: a JSON item,
    a missing one, and an item folder holding none of its files (damaged: raised, not None)."""
    if where == "local":
        step = storage.parse(str(tmp_path / "7"))
        for item in (ondisk.ARRAYS_ITEM, ondisk.METADATA_ITEM, ondisk.ITERATOR_ITEM):
            os.makedirs(os.path.join(step.path, item))
    else:
        server = request.getfixturevalue("gcs_server" if where == "gs" else "s3_server")
        step = storage.parse(server.new_bucket()).join("7")
    storage.write_bytes(step.join(ondisk.ARRAYS_ITEM, ondisk.TREE_METADATA), b"{}")
    storage.write_bytes(step.join(ondisk.METADATA_ITEM, "data.json"), b'{"epoch": 3}')
    storage.write_bytes(step.join(ondisk.ITERATOR_ITEM, "notes.txt"), b"not the item's file")
    assert ondisk.items(step) == sorted([ondisk.ARRAYS_ITEM, ondisk.METADATA_ITEM, ondisk.ITERATOR_ITEM])
    assert ondisk.tree_dir(step) == step.join(ondisk.ARRAYS_ITEM).url
    assert ondisk.read_json_item(step, ondisk.METADATA_ITEM) == {"epoch": 3}
    assert ondisk.read_json_item(step, "metrics") is None
    with pytest.raises(shardckpt.errors.CorruptCheckpointError, match="none of the files"):
        ondisk.read_json_item(step, ondisk.ITERATOR_ITEM)
