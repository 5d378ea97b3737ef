"""Every use of Keras internals, in one place: the upgrade surface behind the Keras pin.

shardckpt uses Keras' public API wherever one exists. What is here has none;
each entry says why it is needed and who uses it. When the pinned Keras
version moves (`pyproject.toml`), this module is what to re-check; the test
suite exercises every entry.

Private modules:

- `saving_lib._save_state` and `saving_lib.H5IOStore` (restore.keys): Keras'
  h5 key of each variable comes from its object-graph walk; running Keras'
  own walk against a recording store is the only way to get exactly the keys
  `save_weights` writes.
- `saving_lib._serialize_model_as_json`, `saving_lib._save_assets_to_dict`
  (training.callback): the model config and assets Keras' own
  `OrbaxCheckpoint` saves beside the state tree, so `load_model` reads ours.
- `saving_lib._write_nested_dict_to_dir`, `saving_lib.DiskIOStore` and
  `saving_lib._load_state` with an assets store only (restore.assets): the
  state of layers kept in asset files (a `StringLookup`'s adapted
  vocabulary), loaded as `load_model` loads a `.keras` archive's or an Orbax
  step's "assets"; `load_weights` never reads them.
- `global_state` (lazy): variables created under
  `StatelessScope(initialize_variables=False)` go on a global
  "uninitialized_variables" list that the next scope exit would fill with
  random values; `lazy_init` takes its own off that list.
- `Distribution` (restore.targets): the base class of every distribution,
  not exported by `keras.distribution`.
- `MonitorCallback` (training.callback): the base class of Keras' own
  `OrbaxCheckpoint` (monitor / mode / best handling), not exported.
- `global_state`'s "name_scope_stack" (layout.distribution, through
  `name_scope_callers`): which layer, optimizer or metric is creating the
  variable Keras asks a distribution to place.
- `utils.naming.to_snake_case` (structure, through `auto_name_base`): the
  name Keras generates for an unnamed object is `auto_name(class name)`,
  the class name through this function plus a counter; the only way to tell
  a generated name from a user's is to compute the same.

Private attributes of `keras.Variable`, through the functions below:

- `TensorLayout._device_mesh` (layout.plan, layout.parallel): Keras'
  `TensorLayout` refuses an entry naming several mesh axes (`("model",
  "data")`: one dimension split over both, as FSDP needs where only one
  dimension divides), although JAX's `PartitionSpec`, which Keras builds
  from it, takes it; `tensor_layout` sets the mesh after construction,
  skipping that check.
- `_value`, `_layout`: replacing a value in a given layout without
  `Variable.assign`, which would re-place it on the variable's previous
  layout and keep the old value alive while the new one is built;
- `_initializer`, `_initialize_with_initializer`: a lazily built variable
  keeps its initializer there until it gets a value.

Private attributes of layers:

- `Layer._dtype_policy` (presets.kerashub, through `resolve_policy_map`): a
  layer built from a config whose dtype is a `DTypePolicyMap` (a quantized
  keras-hub backbone) keeps the map itself as its policy; its variables are
  built quantized, but `save_own_variables` asks `dtype_policy.
  quantization_mode`, which the map answers None, and stores None for the
  scales. Setting the layer's own policy, as `quantize()` does, is the only
  way to get the state the saved model was in; the public setter would
  quantize (read) the unloaded kernel again.

Private methods of optimizers:

- `Muon._should_use_adamw` (layout.memory, through `muon_uses_adamw`):
  which variables Muon updates with AdamW, and so keeps a velocity for (not
  2-D, embeddings, `exclude_layers`); asking Keras keeps the estimate exact
  for the installed version's rule and the optimizer's options.
- `BaseOptimizer._model_variables_moving_average` (training.resume, through
  `weight_averages`): the moving averages `use_ema=True` keeps, which
  `finalize_variable_values` puts into the weights at the end of `fit`;
  `restore_latest` says so when it restores them (no public accessor tells
  them from the other optimizer variables).

Private attributes of models:

- `Model._initial_epoch` (training.callback): the epoch `fit` starts from,
  read by Keras' trainer right after `on_train_begin` (as
  `self._initial_epoch or initial_epoch`: a 0 there is set as a true
  `_FirstEpoch`, see `start_fit_at`); Keras' own `BackupAndRestore`
  resumes through it. There is no public hook.
- `fit`'s local `epoch_iterator` (`EpochIterator.steps_per_epoch`,
  `_num_batches`, `steps_per_execution`, `data_adapter.py_dataset`, and
  its locals `callbacks` and `initial_epoch`; training.callback, through
  `fit_input`): whether `fit` continues one pass of its data across
  epochs (`steps_per_epoch` shorter than the data, or a generator of no
  known length), which a resume at an epoch boundary cannot continue. A
  callback sees neither the data nor `fit`'s `steps_per_epoch` argument
  (`params["steps"]` is the data's length where none was passed). Nor
  does it see the other callbacks, whose state a resume may not restore.
"""

from __future__ import annotations

import os
import sys
import tempfile
import types
from typing import Any, NamedTuple

from keras.src.backend.common import global_state
from keras.src.callbacks.monitor_callback import MonitorCallback
from keras.src.distribution.distribution_lib import Distribution
from keras.src.saving import saving_lib
from keras.src.utils import file_utils, naming

__all__ = [
    "Distribution",
    "auto_name_base",
    "H5IOStore",
    "MonitorCallback",
    "resolve_policy_map",
    "current_layout",
    "current_value",
    "FitInput",
    "fit_input",
    "get_global_attribute",
    "initial_epoch",
    "muon_uses_adamw",
    "initialize",
    "initializer",
    "unset_asset_layers",
    "load_assets",
    "save_assets",
    "save_state",
    "name_scope_callers",
    "serialize_model_config",
    "set_global_attribute",
    "set_initial_epoch",
    "start_fit_at",
    "set_initializer",
    "set_layout",
    "set_value",
    "tensor_layout",
    "weight_averages",
]

H5IOStore = saving_lib.H5IOStore
get_global_attribute = global_state.get_global_attribute
set_global_attribute = global_state.set_global_attribute


def save_state(model: Any, weights_store: Any, *, skip: Any = ()) -> None:
    """Runs Keras' `save_weights` walk over `model` into `weights_store`.

    `skip` are objects left out, as `save_weights(objects_to_skip=...)` does.
    """
    saving_lib._save_state(
        model,
        weights_store=weights_store,
        assets_store=None,
        inner_path="",
        visited_saveables={id(o) for o in skip},
    )


def auto_name_base(cls: type) -> str:
    """The name Keras generates for an unnamed instance of `cls`, before its `_<n>` counter.

    `Operation`, `Optimizer`, `Metric`, `SeedGenerator` and `Variable` all
    call `auto_name(self.__class__.__name__)`: `Dense` -> `dense`,
    `MultiHeadAttention` -> `multi_head_attention`.
    """
    return str(naming.to_snake_case(cls.__name__))


def serialize_model_config(model: Any) -> Any:
    """The model config as Keras' `OrbaxCheckpoint` saves it."""
    return saving_lib._serialize_model_as_json(model)[0]


def save_assets(model: Any) -> Any:
    """The model's assets (vocabularies, ...) as Keras' `OrbaxCheckpoint` saves them."""
    return saving_lib._save_assets_to_dict(model)


class _AssetsReadStore(saving_lib.DiskIOStore):
    """Keras' asset store over a folder, recording the saveables' folders it does not have."""

    def __init__(self, root: str) -> None:
        super().__init__(root, mode="r")
        self.absent: list[str] = []

    def get(self, path: str) -> Any:
        found = super().get(path)
        if found is None:  # Keras gives the saveable's load_assets None (one given its vocabulary ignores it)
            self.absent.append(path)
        return found


def load_assets(model: Any, tree: dict[str, Any]) -> tuple[dict[str, str], list[str]]:
    """Loads an asset tree (as `save_assets` gives it) into `model` by Keras' own walk.

    Each saveable's `load_assets` gets its own folder of the tree, as
    `keras.saving.load_model` gives it (None where the tree has none).
    Returns `{saveable name: error}` of the saveables whose `load_assets`
    raised (the others are loaded), and the folders the walk asked for that
    the tree lacks.
    """
    failed: dict[int, tuple[Any, BaseException]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = file_utils.resolve_path(tmp)
        saving_lib._write_nested_dict_to_dir(tree, root)
        store = _AssetsReadStore(root)
        try:
            saving_lib._load_state(
                model, weights_store=None, assets_store=store, inner_path="",
                visited_saveables=set(), failed_saveables=set(), error_msgs=failed,
            )
        finally:
            store.close()
    errors = {getattr(obj, "name", type(obj).__name__): f"{type(e).__name__}: {e}" for obj, e in failed.values()}
    return errors, store.absent


def _asset_files(layer: Any) -> dict[str, bytes]:
    """The files `layer.save_assets` writes now, by their path in its folder."""
    with tempfile.TemporaryDirectory() as tmp:
        layer.save_assets(tmp)
        files = {}
        for folder, _, names in os.walk(tmp):
            for name in names:
                with open(os.path.join(folder, name), "rb") as f:
                    files[os.path.relpath(os.path.join(folder, name), tmp)] = f.read()
        return files


def unset_asset_layers(model: Any) -> list[str]:
    """Names of the layers of `model` whose asset state is still what their constructor gives.

    A layer keeps state in asset files when its `save_assets` writes one (an
    adapted `StringLookup`'s vocabulary; none for one given `vocabulary=`,
    which its config holds). Its state is unset when those files equal a
    fresh instance's from the layer's config: nothing (`adapt`,
    `set_vocabulary`, a `.keras` load) gave it any, so it computes with an
    empty vocabulary. A layer whose config builds no instance is not named.
    """
    names = []
    for layer in model._flatten_layers(include_self=False):
        if not callable(getattr(layer, "save_assets", None)):
            continue
        try:
            files = _asset_files(layer)
            unset = bool(files) and _asset_files(type(layer).from_config(layer.get_config())) == files
        except Exception:  # noqa: BLE001 (a layer whose config or save_assets fails here: not told unset)
            continue
        if unset:
            names.append(layer.name)
    return names


def current_value(variable: Any) -> Any:
    """The variable's value, or None for a lazily built one (no initializer runs)."""
    return variable._value


def layout_map_of(distribution: Any) -> Any:
    """The `LayoutMap` a `ModelParallel` distribution was built with, or None.

    Keras keeps it as `_layout_map` with no public accessor.
    """
    return getattr(distribution, "_layout_map", None)


def name_scope_callers() -> list[Any]:
    """The objects whose name scopes are open, outermost first (layers, an optimizer, a metric).

    Keras opens `name_scope(name, caller=self)` around every variable a
    layer, optimizer or metric creates, and keeps the stack in its global
    state (`name_scope_stack`) with no public accessor: it is how a
    distribution can tell, when Keras asks for a new variable's layout,
    whether a layer or an optimizer is creating it.
    """
    stack = global_state.get_global_attribute("name_scope_stack", default=None) or []
    return [getattr(scope, "caller", None) for scope in stack]


def current_layout(variable: Any) -> Any:
    """The layout Keras re-places assigned values on (a `TensorLayout`, a sharding or None)."""
    return variable._layout


def tensor_layout(axes: Any, mesh: Any) -> Any:
    """A `keras.distribution.TensorLayout` whose entries may name several mesh axes.

    Plain axes (one name or None per dimension) go through Keras' own
    constructor and its validation.
    """
    from keras import distribution as kd

    if all(a is None or isinstance(a, str) for a in axes):
        return kd.TensorLayout(axes, mesh)
    layout = kd.TensorLayout(tuple(axes))
    layout._device_mesh = mesh
    return layout


def set_layout(variable: Any, layout: Any) -> None:
    """Records `layout` on the variable: later assigns (optimizer updates) and
    optimizer slots made from it (`add_variable_from_reference`) follow it."""
    variable._layout = layout


def set_value(variable: Any, value: Any, *, layout: Any) -> Any:
    """Makes `value` the variable's value in `layout`, bypassing `Variable.assign`.

    `assign` would re-place the value on the variable's previous layout; here
    `layout` becomes the variable's layout. A lazily built variable's
    initializer is dropped: it has a value now.

    Returns:
        The value replaced (None for a lazily built variable).
    """
    variable._layout = layout
    old, variable._value = variable._value, value
    variable._initializer = None
    return old


def initializer(variable: Any) -> Any:
    """The initializer a lazily built variable keeps until it gets a value."""
    return variable._initializer


def set_initializer(variable: Any, value: Any) -> None:
    """Replaces a lazily built variable's pending initializer."""
    variable._initializer = value


def initialize(variable: Any, initializer: Any, *, layout: Any) -> None:
    """Gives a lazily built variable its value from `initializer`, in `layout`.

    With a Keras `TensorLayout` or `NamedSharding`, Keras jits the
    initializer with the layout as its output sharding, so the value is
    created directly in place. With None it lands where Keras puts it by
    default (one device).
    """
    variable._initializer = None
    variable._layout = layout
    variable._initialize_with_initializer(initializer)


def muon_uses_adamw(optimizer: Any, path: str, shape: tuple[int, ...]) -> bool:
    """Whether Keras' `Muon` updates a variable at `path` of `shape` with AdamW (see module docstring).

    Keras reads only `variable.path` and `variable.shape`, so a plan's
    placement is asked about without building the variable.
    """
    return bool(optimizer._should_use_adamw(types.SimpleNamespace(path=path, shape=tuple(shape))))


def weight_averages(optimizer: Any) -> list[Any]:
    """The moving averages of the weights an optimizer with `use_ema=True` keeps (see module docstring)."""
    # A LossScaleOptimizer wraps the optimizer that keeps them.
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)
    if optimizer is None or not getattr(optimizer, "use_ema", False):
        return []
    return list(getattr(optimizer, "_model_variables_moving_average", None) or [])


def initial_epoch(model: Any) -> Any:
    """The epoch `fit` starts from (None before any `fit`)."""
    return getattr(model, "_initial_epoch", None)


class _FirstEpoch(int):
    """Epoch 0 that is true in a condition.

    Keras' trainer starts at `self._initial_epoch or initial_epoch`: a plain 0
    there gives way to `fit(initial_epoch=k)`, so a resume in epoch 0 would
    start at epoch k (measured: other weights, said exact).
    """

    def __bool__(self) -> bool:
        return True


def set_initial_epoch(model: Any, epoch: Any) -> None:
    """Sets the epoch `fit` starts from; valid from `on_train_begin` on."""
    model._initial_epoch = epoch


def start_fit_at(model: Any, epoch: int) -> None:
    """Makes the `fit` calling back start at `epoch`, over its own `initial_epoch` (from `on_train_begin`)."""
    model._initial_epoch = _FirstEpoch(0) if epoch == 0 else epoch


class FitInput(NamedTuple):
    """What the `fit` calling back now draws its batches from (see `fit_input`).

    Attributes:
        steps_per_epoch: As passed to `fit` (None: not passed).
        num_batches: Batches in one pass of the data (None: not known, a generator).
        steps_per_execution: The model's.
        py_dataset: The `keras.utils.PyDataset` given to `fit`, or None.
        callbacks: Every callback of the `fit` (Keras' `History` and progress bar included).
        initial_epoch: As passed to `fit` (read in `on_train_begin`; Keras
            replaces it with `Model._initial_epoch` after that hook).
    """

    steps_per_epoch: int | None
    num_batches: int | None
    steps_per_execution: int
    py_dataset: Any
    callbacks: list[Any]
    initial_epoch: int = 0


def fit_input(model: Any) -> FitInput | None:
    """What the `fit` of `model` that is calling back now draws from, read from its `epoch_iterator`.

    None when no such frame is on the stack (a Keras whose trainer names it
    otherwise, or a callback called outside `fit`).
    """
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        found = frame.f_locals.get("epoch_iterator") if frame.f_locals.get("self") is model else None
        if found is not None and hasattr(found, "steps_per_epoch") and hasattr(found, "_num_batches"):
            adapter = getattr(found, "data_adapter", None)
            return FitInput(found.steps_per_epoch, found._num_batches,
                            int(getattr(found, "steps_per_execution", 1) or 1), getattr(adapter, "py_dataset", None),
                            list(getattr(frame.f_locals.get("callbacks"), "callbacks", None) or []),
                            int(frame.f_locals.get("initial_epoch") or 0))
        frame = frame.f_back
    return None


def resolve_policy_map(model: Any) -> list[str]:
    """Gives each quantized layer under a `DTypePolicyMap` its own policy from the map.

    Returns:
        The paths of the layers changed.
    """
    import keras

    changed = []
    for layer in model._flatten_layers():
        policy_map = layer._dtype_policy
        if not isinstance(policy_map, keras.dtype_policies.DTypePolicyMap) or not layer.path:
            continue
        policy = policy_map[layer.path]
        if policy.quantization_mode is not None:
            layer._dtype_policy = policy
            changed.append(layer.path)
    return changed
