"""Restore traffic under `jax.distributed`, counted on the server side.

Two real processes (4 CPU devices each) load one checkpoint from the fake GCS
server and from moto onto a (1, 8) mesh split over both; each process reads
through its own ports of a counting proxy in front of the server
(tests/proxy.py), so the bytes it asked for are what the server sent it.
Each must ask for at most 0.6 of the checkpoint's array bytes: h5 and
safetensors objects (ranged reads, shardckpt.storage.ranged), an Orbax step
written with chunks on the same layout (tensorstore's OCDBT reads) through
`load_sharded` and `restore_latest` (which `fit(resume=True)` calls too).
"""

from __future__ import annotations

import json

import keras
import numpy as np
import pytest
import safetensors.numpy

from shardckpt import convert, storage
from tests.mp import run_pair
from tests.proxy import CountingProxy

pytestmark = pytest.mark.multiprocess

LIMIT = 0.6
"""Most bytes one of the 2 processes may request, as a fraction of the array bytes."""
FORMATS = {"h5": "m.weights.h5", "safetensors": "m.safetensors", "orbax": "orbax", "restore_latest": "orbax"}


def build() -> keras.Model:
    """~4 MiB of float32: a column-sharded kernel (strided rows) and a row-sharded one."""
    return keras.Sequential(
        [keras.Input((64,)), keras.layers.Dense(8192, name="wide"), keras.layers.Dense(64, name="narrow")],
        name="traffic",
    )


def layout_map(mesh) -> keras.distribution.LayoutMap:
    layouts = keras.distribution.LayoutMap(mesh)
    layouts["traffic/wide/kernel"] = (None, "model")
    layouts["traffic/wide/bias"] = ("model",)
    layouts["traffic/narrow/kernel"] = ("model", None)
    return layouts


def test_each_of_two_processes_requests_only_its_own_pieces(tmp_path, gcs_server, s3_server):
    keras.backend.clear_session()
    keras.utils.set_random_seed(5)
    model = build()
    values = {v.path: np.asarray(v.value) for v in model.weights}
    total = sum(a.nbytes for a in values.values())
    np.savez(tmp_path / "expected.npz", **values)
    model.save_weights(tmp_path / "m.weights.h5")
    safetensors.numpy.save_file(values, str(tmp_path / "m.safetensors"))
    mesh = keras.distribution.DeviceMesh((1, 8), ["data", "model"])
    proxies, loads = [], []
    for server in (gcs_server, s3_server):
        root = storage.parse(server.new_bucket())
        for name in ("m.weights.h5", "m.safetensors"):
            storage.write_bytes(root.join(name), (tmp_path / name).read_bytes())
        # Chunks on the (1, 8) layout, as a save from that layout writes them.
        convert(str(tmp_path / "m.weights.h5"), root.join("orbax", "0").url, model=model,
                layout=layout_map(mesh), progress=False)
        labels = [f"{fmt}-p{i}" for fmt in FORMATS for i in range(2)]
        proxy = CountingProxy(server.endpoint, labels)
        proxies.append((server.scheme, proxy))
        variable = "TENSORSTORE_GCS_HTTP_URL" if server.scheme == "gs" else "AWS_ENDPOINT_URL"
        for fmt, name in FORMATS.items():
            loads.append({
                "label": f"{server.scheme}-{fmt}", "how": fmt, "url": root.join(name).url,
                "endpoint_variable": variable, "endpoints": [proxy.url(f"{fmt}-p{i}") for i in range(2)],
            })
    (tmp_path / "config.json").write_text(json.dumps({"loads": loads}))
    try:
        run_pair("_traffic_worker.py", str(tmp_path))
    finally:
        for _, proxy in proxies:
            proxy.stop()
    results = [json.loads((tmp_path / f"result{i}.json").read_text()) for i in range(2)]
    figures = {}
    for scheme, proxy in proxies:
        for fmt in FORMATS:
            sent = [proxy.body_bytes[f"{fmt}-p{i}"] for i in range(2)]
            figures[f"{scheme}-{fmt}"] = [round(n / total, 3) for n in sent]
            for i in range(2):
                assert results[i][f"{scheme}-{fmt}"]["shards"] > 0
    print(f"array bytes {total}; bytes each process requested, as a fraction of them: {figures}")
    for label, fractions in figures.items():
        assert all(f <= LIMIT for f in fractions), (label, figures)
        assert sum(fractions) >= 0.9, (label, figures)  # together they read everything
