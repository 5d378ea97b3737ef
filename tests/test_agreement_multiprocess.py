"""2 real `jax.distributed` processes agree on the saves of two checkpoint roots at once.

Two `OrbaxCheckpoint`s saving into two buckets (a frequent one and a
per-epoch one) each save on their own worker thread, so the saves of the two
roots start in different orders on different processes. Each root's
agreements must still pair up across processes (the right verdict for each
save, no wait on a key the other process never writes), and the keys of one
root's finished saves go only when a later save of that same root is agreed.
"""

from __future__ import annotations

import json

import pytest

from tests.mp import run_pair

pytestmark = pytest.mark.multiprocess

WAIT_S = "20"  # a wait on a key nobody writes fails in this time, not in an hour


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    folder = tmp_path_factory.mktemp("agree")
    run_pair("_mp_agreement_worker.py", str(folder), timeout=300, env={"SHARDCKPT_PROCESS_WAIT_S": WAIT_S})
    return [json.loads((folder / f"agree{i}.json").read_text()) for i in range(2)]


def test_saves_of_two_roots_opened_in_other_orders_get_each_their_own_verdict(results):
    order = [r["order"] for r in results]
    # Process 1's write into A failed: A's save fails on both, with that error.
    assert order[1]["A"][0]["raised"] == "OSError" and order[1]["A"][0]["message"] == "disk full writing A", order
    failed = order[0]["A"][0]
    assert failed["raised"] == "ProcessSaveError" and failed["processes"] == [1], order
    assert "process 1: OSError: disk full writing A" in failed["message"], order
    assert "'gs://bucket/frequent'" in failed["message"], order
    # B's save, at the same time, succeeds on both; the next save of each root too.
    for r in order:
        assert r["B"] == [None, None], order
        assert r["A"][1] is None, order


def test_keys_of_a_root_are_deleted_only_by_that_roots_later_saves(results):
    got = [r["deletion"] for r in results]
    # D's save was agreed while process 1 had yet to read C's commit verdict:
    # process 0 kept C's keys, so process 1 read it instead of waiting WAIT_S.
    for r in got:
        assert r["c_write"] is None and r["c_commit"] is None and r["d"] is None and r["c_again"] is None, got
    # C's second save deleted its first; D's only save is left: one save per root.
    assert got[0]["keys"] == {"c": ["1"], "d": ["0"]}, got


def test_an_error_of_the_coordination_service_other_than_no_answer_is_raised_as_it_is(results):
    # The service was shut down under the save: the client's wait was cancelled
    # at once. That is JAX's error, raised as it is, not "process 0 gave no outcome".
    got = results[1]["shutdown"]
    assert got["raised"] == "JaxRuntimeError" and got["message"].startswith("CANCELLED"), got
