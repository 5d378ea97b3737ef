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

import base64
import collections
import json
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from shardckpt.errors import IteratorPositionError, IteratorStateError

# Tags of values JSON cannot hold as themselves. A dict holding a key with this
# prefix is stored as a list of items, so a user's key is never read as a tag.
_TAG = "__shardckpt_"
_BYTES, _TUPLE, _ITEMS = _TAG + "bytes_b64__", _TAG + "tuple__", _TAG + "dict_items__"


def encode_state(state: Any, where: str = "state") -> Any:
    """Returns `state` as a JSON value that `decode_state` turns back into it.

    Args:
        state: What an iterator's `get_state()` returned.
        where: The position inside the state, for the error message.

    Raises:
        IteratorStateError: a value of another type (a set, an object...).
    """
    if state is None or isinstance(state, (bool, str)):
        return state
    if isinstance(state, (int, float)) and type(state) in (int, float):
        return state
    if isinstance(state, np.generic) and isinstance(state.item(), (bool, int, float)):
        # grain counters may be numpy scalars; their value is what set_state needs.
        return state.item()
    if isinstance(state, (bytes, bytearray)):
        return {_BYTES: base64.b64encode(bytes(state)).decode("ascii")}
    if isinstance(state, tuple):
        return {_TUPLE: [encode_state(v, f"{where}[{i}]") for i, v in enumerate(state)]}
    if isinstance(state, list):
        return [encode_state(v, f"{where}[{i}]") for i, v in enumerate(state)]
    if isinstance(state, dict):
        if all(isinstance(k, str) and not k.startswith(_TAG) for k in state):
            return {k: encode_state(v, f"{where}[{k!r}]") for k, v in state.items()}
        return {_ITEMS: [[encode_state(k, f"{where} key"), encode_state(v, f"{where}[{k!r}]")]
                         for k, v in state.items()]}
    raise IteratorStateError(
        f"The data iterator's get_state() holds a {type(state).__name__} at {where}, which "
        "cannot be stored exactly. Fix: return bytes, str, numbers, bool, None, lists, "
        "tuples or dicts of these from get_state() (as grain's iterators do)."
    )


def decode_state(value: Any) -> Any:
    """The inverse of `encode_state`."""
    if isinstance(value, list):
        return [decode_state(v) for v in value]
    if isinstance(value, dict):
        if len(value) == 1:
            (key, inner), = value.items()
            if key == _BYTES:
                return base64.b64decode(inner.encode("ascii"))
            if key == _TUPLE:
                return tuple(decode_state(v) for v in inner)
            if key == _ITEMS:
                return {_hashable(decode_state(k)): decode_state(v) for k, v in inner}
        return {k: decode_state(v) for k, v in value.items()}
    return value


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, (list, tuple)) else key


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
            states as `encode_state` takes them.
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
        self.fits = 0  # fits fed so far: batches are counted from the first one's start

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

        Raises:
            IteratorPositionError: `consumed` is no count of batches this
                tracker yielded or still remembers.
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
        raise IteratorPositionError(
            f"No recorded iterator state after {consumed} batches ({self._pulled} pulled). "
            "Fix: feed fit from OrbaxCheckpoint.batches() only, without pulling from "
            "the iterator elsewhere."
        )

    def rewind(self, consumed: int) -> None:
        """Puts the iterator back at its state after `consumed` batches, if pulled past them.

        `fit` may end with batches pulled that it never trains on: it peeks
        two batches when it starts (a fit with one batch left pulls one too
        many), and accelerators fetch one ahead. The next `fit` on the same
        iterator then continues after exactly the batches trained, as the
        uninterrupted run does.
        """
        if self.used and self.fits == 1 and self._pulled > consumed:
            self.iterator.set_state(self.state_after(consumed))


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


class DataPosition:
    """The callback's `data_iterator` and the tracker of its position in the current `fit`.

    Args:
        data_iterator: An iterator with `get_state()` / `set_state(state)`, or None.
        on_first_pull: Given to each tracker (see `IteratorTracker`).

    Raises:
        TypeError: `data_iterator` lacks `get_state` / `set_state`.
    """

    def __init__(self, data_iterator: Any, on_first_pull: Callable[[], None]) -> None:
        self.data_iterator = data_iterator
        self._on_first_pull = on_first_pull
        self.tracker = IteratorTracker(data_iterator, on_first_pull) if data_iterator is not None else None

    @property
    def tracked(self) -> bool:
        """True once `fit` draws from `batches()` (a saved position is then exact)."""
        return self.tracker is not None and self.tracker.used

    def begin_fit(self) -> bool:
        """Called when `fit` starts (after its peek); returns `tracked`."""
        if self.tracked:
            assert self.tracker is not None
            self.tracker.fits += 1
        return self.tracked

    def batches(self) -> Iterator[Any]:
        """The iterator's batches through a new tracker (one per `fit`)."""
        self.tracker = IteratorTracker(self.data_iterator, on_first_pull=self._on_first_pull)
        return self.tracker.batches()

    def rewind(self, fit_batches: int) -> None:
        """At the end of `fit`: the iterator at its position after `fit_batches` trained batches."""
        if self.tracker is not None:
            self.tracker.rewind(fit_batches)

    def states(self, fit_batches: int) -> list[Any] | None:
        """Every process's position after `fit_batches` trained batches, or None without an iterator.

        All processes must call this at the same point (see `gather_json`).
        """
        if self.tracker is None:
            return None
        return gather_json(encode_state(self.tracker.state_after(fit_batches)))
