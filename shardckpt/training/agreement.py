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
process fails the save on all of them at once, with its message. Only the
coordination client's own "no answer" errors (its deadline passed, or the
service is unreachable) count as a process that did not answer; any other
error is raised as it is.

Keys are unique per save, and kept apart per checkpoint root
(`root_keys(url)`: a hash of the root's URL): every process makes the same
saves into one root in the same order (one after another, on that root's
worker), so the n-th save into a root has the same number everywhere, however
the saves of several roots (two `OrbaxCheckpoint`s, each with its own worker
thread) interleave on each process. Process 0 deletes the keys of a root's
earlier saves once every process has answered a phase of a later save into
that root (each has then read all it needed of them), so a long run leaves
the keys of one save per root behind, not of every save.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import threading
from typing import Any

import jax

from shardckpt import _jax
from shardckpt.errors import ProcessSaveError
from shardckpt.storage.deadlines import positive_from_env

WAIT_S = 3600.0
"""Longest wait for another process's outcome of one phase (a phase writes
that process's share of the state)."""

WAIT_ENV = "SHARDCKPT_PROCESS_WAIT_S"
"""The environment variable that overrides `WAIT_S` (seconds)."""

_MAX_WAIT_S = 1e15
"""Cap of the wait handed to the coordination client, whose milliseconds are
a 64-bit integer: a larger limit is, for any run, the same as this one."""

KEYS = "shardckpt/bucket_save"
"""The coordination service's key directory of every agreement."""

_NO_ANSWER = ("DEADLINE_EXCEEDED", "UNAVAILABLE")
"""Status codes of the coordination client's errors that mean "no answer":
its wait ran out, or the service (or the path to it) is gone."""


@dataclasses.dataclass
class _Root:
    """This process's agreements about one checkpoint root."""

    keys: str  # the root's key directory
    numbers: itertools.count = dataclasses.field(default_factory=itertools.count)
    ended: list[str] = dataclasses.field(default_factory=list)  # earlier saves' keys (process 0 deletes them)
    latest: str | None = None  # the newest save's keys


# Saves into different roots run on different threads.
_lock = threading.Lock()
_roots: dict[str, _Root] = {}


def wait_s() -> float:
    """The wait limit: `SHARDCKPT_PROCESS_WAIT_S` when set (not empty), else `WAIT_S`.

    Raises:
        ConfigurationError: the variable is set to anything but a positive,
            finite number of seconds ("abc", "0", "-5", "nan", "inf").
    """
    return positive_from_env(WAIT_ENV, WAIT_S, meaning=": how long a process of a multi-process save waits "
                                                        "for the others' outcome of one phase")


def root_keys(url: str) -> str:
    """The key directory of the agreements about checkpoint root `url`, the same on every process."""
    return f"{KEYS}/{hashlib.sha256(url.encode()).hexdigest()[:16]}"


class Agreement:
    """The outcomes of the phases of one save, shared by every process.

    Args:
        root: The checkpoint root's URL (the saves into one root are numbered
            apart from other roots').
        step: The step being saved (named in errors).
        what: What is being done, for messages ("saving step 4 to gs://b/ck").
    """

    def __init__(self, root: str, step: int, what: str) -> None:
        self.step, self.what = step, what
        self.index, self.count = jax.process_index(), jax.process_count()
        self.client: Any = _jax.distributed_client() if self.count > 1 else None
        # Read before any phase: a bad value fails the save before anything is written.
        self.limit = wait_s() if self.client is not None else WAIT_S
        with _lock:
            self._root = _roots.setdefault(root, _Root(root_keys(root)))
            self.prefix = f"{self._root.keys}/{next(self._root.numbers)}"
            if self._root.latest is not None:  # a root's saves run one after another: that one has ended here
                self._root.ended.append(self._root.latest)
            self._root.latest = self.prefix

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
            jax.errors.JaxRuntimeError: the coordination service failed
                otherwise than by not answering.
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
                # finished this root's earlier saves and read their keys for good.
                with _lock:
                    ended, self._root.ended = self._root.ended, []
                for prefix in ended:
                    self.client.key_value_delete(prefix)
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
        limit = self.limit
        try:
            value = self.client.blocking_key_value_get(key, max(1, round(min(limit, _MAX_WAIT_S) * 1000)))
        except jax.errors.JaxRuntimeError as e:
            # The client raises this one type for every failed call, its
            # status code leading the message; only "no answer" is the other
            # process's silence, anything else is raised as it is.
            if not str(e).startswith(_NO_ANSWER):
                raise
            within = f" within {limit:.0f} s" if str(e).startswith("DEADLINE_EXCEEDED") else ""
            said = f"no answer{within} ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
            if self.index == 0:
                return said  # reported to the others in the verdict
            raise ProcessSaveError(
                f"{self.what}: process {process} gave no outcome of {phase!r}: {said}. The step was "
                "not committed. Fix: check whether that process was killed or is stuck (its log); "
                "SHARDCKPT_PROCESS_WAIT_S sets this limit.",
                step=self.step, processes=[process],
            ) from e
        return json.loads(value)
