"""SIGKILL at a chosen file operation of a delete, a commit and a clean-up; every rerun is exact.

A training run of `_train_worker.py` (`save_freq=2`, `max_to_keep=2`, 3 epochs
of 6 batches: steps 2, 4, ..., 18) installs an audit hook in the child that
SIGKILLs it right after a chosen file of a chosen step's removal is gone
(`_train_worker.kill_at`): the state a real kill at that instant leaves.
After each kill the directory must hold no integer-named step that is not
whole (nothing that loads while incomplete), and `inspect` must list exactly
those; the rerun (no manual step in between) must remove what the kill left,
one log line each, and end bit-equal to an uninterrupted run.

The trials of the fault campaign that found it: a kill after
`_CHECKPOINT_METADATA` of a deleted step, after its `shardckpt_metadata/`,
inside its `pytree/` after `manifest.ocdbt`, after `_CHECKPOINT_METADATA` of
another step, and a kill in resume's own deletion of a newer step after a
kill at a commit. Orbax deletes in place (`rmtree`), so before shardckpt
renamed a step out of the committed set first, the first two reruns failed
or resumed from a half-deleted step. Also here: a kill at a commit rename, a
kill in the clean-up of such leftovers, the in-place half-delete an older
writer (Keras' own callback) leaves, a kill between deleting a bucket
step's commit marker and its objects, and a kill right before a step's
marker in either fake bucket (GCS, S3).
"""

from __future__ import annotations

import os
import re
import shutil
import signal

import pytest

import shardckpt
from shardckpt.formats.orbax import ondisk
from tests.test_resume_kill import Server, _compare, _load

pytestmark = pytest.mark.slow  # training processes killed and rerun: about a minute

EPOCHS, STEPS, SAVE_FREQ = 3, 6, 2
KILLED = -signal.SIGKILL


def step_match(step: int) -> str:
    """The path of step `step`'s folder while it is removed: as it is, or renamed out first."""
    return rf"/{step}({re.escape(ondisk.DELETING_MARK)}-[0-9a-f]+)?$"


def delete_kill(step: int, after: str) -> dict:
    """Kill right after `after` (a file or folder name) of step `step`'s removal is gone."""
    return {"on": "rmtree", "match": step_match(step), "after": after}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(str(tmp_path_factory.mktemp("faults") / "server.log"))
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("jax_cache"))


def _args(root: str, name: str, cache: str, data: str | None) -> dict:
    return {"dir": root, "out": f"{root}_{name}", "save_freq": SAVE_FREQ, "epochs": EPOCHS, "steps": STEPS,
            "max_to_keep": 2, "cache": cache, "data": data}


_references: dict[str | None, tuple] = {}


def reference(server: Server, tmp_path_factory, cache: str, data: str | None = None) -> tuple:
    """The uninterrupted run of an input kind (once per module)."""
    if data not in _references:
        root = str(tmp_path_factory.mktemp("reference") / "ckpt")
        args = _args(root, "out", cache, data)
        assert server.wait(server.start(args)) == 0, "the uninterrupted run failed; see the server log"
        _references[data] = _load(args["out"])
    return _references[data]


def assert_nothing_loads_incomplete(root: str) -> list[int]:
    """Every integer-named folder is a whole step, and `inspect` lists exactly those; returns them."""
    names = sorted(int(n) for n in os.listdir(root) if n.isdigit())
    for step in names:
        assert ondisk.missing_part(os.path.join(root, str(step))) == "", f"step {step} is there but not whole"
    assert ondisk.committed_steps(root) == names
    if names:
        assert shardckpt.inspect(root).steps == names
    return names


def run_trial(server, tmp_path, cache, ref, faults: list[dict], data: str | None = None,
              between=None) -> dict:
    """Runs killed at each of `faults` in turn, then an unhindered rerun; compares it with `ref`."""
    root = str(tmp_path / "ckpt")
    for i, fault in enumerate(faults):
        args = dict(_args(root, f"killed{i}", cache, data), fault=fault)
        assert server.wait(server.start(args)) == KILLED, f"fault {fault} never fired"
        assert_nothing_loads_incomplete(root)
        if between is not None:
            between(root, i)
    left = sorted(name for name, _ in ondisk.leftovers(root))
    args = _args(root, "rerun", cache, data)
    assert server.wait(server.start(args)) == 0, "the rerun failed; see the server log"
    arrays, info = _load(args["out"])
    _compare(arrays, info, *ref, f"after {faults}")
    assert not ondisk.leftovers(root), "the rerun left a half-written or half-deleted step behind"
    for name in left:  # one line each
        assert sum(f"removed {name} from" in line for line in info["log"]) == 1, (name, info["log"])
    assert not any("written by Keras" in line for line in info["log"])
    return {"left": left, "info": info}


def test_kills_in_deletes_commits_and_cleanups_each_rerun_exact(server, tmp_path, tmp_path_factory, cache):
    """One run killed after another, each at a chosen file operation, then a rerun:

    numpy arrays input (fit shuffles them; a resume starts at the newest
    whole-epoch step 6, 12 or 18 and deletes the newer ones). Retention
    deletes 2 at step 6, 4 at 8, 6 and 8 at 12, 10 at 14.

    1. in the retention delete of step 6, after its `_CHECKPOINT_METADATA`
       (trial 1; step 6 must not load afterwards: trial 4);
    2. the rerun resumes from 12; killed in the delete of step 10 after its
       `shardckpt_metadata/` (trial 2);
    3. the rerun resumes from 12 (14 holds part of an epoch) and deletes the
       newer step 14: killed inside its `pytree/` after `manifest.ocdbt`
       (trials 3 and 5: a kill in resume's own deletion of a newer step);
    4. killed just before the rename that commits step 16; then step 14 is
       half-deleted in place, as Keras' own callback or an older writer
       leaves it (Orbax's `rmtree` in directory order);
    5. killed while it removes what run 4 left (clean-up);
    6. the rerun: exact, nothing left behind.
    """
    ref = reference(server, tmp_path_factory, cache, "arrays")

    def between(root, i):
        if i == 0:  # trial 4: the step being deleted loads from nowhere
            assert 6 not in ondisk.committed_steps(root) and not os.path.exists(os.path.join(root, "6"))
            deleting = [n for n, _ in ondisk.leftovers(root) if n.startswith("6" + ondisk.DELETING_MARK)]
            assert deleting, ondisk.leftovers(root)
            with pytest.raises(shardckpt.errors.IncompleteCheckpointError, match="being deleted"):
                shardckpt.inspect(os.path.join(root, deleting[0]))
        if i == 3:
            step = os.path.join(root, "14")
            assert ondisk.missing_part(step) == ""
            os.remove(os.path.join(step, ondisk.STEP_METADATA))
            shutil.rmtree(os.path.join(step, ondisk.METADATA_ITEM))
            assert 14 not in ondisk.committed_steps(root)
            assert ondisk.resolve_step(root).endswith("/12")
            with pytest.raises(shardckpt.errors.IncompleteCheckpointError, match="lacks its _CHECKPOINT_METADATA"):
                shardckpt.inspect(step)

    faults = [
        delete_kill(6, ondisk.STEP_METADATA),
        delete_kill(10, ondisk.METADATA_ITEM),
        delete_kill(14, ondisk.OCDBT_MANIFEST),
        {"on": "rename", "match": r"/16\.orbax-checkpoint-tmp", "after": "before"},
        {"on": "rmtree", "match": re.escape(ondisk.TMP_MARK), "after": ondisk.STEP_METADATA},
    ]
    got = run_trial(server, tmp_path, cache, ref, faults, data="arrays", between=between)
    assert got["info"]["resumed_step"] == 12
    assert len(got["left"]) == 1 and ondisk.TMP_MARK in got["left"][0], got["left"]


@pytest.fixture(scope="module")
def bucket_server(tmp_path_factory, gcs_server):
    """A fork server whose children reach the fake GCS server (its settings are in the environment now)."""
    srv = Server(str(tmp_path_factory.mktemp("bucket_faults") / "server.log"))
    yield srv
    srv.close()


def test_kill_in_bucket_between_marker_and_objects(bucket_server, tmp_path, tmp_path_factory, cache, gcs_server):
    """In a bucket: a kill after retention deleted step 10's commit marker, before its
    objects: step 10 is no committed step; the rerun removes it (one line) and is exact."""
    from shardckpt import storage

    ref = reference(bucket_server, tmp_path_factory, cache, "arrays")
    root = gcs_server.new_bucket() + "/ckpt"
    faults = [{"on": "bucket", "call": "delete_object", "match": r"/10/commit_success\.txt$", "when": "after"}]
    seen = []
    for i, fault in enumerate(faults):
        args = dict(_args(root, "killed", cache, "arrays"), out=str(tmp_path / f"killed{i}"), fault=fault)
        assert bucket_server.wait(bucket_server.start(args)) == KILLED, f"fault {fault} never fired"
        left = [name for name, _ in ondisk.leftovers(root)]
        assert left, "the kill left nothing to clean: it came too early or too late"
        assert all(int(n) not in ondisk.committed_steps(root) for n in left)
        args = dict(_args(root, "rerun", cache, "arrays"), out=str(tmp_path / f"rerun{i}"))
        assert bucket_server.wait(bucket_server.start(args)) == 0, "the rerun failed; see the server log"
        arrays, info = _load(args["out"])
        _compare(arrays, info, *ref, f"after {fault}")
        assert not ondisk.leftovers(root)
        for name in left:
            assert sum(f"removed {name} from" in line for line in info["log"]) == 1, (name, info["log"])
        seen.append(left)
        storage.delete_tree(storage.parse(root))  # the next fault starts from an empty root
    assert seen == [["10"]]


@pytest.fixture(scope="module")
def buckets_server(tmp_path_factory, gcs_server, s3_server):
    """A fork server whose children reach both fake object stores."""
    srv = Server(str(tmp_path_factory.mktemp("marker_faults") / "server.log"))
    yield srv
    srv.close()


@pytest.mark.parametrize("scheme", ["gs", "s3"])
def test_kill_in_bucket_right_before_a_step_marker(scheme, request, buckets_server, tmp_path, tmp_path_factory,
                                                   cache):
    """In either bucket: a kill right before step 8's commit marker (every other object of the step
    written, through the commit protocol): step 8 is no committed step; the rerun removes it (one
    line), resumes from step 6 and is exact."""
    ref = reference(buckets_server, tmp_path_factory, cache, "arrays")
    root = request.getfixturevalue("gcs_server" if scheme == "gs" else "s3_server").new_bucket() + "/ckpt"
    fault = {"on": "bucket", "call": "write_bytes", "match": r"/8/commit_success\.txt$", "when": "before"}
    args = dict(_args(root, "killed", cache, "arrays"), out=str(tmp_path / "killed"), fault=fault)
    assert buckets_server.wait(buckets_server.start(args)) == KILLED, f"fault {fault} never fired"
    assert [name for name, _ in ondisk.leftovers(root)] == ["8"]
    assert ondisk.committed_steps(root) == [4, 6]
    with pytest.raises(shardckpt.errors.IncompleteCheckpointError, match="never committed"):
        shardckpt.inspect(f"{root}/8")
    args = dict(_args(root, "rerun", cache, "arrays"), out=str(tmp_path / "rerun"))
    assert buckets_server.wait(buckets_server.start(args)) == 0, "the rerun failed; see the server log"
    arrays, info = _load(args["out"])
    _compare(arrays, info, *ref, f"after {fault}")
    assert info["resumed_step"] == 6
    assert not ondisk.leftovers(root)
    assert sum("removed 8 from" in line for line in info["log"]) == 1, info["log"]


def test_fault_campaign_smoke(tmp_path, cache):
    """tools/fault_campaign.py at --smoke (a SIGKILL of a convert and of an export while they
    write; each rerun exact, one log line per temporary removed, nothing left behind)."""
    import json
    import subprocess
    import sys

    tool = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "fault_campaign.py")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run([sys.executable, tool, "--smoke", "--work", str(tmp_path), "--cache", cache],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert result["trials"] == result["exact"] == 2, result
