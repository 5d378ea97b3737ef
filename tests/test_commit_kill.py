"""SIGKILL mid-commit of `convert` and `export`, on a local disk and in both fake buckets.

Both write through the one commit protocol (`shardckpt.storage.commit`). A
child process installs `_train_worker.kill_at` (an audit hook on the commit
rename locally; a wrapper of the `shardckpt.storage` call in a bucket) and is
SIGKILLed right before or after the chosen operation: the state a real kill
at that instant leaves. After each kill nothing loads as complete (or the
old destination is still whole); the next run removes what the kill left
(one WARNING line each) and ends bit-equal to the source.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import keras
import numpy as np
import pytest
from safetensors.numpy import load_file

import shardckpt
from shardckpt import storage
from shardckpt.errors import CheckpointNotFoundError, IncompleteCheckpointError
from shardckpt.formats.orbax import ondisk
from tests.buckets import download

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KILLED = -signal.SIGKILL
INDEX = "model.safetensors.index.json"
"""The marker of a split safetensors export: the object its bucket commit writes last."""

_CHILD = """
import json, sys
from tests._train_worker import kill_at
args = json.loads(sys.argv[1])
if args.get("fault"):
    kill_at(args["fault"])
import keras, shardckpt
if args["what"] == "convert":
    shardckpt.convert(args["src"], args["dst"], force=args["again"])
else:
    model = keras.saving.load_model(args["src"])
    shardckpt.export(model, args["dst"], format="safetensors", max_shard_size="4KiB", overwrite=args["again"])
"""


def _child(what: str, src: str, dst: str, *, fault: dict | None = None, again: bool = False) -> tuple[int, str]:
    """Runs one convert or export in a fresh process; returns its exit code and stderr."""
    env = dict(os.environ, PYTHONPATH=_ROOT, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    args = {"what": what, "src": src, "dst": dst, "fault": fault, "again": again}
    proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(args)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode in (0, KILLED), proc.stderr[-3000:]
    return proc.returncode, proc.stderr


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> tuple[str, dict[str, np.ndarray]]:
    """A `.keras` file of a small model and its values by variable path."""
    keras.backend.clear_session()
    inputs = keras.Input((16,))
    model = keras.Model(inputs, keras.layers.Dense(64, name="wide")(inputs))
    rng = np.random.default_rng(0)
    for v in model.weights:
        v.assign(rng.standard_normal(v.shape).astype("float32"))
    path = str(tmp_path_factory.mktemp("src") / "wide.keras")
    model.save(path)
    return path, {v.path: np.asarray(v.value) for v in model.weights}


def _converted_values(src: str, dst: str) -> dict[str, np.ndarray]:
    model = keras.saving.load_model(src)
    shardckpt.load_sharded(model, dst)
    return {v.path: np.asarray(v.value) for v in model.weights}


def _exported_values(folder: str) -> dict[str, np.ndarray]:
    with open(os.path.join(folder, INDEX)) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    out: dict[str, np.ndarray] = {}
    for name in files:
        out.update(load_file(os.path.join(folder, name)))
    return out


def _assert_equal(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        np.testing.assert_array_equal(got[key], value, err_msg=key)


def _one_line_each(err: str, paths: list[str]) -> None:
    for path in paths:
        assert err.count(f"removed {path}:") == 1, (path, err[-3000:])


# ---- local: the commit rename ---------------------------------------------------


def test_convert_killed_at_its_commit_rename_leaves_no_step_and_the_rerun_is_exact(tmp_path, source):
    src, values = source
    dst = str(tmp_path / "out")
    code, _ = _child("convert", src, dst, fault={"on": "rename", "match": r"/\.out\.shardckpt-tmp-\d+-", "after": "before"})
    assert code == KILLED
    left = [n for n in os.listdir(tmp_path) if n != "src"]
    assert not os.path.exists(dst) and len(left) == 1 and ondisk.CONVERT_TMP_MARK in left[0], left
    with pytest.raises(CheckpointNotFoundError):
        shardckpt.inspect(dst)
    code, err = _child("convert", src, dst)
    assert code == 0
    _one_line_each(err, [str(tmp_path / left[0])])
    assert sorted(os.listdir(tmp_path)) == ["out"]
    _assert_equal(_converted_values(src, dst), values)


def test_export_killed_at_its_commit_rename_leaves_no_folder_and_the_rerun_is_exact(tmp_path, source):
    src, values = source
    dst = str(tmp_path / "out")
    code, _ = _child("export", src, dst, fault={"on": "rename", "match": r"/out\.shardckpt-partial$", "after": "before"})
    assert code == KILLED
    assert sorted(os.listdir(tmp_path)) == ["out.shardckpt-partial"]
    # The commit syncs before it renames: the staged folder is whole, but only under its temporary name.
    _assert_equal(_exported_values(dst + ".shardckpt-partial"), values)
    code, err = _child("export", src, dst)
    assert code == 0
    _one_line_each(err, [dst + ".shardckpt-partial"])
    assert sorted(os.listdir(tmp_path)) == ["out"]
    _assert_equal(_exported_values(dst), values)


def test_overwrite_killed_between_its_two_renames_keeps_the_old_folder_aside(tmp_path, source):
    """An overwrite renames the old `dst` aside, then the new one in: killed in between, no `dst` at
    all (never half of each); the rerun removes both temporaries, one line each."""
    src, values = source
    dst = str(tmp_path / "out")
    assert _child("export", src, dst)[0] == 0
    code, _ = _child("export", src, dst, again=True, fault={"on": "rename", "match": r"/out$", "after": "after"})
    assert code == KILLED
    assert sorted(os.listdir(tmp_path)) == ["out.shardckpt-old", "out.shardckpt-partial"]
    _assert_equal(_exported_values(dst + ".shardckpt-old"), values)
    code, err = _child("export", src, dst)
    assert code == 0
    _one_line_each(err, [dst + ".shardckpt-old", dst + ".shardckpt-partial"])
    assert sorted(os.listdir(tmp_path)) == ["out"]
    _assert_equal(_exported_values(dst), values)


# ---- buckets: the marker, written last and deleted first ------------------------


def test_convert_killed_before_its_marker_in_a_bucket_is_never_committed(bucket, source):
    src, values = source
    root = storage.parse(f"{bucket}/ckpts")
    step = root.join("1")
    fault = {"on": "bucket", "call": "write_bytes", "match": r"/1/commit_success\.txt$", "when": "before"}
    assert _child("convert", src, step.url, fault=fault)[0] == KILLED
    keys = storage.list_keys(step)
    assert ondisk.STEP_METADATA in keys and ondisk.COMMIT_MARKER not in keys  # everything but the marker
    assert ondisk.committed_steps(root) == [] and ondisk.incomplete_steps(root) == ["1"]
    with pytest.raises(IncompleteCheckpointError, match="never committed"):
        shardckpt.load_sharded(keras.saving.load_model(src), step.url)
    assert _child("convert", src, step.url, again=True)[0] == 0
    assert ondisk.committed_steps(root) == [1]
    _assert_equal(_converted_values(src, root.url), values)


def test_export_killed_before_its_marker_in_a_bucket_loads_as_nothing(bucket, source, tmp_path):
    src, values = source
    dst = f"{bucket}/out"
    fault = {"on": "bucket", "call": "write_bytes", "match": rf"/out/{INDEX}$", "when": "before"}
    assert _child("export", src, dst, fault=fault)[0] == KILLED
    names = storage.listdir(storage.parse(dst))
    assert INDEX not in names and len(names) >= 2, names  # every shard, no index: nothing to load
    assert _child("export", src, dst, again=True)[0] == 0
    download(dst, str(tmp_path / "back"))
    _assert_equal(_exported_values(str(tmp_path / "back")), values)


def test_export_overwrite_in_a_bucket_deletes_the_marker_first(bucket, source, tmp_path):
    """Killed right after the old folder's marker is deleted (before its other objects): the
    old folder no longer loads as complete; the rerun writes it whole again."""
    src, values = source
    dst = f"{bucket}/out"
    assert _child("export", src, dst)[0] == 0
    fault = {"on": "bucket", "call": "delete_object", "match": rf"/out/{INDEX}$", "when": "after"}
    assert _child("export", src, dst, again=True, fault=fault)[0] == KILLED
    names = storage.listdir(storage.parse(dst))
    assert INDEX not in names and len(names) >= 2, names
    assert _child("export", src, dst, again=True)[0] == 0
    download(dst, str(tmp_path / "back"))
    _assert_equal(_exported_values(str(tmp_path / "back")), values)
