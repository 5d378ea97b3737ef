"""Reading a step back: metadata, iterator position, and `restore_latest`.

Values go into the model through `shardckpt.load_sharded`, which reads each
variable's pieces straight into its current sharding (any mesh), so resuming
on a different topology is the same call.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

from keras import distribution as kd

from shardckpt import _keras, budget, storage
from shardckpt.errors import CheckpointNotFoundError, IteratorCountError
from shardckpt.formats.orbax.ondisk import (  # noqa: F401  (the callback's names for them)
    ARRAYS_ITEM,
    ITERATOR_ITEM,
    METADATA_ITEM,
    latest_step,
    latest_step_dir,
    read_json_item,
)
from shardckpt.lazy import is_unloaded
from shardckpt.progress import some
from shardckpt.restore import LoadReport, load_sharded
from shardckpt.training.iterators import decode_state
from shardckpt.types import Model, StatefulIterator

_log = logging.getLogger("shardckpt")


@dataclasses.dataclass(kw_only=True)
class ResumeInfo:
    """Where a restored run stands.

    Attributes:
        step: The Orbax step restored.
        path: Its step folder.
        epoch: The epoch (0-based) the save happened in.
        batch: Batches of that epoch done when saved.
        epoch_complete: True for a save at the end of `epoch`.
        total_batches: Batches trained since the run began.
        metadata: The whole metadata item (user's dict under "user").
        iterator_state: The state given to the data iterator (this process's),
            or None.
        report: What `load_sharded` loaded.
    """

    step: int
    path: str
    epoch: int | None
    batch: int | None
    epoch_complete: bool
    total_batches: int | None
    metadata: dict[str, Any]
    iterator_state: Any
    report: LoadReport | None

    @property
    def next_epoch(self) -> int:
        """The epoch `fit` continues with."""
        if self.epoch is None:
            return 0
        return self.epoch + 1 if self.epoch_complete else self.epoch


ON_COUNT_CHANGE = ("error", "restart_iterators")
"""What a resume does with saved iterator positions of another process count:
raise `IteratorCountError`, or leave every iterator where it is (restart it)."""


def check_on_count_change(value: str) -> None:
    """Raises ValueError unless `value` is one of `ON_COUNT_CHANGE`."""
    if value not in ON_COUNT_CHANGE:
        raise ValueError(
            f"on_process_count_change must be one of {ON_COUNT_CHANGE}. Received: on_process_count_change={value!r}"
        )


def iterator_state_for_process(
    item: Any, process_index: int, process_count: int, *, step_dir: str = "", on_count_change: str = "error"
) -> Any:
    """Picks this process's state out of a saved iterator item.

    States are stored per process index; with another process count none is
    this process's without a choice (`on_count_change`): "error" raises,
    "restart_iterators" returns None (the iterator keeps its own position)
    and logs a warning once, on process 0.

    Raises:
        IteratorCountError: the counts differ and `on_count_change` is "error".
    """
    check_on_count_change(on_count_change)
    if item is None:
        return None
    states = item.get("process_states") or []
    if len(states) != process_count:
        where = f" {step_dir!r}" if step_dir else ""
        if on_count_change == "error":
            raise IteratorCountError(
                f"The checkpoint step{where} holds data-iterator positions of {len(states)} process(es); "
                f"this run has {process_count}. Positions are per process and cannot be split or "
                "merged exactly. Fix: resume with the same number of processes, or pass "
                "on_process_count_change='restart_iterators' to restore model and optimizer and "
                "leave every data iterator at its own current position. Received: "
                f"on_process_count_change={on_count_change!r}"
            )
        if process_index == 0:
            _log.warning(
                "step%s holds data-iterator positions of %d process(es), this run has %d: the data "
                "iterators restart from their own positions (on_process_count_change='restart_iterators'); "
                "model, optimizer and counters resume from the step.", where, len(states), process_count)
        return None
    # Tagged bytes/tuples (see iterators.encode_state) become themselves again.
    return decode_state(states[process_index])


def build_optimizer(model: Any) -> None:
    """Creates optimizer variables so that their saved values have a target.

    Keras gives each slot its variable's layout
    (`add_variable_from_reference(layout=variable._layout)`). A variable
    built under `lazy_init()` has none until it is loaded, and Keras would
    then place its slots by their own paths, which a `LayoutMap` of variable
    paths does not match: a whole copy on every device, before the load (or,
    for a weights-only step, after it). For the build, each such variable
    holds the layout the active distribution gives it, as Keras gives one to
    every variable it initialises (`JaxVariable._initialize_layout`), so
    the slots are created where they belong; then it has none again, and
    the load places it as it places any lazily built variable.
    """
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or optimizer.built:
        return
    distribution = kd.distribution()
    for_model = getattr(distribution, "for_model", None)
    if callable(for_model):  # a plan's distribution, bound to this model as `load_sharded` binds it
        distribution = for_model(model)
    lent = []
    if distribution is not None:
        lent = [v for v in model.trainable_variables if is_unloaded(v) and _keras.current_layout(v) is None]
    for variable in lent:
        _keras.set_layout(variable, distribution.get_variable_layout(variable))
    try:
        optimizer.build(model.trainable_variables)
    finally:
        for variable in lent:
            _keras.set_layout(variable, None)


def restore_step(
    model: Any,
    step_dir: str,
    *,
    data_iterator: Any = None,
    strict: bool = True,
    on_process_count_change: str = "error",
    max_inflight_bytes: int | None = None,
) -> ResumeInfo:
    """Restores one step into `model` (and `data_iterator`); see `restore_latest`."""
    import jax

    check_on_count_change(on_process_count_change)
    if max_inflight_bytes is not None:
        budget.resolve(max_inflight_bytes)  # refused before the optimizer is built
    build_optimizer(model)
    metadata = read_json_item(step_dir, METADATA_ITEM) or {}
    iterator_state = None
    if data_iterator is not None:  # checked before any value moves: an error leaves the model as it was
        iterator_state = iterator_state_for_process(
            read_json_item(step_dir, ITERATOR_ITEM), jax.process_index(), jax.process_count(),
            step_dir=step_dir, on_count_change=on_process_count_change)
    # A weights-only step has no optimizer/metric arrays: those keep their
    # values, and a warning below says so (such a step cannot resume exactly).
    weights_only = bool(metadata.get("save_weights_only", False))
    # The one call that moves values (switch point for another restore engine).
    report = load_sharded(model, step_dir, strict=strict and not weights_only, max_inflight_bytes=max_inflight_bytes,
                          progress=False)
    # A step without that metadata (Keras' own callback, save_weights_only=True) lacks them
    # the same way; the load lists what it left as it was (`report.kept`).
    kept = _training_state(model) if weights_only else list(report.kept)
    if kept and jax.process_index() == 0:
        said = ("was saved with save_weights_only=True" if weights_only else
                "holds no optimizer or metric state (a weights-only step, as Keras' "
                "OrbaxCheckpoint(save_weights_only=True) writes)")
        _log.warning(
            "step %s %s: only the model's weights were restored; %d "
            "optimizer and metric variables (%s) keep their current values (a new optimizer starts "
            "over: iteration count, learning-rate schedule, slots), so training does not continue "
            "exactly where it stopped. Fix: save with save_weights_only=False to resume training.",
            os.path.basename(step_dir), said, len(kept), some(kept, 3))
    if data_iterator is not None and iterator_state is not None:
        data_iterator.set_state(iterator_state)
    return ResumeInfo(
        step=int(os.path.basename(step_dir)),
        path=step_dir,
        epoch=metadata.get("epoch"),
        batch=metadata.get("batch"),
        epoch_complete=bool(metadata.get("epoch_complete", True)),
        total_batches=metadata.get("total_batches"),
        metadata=metadata,
        iterator_state=iterator_state,
        report=report,
    )


def _training_state(model: Any) -> list[str]:
    """The paths of `model`'s optimizer and metric variables (what a weights-only step lacks)."""
    optimizer = getattr(model, "optimizer", None)
    variables = list(getattr(optimizer, "variables", None) or []) + list(getattr(model, "metrics_variables", []))
    return [variable.path for variable in variables]


def restore_latest(
    model: Model,
    directory: str | os.PathLike,
    *,
    data_iterator: StatefulIterator | None = None,
    strict: bool = True,
    on_process_count_change: str = "error",
    max_inflight_bytes: int | None = None,
) -> ResumeInfo:
    """Restores the latest committed checkpoint of `directory` outside `fit`.

    Every model, optimizer and metric variable (seed-generator states included)
    gets its saved value in its current sharding, so this works on any mesh.
    The optimizer is built first if needed. With `data_iterator`, its saved
    position (this process's) is set too.

    What `fit(initial_epoch=info.next_epoch)` then trains is the uninterrupted
    run's continuation only for a step of whole epochs and an input whose order
    does not come from the global random generators: `fit` shuffles arrays and
    a `PyDataset` with NumPy's and Python's, and draws the first epoch's order
    before any callback runs. `OrbaxCheckpoint(resume=True)` restores those
    generators at the right moment and finishes a partial epoch; a step that
    holds part of an epoch gets a warning here. The step may come from another
    number of processes and another mesh: every array is resharded; only the
    per-process iterator positions then need `on_process_count_change`.

    Example:

    ```python
    model.compile(optimizer="adam", loss="mse")
    info = shardckpt.restore_latest(model, "ckpts/", data_iterator=it)
    print(info.step, info.next_epoch, info.metadata["user"])
    ```

    Args:
        model: A compiled, built Keras model (JAX backend).
        directory: A root written by `OrbaxCheckpoint` (or Keras' callback),
            local or a `gs://` / `s3://` URL (steps there count once their
            `commit_success.txt` exists).
        data_iterator: Optional iterator with `set_state(state)`.
        strict: Passed to `load_sharded`: refuse missing/unexpected arrays.
        on_process_count_change: With `data_iterator`, when the step holds
            positions of another number of processes: "error" (raise
            `IteratorCountError` before anything is restored) or
            "restart_iterators" (restore the rest; the iterator keeps its
            current position; a warning says so).
        max_inflight_bytes: Most bytes of host memory the restore holds at
            once beyond the final state, as `load_sharded`'s (None: its
            default, this host's budget, larger with local accelerators).
            The budget used is in the result's `report.max_inflight_bytes`.

    Returns:
        A `ResumeInfo`.

    Raises:
        CheckpointNotFoundError: `directory` holds no committed step.
        IncompleteCheckpointError: it holds only what interrupted saves or
            deletes left (as `load_sharded` and `inspect` raise).
        IteratorCountError: see `on_process_count_change`.
        ValueError: `max_inflight_bytes` is not a positive number of bytes.
        CheckpointMismatchError, DtypeMismatchError, ...: see `load_sharded`.
    """
    import jax

    # Classified first: an unsupported scheme:// is refused, never a local folder.
    location = storage.parse(directory, what="directory")
    try:
        step_dir = latest_step(location)
    except CheckpointNotFoundError as e:
        raise CheckpointNotFoundError(
            f"{e} Fix: check the directory, or train with OrbaxCheckpoint first.") from None
    info = restore_step(model, step_dir, data_iterator=data_iterator, strict=strict,
                        on_process_count_change=on_process_count_change, max_inflight_bytes=max_inflight_bytes)
    if info.epoch is not None and not info.epoch_complete and jax.process_index() == 0:
        _log.warning(
            "step %d holds part of epoch %d (%s of %s batches trained): fit(initial_epoch=%d) would train "
            "that epoch from its first batch again, with the data going on from where it stopped, and end "
            "past the run it continues. Fix: continue it with OrbaxCheckpoint(directory, resume=True) "
            "in fit (fed from ckpt.batches()), which finishes the epoch's remaining batches.",
            info.step, info.epoch, info.batch, info.metadata.get("steps_per_epoch"), info.next_epoch)
    if _averaged_weights_in_optimizer(model, info) and jax.process_index() == 0:
        # Keras' fit ends with finalize_variable_values (the averages into the weights) after
        # the last step was saved; Keras' ModelCheckpoint files hold the raw weights the same way.
        _log.warning(
            "step %d holds the weights as trained (what a resumed fit continues from); their moving "
            "average (use_ema=True) is in the optimizer's variables, and the model fit returned held "
            "the average, which Keras' fit puts into the weights when it ends. Fix: for the averaged "
            "weights (evaluation, export), call model.optimizer.finalize_variable_values("
            "model.trainable_variables) after this restore.", info.step)
    return info


def _averaged_weights_in_optimizer(model: Model, info: ResumeInfo) -> bool:
    """Whether a restore gave `model`'s optimizer the moving averages of the weights (`use_ema=True`).

    Not where the step holds none (a weights-only step, by shardckpt or Keras):
    the averages then keep the optimizer's own values.
    """
    averages = _keras.weight_averages(getattr(model, "optimizer", None))
    if not averages or info.report is None:
        return False
    unloaded = {*info.report.missing_paths, *info.report.kept}
    return not any(v.path in unloaded for v in averages)
