"""How the processes of a multi-process bucket save agree, through JAX's coordination service.

A bucket save runs in phases (clean the step, write every process's pieces,
commit). After each phase every process knows whether all of them succeeded,
from the key-value store of JAX's coordination service (the service
`jax.distributed.initialize` starts): each process that took part sets its
outcome under the save's own keys, process 0 reads them and sets the verdict,
and the others read the verdict. Nothing is polled in the bucket.

Each wait has a limit (`WAIT_S`, or the environment's `SHARDCKPT_PROCESS_WAIT_S`):
a process killed in the middle of a save never answers, and the others fail
the save with `ProcessSaveError` rather than wait forever. A failure on one
process fails the save on all of them at once, with its message.

Keys are unique per save: every process makes the same saves in the same
order, so the n-th save has the same number everywhere. Process 0 deletes the
keys of earlier saves once every process has answered a phase of a later one
(each has then read all it needed of them), so a long run leaves the keys of
one save behind, not of every save.
"""

from __future__ import annotations

import itertools
import json
import os
from typing import Any

import jax

from shardckpt import _jax
from shardckpt.errors import ProcessSaveError

WAIT_S = 3600.0
"""Longest wait for another process's outcome of one phase (a phase writes
that process's share of the state)."""

_sequence = itertools.count()
_ended: list[str] = []  # key prefixes of this process's earlier agreements (process 0 deletes them)
_latest: list[str] = []  # the newest agreement's prefix


def wait_s() -> float:
    """The wait limit: `SHARDCKPT_PROCESS_WAIT_S` when set, else `WAIT_S`."""
    return float(os.environ.get("SHARDCKPT_PROCESS_WAIT_S", WAIT_S))


class Agreement:
    """The outcomes of the phases of one save, shared by every process.

    Args:
        step: The step being saved (named in errors).
        what: What is being done, for messages ("saving step 4 to gs://b/ck").
    """

    def __init__(self, step: int, what: str) -> None:
        self.step, self.what = step, what
        self.index, self.count = jax.process_index(), jax.process_count()
        self.prefix = f"shardckpt/bucket_save/{next(_sequence)}"
        self.client: Any = _jax.distributed_client() if self.count > 1 else None
        _ended.extend(_latest)  # saves run one after another: the previous one has ended here
        _latest[:] = [self.prefix]

    def settle(self, phase: str, error: Exception | None, *, everyone: bool) -> None:
        """Shares this process's outcome of `phase`; raises on every process if any failed.

        Args:
            phase: The phase's name (unique within the save).
            error: What this process's part raised, or None.
            everyone: Every process took part; False: only process 0 did
                (the others only learn its outcome).

        Raises:
            Exception: `error` itself, on the process that raised it.
            ProcessSaveError: another process failed or did not answer.
        """
        if self.client is None:
            if error is not None:
                raise error
            return
        base = f"{self.prefix}/{phase}"
        mine = None if error is None else f"{type(error).__name__}: {error}"
        if self.index == 0:
            failures = {} if mine is None else {0: mine}
            for i in range(1, self.count if everyone else 1):
                said = self._get(f"{base}/{i}", i, phase)
                if said is not None:
                    failures[i] = said
            if everyone and not failures:
                # Every process answered a phase of this save, so each has
                # finished the earlier ones and read their keys for good.
                while _ended:
                    self.client.key_value_delete(_ended.pop())
            self.client.key_value_set(f"{base}/verdict", json.dumps(failures))
        else:
            if everyone:
                self.client.key_value_set(f"{base}/{self.index}", json.dumps(mine))
            failures = {int(k): v for k, v in self._get(f"{base}/verdict", 0, phase).items()}
        if error is not None:
            raise error
        if failures:
            said = "; ".join(f"process {i}: {message}" for i, message in sorted(failures.items()))
            raise ProcessSaveError(
                f"{self.what} failed on another process ({said}). The step was not committed on any "
                "process; earlier steps are intact. Fix: see that process's error (storage "
                "permissions, bucket, network), then rerun: training resumes from the last committed step.",
                step=self.step, processes=sorted(failures),
            )

    def _get(self, key: str, process: int, phase: str) -> Any:
        limit = wait_s()
        try:
            return json.loads(self.client.blocking_key_value_get(key, int(limit * 1000)))
        except Exception as e:  # JAX raises its runtime error type (DEADLINE_EXCEEDED)
            said = f"no answer within {limit:.0f} s ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
            if self.index == 0:
                return said  # reported to the others in the verdict
            raise ProcessSaveError(
                f"{self.what}: process {process} gave no outcome of {phase!r}: {said}. The step was "
                "not committed. Fix: check whether that process was killed or is stuck (its log); "
                "SHARDCKPT_PROCESS_WAIT_S sets this limit.",
                step=self.step, processes=[process],
            ) from e
