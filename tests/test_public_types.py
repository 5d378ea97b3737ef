"""Public signatures name real types (mypy checks their use inside the package)."""

from __future__ import annotations

import typing
from collections import abc
from typing import Literal

import keras
import numpy.typing as npt

import shardckpt
from shardckpt import types


def _hints(fn):
    return typing.get_type_hints(fn)


def test_model_layout_and_mesh_parameters_are_typed():
    kd = keras.distribution
    layout = types.PlanLike | kd.LayoutMap | kd.ModelParallel | kd.DataParallel | None
    mesh = kd.DeviceMesh | abc.Sequence[int] | tuple[abc.Sequence[int], abc.Sequence[str]]
    assert types.Layout == layout and types.Mesh == mesh

    hints = _hints(shardckpt.load_sharded)
    assert hints["model"] is keras.Model and hints["layout"] == layout
    hints = _hints(shardckpt.from_preset)
    assert hints["return"] is keras.Model and hints["layout"] == layout
    assert hints["mesh"] == mesh | Literal["auto"] | None and hints["cls"] == type[keras.Model] | None
    assert hints["dtype"] == npt.DTypeLike | None
    hints = _hints(shardckpt.auto_layout)
    assert hints["model"] is keras.Model and hints["mesh"] == mesh | Literal["auto"] | None
    hints = _hints(shardckpt.parallelize)
    assert hints["model"] is keras.Model and hints["mesh"] == mesh | Literal["auto"] | None
    hints = _hints(shardckpt.convert)
    assert hints["model"] == keras.Model | None and hints["layout"] == layout and hints["mesh"] == mesh | None
    assert _hints(shardckpt.LayoutPlan.bytes_per_device)["optimizer"] == str | keras.optimizers.Optimizer | None
    hints = _hints(shardckpt.restore_latest)
    assert hints["model"] is keras.Model and hints["data_iterator"] == types.StatefulIterator | None
    hints = _hints(shardckpt.export)
    assert hints["model"] is keras.Model and hints["dtype"] == npt.DTypeLike | None


def test_a_layout_plan_is_plan_like():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8)])
    plan = shardckpt.auto_layout(model, (1, 8))
    assert isinstance(plan, types.PlanLike)
    assert not isinstance(keras.distribution.LayoutMap(plan.mesh), types.PlanLike)
