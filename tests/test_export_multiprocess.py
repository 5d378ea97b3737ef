"""2 real processes x 4 CPU devices export one folder: byte for byte the 1-process export."""

from __future__ import annotations

import json
import os

import hf_fixtures as fx
import keras
import pytest

import shardckpt
from shardckpt import storage
from tests.mp import run_pair

pytestmark = pytest.mark.multiprocess
keras_hub = pytest.importorskip("keras_hub")


def _files(folder) -> dict[str, bytes]:
    # metadata.json holds keras-hub's save date; everything else must be equal.
    return {n: (folder / n).read_bytes() for n in sorted(os.listdir(folder)) if n != "metadata.json"}


def test_two_processes_write_half_each_and_equal_the_single_process_export(tmp_path, gcs_server):
    bucket = gcs_server.new_bucket()
    fx.make_folder("llama", str(tmp_path / "src"))
    keras.backend.clear_session()
    model = shardckpt.from_preset(str(tmp_path / "src"), mesh=(2, 4))
    shardckpt.export(model, tmp_path / "one_hf", max_shard_size="20KB")
    shardckpt.export(model, tmp_path / "one_kh", format="keras-hub", max_shard_size=20e3 / 1024**3)
    keras.distribution.set_distribution(None)

    run_pair("_export_worker.py", str(tmp_path), bucket, timeout=300)

    for one, two in (("one_hf", "mp_hf"), ("one_kh", "mp_kh")):
        a, b = _files(tmp_path / one), _files(tmp_path / two)
        assert list(a) == list(b) and len(a) > 3
        for name in a:
            assert a[name] == b[name], f"{two}/{name} differs from the 1-process export"
    results = [json.loads((tmp_path / f"result{i}.json").read_text()) for i in range(2)]
    for r in results:
        assert "2 processes exporting into one bucket folder is not built" in r["bucket_refusal"]
    assert storage.list_keys(storage.parse(bucket)) == []
    for fmt in ("hf", "keras-hub"):
        total = results[0][fmt]["total"]
        written = [r[fmt]["written"] for r in results]
        assert sum(written) == total, (fmt, written)  # every byte written once, by one process
        assert all(0.3 * total < w < 0.7 * total for w in written), (fmt, written)


def test_a_mixed_dtype_hf_export_warns_once_from_two_processes(tmp_path):
    """The config-dtype warning of a mixed-dtype Hugging Face export (every process plans it) is said by process 0 alone."""
    run_pair("_export_mixed_worker.py", str(tmp_path), timeout=300)
    said = [json.loads((tmp_path / f"mixed{i}.json").read_text()) for i in range(2)]
    assert [len(s) for s in said] == [1, 0], said
    assert "config.json says dtype=float32 (the most bytes)" in said[0][0]
    assert json.loads((tmp_path / "mp_mixed" / "config.json").read_text())["dtype"] == "float32"
