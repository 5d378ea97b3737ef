"""Path classification: an unsupported `scheme://` is refused at every entry point, never a local folder."""

from __future__ import annotations

import os

import keras
import pytest

import shardckpt
from shardckpt import errors, storage
from shardckpt.cli.main import main as cli_main
from tests.zoo import build_zoo


@pytest.mark.parametrize(
    ("path", "scheme", "bucket", "key"),
    [
        ("gs://bkt/ckpts/run-1/", "gs", "bkt", "ckpts/run-1"),
        ("s3://bkt", "s3", "bkt", ""),
        ("S3://bkt//a/./b", "s3", "bkt", "a/b"),
    ],
)
def test_bucket_urls_are_classified(path, scheme, bucket, key, monkeypatch):
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ACCESS_KEY_ID"):
        monkeypatch.delenv(name, raising=False)
    location = storage.parse(path)
    assert (location.scheme, location.bucket, location.path) == (scheme, bucket, key)
    assert location.is_remote and location.local_path is None
    spec = storage.kvstore(location)
    context = spec.pop("context")
    driver = {"gs": "gcs", "s3": "s3"}[scheme]
    assert spec == {"driver": driver, "bucket": bucket, "path": key + "/" if key else ""}
    # Every request is bounded: TensorStore's own default is 32 retries with back-off up to 32 s.
    assert context == {f"{driver}_request_retries": {"max_retries": 4, "initial_delay": "0.5s", "max_delay": "8s"}}


def test_local_paths_and_file_urls_are_local(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert storage.parse("ck/0") == storage.Location("local", str(tmp_path / "ck" / "0"))
    assert storage.parse("file:///tmp/x/") == storage.Location("local", "/tmp/x")
    # One slash is no URL: a (strange) local name, as os.path treats it.
    assert storage.parse("s3:/b/k").scheme == "local"


@pytest.mark.parametrize("url", ["az://container/ck", "hdfs://nn/ck", "http://host/ck", "gs://", "s3:///key"])
def test_unsupported_urls_raise_naming_the_url_and_schemes(url):
    with pytest.raises(errors.UnsupportedURLError) as e:
        storage.parse(url, what="dst")
    assert isinstance(e.value, ValueError)
    assert repr(url) in str(e.value)
    if "://" in url and not url.startswith(("gs", "s3")):
        assert "gs://, s3://, file://" in str(e.value)


@pytest.fixture
def h5_source(tmp_path):
    keras.backend.clear_session()
    model = build_zoo()
    path = str(tmp_path / "src" / "m.weights.h5")
    os.makedirs(os.path.dirname(path))
    model.save_weights(path)
    return model, path


_BAD = "az://bucket/ck"


def _entry_points(model, h5):
    return {
        "load_sharded": lambda: shardckpt.load_sharded(model, _BAD),
        "convert dst": lambda: shardckpt.convert(h5, _BAD, model=model),
        "convert src": lambda: shardckpt.convert(_BAD, "out_ck", model=model),
        "inspect": lambda: shardckpt.inspect(_BAD),
        "verify": lambda: shardckpt.verify(_BAD),
        "OrbaxCheckpoint": lambda: shardckpt.OrbaxCheckpoint(_BAD),
        "restore_latest": lambda: shardckpt.restore_latest(model, _BAD),
        "from_preset": lambda: shardckpt.from_preset(_BAD),
    }


@pytest.mark.parametrize(
    "entry",
    ["load_sharded", "convert dst", "convert src", "inspect", "verify", "OrbaxCheckpoint", "restore_latest",
     "from_preset"],
)
def test_every_entry_point_refuses_unsupported_schemes_and_writes_nothing(tmp_path, monkeypatch, h5_source, entry):
    """The reported bug: a URL became a local folder `az:/bucket/ck` in the working directory."""
    model, h5 = h5_source
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    with pytest.raises(errors.UnsupportedURLError, match="az://"):
        _entry_points(model, h5)[entry]()
    assert os.listdir(work) == []


def test_cli_refuses_unsupported_schemes(tmp_path, monkeypatch, h5_source, capsys):
    _, h5 = h5_source
    monkeypatch.chdir(tmp_path)
    assert cli_main(["inspect", _BAD]) == 1
    assert cli_main(["verify", _BAD]) == 1
    assert cli_main(["convert", h5, _BAD]) == 1
    err = capsys.readouterr().err
    assert err.count("az://bucket/ck") >= 3
    assert not os.path.exists(tmp_path / "az:")


def test_parse_passes_a_location_through_and_refuses_other_schemes():
    location = storage.parse("gs://b/preset/")
    assert location.url == "gs://b/preset"
    assert storage.parse(location) is location  # parsed once: below the API edge it travels as is
    with pytest.raises(errors.UnsupportedURLError, match=r"hf://org/model.*Supported schemes: gs://, s3://, file://"):
        storage.parse("hf://org/model")


def test_a_path_parsed_once_is_still_shown_as_typed(tmp_path, monkeypatch, h5_source):
    """Entry points classify their path once and pass the `Location` down; reports still
    name a relative path as the user typed it, and a location derived from it its own path."""
    model, h5 = h5_source
    monkeypatch.chdir(os.path.dirname(h5))
    location = storage.parse("m.weights.h5")
    assert location == storage.Location("local", h5) and location.shown == "m.weights.h5"
    assert location.parent.shown == os.path.dirname(h5) and location.parent.join("m.weights.h5").shown == h5
    assert shardckpt.inspect("m.weights.h5").path == "m.weights.h5"
    assert shardckpt.verify("m.weights.h5").path == "m.weights.h5"
    assert shardckpt.load_sharded(model, "m.weights.h5").path == "m.weights.h5"
