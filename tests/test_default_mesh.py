"""No mesh given: `from_preset` and `parallelize` plan with mesh="auto", say so in one log line,
and the plan they pick at published sizes is balanced with two all-reduces per block."""

from __future__ import annotations

import logging
import os
import sys

import keras
import numpy as np
import pytest

import shardckpt
from shardckpt.presets import load as preset_load

keras_hub = pytest.importorskip("keras_hub")
PUBLISHED = os.environ.get("SHARDCKPT_PUBLISHED_CONFIGS", os.path.join(os.path.dirname(__file__), "published_configs.json"))
needs_published = pytest.mark.skipif(not os.path.exists(PUBLISHED), reason="published_configs.json not present")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
import layout_real  # noqa: E402

# The meshes the issue measured for the default: GPT-2 base data parallel (its
# vocabulary of 50257 divides by no model axis), Qwen2.5-7B balanced on (2, 4).
CHOSEN = {"gpt2-base": (8, 1), "qwen2.5-7b": (2, 4)}


def _configs() -> dict:
    if not os.path.exists(PUBLISHED):
        return {}
    return layout_real.load_configs(PUBLISHED)


def _one_line(caplog: pytest.LogCaptureFixture, caller: str) -> str:
    lines = [r.getMessage() for r in caplog.records if r.name == "shardckpt" and r.getMessage().startswith(caller)]
    assert len(lines) == 1, lines
    assert "\n" not in lines[0]
    return lines[0]


@needs_published
@pytest.mark.parametrize("name", sorted(CHOSEN))
def test_default_mesh_of_from_preset_and_parallelize_at_published_sizes(name, caplog):
    caplog.set_level(logging.INFO, logger="shardckpt")
    shape = CHOSEN[name]
    config = _configs()[name]
    keras.backend.clear_session()
    model = layout_real.build(config)
    # from_preset's planning step, on the model it built lazily (a published
    # size has no weights here to load).
    distribution = preset_load._distribution(model, None, None)
    assert tuple(distribution.device_mesh.shape) == shape
    line = _one_line(caplog, "from_preset")
    assert f"mesh chosen for 8 devices: {shape}" in line and "mesh=(1, 8)" in line
    assert ("data parallel" if shape[1] == 1 else "the fewest bytes per device among the clean shapes") in line
    keras.distribution.set_distribution(None)
    plan = shardckpt.parallelize(model)  # unloaded variables: the layout only
    assert tuple(plan.mesh.shape) == shape
    assert f"mesh chosen for 8 devices: {shape}" in _one_line(caplog, "parallelize")
    # Explicit (1, n) stays available and logs nothing.
    caplog.clear()
    assert tuple(shardckpt.parallelize(model, (1, 8)).mesh.shape) == (1, 8)
    assert not [r for r in caplog.records if r.getMessage().startswith("parallelize")]
    keras.distribution.set_distribution(None)


@needs_published
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(_configs()))
def test_default_plan_of_every_published_config_is_balanced_with_two_all_reduces_per_block(name):
    """Compiled forward of 1- and 2-block builds on the full model's default mesh (abstract values,
    no weight memory), counted as tools/layout_real.py counts them."""
    config = _configs()[name]
    keras.backend.clear_session()
    model = layout_real.build(config)
    plan = shardckpt.parallelize(model)
    keras.distribution.set_distribution(None)
    assert plan.balance() <= 1.15, (name, tuple(plan.mesh.shape), plan.balance())
    counts = []
    for blocks in (1, 2):
        keras.backend.clear_session()
        small = layout_real.build(config, blocks=blocks)
        counts.append(layout_real.forward_collectives(small, shardckpt.auto_layout(small, plan.mesh)))
    per_block = {k: counts[1][k] - counts[0][k] for k in counts[0]}
    assert per_block.pop("all-reduce") <= 2, (name, tuple(plan.mesh.shape), counts)
    assert set(per_block.values()) == {0}, (name, tuple(plan.mesh.shape), per_block)


def test_from_preset_with_no_mesh_loads_on_the_auto_mesh(tmp_path, caplog):
    """A real preset, loaded with no mesh: the distribution is the "auto" plan's, values bit-equal."""
    caplog.set_level(logging.INFO, logger="shardckpt")
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=64, num_layers=1, num_query_heads=8, num_key_value_heads=8, hidden_dim=32,
        intermediate_dim=64,
    )
    rng = np.random.default_rng(0)
    for v in backbone.weights:
        v.assign(rng.standard_normal(v.shape).astype(np.float32))
    saved = {v.path: np.asarray(v.value) for v in backbone.weights}
    backbone.save_to_preset(str(tmp_path / "preset"))
    keras.backend.clear_session()
    model = shardckpt.from_preset(str(tmp_path / "preset"))
    plan = shardckpt.auto_layout(model, "auto")
    dist = keras.distribution.distribution()
    assert tuple(dist.device_mesh.shape) == tuple(plan.mesh.shape)
    assert f"mesh chosen for 8 devices: {tuple(plan.mesh.shape)}" in _one_line(caplog, "from_preset")
    for v in model.weights:
        assert v.value.sharding == plan.sharding_for(v), v.path
        np.testing.assert_array_equal(np.asarray(v.value), saved[v.path], err_msg=v.path)
    keras.distribution.set_distribution(None)
