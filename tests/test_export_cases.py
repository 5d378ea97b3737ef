"""`shardckpt.export` around the edges: tasks with tokenizers, LoRA, dtypes, refusals, budgets, crashes.

A tiny Llama (tests/hf_fixtures.py) loaded onto a (2, 4) mesh with
`from_preset` is the model unless a test needs another.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import hf_fixtures as fx
import keras
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file

import shardckpt
from shardckpt.errors import (
    CheckpointNotFoundError,
    DestinationExistsError,
    UnknownFormatError,
    UnloadedVariableError,
    UnsupportedModelError,
)

keras_hub = pytest.importorskip("keras_hub")


def _load(folder: str) -> keras.Model:
    keras.backend.clear_session()
    return shardckpt.from_preset(folder, mesh=(2, 4))


def test_bfloat16_export_stores_the_cast_values(llama_folder, tmp_path):
    model = _load(llama_folder)
    shardckpt.export(model, tmp_path / "out", dtype="bfloat16", max_inflight_bytes=512)
    stored = load_file(str(tmp_path / "out" / "model.safetensors"))
    source = load_file(os.path.join(llama_folder, "model.safetensors"))
    assert sorted(stored) == sorted(source)
    for key, value in stored.items():
        assert value.dtype == ml_dtypes.bfloat16, key
        np.testing.assert_array_equal(value, source[key].astype(ml_dtypes.bfloat16), err_msg=key)


def test_tiny_budget_writes_in_row_blocks_bit_equal(llama_folder, tmp_path):
    model = _load(llama_folder)
    report = shardckpt.export(model, tmp_path / "out", max_inflight_bytes=64)  # one row per block
    assert report.bytes_written == report.bytes_total
    stored, source = load_file(str(tmp_path / "out" / "model.safetensors")), load_file(os.path.join(llama_folder, "model.safetensors"))
    for key in source:
        assert stored[key].tobytes() == source[key].tobytes(), key


def test_assembled_blocks_synced_and_dropped_as_they_go_bit_equal(llama_folder, tmp_path, monkeypatch):
    """4 KiB blocks assembled from the (2, 4) pieces, each written back and dropped from the page cache."""
    from shardckpt.exporting import api
    from shardckpt.formats import mapped_writer

    drops = []
    monkeypatch.setattr(api, "BLOCK_BYTES", 4096)
    monkeypatch.setattr(mapped_writer, "WRITEBACK_BYTES", 1)
    fadvise = os.posix_fadvise
    monkeypatch.setattr(mapped_writer.os, "posix_fadvise", lambda *a: (drops.append(a[3]), fadvise(*a)))
    model = _load(llama_folder)
    report = shardckpt.export(model, tmp_path / "out")
    assert report.bytes_written == report.bytes_total
    assert len(drops) > report.bytes_total // 4096 // 2 and set(drops) == {os.POSIX_FADV_DONTNEED}
    stored, source = load_file(str(tmp_path / "out" / "model.safetensors")), load_file(os.path.join(llama_folder, "model.safetensors"))
    assert sorted(stored) == sorted(source)
    for key in source:
        assert stored[key].tobytes() == source[key].tobytes(), key


def test_safetensors_format_keys_are_variable_paths_and_load_back(llama_folder, tmp_path):
    model = _load(llama_folder)
    shardckpt.export(model, tmp_path / "st", format="safetensors", max_shard_size="10KB")
    names = os.listdir(tmp_path / "st")
    assert "model.safetensors.index.json" in names and len([n for n in names if n.endswith(".safetensors")]) > 2
    index = json.loads((tmp_path / "st" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == {v.path for v in model.weights}
    keras.backend.clear_session()
    with shardckpt.lazy_init():
        fresh = shardckpt.presets.hf.build(llama_folder)
    report = shardckpt.load_sharded(
        fresh, str(tmp_path / "st" / "model.safetensors.index.json"), layout=keras.distribution.DataParallel())
    assert not report.missing and not report.unexpected
    for a, b in zip(model.weights, fresh.weights):
        np.testing.assert_array_equal(np.asarray(a.value), np.asarray(b.value), err_msg=a.path)


def test_existing_destination_is_refused_and_overwrite_replaces_it(llama_folder, tmp_path):
    model = _load(llama_folder)
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    with pytest.raises(DestinationExistsError, match="overwrite=True"):
        shardckpt.export(model, dst)
    assert os.listdir(dst) == ["keep.txt"]
    shardckpt.export(model, dst, overwrite=True)
    assert sorted(os.listdir(dst)) == ["config.json", "model.safetensors"]
    assert not os.path.exists(str(dst) + ".shardckpt-partial") and not os.path.exists(str(dst) + ".shardckpt-old")


def test_refusals_happen_before_anything_is_written(llama_folder, tmp_path):
    plain = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    with pytest.raises(UnsupportedModelError, match="Sequential.*format='keras-hub'|Sequential.*format='safetensors'"):
        shardckpt.export(plain, tmp_path / "a")
    with pytest.raises(ValueError, match="format must be one of safetensors, orbax, keras-hub, hf, peft. Received: format='onnx'"):
        shardckpt.export(plain, tmp_path / "b", format="onnx")
    with pytest.raises(ValueError, match="Received: format='h5'"):  # a format shardckpt only reads
        shardckpt.export(plain, tmp_path / "b", format="h5")

    model = _load(llama_folder)
    keras.distribution.set_distribution(None)
    model.quantize("int8")
    with pytest.raises(UnsupportedModelError, match=r"Llama3Backbone is quantized.*export the float model"):
        shardckpt.export(model, tmp_path / "c", format="keras-hub")

    keras.backend.clear_session()
    with shardckpt.lazy_init():
        unloaded = shardckpt.presets.hf.build(llama_folder)
    with pytest.raises(UnloadedVariableError, match="token_embedding"):
        shardckpt.export(unloaded, tmp_path / "d")
    assert os.listdir(tmp_path) == []  # not even a partial folder


def test_export_formats_are_the_writers_of_the_format_table():
    """One table of formats: export's writers fill its `writer` slots (formats cannot import export)."""
    from shardckpt.formats import registry

    writers = {name: fmt.writer for name, fmt in registry.FORMATS.items() if fmt.writer is not None}
    assert sorted(writers) == ["hf", "orbax", "peft", "preset", "safetensors"]
    assert registry.writer_for("keras-hub") is writers["preset"]
    assert registry.writer_for("hf") is writers["hf"] and registry.writer_for("orbax") is writers["orbax"]


def test_lora_model_exports_merged_kernels(llama_folder, tmp_path):
    model = _load(llama_folder)
    model.enable_lora(rank=2)
    rng = np.random.default_rng(3)
    merged = {}
    for layer in model._flatten_layers():
        if getattr(layer, "lora_enabled", False):
            b = layer.lora_kernel_b
            b.assign(rng.standard_normal(b.shape).astype("float32"))
            merged[layer._kernel.path] = np.asarray(layer.kernel)
            assert not np.array_equal(merged[layer._kernel.path], np.asarray(layer._kernel.value))
    assert merged
    shardckpt.export(model, tmp_path / "hf")
    shardckpt.export(model, tmp_path / "kh", format="keras-hub")
    keras.backend.clear_session()
    back = fx.keras_hub_load(str(tmp_path / "hf"))
    for v in back.weights:
        if v.path in merged:
            np.testing.assert_array_equal(np.asarray(v.value), merged[v.path], err_msg=v.path)
    keras.backend.clear_session()
    preset = keras_hub.models.Backbone.from_preset(str(tmp_path / "kh"))
    checked = 0
    for v in preset.weights:
        if v.path in merged:
            np.testing.assert_array_equal(np.asarray(v.value), merged[v.path], err_msg=v.path)
            checked += 1
    assert checked == len(merged)


def _gpt2_task(folder: str) -> keras.Model:
    merges = ["Ġ a", "Ġ t", "a i", "p l", "n e", "Ġa t", "p o", "r t", "ai r", "pl a", "po rt", "Ġa i",
              "Ġai r", "pla ne"]
    tokens = ["<|endoftext|>", "!", *"Ġairplnetobh", *(m.replace(" ", "") for m in merges)]
    vocab = {t: i for i, t in enumerate(dict.fromkeys(tokens))}
    tokenizer = keras_hub.models.GPT2Tokenizer(vocabulary=vocab, merges=merges)
    preprocessor = keras_hub.models.GPT2CausalLMPreprocessor(tokenizer, sequence_length=8)
    backbone = _load(folder)
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=preprocessor)


def test_causal_lm_with_tokenizer_end_to_end(tmp_path):
    fx.make_folder("gpt2", str(tmp_path / "src"))
    task = _gpt2_task(str(tmp_path / "src"))
    values = [np.asarray(v.value) for v in task.backbone.weights]
    ids = np.asarray(task.preprocessor.tokenizer(" airplane at airport"))
    shardckpt.export(task, tmp_path / "hf")
    shardckpt.export(task, tmp_path / "kh", format="keras-hub")
    assert {"config.json", "model.safetensors", "vocab.json", "merges.txt", "tokenizer_config.json"} <= set(
        os.listdir(tmp_path / "hf")
    )
    keras.distribution.set_distribution(None)
    logits = []
    for folder in ("hf", "kh"):
        keras.backend.clear_session()
        back = keras_hub.models.CausalLM.from_preset(str(tmp_path / folder))
        assert type(back).__name__ == "GPT2CausalLM", folder
        for v, want in zip(back.backbone.weights, values):
            np.testing.assert_array_equal(np.asarray(v.value), want, err_msg=f"{folder}: {v.path}")
        np.testing.assert_array_equal(np.asarray(back.preprocessor.tokenizer(" airplane at airport")), ids)
        back.preprocessor.sequence_length = 8  # keras-hub's HF loader gives its default (1024 > 32 positions)
        logits.append(np.asarray(back.predict(["airplane at", "airport"], verbose=0)))
    # The task keras-hub reads from either folder computes the same function.
    np.testing.assert_array_equal(logits[0], logits[1])


_KILL_WORKER = r"""
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["KERAS_BACKEND"] = "jax"
os.environ["JAX_PLATFORMS"] = "cpu"
import keras, keras_hub, numpy as np, shardckpt
keras.distribution.set_distribution(keras.distribution.ModelParallel(
    layout_map=keras_hub.models.Llama3Backbone.get_layout_map(keras.distribution.DeviceMesh((2, 4), ["batch", "model"]))))
model = keras_hub.models.Llama3Backbone(vocabulary_size=16384, num_layers=4, hidden_dim=512, intermediate_dim=2048,
                                        num_query_heads=4, num_key_value_heads=4)  # 133 MB
print("built", flush=True)
shardckpt.export(model, sys.argv[1], max_inflight_bytes=64)
print("done", flush=True)
"""


def test_sigkill_mid_export_leaves_nothing_that_loads(tmp_path):
    dst = tmp_path / "out"
    partial = str(dst) + ".shardckpt-partial"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.Popen([sys.executable, "-c", _KILL_WORKER, str(dst)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not os.path.exists(os.path.join(partial, "model.safetensors")):
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            assert time.monotonic() < deadline, "the export never started"
            time.sleep(0.02)
        # Laid out, now writing pieces (1 row per block: seconds of work).
        assert proc.poll() is None, "the export finished before the kill: make it slower"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not dst.exists()
    assert os.path.exists(partial) and "config.json" not in os.listdir(partial)
    with pytest.raises(CheckpointNotFoundError):
        shardckpt.from_preset(str(dst))
    with pytest.raises(UnknownFormatError):  # the partial folder is no format: no config.json
        shardckpt.from_preset(partial)


def test_cli_convert_to_keras_hub_then_back_to_hf(llama_folder, tmp_path, capsys):
    from shardckpt.cli.main import main

    preset, back = str(tmp_path / "preset"), str(tmp_path / "hf")
    assert main(["convert", llama_folder, preset, "--to", "keras-hub", "--mesh", "2x4", "--quiet"]) == 0
    assert "as keras-hub" in capsys.readouterr().out
    keras.backend.clear_session()
    assert main(["convert", preset, back, "--to", "hf", "--max-shard-size", "10KB", "--quiet"]) == 0
    stored, source = fx_tensors(back), fx_tensors(llama_folder)
    assert sorted(stored) == sorted(source)
    for key in source:
        assert stored[key].tobytes() == source[key].tobytes(), key
    weights = str(tmp_path / "w.weights.h5")
    with open(weights, "wb"):
        pass
    assert main(["convert", weights, str(tmp_path / "x"), "--to", "hf", "--quiet"]) == 1
    assert "needs the architecture: pass --model" in capsys.readouterr().err


def fx_tensors(folder: str) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for name in os.listdir(folder):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, name)))
    return out


def test_orbax_format_loads_back_in_keras_and_shardckpt(llama_folder, tmp_path):
    model = _load(llama_folder)
    values = {v.path: np.asarray(v.value) for v in model.weights}
    report = shardckpt.export(model, tmp_path / "orbax", format="orbax", max_inflight_bytes=4096)
    assert report.arrays == len(model.weights) and report.bytes_written == sum(a.nbytes for a in values.values())
    keras.backend.clear_session()
    with shardckpt.lazy_init():
        fresh = shardckpt.presets.hf.build(llama_folder)
    shardckpt.load_sharded(fresh, str(tmp_path / "orbax"), layout=keras.distribution.DataParallel())
    for v in fresh.weights:
        np.testing.assert_array_equal(np.asarray(v.value), values[v.path], err_msg=v.path)
    keras.distribution.set_distribution(None)
    keras.backend.clear_session()
    plain = shardckpt.presets.hf.build(llama_folder)  # Keras' own loader: a built, compiled model
    shardckpt.presets.hf.initialize_states(plain)
    for v in plain.weights:
        v.assign(np.zeros(v.shape, v.dtype))
    plain.compile()
    plain.load_weights(str(tmp_path / "orbax"))
    for v in plain.weights:
        np.testing.assert_array_equal(np.asarray(v.value), values[v.path], err_msg=v.path)


BUDGET = 1 << 20


def test_host_memory_stays_within_the_budget(tmp_path):
    """A 64 MiB kernel on one device, cast to bfloat16 on the way: the anonymous memory the
    export adds stays near the 1 MiB budget (sampled RssAnon; 12 MiB of slack for the process's
    other threads); with a 1 GiB budget the whole cast piece (32 MiB) is held at once."""
    import threading

    def rss_anon() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))

    model = keras.Sequential([keras.Input((4096,)), keras.layers.Dense(4096, use_bias=False, name="dense")])
    kernel = model.layers[0].kernel
    kernel.assign(np.random.default_rng(0).standard_normal(kernel.shape, dtype=np.float32))
    shardckpt.export(model, tmp_path / "warm", format="safetensors", dtype="bfloat16", max_inflight_bytes=1 << 20)
    base = peak = rss_anon()
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, rss_anon())

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        shardckpt.export(model, tmp_path / "out", format="safetensors", dtype="bfloat16", max_inflight_bytes=BUDGET)
    finally:
        done.set()
        sampler.join()
    assert peak - base < 12 * 2**20, f"{(peak - base) / 2**20:.1f} MiB over the start"
    stored = load_file(str(tmp_path / "out" / "model.safetensors"))[kernel.path]
    np.testing.assert_array_equal(stored, np.asarray(kernel.value).astype(ml_dtypes.bfloat16))
