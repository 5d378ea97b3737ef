"""`plan.distribution()` gives each rebuilt variable the layout planned for its counterpart.

Two same-shape layers of one class split differently share a path pattern
once Keras' generated counters are dropped; a rebuild's counters are
shifted (`dense_3` where the plan has `dense`). The counterpart is found by
the names a user gave (whole, counters included), then by rank under the
parent; where neither tells, the distribution warns instead of guessing
silently.
"""

from __future__ import annotations

import dataclasses
import warnings

import keras
import pytest
from jax.sharding import PartitionSpec

from shardckpt.layout import LayoutPlan, auto_layout

COLUMNS, ROWS = (None, "model"), ("model", None)


def _plan(model: keras.Model, axes: list[tuple]) -> LayoutPlan:
    """`auto_layout(model)` with the 2-D kernels, in weight order, placed on `axes`."""
    plan = auto_layout(model, (1, 8))
    kernels = iter(axes)
    placements = [
        dataclasses.replace(p, axes=next(kernels)) if len(p.shape) == 2 else p for p in plan.placements
    ]
    assert {p.axes for p in placements if len(p.shape) == 2} == set(axes), "the kernels are placed differently"
    return LayoutPlan(plan.mesh, placements, model_axis=plan.model_axis, batch_axis=plan.batch_axis)


def _rebuild_under(plan: LayoutPlan, build) -> keras.Model:
    keras.distribution.set_distribution(plan.distribution())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning here would mean a counterpart was not known
        return build()


def _assert_placed_as_planned(model: keras.Model, plan: LayoutPlan) -> None:
    bound = plan.bind(model)  # by structure, exact
    for v in model.weights:
        assert v.value.sharding.spec == PartitionSpec(*bound.placement(v.path).axes), v.path


def _two_dense(names=(None, None)) -> keras.Model:
    inputs = keras.Input((16,))
    hidden = keras.layers.Dense(16, name=names[0])(inputs)
    return keras.Model(inputs, keras.layers.Dense(16, name=names[1])(hidden))


@pytest.mark.parametrize("clear_session", [False, True], ids=["counters-shifted", "counters-collide"])
def test_rebuilt_same_shape_layers_get_their_counterparts_layout(clear_session):
    first = _two_dense()
    plan = _plan(first, [COLUMNS, ROWS])
    if clear_session:
        # Counters restart: the rebuild's `dense_1` is the counterpart of the plan's `dense`,
        # and its `dense_2` that of the plan's `dense_1`.
        keras.backend.clear_session()
    else:
        keras.layers.Dense(16).build((None, 16))
    keras.layers.Dense(3)
    second = _rebuild_under(plan, _two_dense)
    expected = ["dense_1/kernel", "dense_2/kernel"] if clear_session else ["dense_4/kernel", "dense_5/kernel"]
    assert [v.path for v in second.weights if len(v.shape) == 2] == expected
    _assert_placed_as_planned(second, plan)


def test_user_names_with_counters_stay_whole():
    """`proj_2` is constructed before `proj_1`: neither takes the other's layout."""

    def build():
        return keras.Sequential(
            [keras.Input((16,)), keras.layers.Dense(16, name="proj_2"), keras.layers.Dense(16, name="proj_1")]
        )

    plan = _plan(build(), [COLUMNS, ROWS])
    second = _rebuild_under(plan, build)
    assert second.weights[0].path.endswith("proj_2/kernel")
    _assert_placed_as_planned(second, plan)


class Block(keras.layers.Layer):
    """A subclassed layer with user-named sublayers."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = keras.layers.Dense(16, name="inner")
        self.outer = keras.layers.Dense(16, name="outer")

    def call(self, x):
        return self.outer(self.inner(x))


class Pair(keras.layers.Layer):
    """Two unnamed Blocks, built in the other order than constructed."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.first = Block()
        self.second = Block()

    def call(self, x):
        return self.first(self.second(x))


def _pair() -> keras.Model:
    inputs = keras.Input((16,))
    return keras.Model(inputs, Pair()(inputs))


def test_user_named_sublayers_are_found_under_their_parent_by_rank():
    first = _pair()
    plan = _plan(first, [ROWS, COLUMNS, COLUMNS, ROWS])
    Block()
    keras.layers.Dense(3)
    second = _rebuild_under(plan, _pair)
    assert "pair_1/block_" in second.weights[0].path
    _assert_placed_as_planned(second, plan)


def test_a_counterpart_no_structure_tells_is_warned_once():
    """Two top-level Blocks built in the other order than constructed, with no parent open."""

    def build():
        inputs = keras.Input((16,))
        outer, inner = Block(), Block()
        return keras.Model(inputs, outer(inner(inputs)))

    plan = _plan(build(), [ROWS, COLUMNS, COLUMNS, ROWS])
    keras.distribution.set_distribution(plan.distribution())
    with pytest.warns(UserWarning, match=r"cannot tell which planned variable 'block_2/inner/kernel'") as caught:
        build()
    assert len([w for w in caught if "cannot tell" in str(w.message)]) == 1
