"""Data-iterator positions that match the batches training actually consumed.

Keras pulls batches ahead of the step it runs: a generator given to `fit` is
peeked twice when `fit` starts, and on accelerators one batch is fetched ahead.
`iterator.get_state()` read at a checkpoint is therefore ahead of the model.
`IteratorTracker.batches()` is the generator to give to `fit`: it records the
iterator's state before every pull, so the state after exactly N consumed
batches is known whatever Keras prefetched. Batches reach the train step in the
order they were pulled, which is all this relies on.
"""

from __future__ import annotations

import collections
import json
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np


def check_iterator(data_iterator: Any) -> None:
    """Raises TypeError unless `data_iterator` has `get_state` and `set_state`."""
    missing = [m for m in ("get_state", "set_state") if not callable(getattr(data_iterator, m, None))]
    if missing:
        raise TypeError(
            f"data_iterator must have get_state() and set_state(state) (as grain's "
            f"DatasetIterator has); {type(data_iterator).__name__} lacks {missing}. "
            f"Received: data_iterator={data_iterator!r}"
        )


class IteratorTracker:
    """Records an iterator's state before each batch it yields.

    Args:
        data_iterator: An iterator with `get_state()` / `set_state(state)`;
            states must be JSON-serialisable.
        on_first_pull: Called once, before the first batch is pulled (the
            callback restores a resumed position there).
    """

    def __init__(self, data_iterator: Any, on_first_pull: Callable[[], None] | None = None) -> None:
        check_iterator(data_iterator)
        self.iterator = data_iterator
        self._on_first_pull = on_first_pull
        self._states: collections.deque[tuple[int, Any]] = collections.deque()
        self._pulled = 0
        self.used = False

    def batches(self) -> Iterator[Any]:
        """Yields the iterator's batches, remembering the state before each."""
        self.used = True
        if self._on_first_pull is not None:
            self._on_first_pull()
            self._on_first_pull = None
        while True:
            state = self.iterator.get_state()
            try:
                batch = next(self.iterator)
            except StopIteration:
                return
            self._states.append((self._pulled, state))
            self._pulled += 1
            yield batch

    def state_after(self, consumed: int) -> Any:
        """Returns the iterator state after `consumed` batches went to training.

        Falls back to the live `get_state()` when `batches()` is not what feeds
        `fit` (the state may then be ahead by Keras' prefetch).
        """
        if not self.used:
            return self.iterator.get_state()
        # Drop states of batches already trained on: they are never needed again.
        while self._states and self._states[0][0] < consumed:
            self._states.popleft()
        if self._states and self._states[0][0] == consumed:
            return self._states[0][1]
        if consumed == self._pulled:
            return self.iterator.get_state()
        raise RuntimeError(
            f"No recorded iterator state after {consumed} batches ({self._pulled} pulled). "
            "Fix: feed fit from OrbaxCheckpoint.batches() only, without pulling from "
            "the iterator elsewhere."
        )


def gather_json(value: Any) -> list[Any]:
    """Returns `[value of process 0, value of process 1, ...]` (JSON values).

    One process writes the checkpoint's JSON items, but every process has its
    own iterator position; the positions are all-gathered as UTF-8 bytes with
    `process_allgather` (XLA inserts the collective). All processes must call
    this at the same point, as they do at each save.
    """
    data = np.frombuffer(json.dumps(value).encode(), dtype=np.uint8)
    if jax.process_count() == 1:
        return [value]
    from jax.experimental import multihost_utils

    sizes = multihost_utils.process_allgather(np.array([data.size], np.int32))
    width = int(np.max(sizes))
    padded = np.zeros(width, np.uint8)
    padded[: data.size] = data
    rows = multihost_utils.process_allgather(padded)
    return [json.loads(bytes(row[: int(n)]).decode()) for row, n in zip(rows, np.ravel(sizes))]
