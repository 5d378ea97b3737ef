"""Files in buckets: `.weights.h5`, `.keras`, sharded `.weights.json`, safetensors,
keras-hub presets and Hugging Face folders read from fake GCS / S3 servers by byte ranges.

Each file is written by the library users write it with, uploaded, and
restored on 8 CPU devices: values bit-equal and shardings equal to the
restore of the same local file. `remote.TRAFFIC` counts the bytes this
module's ranged reads ask for, to show no object is downloaded whole.
"""

from __future__ import annotations

import json
import os

import keras
import numpy as np
import pytest

import shardckpt
from shardckpt import errors, storage
from shardckpt.budget import Budget
from shardckpt.formats import containers, open_reader
from shardckpt.storage import ranged as remote
from tests.zoo import build_zoo, lazy_zoo, randomize, saved_zoo_h5


def _upload(local: str, url: str) -> str:
    """Copies a local file, or every file of a local folder, to `url`; returns `url`."""
    if os.path.isdir(local):
        for root, _, files in os.walk(local):
            for name in files:
                rel = os.path.relpath(os.path.join(root, name), local)
                _upload(os.path.join(root, name), f"{url}/{rel}")
        return url
    with open(local, "rb") as f:
        storage.write_bytes(storage.parse(url), f.read())
    return url


def _values(model):
    return {v.path: np.asarray(v.value) for v in model.weights}


def _assert_same_restore(local_model, remote_model):
    """Bit-equal values and the same sharding, variable by variable."""
    local = {v.path: v for v in local_model.weights}
    assert set(local) == {v.path for v in remote_model.weights}
    for v in remote_model.weights:
        want = local[v.path]
        np.testing.assert_array_equal(np.asarray(v.value), np.asarray(want.value), err_msg=v.path)
        assert v.value.dtype == want.value.dtype, v.path
        assert v.value.sharding.is_equivalent_to(want.value.sharding, v.ndim), (v.path, v.value.sharding)


@pytest.fixture
def zoo_h5(tmp_path):
    return saved_zoo_h5(str(tmp_path / "zoo.weights.h5"), 5)


def _load_both(local: str, url: str):
    model, _ = lazy_zoo(mesh_shape=(2, 4))
    local_report = shardckpt.load_sharded(model, local)
    remote_model, _ = lazy_zoo(mesh_shape=(2, 4))
    remote_report = shardckpt.load_sharded(remote_model, url)
    assert remote_report.path == url and remote_report.format == local_report.format
    return model, remote_model


def test_weights_h5_from_bucket_equals_local_restore(zoo_h5, bucket):
    path, expected = zoo_h5
    url = _upload(path, f"{bucket}/ck/zoo.weights.h5")
    local_model, remote_model = _load_both(path, url)
    _assert_same_restore(local_model, remote_model)
    for v in remote_model.weights:
        np.testing.assert_array_equal(np.asarray(v.value), expected[v.path], err_msg=v.path)


@pytest.fixture
def gcs_bucket(gcs_server) -> str:
    """A fresh bucket on the fake GCS server (format checks need one server only)."""
    return gcs_server.new_bucket()


def test_keras_archive_and_sharded_weights_from_bucket(tmp_path, gcs_bucket):
    keras.backend.clear_session()
    model = build_zoo()
    randomize(model, 6)
    archive = str(tmp_path / "zoo.keras")
    model.save(archive)
    index = str(tmp_path / "sharded" / "zoo.weights.json")
    os.makedirs(os.path.dirname(index))
    model.save_weights(index, max_shard_size=5e-6)  # GB: ~5 KiB shards of the 17 KiB zoo
    shards = [n for n in os.listdir(os.path.dirname(index)) if n.endswith(".weights.h5")]
    assert len(shards) >= 3
    archive_url = _upload(archive, f"{gcs_bucket}/zoo.keras")
    folder_url = _upload(os.path.dirname(index), f"{gcs_bucket}/sharded")
    for local, url in ((archive, archive_url), (index, f"{folder_url}/zoo.weights.json")):
        local_model, remote_model = _load_both(local, url)
        _assert_same_restore(local_model, remote_model)


def _safetensors_files(tmp_path):
    from safetensors.numpy import save_file

    keras.backend.clear_session()
    model = build_zoo()
    randomize(model, 7)
    tensors = {v.path: np.asarray(v.value) for v in model.weights}
    single = str(tmp_path / "one" / "zoo.safetensors")
    os.makedirs(os.path.dirname(single))
    save_file(tensors, single)
    # A two-file set with its index, as Hugging Face writes them.
    folder = tmp_path / "set"
    os.makedirs(folder)
    keys = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((keys[::2], keys[1::2])):
        name = f"zoo-{i + 1:05d}-of-00002.safetensors"
        save_file({k: tensors[k] for k in part}, str(folder / name))
        weight_map.update({k: name for k in part})
    with open(folder / "zoo.safetensors.index.json", "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return single, str(folder / "zoo.safetensors.index.json"), tensors


def test_safetensors_file_and_index_set_from_bucket(tmp_path, gcs_bucket):
    single, index, tensors = _safetensors_files(tmp_path)
    single_url = _upload(single, f"{gcs_bucket}/one/zoo.safetensors")
    set_url = _upload(os.path.dirname(index), f"{gcs_bucket}/set")
    for local, url in ((single, single_url), (index, f"{set_url}/zoo.safetensors.index.json")):
        local_model, remote_model = _load_both(local, url)
        _assert_same_restore(local_model, remote_model)
        for v in remote_model.weights:
            np.testing.assert_array_equal(np.asarray(v.value), tensors[v.path], err_msg=v.path)


def _from_preset_both(local: str, url: str, **kw):
    """`from_preset` of the local folder and of its copy in a bucket."""
    keras.backend.clear_session()
    local_model = shardckpt.from_preset(local, **kw)
    keras.distribution.set_distribution(None)
    keras.backend.clear_session()
    remote_model = shardckpt.from_preset(url, **kw)
    assert type(remote_model) is type(local_model)
    return local_model, remote_model


def test_from_preset_of_a_keras_hub_preset_in_a_bucket(tmp_path, gcs_bucket):
    keras_hub = pytest.importorskip("keras_hub")
    keras.backend.clear_session()
    with shardckpt.lazy_init():  # no initializers; randomize gives every value
        backbone = keras_hub.models.LlamaBackbone(
            vocabulary_size=128, num_layers=1, num_query_heads=8, num_key_value_heads=8, hidden_dim=64,
            intermediate_dim=128,
        )
    randomize(backbone, 8)
    expected = _values(backbone)
    local = str(tmp_path / "preset")
    backbone.save_to_preset(local, max_shard_size=5e-5)  # GB: a sharded model.weights.json
    assert os.path.isfile(os.path.join(local, "model.weights.json"))
    url = _upload(local, f"{gcs_bucket}/presets/llama")
    mesh = keras.distribution.DeviceMesh((1, 8), ["batch", "model"])
    layout = keras_hub.models.LlamaBackbone.get_layout_map(mesh)
    local_model, remote_model = _from_preset_both(local, url, layout=layout)
    _assert_same_restore(local_model, remote_model)
    assert any(len(v.value.sharding.device_set) == 8 and not v.value.sharding.is_fully_replicated
               for v in remote_model.weights)
    for v in remote_model.weights:
        np.testing.assert_array_equal(np.asarray(v.value), expected[v.path], err_msg=v.path)


def test_from_preset_of_a_hugging_face_folder_in_a_bucket(tmp_path, gcs_bucket):
    pytest.importorskip("keras_hub")
    from tests.hf_fixtures import make_folder

    local = str(tmp_path / "mixtral")
    make_folder("mixtral", local, shards=2)  # stacked experts: variables made of several tensors
    assert os.path.isfile(os.path.join(local, "model.safetensors.index.json"))
    url = _upload(local, f"{gcs_bucket}/hf/mixtral")
    local_model, remote_model = _from_preset_both(local, url)  # auto_layout on 8 devices
    _assert_same_restore(local_model, remote_model)
    assert any(not v.value.sharding.is_fully_replicated for v in remote_model.weights)


def _embedding_h5(tmp_path, rows=4096, dim=128):
    """A 2 MiB float32 table saved by Keras; returns (path, its values)."""
    keras.backend.clear_session()
    tokens = keras.Input((4,), dtype="int32")
    model = keras.Model(tokens, keras.layers.Embedding(rows, dim, name="table")(tokens))
    randomize(model, 9)
    path = str(tmp_path / "table.weights.h5")
    model.save_weights(path)
    return path, np.asarray(model.weights[0].value)


def _lazy_table(rows=4096, dim=128):
    from tests.zoo import model_parallel

    dist = model_parallel({"table/embeddings": ("model", None)})
    with shardckpt.lazy_init():
        tokens = keras.Input((4,), dtype="int32")
        model = keras.Model(tokens, keras.layers.Embedding(rows, dim, name="table")(tokens))
    return model, dist


def test_a_device_box_requests_only_its_bytes_and_restore_reads_each_byte_once(tmp_path, bucket):
    """No whole-file download: one device's rows are one request of exactly their
    bytes; a sharded restore asks for about the file once, in requests no larger
    than its budget."""
    path, table = _embedding_h5(tmp_path)
    size = os.path.getsize(path)
    url = _upload(path, f"{bucket}/table.weights.h5")
    reader = open_reader(url)
    try:
        (key,) = reader.keys()
        assert isinstance(reader, shardckpt.formats.MappedReader)
        assert not reader.is_mapped(key)  # fresh reads, held under the budget
        remote.TRAFFIC.reset()
        box = (slice(512, 1024), slice(0, 128))  # device 1's rows of 8
        np.testing.assert_array_equal(reader.read(key, box), table[box])
        assert (remote.TRAFFIC.requests, remote.TRAFFIC.bytes) == (1, 512 * 128 * 4)
        remote.TRAFFIC.reset()
        np.testing.assert_array_equal(reader.read(key, (slice(7, 8), slice(40, 50))), table[7:8, 40:50])
        assert remote.TRAFFIC.bytes == 10 * 4
    finally:
        reader.close()

    model, dist = _lazy_table()
    remote.TRAFFIC.reset()
    budget = 512 * 1024
    shardckpt.load_sharded(model, url, max_inflight_bytes=budget)
    variable = model.weights[0]
    np.testing.assert_array_equal(np.asarray(variable.value), table)
    want = dist.get_variable_layout(variable).backend_layout
    assert variable.value.sharding.is_equivalent_to(want, 2)
    # Each data byte once; the metadata h5py reads when opening, a few cached blocks.
    assert table.nbytes <= remote.TRAFFIC.bytes < table.nbytes + 4 * remote.BLOCK
    assert size > table.nbytes
    assert remote.TRAFFIC.largest <= budget


def test_remote_file_reads_what_the_local_file_holds(tmp_path, bucket):
    """The file object h5py and zipfile read through: any seek and read equal to the file's."""
    path, _ = _embedding_h5(tmp_path, rows=1024, dim=64)
    with open(path, "rb") as f:
        data = f.read()
    url = _upload(path, f"{bucket}/t.weights.h5")
    location = storage.parse(url)
    obj = containers.open_container(location)
    assert obj.size == len(data)  # from the HDF5 superblock, checked against the object
    remote.TRAFFIC.reset()
    with obj.open() as f:
        rng = np.random.default_rng(0)
        for _ in range(50):
            at = int(rng.integers(0, len(data)))
            n = int(rng.integers(0, 3 * remote.BLOCK))
            f.seek(at)
            assert f.read(n) == data[at : at + n]
        assert f.seek(-10, os.SEEK_END) == len(data) - 10
        assert f.read() == data[-10:]
        assert f.read(5) == b""
    assert remote.TRAFFIC.bytes < 60 * 3 * remote.BLOCK  # block reads, never the whole 260 KiB per read
    archive = str(tmp_path / "a.keras")
    keras.backend.clear_session()
    build_zoo().save(archive)
    with open(archive, "rb") as f:
        zipped = f.read()
    keras_object = storage.parse(_upload(archive, f"{bucket}/a.keras"))
    assert containers.open_container(keras_object).size == len(zipped)  # from the zip's end record


def test_convert_inspect_and_verify_read_a_bucket_file(tmp_path, gcs_bucket, zoo_h5):
    path, expected = zoo_h5
    url = _upload(path, f"{gcs_bucket}/src/zoo.weights.h5")
    info = shardckpt.inspect(url)
    local_info = shardckpt.inspect(path)
    assert info.path == url and info.format == local_info.format == "h5"
    assert [(a.key, a.shape, a.dtype) for a in info.arrays] == [(a.key, a.shape, a.dtype) for a in local_info.arrays]
    checked = shardckpt.verify(url)
    assert checked.ok and checked.arrays == len(local_info.arrays)

    model, _ = lazy_zoo()
    dst = str(tmp_path / "orbax")
    report = shardckpt.convert(url, dst, model=model)
    assert report.src == url and report.format == "h5"
    loaded, dist = lazy_zoo(mesh_shape=(2, 4))
    shardckpt.load_sharded(loaded, dst)
    for v in loaded.weights:
        np.testing.assert_array_equal(np.asarray(v.value), expected[v.path], err_msg=v.path)
        assert v.value.sharding.is_equivalent_to(dist.get_variable_layout(v).backend_layout, v.ndim), v.path

    # A .keras archive in the bucket names its own architecture: no model
    # needed. What it writes equals what converting the local archive writes.
    keras.backend.clear_session()
    source = build_zoo()
    randomize(source, 10)
    archive = str(tmp_path / "zoo.keras")
    source.save(archive)
    archive_url = _upload(archive, f"{gcs_bucket}/src/zoo.keras")
    keras.backend.clear_session()  # the same auto-generated names in both builds
    assert shardckpt.convert(archive_url, str(tmp_path / "from_bucket")).format == "keras"
    keras.backend.clear_session()
    shardckpt.convert(archive, str(tmp_path / "from_disk"))
    ours, theirs = open_reader(str(tmp_path / "from_bucket")), open_reader(str(tmp_path / "from_disk"))
    try:
        assert ours.keys() == theirs.keys() and len(ours.keys()) > 10
        for key in ours.keys():
            if key.endswith("seed_generator_state"):
                continue  # not in .keras files: convert writes an initial value (random)
            box = tuple(slice(0, n) for n in ours.spec(key).shape)
            np.testing.assert_array_equal(ours.read(key, box), theirs.read(key, box), err_msg=key)
    finally:
        ours.close()
        theirs.close()


def test_truncated_and_missing_bucket_files_raise_typed_errors(tmp_path, gcs_bucket, zoo_h5):
    path, _ = zoo_h5
    with open(path, "rb") as f:
        data = f.read()
    single, _, _ = _safetensors_files(tmp_path)
    with open(single, "rb") as f:
        tensors = f.read()
    for name, content in (("cut.weights.h5", data[: len(data) // 2]), ("cut.safetensors", tensors[:-100])):
        url = f"{gcs_bucket}/{name}"
        storage.write_bytes(storage.parse(url), content)
        model, _ = lazy_zoo(mesh_shape=(2, 4))
        with pytest.raises(errors.CorruptCheckpointError, match=url):
            shardckpt.load_sharded(model, url)
        with pytest.raises(errors.CorruptCheckpointError, match=url):
            shardckpt.verify(url)
    for name in ("gone.weights.h5", "gone.keras", "gone.safetensors", "gone.safetensors.index.json"):
        url = f"{gcs_bucket}/{name}"
        model, _ = lazy_zoo(mesh_shape=(2, 4))
        with pytest.raises(errors.CheckpointNotFoundError, match=url):
            shardckpt.load_sharded(model, url)
    with pytest.raises(errors.CheckpointNotFoundError, match=f"{gcs_bucket}/no-preset"):
        shardckpt.from_preset(f"{gcs_bucket}/no-preset")
    model, _ = lazy_zoo(mesh_shape=(2, 4))
    with pytest.raises(errors.BucketNotFoundError, match="gs://shardckpt-no-such-bucket/m.weights.h5"):
        shardckpt.load_sharded(model, "gs://shardckpt-no-such-bucket/m.weights.h5")


def test_ranged_reads_of_any_box_from_threads_stay_under_the_in_flight_cap(tmp_path, gcs_bucket, monkeypatch):
    """Boxes of every shape come back equal to numpy's, in requests of at most PART
    bytes, with never more than the cap in flight over all threads."""
    import concurrent.futures

    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    cube = rng.standard_normal((16, 64, 96)).astype(np.float32)  # 384 KiB
    path = str(tmp_path / "cube.safetensors")
    save_file({"cube": cube}, path)
    url = _upload(path, f"{gcs_bucket}/cube.safetensors")
    monkeypatch.setattr(remote, "PART", 16 * 1024)
    monkeypatch.setattr(remote, "GAP", 1024)
    cap = Budget(64 * 1024)
    peak = []

    def counted(method):
        def call(n):
            held = method(n)
            peak.append(cap.used)
            return held
        return call

    monkeypatch.setattr(cap, "acquire", counted(cap.acquire))
    monkeypatch.setattr(cap, "try_acquire", counted(cap.try_acquire))
    monkeypatch.setattr(remote, "_IN_FLIGHT", cap)
    boxes = [tuple(slice(0, n) for n in cube.shape)]
    for _ in range(40):
        box = []
        for n in cube.shape:
            a = int(rng.integers(0, n))
            box.append(slice(a, int(rng.integers(a + 1, n + 1))))
        boxes.append(tuple(box))
    reader = open_reader(url)
    remote.TRAFFIC.reset()
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda b: reader.read("cube", b), boxes))
    finally:
        reader.close()
    for box, got in zip(boxes, results, strict=True):
        np.testing.assert_array_equal(got, cube[box], err_msg=str(box))
    assert remote.TRAFFIC.largest <= 16 * 1024
    assert max(peak) <= 64 * 1024 and cap.used == 0


def test_strided_remaps_read_from_a_bucket_equal_numpy(tmp_path, bucket):
    """Hugging Face tensors read as Keras variables (transposed, reshaped, reversed,
    stacked): every box equals numpy's, reading only the elements it needs."""
    from safetensors.numpy import save_file

    from shardckpt.formats.hf_remap import Strided
    from shardckpt.formats.safetensors import SafetensorsReader

    stored = np.arange(64 * 96, dtype=np.float32).reshape(64, 96)
    path = str(tmp_path / "w.safetensors")
    save_file({"w": stored}, path)
    tensors = SafetensorsReader(_upload(path, f"{bucket}/w.safetensors"))
    hooks = [
        lambda x: x.T,
        lambda x: np.transpose(np.reshape(x, (8, 8, 96)), axes=(2, 0, 1)),
        lambda x: np.reshape(x[:, 32:64], (8, 8, 32))[::-1, 1],
        lambda x: np.stack([x.T, x.T[:, ::-1]], axis=1),
    ]
    rng = np.random.default_rng(1)
    try:
        for hook in hooks:
            expected = hook(stored)
            remap = hook(Strided.stored("w", stored.dtype, stored.shape))
            for _ in range(10):
                box = []
                for n in expected.shape:
                    a = int(rng.integers(0, n))
                    box.append(slice(a, int(rng.integers(a + 1, n + 1))))
                np.testing.assert_array_equal(remap.read(tuple(box), tensors.read_strided), expected[tuple(box)])
        # A transposed column block: the runs of its 16 stored rows, not the tensor.
        remote.TRAFFIC.reset()
        box = (slice(10, 20), slice(0, 16))
        np.testing.assert_array_equal(Strided.stored("w", stored.dtype, stored.shape).T.read(box, tensors.read_strided),
                                      stored.T[box])
        # Only its elements: a gap between two rows' runs is 86 elements, far over 1/8 of them.
        assert remote.TRAFFIC.bytes == 16 * 10 * 4
    finally:
        tensors.close()


def test_from_preset_of_a_task_preset_in_a_bucket_reads_its_task_weights(tmp_path, gcs_bucket):
    keras_hub = pytest.importorskip("keras_hub")
    keras.backend.clear_session()
    with shardckpt.lazy_init():  # no initializers (seconds for BERT's); randomize gives every value
        backbone = keras_hub.models.BertBackbone(
            vocabulary_size=128, num_layers=1, num_heads=8, hidden_dim=64, intermediate_dim=128, max_sequence_length=16
        )
    task = keras_hub.models.BertTextClassifier(backbone=backbone, num_classes=4, preprocessor=None)
    randomize(task, 11)
    expected = _values(task)
    local = str(tmp_path / "bert")
    task.save_to_preset(local)
    assert os.path.isfile(os.path.join(local, "task.weights.h5"))
    url = _upload(local, f"{gcs_bucket}/presets/bert")
    mesh = keras.distribution.DeviceMesh((2, 4), ["data", "model"])
    layout = keras.distribution.LayoutMap(mesh)
    layout[".*token_embedding/embeddings"] = ("model", None)
    layout["logits/kernel"] = ("model", None)
    keras.backend.clear_session()
    remote_model = shardckpt.from_preset(url, layout=layout, cls=keras_hub.models.TextClassifier)
    assert isinstance(remote_model, keras_hub.models.BertTextClassifier)
    assert remote_model.optimizer is not None  # compiled as keras-hub's from_preset does
    dist = keras.distribution.distribution()
    assert {v.path for v in remote_model.weights} == set(expected)
    for v in remote_model.weights:
        np.testing.assert_array_equal(np.asarray(v.value), expected[v.path], err_msg=v.path)
        assert v.value.sharding.is_equivalent_to(dist.get_variable_layout(v).backend_layout, v.ndim), v.path
    assert remote_model.get_layer("logits").kernel.value.sharding.spec[0] == "model"


def test_convert_from_a_gcs_bucket_into_an_s3_bucket(gcs_bucket, s3_server, zoo_h5):
    """Both ends remote (and different clouds): the h5 is read by ranges from
    GCS, the Orbax step written into S3, and it restores bit-equal, sharded."""
    path, expected = zoo_h5
    src = _upload(path, f"{gcs_bucket}/src/zoo.weights.h5")
    dst = f"{s3_server.new_bucket()}/ckpt/0"
    model, _ = lazy_zoo()
    report = shardckpt.convert(src, dst, model=model)
    assert report.src == src and report.format == "h5" and report.bytes_on_disk > 0
    assert shardckpt.verify(dst).ok
    loaded, dist = lazy_zoo(mesh_shape=(2, 4))
    assert shardckpt.load_sharded(loaded, dst).path == dst
    for v in loaded.weights:
        np.testing.assert_array_equal(np.asarray(v.value), expected[v.path], err_msg=v.path)
        assert v.value.sharding.is_equivalent_to(dist.get_variable_layout(v).backend_layout, v.ndim), v.path
