"""Missing and invalid credentials against real servers: typed errors naming the URL and the fix.

S3: moto's server checks signatures and IAM policies once its
`INITIAL_NO_AUTH_ACTION_COUNT` setting is 0 (read per request, so the
session's server enforces them for this test only). GCS: fake-gcs-server
checks no credentials, but TensorStore reads the key file before any
request; that runs in a subprocess, because TensorStore keeps its Google
credential provider for the life of the process.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import uuid

import keras
import moto.settings
import numpy as np
import pytest

import shardckpt
from shardckpt import errors, storage

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bucket_with_a_step(server) -> str:
    """A bucket holding one committed step (written while the server accepts anyone)."""
    url = f"{server.new_bucket()}/ck"
    storage.write_bytes(storage.parse(f"{url}/0/commit_success.txt"), b"")
    return url


def _tiny_fit(directory: str) -> None:
    keras.backend.clear_session()
    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    model.compile(optimizer="adam", loss="mse")
    x = np.zeros((8, 4), "float32")
    model.fit(x, np.zeros((8, 2), "float32"), epochs=1, verbose=0,
              callbacks=[shardckpt.OrbaxCheckpoint(directory, save_freq=1)])


@pytest.fixture
def enforcing_s3(s3_server, monkeypatch):
    """The session's moto server, checking every request's signature and IAM policy."""
    url = _bucket_with_a_step(s3_server)
    monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)
    return s3_server, url


def test_s3_unknown_access_key_is_a_credentials_error(enforcing_s3):
    _, url = enforcing_s3  # the fixture's keys ("testing") are not moto's IAM users
    with pytest.raises(errors.StorageCredentialsError) as e:
        shardckpt.inspect(url)
    message = str(e.value)
    assert isinstance(e.value, PermissionError)
    assert url in message and "InvalidAccessKeyId" in message and "AWS_ACCESS_KEY_ID" in message
    # A training run saving there fails at its start, before any batch.
    with pytest.raises(errors.StorageCredentialsError, match="InvalidAccessKeyId"):
        _tiny_fit(f"{url}/train")


def test_s3_wrong_secret_is_a_credentials_error_and_no_policy_is_access_denied(enforcing_s3, monkeypatch):
    import boto3

    server, url = enforcing_s3
    monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", float("inf"))
    iam = boto3.client("iam", endpoint_url=server.endpoint, region_name="us-east-1")
    user = f"shardckpt-{uuid.uuid4().hex[:8]}"
    iam.create_user(UserName=user)
    key = iam.create_access_key(UserName=user)["AccessKey"]
    monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key["AccessKeyId"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key["SecretAccessKey"][::-1])
    with pytest.raises(errors.StorageCredentialsError) as e:
        shardckpt.inspect(url)
    assert url in str(e.value) and "SignatureDoesNotMatch" in str(e.value) and "renew" in str(e.value)

    # The right secret, but the user has no policy: a 403 a role fixes.
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key["SecretAccessKey"])
    with pytest.raises(errors.StorageAccessDeniedError) as e:
        shardckpt.inspect(url)
    assert url in str(e.value) and "s3:GetObject" in str(e.value)


_GCS_CHILD = r"""
import json, os, sys
import shardckpt
from shardckpt import errors

url, missing, malformed = sys.argv[1:4]
results = {}
for label, key_file in (("missing", missing), ("malformed", malformed)):
    os.environ["GOOGLE_APPLICATION_CREDENTIALS"] = key_file
    try:
        shardckpt.inspect(url)
        results[label] = None
    except errors.ShardckptError as e:
        results[label] = [type(e).__name__, str(e)]
print(json.dumps(results))
"""


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_gcs_missing_or_malformed_key_file_is_a_credentials_error(gcs_server, tmp_path):
    url = _bucket_with_a_step(gcs_server)
    malformed = tmp_path / "key.json"
    malformed.write_text("{not a service-account key")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GOOGLE_", "AWS_", "CLOUDSDK_"))}
    env.update(
        PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", HOME=str(tmp_path),  # no gcloud files
        TENSORSTORE_GCS_HTTP_URL=gcs_server.endpoint,
        # The metadata server TensorStore falls back to: a closed local port.
        GCE_METADATA_ROOT=f"127.0.0.1:{_closed_port()}",
    )
    done = subprocess.run([sys.executable, "-c", _GCS_CHILD, url, str(tmp_path / "no-such-key.json"),
                           str(malformed)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    kind, message = results["missing"]
    assert kind == "StorageCredentialsError"
    assert url in message and "no-such-key.json" in message and "gcloud auth application-default login" in message
    kind, message = results["malformed"]
    assert kind == "StorageCredentialsError"
    assert url in message and "key.json" in message and "GOOGLE_APPLICATION_CREDENTIALS" in message
