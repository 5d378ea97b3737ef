"""auto_layout / parallelize / `shardckpt plan` on real keras-hub backbones, 8 CPU devices.

Every keras-hub transformer backbone of `tools/bench_layout.HUB_BACKBONES`
(tiny configs) is built under `lazy_init()` and planned on a (1, 8) mesh; the
plan is then checked against what the devices do with it: parameter bytes
split, all-reduces per block and all-gathers counted in the compiled forward
pass, output against one device, bytes per device against the placed shards.
"""

from __future__ import annotations

import os
import sys

import jax
import keras
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import shardckpt
from shardckpt.layout import auto_layout
from shardckpt.layout.parallel import parallelize
from shardckpt.lazy import is_unloaded
from tests.reference_fit import fit_twice_started, perturb

pytest.importorskip("keras_hub")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
import bench_layout as B  # noqa: E402  (tools/ is put on the path just above)

M = "model"
# Backbones whose key/value heads (2, or 1) the 8-way axis does not divide.
FEW_KV_HEADS = {"Llama (GQA, 2 kv heads)", "Mistral (GQA, 2 kv heads)", "Gemma (MQA, 1 kv head)"}
MOE = {"Mixtral (MoE)", "QwenMoe", "Qwen3Moe", "GPT-OSS (MoE)"}


def _build_lazy(name: str, blocks: int):
    keras.backend.clear_session()
    with shardckpt.lazy_init():
        return B.HUB_BACKBONES[name](blocks)


@pytest.mark.parametrize("name", list(B.HUB_BACKBONES))
def test_backbone_plan_split_cheap_and_exact_and_fit_equals_one_device(name):
    """Both checks of one backbone in one test: the plan's 1-block build gives the fit's
    inputs (one build and one test set-up and tear-down fewer per backbone)."""
    one_block = _check_plan_split_cheap_and_exact(name)
    _check_parallelize_then_fit_equals_one_device(name, B.hub_inputs(one_block, batch=8, seed=1))


def _check_plan_split_cheap_and_exact(name: str) -> keras.Model:
    """>= 90% split, <= 2 all-reduces per block, no all-gather, output and bytes true to the devices.

    Returns the 1-block model it built.
    """
    counts = []
    for blocks in (1, 2):
        lazy = _build_lazy(name, blocks)
        assert all(is_unloaded(v) for v in lazy.variables)
        plan = auto_layout(lazy, (1, 8))
        assert plan.validate(lazy) == []
        assert [p.path for p in plan.placements] == [v.path for v in lazy.variables]
        keras.backend.clear_session()
        model = B.HUB_BACKBONES[name](blocks)
        perturb(model, blocks)
        assert auto_layout(model, (1, 8)).placements == plan.placements  # lazy or built: one plan
        xs = B.hub_inputs(model)
        tv, ntv = B.placed_state(model, plan.sharding_for)
        for v, arr in zip(model.trainable_variables + model.non_trainable_variables, tv + ntv):
            assert arr.sharding == NamedSharding(plan.mesh.backend_mesh, PartitionSpec(*plan[v.path].axes)), v.path
        assert B.max_device_bytes(tv + ntv) == plan.bytes_per_device()
        forward = jax.jit(lambda a, b, x, model=model: model.stateless_call(a, b, x)[0])
        counts.append(B.count_collectives(forward.lower(tv, ntv, xs).compile().as_text()))
        if blocks == 1:
            one_block = model
            continue  # built for the collective count only: per block = 2 blocks - 1 block
        # The same program on one device is the reference (eager execution
        # rounds differently: DeBERTa's log-bucketed relative positions
        # differ from jit by 2e-3 on one device already). BERT-like
        # backbones return a dict (sequence and pooled output).
        one = forward([v.value for v in model.trainable_variables], [v.value for v in model.non_trainable_variables], xs)
        for got, want in zip(keras.tree.flatten(forward(tv, ntv, xs)), keras.tree.flatten(one)):
            got, want = np.asarray(got), np.asarray(want)
            assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want))
    assert plan.sharded_fraction() >= 0.90, plan.sharded_fraction()
    text = str(plan.explain())
    for p in plan.placements:
        assert p.path in text and p.reason in text, p.path
    per_block = {k: counts[1][k] - counts[0][k] for k in counts[0]}
    assert per_block["all-reduce"] <= 2, counts
    assert counts[0]["all-reduce"] - per_block["all-reduce"] == 1, counts  # the vocabulary-split embedding
    assert all(c["all-gather"] == 0 and c["all-to-all"] == 0 and c["collective-permute"] == 0 for c in counts), counts
    if name in FEW_KV_HEADS:
        for p in plan.placements:
            if p.path.endswith(("key/kernel", "value/kernel")):
                assert p.axes == (None,) * 3 and p.source == "fallback" and "does not divide" in p.reason, p
            elif p.path.endswith(("query/kernel", "attention_output/kernel")):
                assert M in p.axes, p
    if name in MOE:
        # Expert tensors (experts, in, out): each device holds 1/8 of them,
        # read from the placed shards of the 2-block model.
        experts = [(v, arr) for v, arr in zip(model.trainable_variables, tv) if "/experts/" in v.path]
        assert len(experts) >= 4  # at least two expert tensors in each of the two blocks
        assert all(M in plan[v.path].axes for v, _ in experts)
        total = sum(arr.nbytes for _, arr in experts)
        assert B.max_device_bytes([arr for _, arr in experts]) == total // 8
    return one_block


def _check_parallelize_then_fit_equals_one_device(name: str, xs: dict) -> None:
    ys = np.random.default_rng(2).standard_normal((8, B.HUB_SEQ, 64)).astype("float32")

    def fit(model):
        # Dict outputs (BERT: sequence and pooled) train on the sequence output.
        loss = {"sequence_output": "mse"} if isinstance(model.output, dict) else "mse"
        targets = {"sequence_output": ys} if isinstance(model.output, dict) else ys
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss=loss)
        history = model.fit(xs, targets, batch_size=8, epochs=3, shuffle=False, verbose=0)
        return history.history["loss"], [np.asarray(v.value) for v in model.variables]

    model, (losses_one, after_one) = fit_twice_started(lambda: B.HUB_BACKBONES[name](1), fit)
    plan = parallelize(model, (1, 8))
    assert plan.sharded_fraction() >= 0.9
    losses_tp, after_tp = fit(model)
    np.testing.assert_allclose(losses_tp, losses_one, rtol=1e-5)
    for v, a, b in zip(model.variables, after_tp, after_one):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=v.path)
        assert v.value.sharding == plan.sharding_for(v), v.path


def test_plan_command_on_a_preset_folder_reads_no_weights(tmp_path, capsys):
    """`shardckpt plan PRESET_DIR`: config.json only; works with the weights file gone."""
    from shardckpt.cli import main
    from shardckpt.cli.plan import load_preset_architecture

    name = "Llama (GQA, 2 kv heads)"
    keras.backend.clear_session()
    B.HUB_BACKBONES[name](2).save_to_preset(str(tmp_path / "preset"))
    os.remove(tmp_path / "preset" / "model.weights.h5")  # proves no weight is read
    keras.backend.clear_session()
    model = load_preset_architecture(str(tmp_path / "preset"))
    assert model.count_params() > 0 and all(is_unloaded(v) for v in model.variables)
    plan = auto_layout(model, (1, 8))
    keras.backend.clear_session()
    assert main(["plan", str(tmp_path / "preset"), "--mesh", "1x8", "--optimizer", "adam"]) == 0
    out = capsys.readouterr().out
    for p in plan.placements:
        assert p.path in out, p.path
    assert f"per device (weights + adam slots): {plan.bytes_per_device('adam'):,} bytes" in out
    with pytest.raises(shardckpt.errors.ModelRequiredError, match="config.json"):
        load_preset_architecture(str(tmp_path))


def test_explain_prints_as_text_and_stays_a_rich_table(capsys):
    import rich
    from rich.table import Table

    with shardckpt.lazy_init():
        model = B.HUB_BACKBONES["GPT-2"](1)
    plan = auto_layout(model, (1, 8))
    table = plan.explain()
    assert isinstance(table, Table) and table.row_count == len(model.variables)
    print(table)
    printed = capsys.readouterr().out
    assert "rich.table.Table object" not in printed
    assert "token_embedding/embeddings" in printed and "vocabulary split" in printed
    assert printed.strip() == str(plan).strip()
    rich.print(table)  # rich folds cells at its own width (80 columns when captured)
    rendered = capsys.readouterr().out
    assert "Layout plan: mesh" in rendered and "vocabulary" in rendered and "Table object" not in rendered


def test_non_jax_backend_fails_loudly_at_import():
    import subprocess

    root = os.path.join(os.path.dirname(__file__), "..")
    env = {**os.environ, "KERAS_BACKEND": "numpy", "PYTHONPATH": os.path.abspath(root)}
    proc = subprocess.run(
        [sys.executable, "-c", "import shardckpt"], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("shardckpt.errors.BackendError:"), proc.stderr[-2000:]
    assert "'numpy'" in last and "KERAS_BACKEND=jax" in last


def test_bench_layout_smoke_runs_both_plans(capsys):
    """tools/bench_layout.py --smoke: shardckpt and keras-hub's own map side by side."""
    assert B.main(["--smoke", "--models", "hub"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("│")]
    assert any("Llama" in r and "shardckpt.auto_layout" in r for r in rows)
    assert any("Llama" in r and "keras-hub get_layout_map" in r for r in rows)
    assert any("GPT-2" in r and "none in keras-hub" in r for r in rows)


def test_heads_the_axis_does_not_divide_keep_the_residual_stream_whole():
    """4 heads on 8 devices: query/key replicated, values over the head dimension, MLP split, every norm scale replicated.

    Rotary embeddings cut the query's and key's head dimension in halves, so
    those cannot split it; values and the output projection can (one
    all-reduce after the output projection, as with split heads).

    An RMSNorm sums `x * x`, a tensor read nowhere else; counting that sum as
    a contraction would let the attention output split the residual stream
    along the hidden size (4 all-reduces and an all-gather per block measured).
    """
    import keras_hub

    keras.backend.clear_session()
    with shardckpt.lazy_init():
        model = keras_hub.models.LlamaBackbone(
            vocabulary_size=128, num_layers=1, num_query_heads=4, num_key_value_heads=4, hidden_dim=64,
            intermediate_dim=128,
        )
    plan = auto_layout(model, (1, 8))
    for p in plan.placements:
        if "self_attention/query" in p.path or "self_attention/key" in p.path:
            assert p.axes == (None,) * len(p.shape), p
        elif p.path.endswith("scale"):
            assert p.axes == (None,), p
    assert plan["transformer_layer_0/self_attention/value/kernel"].axes == (None, None, M)
    assert plan["transformer_layer_0/self_attention/attention_output/kernel"].axes == (None, M, None)
    assert plan["transformer_layer_0/feedforward_gate_dense/kernel"].axes == (None, M)
    assert plan["transformer_layer_0/feedforward_output_dense/kernel"].axes == (M, None)
    query = plan["transformer_layer_0/self_attention/query/kernel"]
    assert query.source == "fallback" and "(4)" in query.reason
