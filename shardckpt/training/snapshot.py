"""A copy of a model's state tree, safe to save in the background.

Keras' JAX train step donates its state buffers: the arrays a callback reads
from the model at batch end are freed by the next step. A background save must
therefore write a copy that nobody donates. Two ways to make it (`MODES`):

* "device": one jitted program (`jnp.copy` of every leaf, outputs in the
  inputs' shardings) dispatched asynchronously: the training thread pays only
  the dispatch, and the device makes the copy before it runs the next step.
  On accelerators the save's worker then moves the copy into host memory
  (`to_host_dropping`): every leaf's device-to-host transfer is started at
  once, and each device copy is deleted as soon as its leaf is on the host,
  so device memory above the state is at most one copy of the state (weights
  plus Adam's two slots: 3x the weights) at the snapshot, falling to the
  leaves still in flight, and none while the file is written. On CPU
  devices the copy stays where it is: their memory is the host's already.
  There the dispatch is not free: XLA:CPU's `Execute` returns once every
  device's launch has run, and a launch whose inputs are ready (the state
  is, at batch end: Keras reads the step's logs before the callbacks) runs
  the copy there and then on XLA's thread pool, so the training thread
  waits for much of the copy (8 simulated devices, 576 MiB in 36 arrays:
  18-26 ms median against 0.6-0.8 ms when the step making the inputs was
  still running; `perf` puts the wait in `CommonPjRtLoadedExecutable::Execute`).
  Accelerators enqueue the copy on a stream and return.
* "host": the state goes off the devices piece by piece, each piece at most
  `budget_bytes`, into host memory through JAX memory kinds ("pinned_host",
  the memory kind accelerators copy to directly), keeping every array's
  sharding. The next piece is started before the previous one is awaited
  (two pieces in transfer at a time: the link stays busy between pieces;
  the copies take host memory, not device memory), and the training thread
  waits for the whole copy (state bytes over the device-to-host bandwidth,
  which `tools/bench_save.py` prints).

"auto" (`choose`) takes the cheaper mode that keeps device memory bounded:

* CPU devices: "device". Their memory is the host's RAM, so a "host" copy
  takes the same extra memory as the on-device one and makes training wait
  for it besides (measured with `tools/bench_save.py`: README, "Save
  blocking").
* accelerators: "device" when every local device reports (via
  `Device.memory_stats()`) room for its share of the state plus the budget,
  and "host" otherwise, including where a device reports nothing.

The callback's log line of each save says which mode was used and why.
"""

from __future__ import annotations

import concurrent.futures
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from shardckpt import threads
from shardckpt.progress import format_bytes
from shardckpt.state import check_unique_paths, collections

MODES = ("auto", "device", "host")
DEFAULT_BUDGET_BYTES = 256 * 2**20


def _copy_leaves(values: list[jax.Array]) -> list[jax.Array]:
    return [jnp.copy(v) for v in values]


# One compiled program per distinct list of shapes/dtypes/shardings (jit's cache).
_copy = jax.jit(_copy_leaves)


def nest(paths: list[str], values: list[Any]) -> dict[str, Any]:
    """Nests `values` by their '/'-separated `paths`, as Keras' state tree does."""
    tree: dict[str, Any] = {}
    for path, value in zip(paths, values):
        node = tree
        parts = path.split("/")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        if parts[-1] in node:
            # Keras' get_state_tree refuses the same; two arrays cannot share a key.
            raise ValueError(
                f"Variable path {path!r} is found twice in the model; checkpoint keys "
                "must be unique. Fix: give unique names to your layers."
            )
        node[parts[-1]] = value
    return tree


def _per_device_bytes(values: list[jax.Array]) -> dict[Any, int]:
    """Bytes of `values` held by each local device (its shards).

    Read from each sharding, not from `addressable_shards`: a shard's `.data`
    makes an array per shard, on the training thread at every "auto" save
    (76 arrays on 8 CPU devices: 0.67 ms that way, 0.10 ms this way).
    """
    held: dict[Any, int] = {}
    for value in values:
        shard_bytes = math.prod(value.sharding.shard_shape(value.shape)) * value.dtype.itemsize
        for device in value.sharding.addressable_devices:
            held[device] = held.get(device, 0) + shard_bytes
    return held


class Choice(NamedTuple):
    """The snapshot mode to use and why (the callback logs both)."""

    mode: str
    reason: str


def choose(values: list[jax.Array], mode: str, budget_bytes: int) -> Choice:
    """Resolves "auto" to "device" or "host", with the reason (see the module docstring).

    Args:
        values: The arrays to copy.
        mode: One of `MODES`.
        budget_bytes: Device memory allowed above the state.

    Returns:
        A `Choice` ("device" or "host", and why).
    """
    if mode != "auto":
        return Choice(mode, f"snapshot={mode!r} was asked for")
    devices: set[Any] = {device for value in values for device in value.sharding.device_set}
    if all(device.platform == "cpu" for device in devices):
        return Choice("device", "CPU devices: device memory is host memory, so a host copy would take "
                                "the same memory and block training for the copy")
    for device, need in _per_device_bytes(values).items():
        stats = device.memory_stats()
        if not stats or "bytes_limit" not in stats:
            return Choice("host", f"{device} reports no memory statistics to check room for an on-device copy")
        free = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
        if need + budget_bytes > free:
            return Choice("host", f"{device} has {format_bytes(free)} free, an on-device copy needs "
                                  f"{format_bytes(need)} + {format_bytes(budget_bytes)} of margin")
    return Choice("device", "every device has room for an on-device copy plus the margin")


def choose_mode(values: list[jax.Array], mode: str, budget_bytes: int) -> str:
    """The mode `choose` picks ("device" or "host")."""
    return choose(values, mode, budget_bytes).mode


def _host_kind(value: jax.Array) -> str | None:
    """The host memory kind `value`'s devices copy to, or None if they have none."""
    device = next(iter(value.sharding.device_set))
    # jaxlib's Device stub lacks addressable_memories(), a public method of every device.
    kinds = {m.kind for m in device.addressable_memories()}  # type: ignore[attr-defined]
    for kind in ("pinned_host", "unpinned_host"):
        if kind in kinds:
            return kind
    return None


def _to_host(values: list[jax.Array], budget_bytes: int) -> list[Any]:
    """Copies `values` to host memory in pieces of at most `budget_bytes`.

    An array larger than the budget is one piece. Devices without a host
    memory kind get `jax.device_get` (numpy) per piece.
    """
    out: list[Any] = [None] * len(values)
    in_flight: list[int] = []  # the previous piece, started and not awaited

    def start(piece: list[int]) -> None:
        nonlocal in_flight
        arrays = [values[i] for i in piece]
        kind = _host_kind(arrays[0])
        if kind is None or any(_host_kind(a) != kind for a in arrays):
            copies = [jax.device_get(a) for a in arrays]
        else:
            copies = jax.device_put(arrays, [a.sharding.with_memory_kind(kind) for a in arrays])
        for i, copy in zip(piece, copies):
            out[i] = copy
        # The previous piece is off the devices before a third one starts.
        jax.block_until_ready([out[i] for i in in_flight])
        in_flight = piece

    for piece in _pieces(values, budget_bytes):
        start(piece)
    jax.block_until_ready([out[i] for i in in_flight])
    return out


def _pieces(values: list[jax.Array], budget_bytes: int) -> list[list[int]]:
    """Indices of `values` in consecutive groups of at most `budget_bytes` (a larger array alone)."""
    pieces: list[list[int]] = []
    size = 0
    for i, value in enumerate(values):
        if not pieces or (pieces[-1] and size + value.nbytes > budget_bytes):
            pieces.append([])
            size = 0
        pieces[-1].append(i)
        size += value.nbytes
    return pieces


MOVED_TO_HOST = "; the save's worker moves the copy to host memory, dropping each device piece once it is there"
"""Ends the reason of a "device" snapshot that `before_write` moves off the devices."""


def _moved_to_host(choice: Choice) -> bool:
    """Whether the save moves a "device" snapshot of `choice` off the devices (`before_write`)."""
    return choice.mode == "device" and choice.reason.endswith(MOVED_TO_HOST)


def before_write(tree: dict[str, Any], choice: Choice) -> Callable[[], None] | None:
    """What the save's worker runs before writing the snapshot `tree` (`to_host_dropping`), or None."""
    return (lambda: to_host_dropping(tree)) if _moved_to_host(choice) else None


def off_devices(choice: Choice) -> bool:
    """Whether a snapshot of `choice` is in host memory once `before_write` ran (a later save may queue behind it)."""
    return choice.mode == "host" or _moved_to_host(choice)


def stays_on_device(values: list[jax.Array]) -> bool:
    """True when a "device" snapshot of `values` is left on the devices (CPU devices: see the module docstring)."""
    devices = {d for v in values for d in v.sharding.device_set}
    return all(d.platform == "cpu" for d in devices) or any(_host_kind(v) is None for v in values)  # type: ignore[attr-defined]


def to_host_dropping(tree: dict[str, Any]) -> None:
    """Moves the `jax.Array` leaves of `tree` into host memory, deleting each device copy once it is there.

    For a "device" snapshot on the save's worker thread: every transfer is
    started at once (the link is busy from the first byte), then each leaf is
    awaited in turn and its device copy deleted, so the device holds only the
    leaves still in flight. The host copies keep their shardings (memory
    kind "pinned_host" where the devices have it). `tree` is changed in place.

    Args:
        tree: A snapshot (`snapshot_state`), nested dicts of arrays; nobody
            else may use its device arrays.
    """
    slots: list[tuple[dict[str, Any], str]] = []

    def walk(node: dict[str, Any]) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value)
            elif isinstance(value, jax.Array):
                slots.append((node, key))

    walk(tree)
    if not slots:
        return
    values = [node[key] for node, key in slots]
    kinds = [_host_kind(v) for v in values]
    copies = [jax.device_put(v, v.sharding.with_memory_kind(kind)) if kind is not None else v
              for v, kind in zip(values, kinds)]
    for (node, key), value, copy in zip(slots, values, copies):
        if copy is value:
            continue
        copy.block_until_ready()
        node[key] = copy
        value.delete()


def prepare(
    model: Any, *, weights_only: bool = False, mode: str = "device", budget_bytes: int = DEFAULT_BUDGET_BYTES,
) -> concurrent.futures.Future | None:
    """Compiles the "device" copy program on a thread, ahead of the first `snapshot_state`.

    Compiling it inside the first save made that save block training
    for the compile too (about 60 ms for 76 arrays on 8 CPU devices, more
    than the copy's own dispatch). Compiled for the state's arrays while
    `fit` starts, the first save finds it in jit's cache. Lowering reads
    only their shapes, dtypes and shardings, so the training step may
    donate them meanwhile. (Lowered from `ShapeDtypeStruct`s instead, the
    first save compiled again: tests/test_callback_snapshot.py.)

    Args:
        model: The model about to train (its state built).
        weights_only: As for `snapshot_state`.
        mode: As for `snapshot_state`; nothing is compiled unless it resolves to "device".
        budget_bytes: As for `snapshot_state`.

    Returns:
        A future to wait for before the first save (it raises what the
        compile raised), or None when there is nothing to compile.
    """
    values = [v.value for group in collections(model, weights_only=weights_only).values() for v in group]
    if not values or choose(values, mode, budget_bytes).mode != "device":
        return None
    def compile_copy() -> None:
        _copy.lower(values).compile()

    return threads.start(compile_copy, name="shardckpt-copy-compile")


def snapshot_state(
    model: Any, *, weights_only: bool = False, mode: str = "device", budget_bytes: int = DEFAULT_BUDGET_BYTES,
) -> tuple[dict[str, Any], Choice]:
    """Returns a copy of `model.get_state_tree()` safe from donation, and its mode with the reason.

    The copy keeps every array's sharding. In "device" mode it is dispatched,
    not awaited: the call returns as soon as the copy is enqueued. In "host"
    mode the call returns when the state is in host memory.

    Example:

    ```python
    tree, mode = snapshot_state(model)  # cheap; training may go on
    checkpointer.save_checkpointables(step, {"pytree": tree})
    ```

    Args:
        model: A built Keras model (JAX backend) whose variables hold values.
        weights_only: Only trainable and non-trainable variables.
        mode: "device", "host" or "auto" (see the module docstring).
        budget_bytes: Host mode's piece size, and the room "auto" wants
            free on every device beside the copy.

    Returns:
        (`{collection: nested {path part: array}}`, the layout of
        `Model.get_state_tree()`; the `Choice`: the mode used, "device" or
        "host", and why).
    """
    groups = collections(model, weights_only=weights_only)
    # Before any copy: a clash of keys would fail the nesting after the device copy was made.
    check_unique_paths(groups, getattr(model, "optimizer", None))
    variables = [v for group in groups.values() for v in group]
    values = [v.value for v in variables]
    used = choose(values, mode, budget_bytes)
    copies = _copy(values) if used.mode == "device" else _to_host(values, budget_bytes)
    if used.mode == "device" and not stays_on_device(values):
        used = Choice("device", used.reason + MOVED_TO_HOST)
    tree: dict[str, Any] = {}
    start = 0
    for name, group in groups.items():
        part = copies[start : start + len(group)]
        start += len(group)
        tree[name] = nest([v.path for v in group], part)
    return tree, used
