"""`PlannedDistribution`: the Keras distribution of a `LayoutPlan`, matched by structure.

Keras asks a distribution where each new variable goes
(`get_variable_layout`) while the model is being built, before the model
exists as a whole, so a variable's structural key (`shardckpt.structure`)
cannot be computed yet. A `ModelParallel` over the plan's exact paths then
misses every variable of a second instance of the architecture (Keras
names unnamed layers by a process-wide counter: `mixtral_sparse_moe_block_2`
where the plan has `mixtral_sparse_moe_block`) and replicates it without a
word. This distribution resolves a variable the way `LayoutPlan.bind` pairs
keys: by its path without Keras' generated counters (the layer classes
along the path, the names a user gave, whole, and the variable's name),
then its shape. Where placements of that pattern and shape differ (two
same-shape layers of one class, split differently), the counterpart is the
planned variable of the same rank: at each level of the path, the layer's
rank by generated counter among its parent's layers of its class (Keras
numbers them in construction order, in every build); for a layer built
with no parent open (a functional model's), the order in which the rebuild
creates them. When that order contradicts the counters (a layer built
before one constructed earlier), the counterpart is not known: the
distribution warns once, naming the variables. A layer's
variable it cannot place is an `UnplannedVariableError`, never replicated;
optimizer slots follow their variable (Keras passes the variable's layout)
and metric variables are replicated, as Keras does. The state of a random
seed generator the plan does not know (a keras-hub sampler's, made when a
causal LM is compiled after its load) is replicated too: it is a counter,
not a parameter, and every device must draw the same numbers from it.

`load_sharded` under this distribution binds the plan to the loaded model
exactly (`for_model`: `plan.bind`), so the resolution above decides only
where values are created while a model is built.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

from keras import distribution as kd
from keras import layers, metrics, optimizers, random

from shardckpt import _keras, userwarn
from shardckpt.errors import UnplannedVariableError
from shardckpt.layout.lora import lora_layout
from shardckpt.layout.placement import Axis, Placement
from shardckpt.structure import is_explicitly_named

if TYPE_CHECKING:
    from shardckpt.layout.plan import LayoutPlan

# Keras makes generated names unique by appending `_<n>` to each name.
_COUNTERS = re.compile(r"_(\d+)(?=/|$)")


# Objects whose variables are state, not parameters: a variable one of them
# creates (the innermost name scope) that the plan does not know is
# replicated. A seed generator holds a (seed, counter) pair every device must
# share to draw the same numbers; splitting it is meaningless, and one made
# after planning (a sampler built by `compile()`) has nothing in the plan.
_REPLICATED_STATE: tuple[type, ...] = (random.SeedGenerator,)


_COUNTER = re.compile(r"_(\d+)$")


def generated_pattern(path: str, explicit: Collection[str] = ()) -> str:
    """`path` without Keras' uniquifying counters: the same for every build of a model.

    Args:
        path: A variable path (names joined by "/").
        explicit: Names a user gave (`structure.is_explicitly_named`): a
            counter in them is part of the name (`proj_1` stays `proj_1`).
    """
    return "/".join(part if part in explicit else _COUNTER.sub("", part) for part in path.split("/"))


def _counter(name: str) -> int:
    """The generated counter of a name (`dense_3`: 3; `dense`: 0, Keras' first)."""
    found = _COUNTER.search(name)
    return int(found.group(1)) if found else 0


def _creation_order(path: str) -> tuple[int, ...]:
    return tuple(int(n) for n in _COUNTERS.findall(path))


def _plan_ranks(placements: Sequence[Placement]) -> dict[str, tuple[tuple[int, int], ...]]:
    """`{path: ((rank, siblings) per layer level)}`: each level's name ranked by counter
    among the names of the same pattern under the same parent path in the plan."""
    siblings: dict[tuple[str, str], set[str]] = {}
    for p in placements:
        parts = p.path.split("/")
        for i in range(len(parts) - 1):
            siblings.setdefault(("/".join(parts[:i]), _COUNTER.sub("", parts[i])), set()).add(parts[i])
    ordered = {group: sorted(names, key=_counter) for group, names in siblings.items()}
    out = {}
    for p in placements:
        parts = p.path.split("/")
        ranks = []
        for i in range(len(parts) - 1):
            names = ordered[("/".join(parts[:i]), _COUNTER.sub("", parts[i]))]
            ranks.append((names.index(parts[i]), len(names)))
        out[p.path] = tuple(ranks)
    return out


def _layer_chain(parts: list[str], callers: list[Any]) -> list[Any]:
    """The layer object of each name of a variable's path, None where not known.

    The open name scopes give the outer layers; a sublayer built by Keras
    tracing its parent's `call` gets its variables initialised after its own
    scope closed, so the rest is found by name among each layer's direct
    sublayers.
    """
    chain: list[Any] = [None] * (len(parts) - 1)
    for caller in callers:
        name = getattr(caller, "name", None)
        if name in parts[:-1]:
            chain[parts.index(name)] = caller
    for i in range(1, len(chain)):
        flatten = getattr(chain[i - 1], "_flatten_layers", None)
        if chain[i] is None and flatten is not None:
            chain[i] = next((c for c in flatten(include_self=False, recursive=False) if c.name == parts[i]), None)
    return chain


def _rank_under_parent(parent: Any, layer: Any) -> tuple[int, int] | None:
    """`(rank, count)` of `layer` among `parent`'s direct sublayers of its generated name, by counter."""
    flatten = getattr(parent, "_flatten_layers", None)
    if flatten is None:
        return None
    base = _COUNTER.sub("", layer.name)
    same = [
        c for c in flatten(include_self=False, recursive=False)
        if not is_explicitly_named(c) and _COUNTER.sub("", c.name) == base
    ]
    same.sort(key=lambda c: _counter(c.name))
    index = next((i for i, c in enumerate(same) if c is layer), None)
    return None if index is None else (index, len(same))


def _quantizable(layer: Any) -> bool:
    """Whether `layer`'s class implements Keras' `quantized_build` (Dense, EinsumDense, Embedding).

    Only such a layer adds variables once built, through `quantize()`. A built
    layer is not enough: Keras' recurrent cells call `Layer.build` (which
    marks them built) before creating their kernels, so a cell of another
    architecture would be mistaken for a quantization.
    """
    own = getattr(type(layer), "quantized_build", None)
    return own is not None and own is not layers.Layer.quantized_build


class PlannedDistribution(kd.ModelParallel):
    """A `keras.distribution.ModelParallel` that places variables by a `LayoutPlan`.

    Made by `LayoutPlan.distribution()`. Its `layout_map` holds the plan's
    exact paths (as Keras' `ModelParallel` reads them); `get_variable_layout`
    also places another instance of the planned architecture (see the
    module docstring) and refuses what the plan does not know.

    Args:
        plan: The plan.
        auto_shard_dataset: Passed to Keras.

    Attributes:
        plan: The plan (`load_sharded` binds it to the model it loads).
    """

    def __init__(self, plan: LayoutPlan, *, auto_shard_dataset: bool = True) -> None:
        super().__init__(
            layout_map=plan.layout_map(), batch_dim_name=plan.batch_axis, auto_shard_dataset=auto_shard_dataset
        )
        self.plan = plan
        self._by_pattern: dict[str, list[Placement]] = {}
        for p in sorted(plan.placements, key=lambda p: _creation_order(p.path)):
            self._by_pattern.setdefault(generated_pattern(p.path), []).append(p)
        self._outputs = {
            generated_pattern(key): layout
            for key, layout in self._layout_map.items()
            if key.endswith("/output")
        }
        # LoRA factors `enable_lora` may create later (`layout.lora`): split with their base weight.
        self._lora = {generated_pattern(path): axes for path, axes in lora_layout(plan.placements)}
        self._ranks = _plan_ranks(plan.placements)
        # Per group of placements that differ and that structure cannot tell
        # apart (layers built with no parent open): the counters of the
        # variables placed so far in this build, in the order they came.
        self._arrivals: dict[tuple[Any, ...], list[tuple[int, ...]]] = {}
        self._warned = False

    def for_model(self, model: Any) -> PlannedDistribution:
        """This distribution with its plan bound to `model` (`LayoutPlan.bind`: exact by structure).

        Raises:
            UnplannedVariableError: see `LayoutPlan.bind`.
        """
        bound = self.plan.bind(model)
        if bound is self.plan:
            return self
        return PlannedDistribution(bound, auto_shard_dataset=self.auto_shard_dataset)

    def get_variable_layout(self, variable: Any) -> Any:
        """The `TensorLayout` of `variable` (Keras calls this when it creates one).

        Raises:
            UnplannedVariableError: a layer's variable the plan has no
                placement for (another architecture), unless the plan was
                made with `unknown="replicate"`. A seed generator's state
                the plan does not know is replicated, not refused.
        """
        if getattr(variable, "_layout", None) is not None:
            return variable._layout
        return _keras.tensor_layout(self._axes(variable), self.device_mesh)

    def get_tensor_layout(self, path: str) -> Any:
        """Activation layouts (`<layer path>/output`), found also under other generated names."""
        found = self._layout_map[path]
        if found is None:
            found = self._outputs.get(generated_pattern(re.escape(path)))
        return found

    def _axes(self, variable: Any) -> tuple[Axis, ...]:
        shape = tuple(int(d) for d in variable.shape)
        callers = _keras.name_scope_callers()
        if any(isinstance(c, optimizers.Optimizer | metrics.Metric) for c in callers):
            # Not the model's: slots follow their variable, the rest is replicated.
            return self.plan.axes_for(variable, unknown="replicate")
        pattern = generated_pattern(variable.path)
        candidates = self._candidates(variable, callers)
        if candidates:
            if len({p.axes for p in candidates}) == 1:
                return candidates[0].axes
            return self._counterpart(variable, callers, candidates).axes
        lora = self._lora.get(pattern)
        if lora is not None and len(lora) == len(shape):
            return lora
        if not shape or self.plan.unknown == "replicate":
            return (None,) * len(shape)
        if callers and isinstance(callers[-1], _REPLICATED_STATE):
            return (None,) * len(shape)
        planned = self._by_pattern.get(pattern)
        found = f"the plan has it with shape {planned[0].shape}" if planned else "the plan has no variable there"
        layer: Any = callers[-1] if callers else None
        if getattr(layer, "built", False) and _quantizable(layer):
            # A built layer adding variables: `quantize()` after the plan (its scales, an int4
            # kernel's packed shape). Keras has already dropped the layer's float kernel.
            raise UnplannedVariableError(
                f"Variable {variable.path!r} (shape {shape}) has no placement in the layout plan "
                f"({found}): layer {layer.name!r} was already built, so it comes from "
                "model.quantize() after the plan was made (auto_layout / parallelize), and the "
                "plan knows only the float variables. The layer's quantization stopped partway. "
                "Fix: rebuild the model, quantize it, then plan it (shardckpt.parallelize(model, "
                "mesh) or auto_layout); or build it with the quantized policy (e.g. "
                "dtype='int8_from_float32') under lazy_init and load the quantized checkpoint. "
                f"Received: variable={variable.path!r}"
            )
        raise UnplannedVariableError(
            f"Variable {variable.path!r} (shape {shape}) has no placement in the layout plan "
            f"({found}): the model being built is not the planned architecture, and Keras would "
            "replicate it on every device. Fix: plan this model with shardckpt.auto_layout(model, "
            "mesh) and set that plan's distribution, or make the plan with unknown='replicate'. "
            f"Received: variable={variable.path!r}"
        )

    def _candidates(self, variable: Any, callers: list[Any]) -> list[Placement]:
        """Placements of the variable's pattern and shape whose user-given names are its own."""
        parts = variable.path.split("/")
        chain = _layer_chain(parts, callers)
        explicit = [i for i, layer in enumerate(chain) if layer is not None and is_explicitly_named(layer)]
        # The variable's own name: `kernel` is given, `variable_3` (an unnamed weight) is not.
        if is_explicitly_named(variable):
            explicit.append(len(parts) - 1)
        shape = tuple(int(d) for d in variable.shape)
        return [
            p for p in self._by_pattern.get(generated_pattern(variable.path), ())
            if p.shape == shape and all(p.path.split("/")[i] == parts[i] for i in explicit)
        ]

    def _counterpart(self, variable: Any, callers: list[Any], candidates: list[Placement]) -> Placement:
        """The planned counterpart among same-pattern placements that differ (see the module docstring)."""
        parts = variable.path.split("/")
        chain = _layer_chain(parts, callers)
        unranked: list[int] = []
        ranked: list[tuple[int, int]] = []
        for i in range(len(parts) - 1):
            if chain[i] is not None and is_explicitly_named(chain[i]):
                continue  # matched by name already
            parent, layer = (chain[i - 1], chain[i]) if i > 0 else (None, None)
            rank = _rank_under_parent(parent, layer) if parent is not None and layer is not None else None
            if rank is None:
                unranked.append(i)
                continue
            ranked.append(rank)
            candidates = [p for p in candidates if self._ranks[p.path][i] == rank]
        if len({p.axes for p in candidates}) == 1:
            return candidates[0]
        if not candidates:
            self._warn(variable, "the plan has no variable of its rank under its parent")
            return self._by_pattern[generated_pattern(variable.path)][0]
        # Left: levels built with no parent open. Keras numbers layers as they
        # are constructed; a rebuild that builds them in that order meets them
        # in the plan's order.
        group = (generated_pattern(variable.path), tuple(variable.shape), tuple(ranked))
        seen = self._arrivals.setdefault(group, [])
        order = tuple(_counter(parts[i]) for i in unranked)
        if seen and order <= seen[-1]:
            self._warn(variable, "it was built before a layer constructed earlier (the build order "
                       "is not the construction order)")
        index = len(seen)
        seen.append(order)
        if len(seen) == len(candidates):
            seen.clear()  # a whole instance placed; the next build starts again
        return candidates[index % len(candidates)]

    def _warn(self, variable: Any, why: str) -> None:
        if self._warned:
            return
        self._warned = True
        userwarn.warn(
            f"plan.distribution() cannot tell which planned variable {variable.path!r} corresponds "
            f"to: {why}, and same-shape variables of its pattern are placed differently in the plan. "
            "It and others like it may get another's layout. Fix: build the model under "
            "shardckpt.lazy_init() and load it with shardckpt.load_sharded(..., layout=plan), or "
            "place it with shardckpt.parallelize(model, plan.bind(model)) (both match by structure, "
            f"exactly). Received: variable={variable.path!r}"
        )
