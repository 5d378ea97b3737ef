"""The commit protocol (`shardckpt.storage.commit`) and the one step listing, locally and in buckets."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest

from shardckpt import storage
from shardckpt.errors import DestinationExistsError, IncompleteCheckpointError, StepExistsError
from shardckpt.formats.orbax import ondisk
from shardckpt.storage import commit


def test_a_stage_appears_at_dst_only_at_commit(tmp_path):
    dst = str(tmp_path / "out")
    stage = commit.begin(dst, overwrite=False, marker="done.txt", who="test")
    assert os.path.dirname(stage.location.path) == str(tmp_path) and commit.PRIVATE_MARK in stage.location.name
    with open(os.path.join(stage.location.path, "a.bin"), "wb") as f:
        f.write(b"abc")
    assert not os.path.exists(dst)
    stage.commit(b"marker")
    assert sorted(os.listdir(tmp_path)) == ["out"]
    assert sorted(os.listdir(dst)) == ["a.bin", "done.txt"]
    with open(os.path.join(dst, "done.txt"), "rb") as f:
        assert f.read() == b"marker"
    with pytest.raises(DestinationExistsError, match="pass overwrite=True"):
        commit.begin(dst, overwrite=False, who="test")


def test_a_local_overwrite_replaces_only_at_commit(tmp_path):
    dst = str(tmp_path / "out")
    os.makedirs(dst)
    open(os.path.join(dst, "old"), "w").close()
    stage = commit.begin(dst, overwrite=True, shared=True, who="test")
    assert stage.location.path == dst + commit.SHARED_SUFFIX
    open(os.path.join(stage.location.path, "new"), "w").close()
    assert os.listdir(dst) == ["old"]  # untouched until the commit
    stage.commit()
    assert sorted(os.listdir(tmp_path)) == ["out"] and os.listdir(dst) == ["new"]


def test_a_bucket_stage_writes_its_marker_last_and_withdraws_it_first(bucket, monkeypatch):
    dst = storage.parse(f"{bucket}/out")
    calls: list[tuple[str, str]] = []
    for name in ("write_bytes", "delete_object", "delete_tree"):
        original = getattr(storage, name)

        def spy(location, *rest, _name=name, _original=original, **kwargs):
            calls.append((_name, location.url.removeprefix(dst.url)))
            return _original(location, *rest, **kwargs)

        monkeypatch.setattr(storage, name, spy)
    stage = commit.begin(dst, overwrite=False, marker="config.json", who="test")
    assert stage.location == dst
    storage.write_bytes(dst.join("a.bin"), b"abc")
    stage.commit(b"{}")
    assert calls == [("write_bytes", "/a.bin"), ("write_bytes", "/config.json")]
    calls.clear()
    commit.begin(dst, overwrite=True, marker="config.json", who="test")
    assert calls == [("delete_object", "/config.json"), ("delete_tree", "")]
    assert storage.list_keys(dst) == []


def test_leftovers_beside_a_destination_are_removed_one_line_each(tmp_path, caplog):
    dst = str(tmp_path / "out")
    dead = [f".out{commit.PRIVATE_MARK}999999999-abc", "out" + commit.SHARED_SUFFIX, "out" + commit.OLD_SUFFIX,
            "out" + commit.WITHDRAW_MARK + "-0123"]
    live = f".out{commit.PRIVATE_MARK}{os.getppid()}-live"
    for name in [*dead, live, "other"]:
        os.makedirs(tmp_path / name)
    with caplog.at_level(logging.WARNING, logger="shardckpt"):
        removed = commit.remove_leftovers(dst, who="test")
    assert sorted(removed) == sorted(str(tmp_path / n) for n in dead)
    assert sorted(os.listdir(tmp_path)) == sorted([live, "other"])
    for name in dead:
        assert sum(f"removed {tmp_path / name}:" in r.getMessage() for r in caplog.records) == 1


def _step(root: storage.Location, step: int, *, marker: bool) -> None:
    """A minimal Orbax step (metadata, one JSON item), committed by its marker or not."""
    at = root.join(str(step))
    if at.local_path is not None:
        os.makedirs(os.path.join(at.path, "meta"))
    ondisk.write_json(at.join(ondisk.STEP_METADATA).url, {"item_handlers": {"meta": ondisk.JSON_HANDLER}})
    ondisk.write_json(at.join("meta", "data.json").url, {"step": step})
    if marker:
        storage.write_bytes(at.join(ondisk.COMMIT_MARKER), b"")


@pytest.mark.parametrize("where", ["local", "bucket"])
def test_one_step_listing_answers_alike_locally_and_in_a_bucket(where, tmp_path, request):
    """Local: a step missing a recorded part is not committed; in a bucket: a step without its marker.
    The same functions answer both, from one listing each."""
    url = str(tmp_path / "root") if where == "local" else request.getfixturevalue("gcs_server").new_bucket() + "/root"
    root = storage.parse(url)
    _step(root, 2, marker=True)
    _step(root, 4, marker=True)
    _step(root, 6, marker=where == "local")
    if where == "local":
        os.remove(os.path.join(root.path, "6", "meta", "data.json"))  # a delete in place, interrupted
    assert ondisk.committed_steps(url) == [2, 4]
    assert ondisk.incomplete_steps(url) == ["6"]
    assert ondisk.latest_step(url) == root.join("4").url
    assert ondisk.resolve_step(url) == root.join("4").url
    with pytest.raises(IncompleteCheckpointError, match="not a whole step"):
        ondisk.resolve_step(root.join("6").url)


def test_a_missing_local_root_lists_no_step(tmp_path):
    assert ondisk.committed_steps(str(tmp_path / "nothing")) == []
    assert ondisk.latest_step_dir(str(tmp_path / "nothing")) is None


def test_a_bucket_save_of_a_committed_step_is_a_typed_error(gcs_server):
    from shardckpt.training.step_save import StepCheckpointer

    root = storage.parse(gcs_server.new_bucket() + "/ckpt")
    saver = StepCheckpointer(root, policy=None, compression=False)
    payload = {ondisk.ARRAYS_ITEM: {"w": np.arange(4, dtype="float32")}}
    saver.save_checkpointables(1, payload)
    assert ondisk.committed_steps(root) == [1]
    with pytest.raises(StepExistsError, match="Step 1 already exists.*Fix:") as info:
        saver.save_checkpointables(1, payload)
    assert isinstance(info.value, ValueError) and isinstance(info.value, DestinationExistsError)
