"""`LayoutPlan`: where every variable of a model goes on a device mesh.

A plan is plain data (one `Placement` per variable: path, structural key,
shape, dtype, mesh axes per dimension, why) plus the mesh. Everything Keras
and JAX need is derived from it: a `keras.distribution.LayoutMap` with one
exact key per variable, a `ModelParallel` distribution, a `NamedSharding`
per variable, per-device memory, and JSON to store beside a checkpoint.

Variables are identified by structure (`shardckpt.structure`: their
position in the model's object graph, as `.weights.h5` keys them), so a
plan applies to any instance of the architecture: `plan.bind(model)` maps
it onto another instance whose generated layer names differ (in this
process, or in another one after `to_json` / `from_json`). A variable the
plan does not know is an `UnplannedVariableError`, unless the plan was made
with `unknown="replicate"`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import keras
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from keras import distribution as kd

from shardckpt import _keras
from shardckpt.errors import LayoutError, UnplannedVariableError
from shardckpt.layout.distribution import PlannedDistribution
from shardckpt.layout.lora import lora_layout
from shardckpt.layout.memory import Slots, slots_for
from shardckpt.layout.mesh import check_device_count
from shardckpt.layout.placement import Axis, Placement, axis_from_json, axis_json, flat_axes
from shardckpt.structure import structural_paths

_FORMAT = "shardckpt.layout_plan/2"
_READABLE = (_FORMAT, "shardckpt.layout_plan/1")  # /1: no structural keys (matched by path)
UNKNOWN_CHOICES = (None, "replicate")


class LayoutPlan:
    """Where every variable of a model goes on a device mesh.

    Made by `shardckpt.auto_layout(model, mesh)`; read by
    `shardckpt.load_sharded(..., layout=plan)`, Keras (through
    `layout_map()` / `distribution()`) and `shardckpt.parallelize`.

    Example:

    ```python
    plan = shardckpt.auto_layout(model, keras.distribution.DeviceMesh((1, 8), ["data", "model"]))
    rich.print(plan.explain())
    keras.distribution.set_distribution(plan.distribution())
    other = plan.bind(rebuilt_model)       # same architecture, other generated names
    ```

    Args:
        mesh: The device mesh.
        placements: One `Placement` per model variable.
        model_axis: The mesh axis weights are split over.
        batch_axis: The mesh axis batches are split over.
        unknown: What to do with a variable the plan does not know: None
            (raise `UnplannedVariableError`) or "replicate".
        notes: Lines `explain()` prints under its title (how the mesh was
            chosen, FSDP).
        fsdp: Whether parameters are also split over the batch axis.
        gathered_outputs: Structural keys of embedding tables split along
            their width: `layout_map()` relays the output of the layer that
            owns each (`<layer path>/output`, Keras' activation layouts) to
            batch-only, so the lookup is gathered once and the rest of the
            model sees whole rows.
        problems: Lines about what the user asked for that the plan could
            not honour (a layout rule that places no variable), shown by
            `validate()` and `explain()`.
    """

    def __init__(
        self,
        mesh: kd.DeviceMesh,
        placements: Sequence[Placement],
        *,
        model_axis: str,
        batch_axis: str,
        unknown: str | None = None,
        notes: Sequence[str] = (),
        fsdp: bool = False,
        gathered_outputs: Sequence[str] = (),
        problems: Sequence[str] = (),
    ) -> None:
        if unknown not in UNKNOWN_CHOICES:
            raise LayoutError(f"unknown must be None or 'replicate'. Received: unknown={unknown!r}")
        self.mesh = mesh
        self.placements = tuple(placements)
        self.model_axis = model_axis
        self.batch_axis = batch_axis
        self.unknown = unknown
        self.notes = tuple(notes)
        self.fsdp = fsdp
        self.gathered_outputs = tuple(gathered_outputs)
        self.problems = tuple(problems)
        self._by_path = {p.path: p for p in self.placements}
        # Two variables may share a path (sub-models whose layers have the same given names):
        # told apart by shape where they differ (`auto_layout` gives them one placement otherwise).
        self._by_path_shape = {(p.path, p.shape): p for p in self.placements}
        self._by_key = {p.key: p for p in self.placements if p.key}
        # Optimizer slots are named "<optimizer>/<variable path with / -> _>_<slot>"
        # by Keras (`BaseOptimizer.add_variable_from_reference`).
        self._by_slot_stem = {p.path.replace("/", "_"): p for p in self.placements}

    # -- lookup --------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.placements)

    def __getitem__(self, path: str) -> Placement:
        return self._by_path[path]

    def placement(self, path: str) -> Placement | None:
        """The placement of the variable at `path` (exactly), or None."""
        return self._by_path.get(path)

    def bind(self, model: Any, *, unknown: str | None = None) -> LayoutPlan:
        """This plan for `model`: another instance of the architecture it was made for.

        Variables are matched by their structural key (their position in the
        model's layer tree), so generated layer names (`dense_2` where the
        plan has `dense`) do not matter; the returned plan holds `model`'s
        paths, so its `layout_map()` and `distribution()` fit `model`, and
        its trainable flags (which variables get optimizer slots in
        `bytes_per_device`) as they are now.

        Args:
            model: The model to place.
            unknown: Overrides the plan's `unknown` ("replicate": variables
                the plan does not know are replicated, reported in `explain()`).

        Returns:
            A plan with one placement per variable of `model` (`self` when
            nothing changes).

        Raises:
            UnplannedVariableError: A variable of `model` has no placement
                (and `unknown` is not "replicate"), or its shape differs.
        """
        unknown = self.unknown if unknown is None else unknown
        keys = structural_paths(model)
        # Read now, not from the plan: a layer frozen (or unfrozen) since
        # planning changes which variables an optimizer keeps slots for.
        trainable = {id(v) for v in model.trainable_variables}
        placements: list[Placement] = []
        problems: list[str] = []
        for v in model.variables:
            key = keys[id(v)]
            shape = tuple(int(d) for d in v.shape)
            found = self._by_key.get(key) if self._by_key else self._by_path.get(v.path)
            if found is None and unknown == "replicate":
                found = Placement(
                    path=v.path, key=key, shape=shape, dtype=jnp.dtype(v.dtype).name,
                    axes=(None,) * len(shape), reason="not in the plan: replicated (unknown='replicate')",
                    source="default",
                )
            if found is None:
                problems.append(f"{v.path} (structural key {key!r}, shape {shape}): no placement")
            elif found.shape != shape:
                problems.append(f"{v.path} (structural key {key!r}): model shape {shape}, plan shape {found.shape}")
            else:
                placements.append(dataclasses.replace(found, path=v.path, key=key, trainable=id(v) in trainable))
        if problems:
            raise UnplannedVariableError(
                f"The layout plan does not fit model {getattr(model, 'name', model)!r}: "
                + "; ".join(problems[:10])
                + (f"; and {len(problems) - 10} more" if len(problems) > 10 else "")
                + ". Fix: plan this model with shardckpt.auto_layout(model, mesh), or pass "
                "unknown='replicate' to replicate what the plan does not know."
            )
        if tuple(placements) == self.placements and unknown == self.unknown:
            return self
        return LayoutPlan(
            self.mesh, placements, model_axis=self.model_axis, batch_axis=self.batch_axis,
            unknown=unknown, notes=self.notes, fsdp=self.fsdp, gathered_outputs=self.gathered_outputs,
            problems=self.problems,
        )

    def slot_axes(self, variable: Any) -> tuple[Axis, ...] | None:
        """The axes of the model variable an optimizer slot was made from, or None."""
        if "/" not in variable.path:
            return None
        stem = variable.path.split("/", 1)[1]
        for key in _slot_stems(stem):
            placement = self._by_slot_stem.get(key)
            if placement is not None and placement.shape == tuple(variable.shape):
                return placement.axes
        return None

    def axes_for(self, variable: Any, *, unknown: str | None = None) -> tuple[Axis, ...]:
        """Mesh axes per dimension of `variable` (a model, optimizer or metric variable).

        Model variables get their planned axes; an optimizer slot gets the
        axes of the variable it was made from (same shape); a scalar (step
        counter, learning rate, metric total) is replicated.

        Args:
            variable: The variable.
            unknown: Overrides the plan's `unknown` for this call.

        Raises:
            UnplannedVariableError: Any other variable, unless `unknown`
                (or the plan's) is "replicate". The plan never replicates a
                variable silently: a rebuilt model's generated names differ
                from the plan's, and `plan.bind(model)` maps them.
        """
        placement = self._by_path_shape.get((variable.path, tuple(int(d) for d in variable.shape)))
        if placement is not None:
            return placement.axes
        axes = self.slot_axes(variable)
        if axes is not None:
            return axes
        if len(variable.shape) == 0 or (unknown or self.unknown) == "replicate":
            return (None,) * len(variable.shape)
        raise UnplannedVariableError(
            f"Variable {variable.path!r} (shape {tuple(variable.shape)}) has no placement in this "
            "layout plan. Fix: for another instance of the planned architecture (generated layer "
            "names differ), use plan.bind(model); for another model, plan it with "
            "shardckpt.auto_layout; or pass unknown='replicate' to replicate what the plan does "
            f"not know. Received: variable={variable.path!r}"
        )

    def sharding_for(self, variable: Any) -> NamedSharding:
        """The `jax.sharding.NamedSharding` of `variable` under this plan (see `axes_for`)."""
        return NamedSharding(self.mesh.backend_mesh, PartitionSpec(*self.axes_for(variable)))

    # -- Keras export ----------------------------------------------------------
    def layout_map(self) -> kd.LayoutMap:
        """A `keras.distribution.LayoutMap` with one exact key per variable.

        Keys are `re.escape(path)`, so Keras' `re.fullmatch` lookup matches
        exactly one variable and never two. Keys for the LoRA factors that
        `enable_lora` would add beside a kernel or embedding table place them
        with it when they are created (`layout.lora`). The layer outputs of
        `gathered_outputs` get an activation layout (batch axis only) under
        `<layer path>/output`, the key Keras' `Layer.__call__` looks up.

        Exact keys fit the variable paths of the model planned (or bound).
        A model built anew gets other generated names (`dense_3` for
        `dense`), which these keys do not match, and Keras' `ModelParallel`
        replicates a variable no key matches without a word: for a model
        built after the plan, use `distribution()`, which places it by
        structure and refuses what it does not know.
        """
        layout_map = kd.LayoutMap(self.mesh)
        placed: dict[str, tuple[Any, ...]] = {}

        def put(key: str, axes: tuple[Any, ...]) -> None:
            # Two variables may share a path (see `axes_for`): one key places both, if alike.
            if key in placed:
                if placed[key] != axes:
                    raise LayoutError(
                        f"Two variables share the path {key!r} and this plan places them differently "
                        f"({placed[key]} and {axes}); Keras places variables by path, so no LayoutMap "
                        "can place them apart. Fix: give the layers of each sub-model their own names, "
                        f"or place both alike. Received: path={key!r}"
                    )
                return
            placed[key] = axes
            layout_map[key] = _keras.tensor_layout(axes, self.mesh)

        for p in self.placements:
            put(re.escape(p.path), p.axes)
        # LoRA factors `enable_lora` may create later, split with their base weight.
        for path, axes in lora_layout(self.placements):
            put(re.escape(path), axes)
        by_key = {p.key: p for p in self.placements}
        for key in self.gathered_outputs:
            owner = re.escape(by_key[key].path.rsplit("/", 1)[0]) + "/output"
            if owner not in placed:
                placed[owner] = (self.batch_axis,)
                layout_map[owner] = kd.TensorLayout((self.batch_axis,), self.mesh)
        return layout_map

    def distribution(self, *, auto_shard_dataset: bool = True) -> kd.ModelParallel:
        """A `keras.distribution.ModelParallel` that places variables by this plan.

        It places any instance of the planned architecture, built under it
        after the plan was made (generated layer names may differ), and
        raises `UnplannedVariableError` for a layer's variable the plan does
        not know, instead of replicating it
        (`shardckpt.layout.distribution.PlannedDistribution`).

        Args:
            auto_shard_dataset: Passed to Keras (False for multi-process
                input pipelines that shard themselves).
        """
        return PlannedDistribution(self, auto_shard_dataset=auto_shard_dataset)

    # -- memory --------------------------------------------------------------
    def split_factor(self, axes: Sequence[Axis]) -> int:
        """Devices one variable placed on `axes` is split over."""
        sizes = dict(zip(self.mesh.axis_names, self.mesh.shape))
        return math.prod(sizes[a] for a in flat_axes(axes))

    def bytes_per_device(self, optimizer: str | keras.optimizers.Optimizer | None = None) -> int:
        """Bytes of variables on the most loaded device.

        Args:
            optimizer: None, or an optimizer name / instance whose slots are
                added (e.g. "adam": two slots per trainable variable, each
                sharded like its variable; step and learning rate ignored).
                Adafactor's factored second moments, which Keras makes with
                no layout, count whole on every device; Muon's velocity
                counts for the variables it updates with AdamW
                (`shardckpt.layout.memory.slots_for`).

        Returns:
            Bytes on one device (all devices hold the same, since every split
            divides evenly).
        """
        total = 0
        for p in self.placements:
            slots = self._slots(optimizer, p)
            piece = p.nbytes // self.split_factor(p.axes)
            total += piece * (1 + slots.sharded) + slots.replicated_bytes()
        return total

    @staticmethod
    def _slots(optimizer: Any, placement: Placement) -> Slots:
        """What `optimizer` keeps for the variable of `placement` (nothing for a frozen one)."""
        if optimizer is None or not placement.trainable:
            return Slots(0)
        return slots_for(optimizer, placement.path, placement.shape, placement.dtype)

    def shard_devices(self) -> int:
        """Devices a perfect split spreads the parameters over.

        The model axis; with FSDP, the whole mesh (the batch axis splits
        parameters too). Replicas along a batch axis without FSDP are copies
        by design, not imbalance.
        """
        sizes = dict(zip(self.mesh.axis_names, self.mesh.shape))
        return math.prod(self.mesh.shape) if self.fsdp else sizes[self.model_axis]

    def balance(self, optimizer: Any = None) -> float:
        """The most loaded device against a perfect split (1.0: perfect).

        `bytes_per_device(optimizer)` divided by the total bytes (with the
        optimizer's slots) over `shard_devices()`.
        """
        total = 0
        for p in self.placements:
            # Replicated slots (Adafactor's factors) counted once: a perfect split would split them too.
            slots = self._slots(optimizer, p)
            total += p.nbytes * (1 + slots.sharded) + slots.replicated_bytes()
        if not total:
            return 1.0
        return self.bytes_per_device(optimizer) / (total / self.shard_devices())

    def sharded_fraction(self) -> float:
        """Share of parameter bytes split across devices (each device holds a part, not all).

        A variable counts when the mesh axes it is placed on span more than
        one device (`split_factor`): a placement over an axis of size 1 (the
        model axis of a data-parallel `(8, 1)` mesh) leaves every device the
        whole variable, and FSDP's batch axis splits one.
        """
        total = sum(p.nbytes for p in self.placements)
        split = sum(p.nbytes for p in self.placements if self.split_factor(p.axes) > 1)
        return split / total if total else 0.0

    # -- reports ---------------------------------------------------------------
    def explain(self) -> Any:
        """The plan as a table: path, shape, dtype, axes, bytes per device, why.

        `print(plan.explain())` prints it as text (`str()` renders it, at the
        terminal's width on a terminal, unfolded otherwise); it is also a
        `rich.table.Table`, so `rich.print(plan.explain())` shows it in colour.
        """
        from shardckpt.layout.table import explain_table

        return explain_table(self)

    def __str__(self) -> str:
        return str(self.explain())

    def validate(self, model: Any = None) -> list[str]:
        """Problems with this plan, one line each (empty: none).

        Checks every placement (axes are mesh axes, one per dimension, each
        dividing its dimension, no axis used twice) and, given `model`, that
        every model variable has a placement of its shape and nothing extra;
        lists `problems` found while planning (layout rules that place no
        variable).
        """
        problems = list(self.problems)
        sizes = dict(zip(self.mesh.axis_names, self.mesh.shape))
        seen: set[str] = set()
        for p in self.placements:
            if p.path in seen and self._by_path[p.path].axes != p.axes:
                problems.append(f"{p.path}: two variables share this path, placed differently")
            seen.add(p.path)
            if len(p.axes) != len(p.shape):
                problems.append(f"{p.path}: {len(p.axes)} axes for a rank-{len(p.shape)} variable")
                continue
            used = flat_axes(p.axes)
            if len(used) != len(set(used)):
                problems.append(f"{p.path}: mesh axis used twice in {p.axes}")
            for dim, (size, axis) in enumerate(zip(p.shape, p.axes)):
                names = flat_axes((axis,))
                if not names:
                    continue
                if any(a not in sizes for a in names):
                    problems.append(f"{p.path}: unknown mesh axis {axis!r} (mesh axes: {tuple(sizes)})")
                elif size % math.prod(sizes[a] for a in names):
                    problems.append(f"{p.path}: dim {dim} ({size}) is not divisible by axis {axis!r}")
        if model is not None:
            paths = {}
            for v in model.variables:
                paths[(v.path, tuple(v.shape))] = v.path
            for path, shape in paths:
                if path not in self._by_path:
                    problems.append(f"{path}: model variable has no placement")
                elif (path, shape) not in self._by_path_shape:
                    problems.append(f"{path}: model shape {shape}, plan shape {self._by_path[path].shape}")
            for path in self._by_path.keys() - set(paths.values()):
                problems.append(f"{path}: placement matches no model variable")
        return problems

    # -- JSON ----------------------------------------------------------------
    def to_json(self) -> str:
        """The plan as JSON (mesh shape and axis names, not device ids).

        Each placement carries its structural key, so the JSON applies to a
        model built in another process: `LayoutPlan.from_json(text).bind(model)`
        (`load_sharded` and `parallelize` bind by themselves).
        """
        return json.dumps(
            {
                "format": _FORMAT,
                "mesh": {"shape": list(self.mesh.shape), "axis_names": list(self.mesh.axis_names)},
                "model_axis": self.model_axis,
                "batch_axis": self.batch_axis,
                "unknown": self.unknown,
                "fsdp": self.fsdp,
                "notes": list(self.notes),
                "gathered_outputs": list(self.gathered_outputs),
                "problems": list(self.problems),
                "placements": [
                    {**dataclasses.asdict(p), "shape": list(p.shape), "axes": [axis_json(a) for a in p.axes]}
                    for p in self.placements
                ],
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str, *, devices: Sequence[Any] | None = None) -> LayoutPlan:
        """Reads a plan written by `to_json`, on `devices` (default: all devices).

        Raises:
            LayoutError: The text is not a plan, or the mesh needs a different
                number of devices than are given.
        """
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise LayoutError(f"Not a layout plan: invalid JSON ({err}).") from err
        if not isinstance(data, dict) or data.get("format") not in _READABLE:
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise LayoutError(
                f"Not a layout plan: expected format {_FORMAT!r}, found {found!r}. "
                "Fix: pass the text written by LayoutPlan.to_json()."
            )
        shape = tuple(data["mesh"]["shape"])
        pool = list(devices) if devices is not None else jax.devices()
        check_device_count(
            shape, len(pool), what=f"The plan's mesh {shape}",
            fix="re-plan for these devices with shardckpt.auto_layout.",
        )
        mesh = kd.DeviceMesh(shape, data["mesh"]["axis_names"], np.asarray(pool).reshape(shape))
        placements = [
            Placement(**{**p, "shape": tuple(p["shape"]), "axes": tuple(axis_from_json(a) for a in p["axes"])})
            for p in data["placements"]
        ]
        return cls(
            mesh, placements, model_axis=data["model_axis"], batch_axis=data["batch_axis"],
            unknown=data.get("unknown"), notes=data.get("notes", ()), fsdp=data.get("fsdp", False),
            gathered_outputs=data.get("gathered_outputs", ()), problems=data.get("problems", ()),
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, LayoutPlan):
            return NotImplemented
        return (
            self.placements == other.placements
            and tuple(self.mesh.shape) == tuple(other.mesh.shape)
            and tuple(self.mesh.axis_names) == tuple(other.mesh.axis_names)
            and (self.model_axis, self.batch_axis) == (other.model_axis, other.batch_axis)
            and (self.unknown, self.fsdp) == (other.unknown, other.fsdp)
            and self.gathered_outputs == other.gathered_outputs
        )

    def __repr__(self) -> str:
        return (
            f"LayoutPlan({len(self.placements)} variables, mesh="
            f"{dict(zip(self.mesh.axis_names, self.mesh.shape))}, "
            f"{self.sharded_fraction():.1%} of bytes split)"
        )


def _slot_stems(stem: str) -> list[str]:
    """Candidate variable stems of a slot name `<stem>_<slot name>`, longest first."""
    parts = stem.split("_")
    return ["_".join(parts[:k]) for k in range(len(parts) - 1, 0, -1)]

