#!/usr/bin/env python3
"""Layout benchmark: `shardckpt.auto_layout` beside hand-written keras-hub-style maps.

For transformer stacks of several shapes (multi-head, grouped-query with 2
key/value heads, multi-query, top-2 mixture of experts, an encoder with
position and token-type embeddings), it places the variables by each plan,
compiles the forward pass on the mesh and prints, per plan:

- split: share of parameter bytes split over the model axis;
- all-reduce / all-gather / reduce-scatter per block, and the rest (embedding
  and head), read from the compiled HLO of a 1-block and a 2-block model
  (per block = count(2 blocks) - count(1 block));
- max bytes of variables on one device;
- relative error of the output against one device (max |diff| / max |ref|).

The keras-hub-style maps follow keras-hub's `LlamaBackbone.get_layout_map`
(query/key/value kernels split on the hidden dimension, attention output on
heads, MLP up/gate column-, down row-parallel, token embedding over the
vocabulary), applied to these models' variables by their roles; mixture-of-
experts weights are left out as in keras-hub's QwenMoe map.

With keras-hub installed, every backbone of `HUB_BACKBONES` (Llama, Gemma,
Qwen, Mixtral, GPT-2, BERT, ...; 8 query heads, hidden `--hidden`) is
measured the same way, shardckpt against keras-hub's own `get_layout_map`
where the backbone has one.

The model builders are tests/stacks.py's, shared with tests/test_layout*.py.

With `--real`, the published configs at their real sizes instead, built
lazily (no weight memory), on 8 and on 4 of the devices, with and without
FSDP and with `mesh="auto"` (see tools/layout_real.py): split share,
balance, collectives per block from the compiled forward pass, plan time.

Usage:
    python tools/bench_layout.py [--mesh 1x8] [--models all|synthetic|hub] [--hidden 256] [--smoke]
    python tools/bench_layout.py --real [--devices 8,4] [--configs gpt2-base,...] [--smoke]
"""
from __future__ import annotations

import os
import re
import sys

if __name__ == "__main__":
    from _bench import setup_jax

    setup_jax(int(os.environ.get("BENCH_DEVICES", "8")), cpu_only=False)

import jax
import keras
from keras import layers

# The stacks are the layout tests' own (tests/stacks.py), measured here as they are tested.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.stacks import (  # noqa: E402
    SHAPES,
    DenseMoE,
    Shape,
    TiedLogits,
    build_transformer,
    sample_inputs,
)

# ---------------------------------------------------------------------------
# keras-hub backbones (tiny configs; keras-hub is optional and imported lazily)

# Sizes scale with `hidden` (64 in the tests): 8 query heads of hidden / 8
# (the 8-way axis divides them), MLP 2 x hidden, vocabulary 2 x hidden (at
# least 128). Key/value heads: 8 where the model allows, fewer (2, or 1 for
# Gemma) in the grouped-/multi-query cases, which the axis does not divide.
HUB_VOCAB = 128  # token ids of `hub_inputs` stay below it
HUB_SEQ = 16


def _hub_decoder(cls_name: str, extra=lambda h: {}):
    def build(blocks: int, hidden: int = 64):
        import keras_hub

        cls = getattr(keras_hub.models, cls_name)
        args = dict(vocabulary_size=max(HUB_VOCAB, 2 * hidden), hidden_dim=hidden, intermediate_dim=2 * hidden)
        return cls(num_layers=blocks, **{**args, **extra(hidden)})

    return build


def _hub_encoder(cls_name: str, extra=lambda h: {}):
    def build(blocks: int, hidden: int = 64):
        import keras_hub

        cls = getattr(keras_hub.models, cls_name)
        args = dict(vocabulary_size=max(HUB_VOCAB, 2 * hidden), num_layers=blocks, num_heads=8, hidden_dim=hidden,
                    intermediate_dim=2 * hidden, max_sequence_length=HUB_SEQ, dropout=0.0)
        args.update(extra(hidden))
        if cls_name == "ElectraBackbone":  # its one differently named argument
            args["vocab_size"] = args.pop("vocabulary_size")
        return cls(**{k: v for k, v in args.items() if v is not None})

    return build


def _heads(q: int, kv: int, head_dim: bool = False):
    return lambda h: {"num_query_heads": q, "num_key_value_heads": kv, **({"head_dim": h // q} if head_dim else {})}


def _moe(q: int, kv: int, head_dim: bool = False, shared: bool = False, **fixed):
    def extra(h):
        out = {**_heads(q, kv, head_dim)(h), "num_experts": 8, "top_k": 2, **fixed}
        if shared:
            out.update(moe_intermediate_dim=h // 2, shared_expert_intermediate_dim=h)
        return out

    return extra


# name -> builder(blocks, hidden=64) of a keras-hub backbone. One table, so
# the tests (tests/test_layout_hub.py) and this bench cover the same models.
HUB_BACKBONES = {
    "Llama (GQA, 2 kv heads)": _hub_decoder("LlamaBackbone", _heads(8, 2)),
    "Llama3": _hub_decoder("Llama3Backbone", _heads(8, 8)),
    "Mistral (GQA, 2 kv heads)": _hub_decoder("MistralBackbone", _heads(8, 2)),
    "Mixtral (MoE)": _hub_decoder("MixtralBackbone", _moe(8, 8)),
    "Gemma (MQA, 1 kv head)": _hub_decoder("GemmaBackbone", _heads(8, 1, head_dim=True)),
    "Gemma3": _hub_decoder("Gemma3Backbone", lambda h: {**_heads(8, 8, head_dim=True)(h), "image_size": None}),
    "Qwen": _hub_decoder("QwenBackbone", _heads(8, 8)),
    "Qwen3": _hub_decoder("Qwen3Backbone", _heads(8, 8, head_dim=True)),
    "QwenMoe": _hub_decoder("QwenMoeBackbone", _moe(8, 8, shared=True)),
    "Qwen3Moe": _hub_decoder("Qwen3MoeBackbone", lambda h: {**_moe(8, 8, head_dim=True)(h), "moe_intermediate_dim": h // 2}),
    "Phi3": _hub_decoder("Phi3Backbone", _heads(8, 8)),
    "GPT-2": _hub_encoder("GPT2Backbone"),
    "BERT": _hub_encoder("BertBackbone"),
    "RoBERTa": _hub_encoder("RobertaBackbone"),
    "OPT": _hub_encoder("OPTBackbone"),
    "GPT-NeoX": _hub_encoder("GPTNeoXBackbone"),
    "DistilBERT": _hub_encoder("DistilBertBackbone"),
    "ELECTRA": _hub_encoder("ElectraBackbone", lambda h: {"embedding_dim": h}),
    "ESM": _hub_encoder("ESMBackbone"),
    "RoFormerV2": _hub_encoder("RoformerV2Backbone", lambda h: {"head_size": h // 8, "max_sequence_length": None}),
    "Bloom": _hub_encoder("BloomBackbone", lambda h: {"max_sequence_length": None}),
    "Falcon": _hub_decoder("FalconBackbone", lambda h: {"num_attention_heads": 8}),
    "GPT-OSS (MoE)": _hub_decoder("GptOssBackbone", _moe(8, 8, head_dim=True)),
    # Relative positions in buckets of the sequence length (its default 256
    # buckets would make the replicated, layer-normalized table the largest
    # variable of a model this small).
    "DeBERTa-v3": _hub_encoder("DebertaV3Backbone", lambda h: {"bucket_size": HUB_SEQ}),
}
# Left out: SmolLM3 (keras-hub 0.32 gives two variables of every block the
# same path, `o_proj/kernel` and `rotary_emb/inv_freq`, so no path-keyed
# layout can tell them apart), ALBERT and FNet (88%: a replicated embedding
# projection weighs more than 10% at these tiny sizes).


def hub_inputs(model: keras.Model, *, batch: int = 2, seed: int = 0) -> dict:
    """Deterministic inputs in the backbone's own structure (token ids, mask, segments)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = {}
    for key in model.input:
        if key == "padding_mask":
            mask = np.ones((batch, HUB_SEQ), "int32")
            mask[1:, HUB_SEQ - 3:] = 0  # some padding, so masks take part
            out[key] = mask
        elif key == "segment_ids":
            out[key] = (np.arange(HUB_SEQ)[None, :] >= HUB_SEQ // 2).astype("int32").repeat(batch, 0)
        else:
            out[key] = rng.integers(0, HUB_VOCAB, size=(batch, HUB_SEQ)).astype("int32")
    return out


# ---------------------------------------------------------------------------
# Benchmark


COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_COLLECTIVE = re.compile(r"\b(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")


def count_collectives(hlo: str) -> dict[str, int]:
    """Collective ops in compiled HLO text, by kind (async `-start` counted once)."""
    counts = dict.fromkeys(COLLECTIVES, 0)
    for name in _COLLECTIVE.findall(hlo):
        counts[name] += 1
    return counts


def keras_hub_style_axes(model: keras.Model, model_axis: str = "model", data_axis: str = "data") -> dict:
    """Path -> axes as keras-hub's Llama map would place these models' variables."""
    m, d = model_axis, data_axis
    axes = {}
    embeddings = [layer for layer in _walk(model) if isinstance(layer, layers.Embedding)]
    if embeddings:
        axes[embeddings[0].embeddings.path] = (m, d)  # token_embedding/embeddings
    for layer in _walk(model):
        if isinstance(layer, (layers.MultiHeadAttention, layers.GroupQueryAttention)):
            subs = [getattr(layer, n) for n in ("_query_dense", "_key_dense", "_value_dense", "_output_dense")]
            for sub in subs[:3]:
                axes[sub.kernel.path] = (m, d, None)  # .*attention.*(query|key|value).kernel
            axes[subs[3].kernel.path] = (m, None, d)  # .*attention_output.kernel
    dense = [layer for layer in _walk(model) if isinstance(layer, layers.Dense) and not _inside_moe(model, layer)]
    head = dense[-1] if not any(isinstance(layer, TiedLogits) for layer in _walk(model)) else None
    mlp = [layer for layer in dense if layer is not head]
    for layer in mlp:
        if layer.kernel.shape[0] < layer.kernel.shape[1]:
            axes[layer.kernel.path] = (d, m)  # feedforward_intermediate / gate
        else:
            axes[layer.kernel.path] = (m, d)  # feedforward_output
    if head is not None:
        axes[head.kernel.path] = (d, m)  # token_embedding/reverse_embeddings
    return axes


def _walk(model):
    return list(model._flatten_layers(include_self=False, recursive=True))


def _inside_moe(model, layer) -> bool:
    return any(isinstance(other, DenseMoE) and other.router is layer for other in _walk(model))


def _jitted_forward(model):
    """`model`'s forward pass, jitted (a function of its own binds this model, not the loop's variable)."""
    return jax.jit(lambda a, b, x: model.stateless_call(a, b, x)[0])


def placed_state(model, sharding_of):
    """(trainable, non-trainable) values of `model` put in `sharding_of(variable)`."""
    tv = [jax.device_put(v.value, sharding_of(v)) for v in model.trainable_variables]
    ntv = [jax.device_put(v.value, sharding_of(v)) for v in model.non_trainable_variables]
    return tv, ntv


def max_device_bytes(arrays) -> int:
    """The most bytes of `arrays` any one device holds."""
    per_device: dict = {}
    for arr in arrays:
        for shard in arr.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return max(per_device.values())


def measure(build, sharding_for_model, inputs_for):
    """Counts, split share, max device bytes and error for one plan on 1- and 2-block models."""
    import numpy as np

    rows = []
    for blocks in (1, 2):
        keras.backend.clear_session()
        model = build(blocks)
        sharding_of, split = sharding_for_model(model)
        xs = inputs_for(model)
        tv, ntv = placed_state(model, sharding_of)
        forward = _jitted_forward(model)
        counts = count_collectives(forward.lower(tv, ntv, xs).compile().as_text())
        err = 0.0
        # Reference: the same program on one device (eager execution rounds
        # differently). keras-hub encoders return a dict (sequence, pooled).
        one = forward([v.value for v in model.trainable_variables], [v.value for v in model.non_trainable_variables], xs)
        for got, want in zip(keras.tree.flatten(forward(tv, ntv, xs)), keras.tree.flatten(one)):
            got, want = np.asarray(got), np.asarray(want)
            err = max(err, float(np.max(np.abs(got - want)) / np.max(np.abs(want))))
        rows.append((counts, split, max_device_bytes(tv + ntv), err))
    (c1, _, _, _), (c2, split, max_bytes, err) = rows
    per_block = {k: c2[k] - c1[k] for k in COLLECTIVES}
    rest = {k: c1[k] - per_block[k] for k in COLLECTIVES}
    return {"split": split, "per_block": per_block, "rest": rest, "max_bytes": max_bytes, "error": max(err, rows[0][3])}


def _auto(mesh_shape):
    from shardckpt.layout import auto_layout

    def sharding_for_model(model):
        plan = auto_layout(model, mesh_shape)
        return plan.sharding_for, plan.sharded_fraction()

    return sharding_for_model


def _hand(mesh_shape):
    from jax.sharding import NamedSharding, PartitionSpec

    def sharding_for_model(model):
        mesh = keras.distribution.DeviceMesh(mesh_shape, ["data", "model"], jax.devices())
        axes = keras_hub_style_axes(model)
        total = sum(_nbytes(v) for v in model.variables)
        split = sum(_nbytes(v) for v in model.variables if any(a == "model" for a in axes.get(v.path, ()))) / total

        def sharding_of(v):
            return NamedSharding(mesh.backend_mesh, PartitionSpec(*axes.get(v.path, (None,) * len(v.shape))))

        return sharding_of, split

    return sharding_for_model


def _nbytes(v) -> int:
    import math

    import jax.numpy as jnp

    return math.prod(v.shape) * jnp.dtype(v.dtype).itemsize


def hub_rows(mesh_shape, names, hidden: int):
    """shardckpt and keras-hub's own `get_layout_map` (where one exists) per keras-hub backbone."""
    from shardckpt.lazy import lazy_init

    rows = []
    for name in names:
        def build(blocks, factory=HUB_BACKBONES[name]):
            return factory(blocks, hidden)

        keras.backend.clear_session()
        with lazy_init():
            cls = type(build(1))
        plans = [("shardckpt.auto_layout", _auto(mesh_shape))]
        if hasattr(cls, "get_layout_map"):
            plans.append(("keras-hub get_layout_map", _hub_map(cls, mesh_shape)))
        for label, sharding in plans:
            try:
                rows.append((name, label, measure(build, sharding, hub_inputs)))
            except Exception as err:  # a map that cannot place the model is a result, reported as such
                rows.append((name, label, f"{type(err).__name__}: {str(err).splitlines()[0][:40]}"))
        if len(plans) == 1:
            rows.append((name, "keras-hub get_layout_map", "none in keras-hub"))
    return rows


def _hub_map(cls, mesh_shape):
    def sharding_for_model(model):
        mesh = keras.distribution.DeviceMesh(mesh_shape, ["batch", "model"], jax.devices())
        layout_map = cls.get_layout_map(mesh)
        total = sum(_nbytes(v) for v in model.variables)
        layouts = {v.path: layout_map[v.path] for v in model.variables}
        split = sum(_nbytes(v) for v in model.variables if layouts[v.path] is not None and "model" in layouts[v.path].axes) / total

        def sharding_of(v):
            layout = layouts[v.path]
            return layout.backend_layout if layout is not None else jax.sharding.NamedSharding(
                mesh.backend_mesh, jax.sharding.PartitionSpec())

        return sharding_of, split

    return sharding_for_model


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", default="1x8", help="data x model, e.g. 1x8 or 2x4")
    parser.add_argument("--models", choices=("all", "synthetic", "hub"), default="all",
                        help="the synthetic Keras stacks, the keras-hub backbones, or both")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size of the keras-hub backbones")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny run for the tests: one synthetic stack, two keras-hub backbones, hidden 64")
    parser.add_argument("--real", action="store_true",
                        help="the published configs at real sizes, built lazily (tools/layout_real.py)")
    parser.add_argument("--devices", default="8,4", help="--real: device counts to plan on")
    parser.add_argument("--configs", default=None, help="--real: comma-separated config names (default: all)")
    parser.add_argument("--only", choices=("auto",), default=None, help="--real: only the mesh='auto' rows")
    args = parser.parse_args(argv)
    if args.real:
        return _real(args)
    mesh_shape = tuple(int(s) for s in args.mesh.split("x"))
    n = mesh_shape[0] * mesh_shape[1]
    if jax.device_count() != n:
        print(f"need {n} devices, have {jax.device_count()} (set BENCH_DEVICES={n})", file=sys.stderr)
        return 2
    shapes = dict(SHAPES) if args.models != "hub" else {}
    hub_names = list(HUB_BACKBONES) if args.models != "synthetic" else []
    hidden = args.hidden
    if args.smoke:
        shapes = {"multi-head": Shape(vocab=64, seq=8, dim=32, ff=64)} if args.models != "hub" else {}
        hub_names = ["Llama (GQA, 2 kv heads)", "GPT-2"] if args.models != "synthetic" else []
        hidden = 64
    if hub_names:
        try:
            import keras_hub  # noqa: F401
        except ImportError:
            print("keras-hub is not installed (pip install keras-hub): its backbones are skipped", file=sys.stderr)
            hub_names = []

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Forward pass on a {args.mesh} mesh (data x model); keras-hub backbones at hidden {hidden}")
    for col in ("model", "plan", "split", "all-reduce / block", "all-gather / block", "reduce-scatter / block",
                "embedding+head (AR/AG/RS)", "max bytes on one device", "rel. error"):
        table.add_column(col, justify="left" if col in ("model", "plan") else "right")
    rows = []
    for name, shape in shapes.items():
        def build(blocks, shape=shape):
            return build_transformer(shape, blocks=blocks)

        def inputs_for(model, shape=shape):
            return sample_inputs(model, shape.vocab)

        for label, sharding in (("shardckpt.auto_layout", _auto(mesh_shape)), ("keras-hub-style map", _hand(mesh_shape))):
            rows.append((name, label, measure(build, sharding, inputs_for)))
    rows += hub_rows(mesh_shape, hub_names, hidden)
    for name, label, r in rows:
        if isinstance(r, str):
            table.add_row(name, label, r, "", "", "", "", "", "")
            continue
        pb, rest = r["per_block"], r["rest"]
        table.add_row(name, label, f"{r['split']:.1%}", str(pb["all-reduce"]), str(pb["all-gather"]),
                      str(pb["reduce-scatter"]), f"{rest['all-reduce']}/{rest['all-gather']}/{rest['reduce-scatter']}",
                      f"{r['max_bytes']:,}", f"{r['error']:.1e}")
    Console(width=240).print(table)
    return 0


def _real(args) -> int:
    import layout_real
    from rich.console import Console

    names = args.configs.split(",") if args.configs else list(layout_real.NAMES)
    counts = [int(n) for n in args.devices.split(",")]
    if args.smoke:
        names, counts = ["gpt2-base"], [8]
    misses = []
    for devices in counts:
        if devices > jax.device_count():
            print(f"need {devices} devices, have {jax.device_count()} (set BENCH_DEVICES)", file=sys.stderr)
            return 2
        rows = layout_real.run(names, devices, smoke=args.smoke, only=args.only)
        Console(width=240).print(layout_real.table(rows, devices))
        for line in layout_real.verdicts(rows, devices):
            print(line)
        misses += layout_real.check(rows)
    for line in misses:
        print(f"not met: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
