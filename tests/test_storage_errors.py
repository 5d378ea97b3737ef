"""Typed errors for buckets: missing bucket, missing path (404), refused (403), no credentials.

Missing buckets and paths come from the fake GCS and S3 servers; refusals from
a local server that answers every request the way GCS and S3 answer a
caller without permission (HTTP 403 and their error bodies).
"""

from __future__ import annotations

from collections.abc import Iterator

import keras
import pytest

import shardckpt
from shardckpt import errors
from shardckpt.formats import FORMATS
from tests.buckets import start_denying
from tests.zoo import build_zoo


@pytest.fixture(scope="module")
def denying_server() -> Iterator[str]:
    url, stop = start_denying()
    yield url
    stop()


@pytest.mark.parametrize("scheme", ["gs", "s3"])
def test_missing_bucket_names_the_url_and_the_fix(scheme, request):
    request.getfixturevalue("gcs_server" if scheme == "gs" else "s3_server")
    url = f"{scheme}://shardckpt-no-such-bucket/ck"
    with pytest.raises(errors.BucketNotFoundError) as e:
        shardckpt.inspect(url)
    assert isinstance(e.value, FileNotFoundError)
    assert url in str(e.value) and "create it" in str(e.value)


@pytest.mark.parametrize("scheme", ["gs", "s3"])
def test_convert_into_missing_bucket(tmp_path, scheme, request):
    request.getfixturevalue("gcs_server" if scheme == "gs" else "s3_server")
    keras.backend.clear_session()
    model = build_zoo()
    src = str(tmp_path / "m.weights.h5")
    model.save_weights(src)
    with pytest.raises(errors.BucketNotFoundError, match=f"{scheme}://shardckpt-no-such-bucket/m"):
        shardckpt.convert(src, f"{scheme}://shardckpt-no-such-bucket/m", model=model)


def test_missing_path_in_bucket_is_404(bucket, tmp_path):
    url = f"{bucket}/no/such/checkpoint"
    with pytest.raises(errors.CheckpointNotFoundError, match=url):
        shardckpt.inspect(url)
    with pytest.raises(errors.CheckpointNotFoundError, match=url):
        shardckpt.load_sharded(build_zoo(), url)
    # The message lists every format shardckpt reads (it once left out .weights.json,
    # keras-hub presets and Hugging Face folders), from the formats' one table, as the
    # local message does; a format only written (no reader: `peft`) is not offered.
    with pytest.raises(errors.CheckpointNotFoundError) as e:
        shardckpt.inspect(url)
    with pytest.raises(errors.CheckpointNotFoundError) as local:
        shardckpt.inspect(tmp_path / "no-such-checkpoint")
    assert any(fmt.reader is None for fmt in FORMATS.values())
    for fmt in FORMATS.values():
        readable = fmt.reader is not None
        assert (fmt.description in str(e.value)) == readable, fmt.name
        assert (fmt.description in str(local.value)) == readable, fmt.name
    assert "sharded `.weights.json`" in str(e.value) and "keras-hub preset" in str(e.value)


def test_refused_s3_request_is_403_naming_permissions(denying_server, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", denying_server)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    with pytest.raises(errors.StorageAccessDeniedError) as e:
        shardckpt.inspect("s3://private-bucket/ck")
    assert isinstance(e.value, PermissionError)
    assert "s3://private-bucket/ck" in str(e.value) and "s3:GetObject" in str(e.value)


def test_refused_gcs_request_is_403_although_listing_says_empty(denying_server, monkeypatch):
    """TensorStore's gcs driver lists a bucket it may not list as empty; the error must still say 403."""
    monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", denying_server)
    monkeypatch.setenv("GOOGLE_AUTH_TOKEN_FOR_TESTING", "fake-token")
    with pytest.raises(errors.StorageAccessDeniedError) as e:
        shardckpt.inspect("gs://private-bucket/ck")
    assert "gs://private-bucket/ck" in str(e.value) and "roles/storage.objectViewer" in str(e.value)


def test_no_s3_credentials_says_where_they_are_looked_for(denying_server, monkeypatch, tmp_path):
    monkeypatch.setenv("AWS_ENDPOINT_URL", denying_server)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.aws
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # TensorStore would ask 169.254.169.254
    with pytest.raises(errors.StorageCredentialsError) as e:
        shardckpt.inspect("s3://private-bucket/ck")
    assert isinstance(e.value, PermissionError)
    assert "s3://private-bucket/ck" in str(e.value) and "AWS_ACCESS_KEY_ID" in str(e.value)


def test_an_object_the_checkpoint_lists_missing_in_a_bucket_is_damage_naming_it(bucket, tmp_path):
    """A 404 for a file an index names (or an Orbax data object) is `CorruptCheckpointError`
    naming the object and the fix, never "check the URL" as for a wrong path."""
    import json

    import numpy as np
    from safetensors.numpy import save_file

    from shardckpt import storage

    save_file({"x": np.ones((4, 4), "float32")}, str(tmp_path / "a.safetensors"))
    index = {"metadata": {}, "weight_map": {"x": "a.safetensors", "y": "b.safetensors", "z": "b.safetensors"}}
    storage.write_bytes(storage.parse(f"{bucket}/st/a.safetensors"), (tmp_path / "a.safetensors").read_bytes())
    storage.write_bytes(storage.parse(f"{bucket}/st/m.safetensors.index.json"), json.dumps(index).encode())
    url = f"{bucket}/st/m.safetensors.index.json"
    for call in (shardckpt.inspect, shardckpt.verify):
        with pytest.raises(errors.CorruptCheckpointError) as e:
            call(url)
        assert str(e.value) == (
            f"The index {url!r} puts 2 array(s) (y, z) in 'b.safetensors', which does not exist at "
            f"'{bucket}/st/b.safetensors'. Fix: copy (or upload) every .safetensors file the index lists beside "
            "it, or download the set again.")

    # An Orbax step whose data objects are gone (its b-tree with them): damage naming a lost object.
    model = build_zoo()
    src = str(tmp_path / "m.weights.h5")
    model.save_weights(src)
    dst = f"{bucket}/orbax"
    shardckpt.convert(src, dst, model=model)
    for key in storage.list_keys(storage.parse(dst)):
        if key.startswith("pytree/d/"):
            storage.delete_object(storage.parse(dst).join(key))
    lost = rf"; the object '{dst}/pytree/d/[0-9a-f]+' does not exist \(deleted, or not copied with the rest of the step\)"
    for call in (shardckpt.verify, lambda url: shardckpt.load_sharded(model, url)):
        with pytest.raises(errors.CorruptCheckpointError, match=rf"of '{dst}/pytree' .*{lost}.*Fix: restore from another step"):
            call(dst)
