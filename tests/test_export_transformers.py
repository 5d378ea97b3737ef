"""A real client reads what `export(format="hf")` writes: transformers itself (CPU torch).

For backbones built from keras-hub constructors (tests/export_grid.py: every
GPT-2 and BERT config, and one non-default config of each other architecture),
the exported folder is loaded with `transformers.AutoModel.from_pretrained`
(eager attention, float32) and its last hidden states on the same token ids
equal keras-hub's backbone output within 1e-4. `config.json` is checked
against the architecture's transformers config class: every key it writes is
one that class knows (no keras-hub-only keys), and the values keras-hub's own
importer leaves unread (`shardckpt.formats.hf_carried`) are read there as
the backbone's arguments.
"""

from __future__ import annotations

import importlib
import inspect
import warnings

import export_grid as grid
import hf_fixtures as fx
import keras
import numpy as np
import pytest

import shardckpt
from shardckpt.formats import hf_carried

keras_hub = pytest.importorskip("keras_hub")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# Keys every transformers config takes (PretrainedConfig's), beside the class's own, and
# transformers 5's legacy rope keys (read into `rope_parameters` on load).
_COMMON = {"architectures", "torch_dtype", "dtype", "model_type", "transformers_version", "use_cache",
           "pad_token_id", "bos_token_id", "eos_token_id", "rope_theta", "rope_scaling"}
# Random weights of this scale keep activations near 1, so float32 rounding in two
# frameworks' different op orders stays far below the tolerance (weights of scale 1
# through post-norm BERT blocks reach 1e-4 of rounding on values near 4).
_SCALE = 0.3


def _chosen() -> list[tuple[str, str, dict]]:
    out, seen = [], set()
    for name, class_name, args in grid.GRID:
        family = name.split("-")[0]
        if class_name in ("GPT2Backbone", "BertBackbone") or family not in seen:
            out.append((name, class_name, args))
            seen.add(family)
    return out


CHOSEN = _chosen()


def _inputs(model: keras.Model, ids: np.ndarray) -> dict[str, np.ndarray]:
    inputs = {"token_ids": ids, "padding_mask": np.ones_like(ids)}
    if "segment_ids" in model._inputs_struct:
        inputs["segment_ids"] = np.zeros_like(ids)
    return inputs


@pytest.mark.slow
@pytest.mark.parametrize(("name", "class_name", "args"), CHOSEN, ids=[c[0] for c in CHOSEN])
def test_transformers_loads_the_export_and_computes_the_same_hidden_states(name, class_name, args, tmp_path):
    keras.backend.clear_session()
    model = grid.build(class_name, args)
    fx.randomize(model, seed=len(name))
    for v in model.weights:
        v.assign(np.asarray(v.value) * np.asarray(_SCALE, v.dtype))
    folder = str(tmp_path / "hf")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # what keras-hub's importer misreads: test_export_configs
        shardckpt.export(model, folder)

    config = transformers.AutoConfig.from_pretrained(folder)
    written = set(transformers.PretrainedConfig.get_config_dict(folder)[0])
    default = type(config)()
    known = set(default.to_dict()) | set(default.attribute_map) | _COMMON
    # A key the config class does not declare must be one its modeling code reads
    # (`getattr(config, "head_dim", ...)`): transformers keeps it as an attribute.
    modeling = inspect.getsource(importlib.import_module(type(config).__module__.replace("configuration_", "modeling_")))
    unread = sorted(k for k in written - known if f'"{k}"' not in modeling and f"config.{k}" not in modeling)
    assert not unread, f"keys {type(config).__name__} neither declares nor reads: {unread}"
    for argument, key in hf_carried.carried(config.model_type).items():
        if argument in args:
            assert getattr(config, key) == args[argument], (key, argument)

    ids = np.random.default_rng(0).integers(0, grid.V, size=(2, 7)).astype("int32")
    out = model(_inputs(model, ids))
    want = np.asarray(out["sequence_output"] if isinstance(out, dict) else out, np.float32)
    hf_model = transformers.AutoModel.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32)
    hf_model.eval()
    kwargs = {"input_ids": torch.from_numpy(ids.astype(np.int64))}
    if "segment_ids" in model._inputs_struct:
        kwargs["token_type_ids"] = torch.zeros_like(kwargs["input_ids"])
    with torch.no_grad():
        got = hf_model(**kwargs).last_hidden_state.numpy()
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0, err_msg=name)
