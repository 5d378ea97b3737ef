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
along the path and the variable's name), then its shape, then, where
placements of that pattern and shape differ, its exact path or the order in
which Keras creates them (the order of the planned model). A layer's
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
from typing import TYPE_CHECKING, Any

from keras import distribution as kd
from keras import metrics, optimizers, random

from shardckpt import _keras
from shardckpt.errors import UnplannedVariableError
from shardckpt.layout.lora import lora_layout
from shardckpt.layout.placement import Axis, Placement

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


def generated_pattern(path: str) -> str:
    """`path` without Keras' uniquifying counters: the same for every build of a model."""
    return _COUNTERS.sub("", path)


def _creation_order(path: str) -> tuple[int, ...]:
    return tuple(int(n) for n in _COUNTERS.findall(path))


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
        # Variables already placed per (pattern, shape): the next one of a
        # group whose placements differ takes the next placement.
        self._taken: dict[tuple[str, tuple[int, ...]], int] = {}

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
        exact = self.plan.placement(variable.path)
        pattern = generated_pattern(variable.path)
        candidates = [p for p in self._by_pattern.get(pattern, ()) if p.shape == shape]
        if candidates:
            if len({p.axes for p in candidates}) == 1:
                return candidates[0].axes
            if exact is not None and exact.shape == shape:
                return exact.axes
            index = self._taken.get((pattern, shape), 0)
            self._taken[(pattern, shape)] = index + 1
            return candidates[index % len(candidates)].axes
        lora = self._lora.get(pattern)
        if lora is not None and len(lora) == len(shape):
            return lora
        if not shape or self.plan.unknown == "replicate":
            return (None,) * len(shape)
        if callers and isinstance(callers[-1], _REPLICATED_STATE):
            return (None,) * len(shape)
        planned = self._by_pattern.get(pattern)
        found = f"the plan has it with shape {planned[0].shape}" if planned else "the plan has no variable there"
        raise UnplannedVariableError(
            f"Variable {variable.path!r} (shape {shape}) has no placement in the layout plan "
            f"({found}): the model being built is not the planned architecture, and Keras would "
            "replicate it on every device. Fix: plan this model with shardckpt.auto_layout(model, "
            "mesh) and set that plan's distribution, or make the plan with unknown='replicate'. "
            f"Received: variable={variable.path!r}"
        )
