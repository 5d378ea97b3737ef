"""Target shardings: what `layout=` means for `load_sharded` and `convert`.

Accepted forms, each turned into one function `variable -> TargetLayout`:
None (the active Keras distribution, else the variable's current sharding),
a `keras.distribution.Distribution`, a `keras.distribution.LayoutMap`, or a
plan object with `sharding_for(variable)` or `layout_map()` (a `LayoutPlan`
from `shardckpt.auto_layout`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from keras import distribution as kd

from shardckpt import _keras, userwarn
from shardckpt.errors import LayoutError, MeshMismatchError
from shardckpt.progress import some
from shardckpt.structure import lora_factor_paths
from shardckpt.types import Layout


@dataclasses.dataclass(frozen=True)
class TargetLayout:
    """Where one variable goes.

    Attributes:
        sharding: The JAX sharding of the restored array.
        keras_layout: The Keras `TensorLayout` to record on the variable, when
            the target came from a Keras distribution or layout map (Keras
            re-places later assigned values on it).
    """

    sharding: jax.sharding.Sharding
    keras_layout: Any = None


def resolve_layout(
    layout: Layout, *, unplaced: str = "first_device", references: Mapping[int, Any] | None = None
) -> Callable[[Any], TargetLayout]:
    """Returns `variable -> TargetLayout` for any accepted `layout` form.

    Args:
        layout: The `layout=` value.
        unplaced: With no `layout` and no active distribution, where a variable
            with no sharding yet (built under `lazy_init()`) goes:
            "first_device", or "raise" (`load_sharded` on a host of several
            devices: the model would compute on one device, and the next
            sharded step fails inside JAX on incompatible devices).
        references: `{id(slot): variable}` of the model's optimizer slots
            (`structure.slot_references`): under a distribution or a
            `LayoutMap`, a slot goes where its variable goes (see the module
            docstring).

    Raises:
        TypeError: `layout` is none of the accepted forms.
        LayoutError: from the returned function, for an unplaced variable
            when `unplaced="raise"`.
    """
    references = references or {}
    if layout is None:
        active = kd.distribution()
        if active is not None:
            return _slots_follow(_from_distribution(active), references)
        return _current if unplaced == "first_device" else _current_or_raise
    sharding_for = getattr(layout, "sharding_for", None)
    if sharding_for is not None:
        return lambda v: TargetLayout(sharding_for(v))
    if isinstance(layout, _keras.Distribution):
        return _slots_follow(_from_distribution(layout), references)
    if hasattr(layout, "layout_map") and callable(layout.layout_map):
        layout = layout.layout_map()
    if isinstance(layout, kd.LayoutMap):
        return _slots_follow(_from_layout_map(layout), references)
    raise TypeError(
        "layout must be None, a keras.distribution.Distribution or LayoutMap, or a "
        f"plan with layout_map() (shardckpt.auto_layout). Received: layout={layout!r}"
    )


def mesh_of(layout: Any) -> Any:
    """The `keras.distribution.DeviceMesh` a `layout=` value places on, or None."""
    if layout is None:
        return None
    for name in ("device_mesh", "mesh"):  # Distribution / LayoutMap; LayoutPlan
        mesh = getattr(layout, name, None)
        if mesh is not None:
            return mesh
    return None


def _ids(mesh: Any) -> list[int]:
    # Keras' DeviceMesh.devices holds names ("cpu:0"); its JAX mesh the devices.
    return [int(d.id) for d in np.asarray(mesh.backend_mesh.devices).reshape(-1)]


def _describe(mesh: Any) -> str:
    return f"{dict(zip(mesh.axis_names, mesh.shape))} on devices {_ids(mesh)}"


def _same(a: Any, b: Any) -> bool:
    return list(a.axis_names) == list(b.axis_names) and tuple(a.shape) == tuple(b.shape) and _ids(a) == _ids(b)


def check_mesh(layout: Layout, *, allow_other_mesh: bool = False) -> None:
    """Refuses a layout that would move the model off the mesh it runs on.

    Keras places every computation on the active distribution's mesh: a
    variable loaded onto another mesh (other devices, or a subset of them)
    makes the next step fail or silently move data across devices. Without an
    active distribution, a mesh of fewer devices than JAX has leaves the rest
    idle. Either is usually a mistake (a `LayoutMap` built for another mesh).

    Args:
        layout: The `layout=` value (see `resolve_layout`).
        allow_other_mesh: Load there anyway (on purpose: a model kept on a
            sub-mesh, e.g. beside another one).

    Raises:
        MeshMismatchError: naming both meshes and the fix.
    """
    mesh = mesh_of(layout)
    if mesh is None or allow_other_mesh:
        return
    active = kd.distribution()
    if active is not None and not _same(mesh, active.device_mesh):
        raise MeshMismatchError(
            f"The layout places variables on mesh {_describe(mesh)}, but the active Keras "
            f"distribution runs on {_describe(active.device_mesh)}: every variable would move "
            "off the mesh the model computes on. Fix: build the layout on the active "
            "distribution's mesh (keras.distribution.distribution().device_mesh), set the "
            "layout's distribution first, or pass allow_other_mesh=True to load there on purpose."
        )
    if active is None and len(_ids(mesh)) < jax.device_count():
        raise MeshMismatchError(
            f"The layout places variables on mesh {_describe(mesh)}, {len(_ids(mesh))} "
            f"of the {jax.device_count()} devices. Fix: build the mesh over every device "
            "(keras.distribution.DeviceMesh(shape, axes) with a shape whose product is "
            f"{jax.device_count()}), or pass allow_other_mesh=True to use only these on purpose."
        )


def _layout_map(layout: Layout) -> kd.LayoutMap | None:
    """The `LayoutMap` behind `layout=` (None: the active distribution's), or None where there is none."""
    if layout is None:
        layout = kd.distribution()
    layout_map = layout if isinstance(layout, kd.LayoutMap) else _keras.layout_map_of(layout)
    return layout_map if isinstance(layout_map, kd.LayoutMap) else None


_warned_unmatched: set[tuple[str, ...]] = set()


def warn_unmatched_keys(layout: Layout, model: Any) -> list[str]:
    """Warns once when keys of a user's `LayoutMap` match no variable of `model`.

    Keras looks a variable's path up in a `LayoutMap` exactly, then as
    `re.fullmatch` of each key: `"dense/kernel"` matches no variable of a
    `Sequential` model (its paths are `"sequential/dense/kernel"`), and Keras
    replicates every variable it finds no layout for, without a word. A key
    that places nothing is almost always such a mistake, so it is said.

    Args:
        layout: The `layout=` value; None reads the active distribution's map.
        model: The model being loaded.

    Returns:
        The keys that match no variable (warned about the first time only).
    """
    layout_map = _layout_map(layout)
    if layout_map is None:
        return []
    paths = [v.path for v in model.variables]
    # A LayoutPlan's map also places the LoRA factors `enable_lora` may add later: not a mistake.
    reserved = lora_factor_paths(paths)
    # "<layer path>/output" places a layer's output (Keras' `distribute_tensor` of activations):
    # it matches a layer, found here as a prefix of its variables' paths.
    layers = {"/".join(parts[:n]) for parts in (p.split("/") for p in paths) for n in range(1, len(parts))}
    unmatched = [
        key for key in layout_map
        if not any(p == key or re.fullmatch(key, p) for p in paths) and not any(re.fullmatch(key, r) for r in reserved)
        and not _places_a_layer_output(key, layers)
    ]
    if unmatched and tuple(unmatched) not in _warned_unmatched:
        _warned_unmatched.add(tuple(unmatched))
        userwarn.warn(
            f"LayoutMap key(s) {some([repr(k) for k in unmatched])} match no variable of model {model.name!r}: Keras matches a key against "
            f"the whole variable path (re.fullmatch), and replicates the variables it meant on every device. "
            f"This model's paths look like {paths[0]!r}. Fix: write the whole path, or a pattern such as "
            f"'.*{unmatched[0]}'."
        )
    return unmatched


def check_unambiguous_keys(layout: Layout, model: Any) -> None:
    """Refuses a `LayoutMap` (yours, or the active distribution's) where a variable path
    matches several keys.

    Keras looks a path up exactly, then as `re.fullmatch` of every key, and
    raises a bare `ValueError` for the first path two keys match, in the
    middle of placing variables. Here every such path is named at once,
    before anything is read.

    Args:
        layout: The `layout=` value; None reads the active distribution's map.
        model: The model being loaded.

    Raises:
        LayoutError: naming each path, the keys it matches and the fix.
    """
    layout_map = _layout_map(layout)
    if layout_map is None:
        return
    keys = list(layout_map)
    ambiguous = []
    for path in dict.fromkeys(v.path for v in model.variables):
        if path in keys:
            continue  # an exact key wins, as in Keras
        matched = [key for key in keys if re.fullmatch(key, path)]
        if len(matched) > 1:
            ambiguous.append(f"{path!r} matches {matched}")
    if ambiguous:
        raise LayoutError(
            f"{len(ambiguous)} variable path(s) match several LayoutMap keys, and Keras places a path by "
            f"one key only (an exact key first, else the one pattern that re.fullmatch-es it): "
            f"{some(ambiguous)}. Fix: narrow the patterns so that each path matches at most one "
            f"(e.g. anchor them on the layer name), or add the path itself as a key. "
            f"Received: keys={keys}"
        )


def _places_a_layer_output(key: str, layers: set[str]) -> bool:
    """Whether `key` is `<layer>/output` for one of `layers` (exactly, or as Keras' `re.fullmatch`)."""
    suffix = "/output"
    if not key.endswith(suffix):
        return False
    layer = key[: -len(suffix)]
    return layer in layers or any(re.fullmatch(layer, path) for path in layers)


def _current(variable: Any) -> TargetLayout:
    value, layout = _keras.current_value(variable), _keras.current_layout(variable)
    if value is not None and hasattr(value, "sharding"):
        return TargetLayout(value.sharding, layout)
    if layout is not None:
        return _from_keras_layout(layout)
    return TargetLayout(jax.sharding.SingleDeviceSharding(jax.local_devices()[0]))


def _current_or_raise(variable: Any) -> TargetLayout:
    value, layout = _keras.current_value(variable), _keras.current_layout(variable)
    if (value is not None and hasattr(value, "sharding")) or layout is not None:
        return _current(variable)
    raise LayoutError(
        f"Variable {variable.path!r} (shape {tuple(variable.shape)}) has no sharding yet (built under "
        f"lazy_init()), no layout= was given and no Keras distribution is set, on a host of "
        f"{jax.device_count()} devices: it would load onto one device, and a later sharded step fails "
        "on incompatible devices. Fix: pass layout= (shardckpt.auto_layout(model, mesh), a LayoutMap "
        "or a Distribution), or call keras.distribution.set_distribution(...) before building and "
        "loading the model (keras.distribution.DataParallel() to replicate it on every device)."
    )


def _from_keras_layout(layout: Any) -> TargetLayout:
    if isinstance(layout, kd.TensorLayout):
        return TargetLayout(layout.backend_layout, layout)
    return TargetLayout(layout)


def _slots_follow(
    layout_of: Callable[[Any], TargetLayout], references: Mapping[int, Any]
) -> Callable[[Any], TargetLayout]:
    """`layout_of`, with each optimizer slot placed as its variable (see the module docstring)."""
    if not references:
        return layout_of

    def follow(variable: Any) -> TargetLayout:
        return layout_of(references.get(id(variable), variable))

    return follow


def _from_distribution(dist: Any) -> Callable[[Any], TargetLayout]:
    def layout_of(variable: Any) -> TargetLayout:
        return _from_keras_layout(dist.get_variable_layout(variable))

    return layout_of


def _from_layout_map(layout_map: Any) -> Callable[[Any], TargetLayout]:
    mesh = layout_map.device_mesh
    if mesh is None:
        raise TypeError("The LayoutMap has no device_mesh; build it as LayoutMap(mesh).")

    def layout_of(variable: Any) -> TargetLayout:
        found = layout_map[variable.path]
        if found is None:
            replicated = kd.TensorLayout([None] * len(variable.shape), mesh)
            return TargetLayout(replicated.backend_layout, replicated)
        if found.device_mesh is None:
            found.device_mesh = mesh
        return _from_keras_layout(found)

    return layout_of

