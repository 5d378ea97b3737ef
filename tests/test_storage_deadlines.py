"""Every bucket request has a deadline: a dead or silent endpoint ends in `StorageTimeoutError`.

Before, TensorStore's defaults applied (32 retries with back-off up to 32 s,
no request timeout): a wrong `AWS_ENDPOINT_URL` hung past 120 s, and `s3://`
with no credentials and the AWS endpoint unreachable past 300 s, printing
nothing. Servers here are plain sockets on 127.0.0.1: one closed port, one
that accepts connections and never answers.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

import shardckpt
from shardckpt import errors, storage

_ENDPOINT_VARS = {"gs": "TENSORSTORE_GCS_HTTP_URL", "s3": "AWS_ENDPOINT_URL"}


def _closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"  # closed again: connections are refused


@pytest.fixture
def silent_endpoint():
    """An endpoint that accepts connections and never sends a byte."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


def _point_at(monkeypatch, scheme: str, endpoint: str) -> None:
    monkeypatch.setenv(_ENDPOINT_VARS[scheme], endpoint)
    if scheme == "gs":
        monkeypatch.setenv("GOOGLE_AUTH_TOKEN_FOR_TESTING", "token")
    else:
        monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
        monkeypatch.setenv("AWS_REGION", "us-east-1")


@pytest.mark.parametrize("scheme", ["gs", "s3"])
def test_a_closed_port_fails_within_the_deadline_naming_url_endpoint_and_fix(scheme, monkeypatch):
    endpoint = _closed_port()
    _point_at(monkeypatch, scheme, endpoint)
    url = f"{scheme}://deadline-bucket/ckpt"
    start = time.monotonic()
    with storage.deadline(timeout=10, retries=2):
        with pytest.raises(errors.StorageTimeoutError) as caught:
            shardckpt.inspect(url)
    assert time.monotonic() - start < 10
    message = str(caught.value)
    assert url in message and f"Endpoint tried: {endpoint}" in message
    assert "could not be reached" in message and "Fix: check the network and the endpoint" in message
    assert _ENDPOINT_VARS[scheme] in message or scheme == "gs"  # S3's hint names AWS_ENDPOINT_URL


@pytest.mark.parametrize("scheme", ["gs", "s3"])
def test_a_server_that_never_answers_fails_within_the_deadline(scheme, monkeypatch, silent_endpoint):
    _point_at(monkeypatch, scheme, silent_endpoint)
    url = f"{scheme}://deadline-bucket/model.safetensors"
    location = storage.parse(url)
    start = time.monotonic()
    with storage.deadline(timeout=2, retries=1):
        with pytest.raises(errors.StorageTimeoutError, match=r"within the deadline of 2 s") as caught:
            storage.read_bytes(location)
    assert time.monotonic() - start < 2 + 3  # the deadline, plus the time to cancel
    assert f"Endpoint tried: {silent_endpoint}" in str(caught.value)
    assert isinstance(caught.value, TimeoutError)  # a built-in, for `except TimeoutError`


def test_the_deadline_comes_from_the_environment(monkeypatch, silent_endpoint):
    _point_at(monkeypatch, "s3", silent_endpoint)
    monkeypatch.setenv("SHARDCKPT_STORAGE_TIMEOUT", "1.5")
    monkeypatch.setenv("SHARDCKPT_STORAGE_RETRIES", "1")
    assert storage.deadlines.current() == storage.Deadline(timeout=1.5, retries=1)
    start = time.monotonic()
    with pytest.raises(errors.StorageTimeoutError, match=r"within the deadline of 1.5 s"):
        storage.read_bytes(storage.parse("s3://deadline-bucket/x"))
    assert time.monotonic() - start < 1.5 + 3


def test_bad_deadlines_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="timeout must be a positive number of seconds. Received: timeout=0"):
        storage.Deadline(timeout=0)
    with pytest.raises(ValueError, match="retries must be at least 1"):
        storage.Deadline(retries=0)


@pytest.mark.parametrize(("name", "text"), [
    ("SHARDCKPT_STORAGE_TIMEOUT", "soon"), ("SHARDCKPT_STORAGE_TIMEOUT", "0"), ("SHARDCKPT_STORAGE_TIMEOUT", "inf"),
    ("SHARDCKPT_STORAGE_CONNECT_TIMEOUT", "-3"), ("SHARDCKPT_STORAGE_CONNECT_TIMEOUT", "nan"),
    ("SHARDCKPT_STORAGE_RETRIES", "2.5"), ("SHARDCKPT_STORAGE_RETRIES", "0"),
])
def test_bad_deadline_variables_are_a_configuration_error_naming_them(monkeypatch, name, text):
    """A variable that is not a positive, finite number of seconds (retries: a whole number >= 1)
    is refused with its name, its value and the fix; none is taken half-way (2.5 retries as 2)."""
    monkeypatch.setenv(name, text)
    with pytest.raises(errors.ConfigurationError, match=rf"{name} must be .* Fix: .* Received: {name}={text!r}"):
        storage.deadlines.current()


_NO_CREDENTIALS_CHILD = """
import time, shardckpt
from shardckpt import errors, storage
start = time.monotonic()
try:
    with storage.deadline(timeout=20, connect_timeout=2, retries=2):
        shardckpt.inspect("s3://shardckpt-no-such-bucket-for-tests/ckpt")
except errors.StorageTimeoutError as e:
    print("TIMEOUT", round(time.monotonic() - start, 1), e)
except errors.ShardckptError as e:
    print("TYPED", type(e).__name__, round(time.monotonic() - start, 1), e)
"""


def test_s3_without_credentials_or_endpoint_ends_with_a_typed_error(tmp_path):
    """The reported hang: no credentials, no endpoint, AWS unreachable (no network here)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "TENSORSTORE_"))}
    env["HOME"] = str(tmp_path)  # no ~/.aws files either
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", _NO_CREDENTIALS_CHILD], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert time.monotonic() - start < 60
    # Without a network the endpoint cannot be reached; with one, AWS answers that
    # credentials are missing: either way a typed error naming the URL, not a hang.
    assert done.stdout.startswith(("TIMEOUT", "TYPED")), done.stdout + done.stderr[-3000:]
    assert "s3://shardckpt-no-such-bucket-for-tests/ckpt" in done.stdout


_ENV_CREDENTIALS_CHILD = """
from shardckpt import storage
location = storage.parse("{url}/probe.txt")
storage.write_bytes(location, b"x")
assert storage.read_bytes(location) == b"x"
"""


def test_no_aws_config_lines_on_a_bucket_run_with_keys_in_the_environment(tmp_path, s3_server):
    """aws-c-auth logged 5 `E` lines about a missing ~/.aws/config on every such run."""
    env = dict(os.environ, HOME=str(tmp_path), **s3_server.env)
    child = _ENV_CREDENTIALS_CHILD.format(url=s3_server.new_bucket())
    done = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert ".aws/config" not in done.stderr and ".aws/credentials" not in done.stderr, done.stderr[-3000:]
