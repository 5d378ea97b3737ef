"""auto_layout / LayoutPlan on real Keras transformers and a CNN, 8 simulated CPU devices."""

from __future__ import annotations

import json
import re
import warnings

import jax
import keras
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import shardckpt
from shardckpt.errors import LayoutError
from shardckpt.layout import LayoutPlan, auto_layout
from tests import stacks as models
from tests.support import device_bytes

M = "model"
COLLECTIVE = re.compile(r"\b(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(")


def _collectives(hlo: str) -> dict[str, int]:
    counts = {"all-reduce": 0, "all-gather": 0, "reduce-scatter": 0, "all-to-all": 0, "collective-permute": 0}
    for name in COLLECTIVE.findall(hlo):
        counts[name] += 1
    return counts


def _sharded_state(model, plan):
    tv = [jax.device_put(v.value, plan.sharding_for(v)) for v in model.trainable_variables]
    ntv = [jax.device_put(v.value, plan.sharding_for(v)) for v in model.non_trainable_variables]
    return tv, ntv


def _forward(model):
    return jax.jit(lambda tv, ntv, x: model.stateless_call(tv, ntv, x)[0])


# Expected axes of the grouped-query stack (1 block), by the variable's role.
GQA_AXES = {
    "embedding/embeddings": (M, None),  # vocabulary split
    "layer_normalization/gamma": (None,),
    "layer_normalization/beta": (None,),
    "grouped_query_attention/query/kernel": (None, M, None),  # heads
    "grouped_query_attention/query/bias": (M, None),  # follows its kernel
    "grouped_query_attention/key/kernel": (None, None, None),  # 2 kv heads on 8: replicated
    "grouped_query_attention/key/bias": (None, None),
    "grouped_query_attention/value/kernel": (None, None, None),
    "grouped_query_attention/value/bias": (None, None),
    "grouped_query_attention/attention_output/kernel": (M, None, None),  # row-parallel over heads
    "grouped_query_attention/attention_output/bias": (None,),  # after a row-parallel kernel
    "layer_normalization_1/gamma": (None,),
    "layer_normalization_1/beta": (None,),
    "dense/kernel": (None, M),  # gate
    "dense_1/kernel": (None, M),  # up
    "dense_2/kernel": (M, None),  # down
    "layer_normalization_2/gamma": (None,),
    "layer_normalization_2/beta": (None,),
    "dense_3/kernel": (None, M),  # untied head, vocabulary split like the embedding
}


def test_grouped_query_plan_axes_and_reasons():
    with shardckpt.lazy_init():
        model = models.build_transformer(models.SHAPES["grouped-query"], blocks=1)
    plan = auto_layout(model, (1, 8))
    assert {p.path: p.axes for p in plan.placements} == GQA_AXES
    assert plan.validate(model) == []
    key = plan["grouped_query_attention/key/kernel"]
    assert key.source == "fallback" and "(2)" in key.reason and "does not divide" in key.reason
    assert plan["dense_2/kernel"].reason.startswith("row-parallel")
    assert plan.batch_axis == "data" and plan.model_axis == "model"


@pytest.mark.parametrize("name", list(models.SHAPES))
def test_every_shape_covered_sharded_and_exact(name):
    """>= 90% of bytes split, 2 all-reduces per block + 1, no all-gather, output equal to one device."""
    shape = models.SHAPES[name]
    counts = []
    for blocks in (1, 2):
        keras.backend.clear_session()
        model = models.build_transformer(shape, blocks=blocks)
        plan = auto_layout(model, (1, 8))
        assert plan.validate(model) == []
        assert [p.path for p in plan.placements] == [v.path for v in model.variables]
        assert plan.sharded_fraction() >= 0.90
        xs = models.sample_inputs(model, shape.vocab)
        tv, ntv = _sharded_state(model, plan)
        for v, arr in zip(model.trainable_variables, tv):
            assert arr.sharding == NamedSharding(plan.mesh.backend_mesh, PartitionSpec(*plan[v.path].axes))
        forward = _forward(model)
        counts.append(_collectives(forward.lower(tv, ntv, xs).compile().as_text()))
        got = np.asarray(forward(tv, ntv, xs))
        want = np.asarray(model(xs))
        assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want))
    per_block = counts[1]["all-reduce"] - counts[0]["all-reduce"]
    assert per_block == 2
    assert counts[0]["all-reduce"] - per_block == 1  # the embedding lookup
    assert all(c["all-gather"] == 0 and c["reduce-scatter"] == 0 and c["all-to-all"] == 0 for c in counts)


def test_one_training_step_equals_one_device_under_model_parallel():
    """Keras' ModelParallel accepts layout_map(); a train step matches one device."""
    shape = models.SHAPES["mixture-of-experts"]
    keras.utils.set_random_seed(1)
    single = models.build_transformer(shape, blocks=1)
    plan = auto_layout(single, (2, 4))
    weights = single.get_weights()
    xs = models.sample_inputs(single, shape.vocab, batch=4)
    ys = np.random.default_rng(2).integers(0, shape.vocab, size=(4, shape.seq)).astype("int32")

    def train(model):
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        loss = model.train_on_batch(xs, ys)
        return loss, [np.asarray(v.value) for v in model.variables]

    loss_one, after_one = train(single)
    keras.backend.clear_session()
    keras.distribution.set_distribution(plan.distribution())
    sharded = models.build_transformer(shape, blocks=1)
    sharded.set_weights(weights)
    for v in sharded.variables:
        assert v.value.sharding == plan.sharding_for(v), v.path
    loss_tp, after_tp = train(sharded)
    np.testing.assert_allclose(loss_tp, loss_one, rtol=1e-5)
    for v, a, b in zip(sharded.variables, after_tp, after_one):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=v.path)
        assert v.value.sharding == plan.sharding_for(v), v.path
    # Optimizer slots are not needed by SGD without momentum; the step counter is replicated.
    it = sharded.optimizer.iterations
    assert it.value.sharding.is_fully_replicated


def test_cnn_channels_split_and_forward_equal():
    model = models.build_cnn()
    plan = auto_layout(model, (1, 8))
    axes = {p.path: p.axes for p in plan.placements}
    assert axes["conv2d/kernel"] == (None, None, None, M)  # output channels
    assert axes["conv2d/bias"] == (M,)
    assert axes["batch_normalization/moving_variance"] == (M,)  # follows the split channels
    assert axes["conv2d_1/kernel"] == (None, None, M, None)  # input channels (row-parallel)
    assert axes["conv2d_1/bias"] == (None,)
    assert axes["dense/kernel"] == (None, None)  # 10 classes on 8 devices
    assert plan["dense/kernel"].source == "fallback"
    x = np.random.default_rng(0).standard_normal((4, 16, 16, 3)).astype("float32")
    tv, ntv = _sharded_state(model, plan)
    got = np.asarray(_forward(model)(tv, ntv, x))
    want = np.asarray(model(x))
    assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want))


def test_heads_not_divisible_split_the_head_dimension_and_match_one_device():
    s = models.Shape(heads=4, dim=32, kv_heads=1, ff=64, blocks=1, gated=True)
    model = models.build_transformer(s)
    plan = auto_layout(model, (1, 8))
    # 4 query heads, 1 key/value head on 8: every projection splits the head dimension (8) instead.
    for name in ("query", "key", "value"):
        p = plan[f"grouped_query_attention/{name}/kernel"]
        assert p.axes == (None, None, M) and p.source == "fallback" and "one more all-reduce" in p.reason
    assert plan["grouped_query_attention/attention_output/kernel"].axes == (None, M, None)
    assert plan["dense/kernel"].axes == (None, M)
    assert plan.validate(model) == [] and plan.balance() < 1.15
    xs = models.sample_inputs(model, s.vocab)
    tv, ntv = _sharded_state(model, plan)
    forward = _forward(model)
    got, want = np.asarray(forward(tv, ntv, xs)), np.asarray(model(xs))
    assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want))
    counts = _collectives(forward.lower(tv, ntv, xs).compile().as_text())
    # Embedding, scores (the split head dimension is contracted), attention output, MLP down.
    assert counts == {"all-reduce": 4, "all-gather": 0, "reduce-scatter": 0, "all-to-all": 0, "collective-permute": 0}


def test_rules_override_and_bad_rules():
    model = models.build_transformer(models.SHAPES["multi-head"], blocks=1)
    plan = auto_layout(model, (1, 8), rules={r".*embeddings": (None, M), r"dense/bias": (M,)})
    assert plan["embedding/embeddings"].axes == (None, M) and plan["embedding/embeddings"].source == "rule"
    assert plan["dense/kernel"].axes == (None, M) and plan["dense/kernel"].source == "auto"
    with pytest.raises(LayoutError, match=r"embedding/embeddings.*rank 2"):
        auto_layout(model, (1, 8), rules=[(r".*embeddings", (M,))])
    with pytest.raises(LayoutError, match=r"'tensor'.*Fix"):
        auto_layout(model, (1, 8), rules={r".*embeddings": ("tensor", None)})
    # A rule the axis does not divide falls back to replication, recorded.
    odd = auto_layout(model, (1, 8), rules={r"dense_1/bias": (M,), r".*gamma": ("data",)})
    assert odd["dense_1/bias"].axes == (M,)  # 64 / 8
    assert odd["layer_normalization/gamma"].axes == ("data",) and odd["layer_normalization/gamma"].source == "rule"
    keras.backend.clear_session()
    small = keras.Sequential([keras.Input((4,)), keras.layers.Dense(12)])
    fallback = auto_layout(small, (1, 8), rules={r".*kernel": (None, M)})
    kernel = fallback[small.layers[0].kernel.path]
    assert kernel.axes == (None, None) and kernel.source == "fallback" and "12" in kernel.reason


def test_rules_that_place_nothing_warn_once_and_are_listed_as_problems():
    """A rule matching no variable (a typo) and one every match of which an earlier rule takes (wrong
    order) change nothing: each warns once by name, and plan.problems, validate() and explain() list
    them, also after bind() and a JSON round trip (was: ignored without a word, validate() == [])."""
    keras.backend.clear_session()
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256), keras.layers.Dense(64)])
    rules = {r".*kernel": (None, M), r".*dense/kernel": (M, None), r".*embedings": (None, M), r".*bias": (None,)}
    with pytest.warns(UserWarning) as caught:
        plan = auto_layout(model, (1, 8), rules=rules)
    lines = [str(w.message) for w in caught if "layout rule" in str(w.message)]
    assert len(lines) == 2
    assert lines[0].startswith("layout rule '.*dense/kernel' never applies") and "'.*kernel'" in lines[0]
    assert lines[1].startswith("layout rule '.*embedings' matches no variable path")
    assert plan.problems == tuple(lines)
    assert plan.validate(model) == lines
    text = str(plan.explain())
    assert "problem: layout rule '.*dense/kernel' never applies" in text and "'.*embedings'" in text
    assert LayoutPlan.from_json(plan.to_json()).bind(model).problems == plan.problems
    with pytest.warns(UserWarning, match="matches no variable") as caught:
        auto_layout(model, devices=8, rules={r".*embedings": (None, M)})  # several meshes planned, one warning
    assert sum("layout rule" in str(w.message) for w in caught) == 1
    assert auto_layout(model, (1, 8), rules={r".*kernel": (None, M)}).problems == ()


def test_mostly_replicated_on_a_given_model_axis_warns_once_naming_the_largest():
    """Widths 90 and 30 divide by no model axis of 8: on the (1, 8) mesh the user gave, all bytes stay
    replicated, and one warning names the largest variables and why (was: silent). Not on (4, 2), where
    they split, nor with mesh="auto", which weighs this itself."""
    keras.backend.clear_session()
    model = keras.Sequential([keras.Input((30,)), keras.layers.Dense(90), keras.layers.Dense(30)])
    kernel = model.layers[0].kernel.path
    with pytest.warns(UserWarning, match="replicated on every device") as caught:
        plan = auto_layout(model, (1, 8))
    assert plan.sharded_fraction() == 0.0
    lines = [str(w.message) for w in caught if "replicated on every device" in str(w.message)]
    assert len(lines) == 1
    assert lines[0].startswith("100% of parameter bytes stay replicated on every device although the mesh splits model "
                               "axis 'model' 8 ways. Largest: ")
    assert f"{kernel} (30, 90) (10,800 bytes): [fallback] {plan[kernel].reason}" in lines[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert auto_layout(model, (4, 2)).sharded_fraction() > 0.5
        auto_layout(model, devices=8)


def test_layout_map_exact_keys_and_distribution():
    keras.backend.clear_session()
    inputs = keras.Input((16,))
    a = keras.layers.Dense(32, name="blk.0")(inputs)
    b = keras.layers.Dense(16, name="blkx0")(a)
    model = keras.Model(inputs, b)
    plan = auto_layout(model, (1, 8))
    layout_map = plan.layout_map()
    # Plus the LoRA factors enable_lora would create beside each kernel (layout.lora).
    lora = {re.escape(f"{layer}/lora_kernel_{f}") for layer in ("blk.0", "blkx0") for f in "ab"}
    assert set(layout_map) == {re.escape(v.path) for v in model.variables} | lora
    assert layout_map["blk.0/lora_kernel_b"].axes == (None, M) and layout_map["blkx0/lora_kernel_a"].axes == (M, None)
    for v in model.variables:
        assert layout_map[v.path].axes == plan[v.path].axes
    assert layout_map["blk.0/kernel"].axes == (None, M)
    assert layout_map["blkx0/kernel"].axes == (M, None)
    assert layout_map["blkX0/kernel"] is None
    dist = plan.distribution()
    assert isinstance(dist, keras.distribution.ModelParallel) and dist.batch_dim_name == "data"


def test_bytes_per_device_with_optimizer_slots():
    keras.backend.clear_session()
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, activation="relu"), keras.layers.Dense(64)])
    plan = auto_layout(model, (1, 8))
    assert [p.axes for p in plan.placements] == [(None, M), (M,), (M, None), (None,)]
    weights = (64 * 256 + 256 + 256 * 64) * 4 // 8 + 64 * 4
    assert plan.bytes_per_device() == weights
    assert plan.bytes_per_device("adam") == 3 * weights
    assert plan.bytes_per_device(keras.optimizers.SGD(momentum=0.9)) == 2 * weights
    assert plan.bytes_per_device("sgd") == weights
    with pytest.raises(LayoutError, match="Unknown optimizer"):
        plan.bytes_per_device("shampoo")



def _built_under_plan(make_optimizer):
    """A Dense stack and `make_optimizer()` built under its plan's distribution, and the plan."""
    keras.backend.clear_session()
    build = lambda: keras.Sequential(  # noqa: E731
        [keras.Input((64,)), keras.layers.Dense(256), keras.layers.Dense(64)]
    )
    plan = auto_layout(build(), (1, 8))
    keras.distribution.set_distribution(plan.distribution())
    model = build()
    model.compile(optimizer=make_optimizer(), loss="mse")
    model.optimizer.build(model.trainable_variables)
    return model, plan.bind(model)


@pytest.mark.parametrize(
    "make_optimizer",
    [
        lambda: keras.optimizers.Adam(gradient_accumulation_steps=2),
        lambda: keras.optimizers.SGD(gradient_accumulation_steps=3),
        lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(gradient_accumulation_steps=2)),
    ],
    ids=["adam", "sgd", "loss-scaled-adam"],
)
def test_bytes_per_device_counts_gradient_accumulators(make_optimizer):
    """With gradient_accumulation_steps, Keras keeps one accumulator per trainable variable, sharded
    like it: the estimate equals the bytes the built model and optimizer hold per device, less the
    optimizer's scalars (was: accumulators left out, 50,304 estimated against 67,080 held for Adam).
    A LossScaleOptimizer counts as the Adam it wraps (was: LayoutError "Unknown optimizer")."""
    model, plan = _built_under_plan(make_optimizer)
    optimizer = model.optimizer
    scalars = device_bytes([v for v in optimizer.variables if not v.shape])
    held = device_bytes(model.variables + optimizer.variables)
    assert plan.bytes_per_device(optimizer) == held - scalars
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    slots = 2 if isinstance(inner, keras.optimizers.Adam) else 0
    assert plan.bytes_per_device(optimizer) == (2 + slots) * plan.bytes_per_device()


def test_bind_reads_the_trainable_flags_of_the_model_as_they_are_now():
    """A layer frozen after planning gets no Adam slots: bind() takes the live flags, and the estimate
    equals the bytes the built model and optimizer hold per device (was: the plan's flags kept,
    50,304 estimated against 33,672 held)."""
    keras.backend.clear_session()
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256), keras.layers.Dense(64)])
    plan = auto_layout(model, (1, 8))
    keras.distribution.set_distribution(plan.distribution())
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256), keras.layers.Dense(64)])
    model.layers[0].trainable = False
    bound = plan.bind(model)
    assert [p.trainable for p in bound.placements] == [False, False, True, True]
    model.compile(optimizer="adam", loss="mse")
    model.optimizer.build(model.trainable_variables)
    scalars = device_bytes([v for v in model.optimizer.variables if not v.shape])
    assert bound.bytes_per_device("adam") == device_bytes(model.variables + model.optimizer.variables) - scalars
    model.layers[0].trainable = True
    assert [p.trainable for p in plan.bind(model).placements] == [True] * 4


def test_json_round_trip_explain_and_errors():
    model = models.build_transformer(models.SHAPES["encoder"], blocks=1)
    plan = auto_layout(model, ((2, 4), ("data", "model")))
    again = LayoutPlan.from_json(plan.to_json())
    assert again == plan
    for v in model.variables:
        assert again.sharding_for(v) == plan.sharding_for(v)
    assert json.loads(plan.to_json())["mesh"] == {"shape": [2, 4], "axis_names": ["data", "model"]}
    with pytest.raises(LayoutError, match="needs 8 devices but 4"):
        LayoutPlan.from_json(plan.to_json(), devices=jax.devices()[:4])
    with pytest.raises(LayoutError, match="expected format"):
        LayoutPlan.from_json('{"placements": []}')
    table = plan.explain()
    assert table.row_count == len(model.variables)
    text = str(plan)
    assert "embedding/embeddings" in text and "vocabulary split" in text


def test_lazy_model_plans_like_a_built_one_and_loads_with_the_plan(tmp_path):
    shape = models.SHAPES["multi-query"]
    model = models.build_transformer(shape, blocks=1)
    path = str(tmp_path / "m.weights.h5")
    model.save_weights(path)
    built_plan = auto_layout(model, (1, 8))
    keras.backend.clear_session()
    with shardckpt.lazy_init():
        lazy = models.build_transformer(shape, blocks=1)
    plan = auto_layout(lazy, (1, 8))
    assert plan.placements == built_plan.placements
    shardckpt.load_sharded(lazy, path, layout=plan)
    for v, want in zip(lazy.variables, model.variables):
        np.testing.assert_array_equal(np.asarray(v.value), np.asarray(want.value))
        assert v.value.sharding == plan.sharding_for(v), v.path


def test_mesh_forms_and_errors():
    model = models.build_transformer(models.SHAPES["multi-head"], blocks=1)
    one_d = auto_layout(model, (8,))
    assert tuple(one_d.mesh.shape) == (1, 8) and one_d.batch_axis == "data"
    mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "tp"], jax.devices())
    plan = auto_layout(model, mesh, model_axis="tp")
    assert plan.batch_axis == "batch" and plan["dense/kernel"].axes == (None, "tp")
    with pytest.raises(LayoutError, match="no model axis 'model'"):
        auto_layout(model, mesh)
    with pytest.raises(LayoutError, match="needs 6 devices but 8"):
        auto_layout(model, (2, 3))
    with pytest.raises(LayoutError, match="no variables"):
        auto_layout(keras.Sequential([keras.layers.Dense(3)]), (1, 8))


def test_subclassed_model_called_once_is_traced():
    class Mlp(keras.Model):
        def __init__(self):
            super().__init__()
            self.up = keras.layers.Dense(64, activation="relu")
            self.down = keras.layers.Dense(16)

        def call(self, x):
            return x + self.down(self.up(x))

    model = Mlp()
    model(np.ones((2, 16), "float32"))
    plan = auto_layout(model, (1, 8))
    assert [p.axes for p in plan.placements] == [(None, M), (M,), (M, None), (None,)]
    never_called = Mlp()
    never_called.up.build((None, 16))
    never_called.down.build((None, 64))
    fallback = auto_layout(never_called, (1, 8))
    assert all(p.axes == (None,) * len(p.shape) for p in fallback.placements)
    assert "never called" in fallback.placements[0].reason
