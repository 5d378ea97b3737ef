"""A counting HTTP proxy in front of a fake object store (tests/buckets.py).

Each label (a process, a client) gets a port of its own, so the bytes each
one asked of the store are counted on the server side, not by the client
code under test. A hook sees every request before it is forwarded: tests use
it to change the bucket at an exact point of a load (between two reads).
"""

from __future__ import annotations

import collections
import http.client
import http.server
import threading
import urllib.parse
from collections.abc import Callable, Iterable

_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "proxy-connection"}

Hook = Callable[[str, str, str, "str | None"], None]
"""`hook(label, method, path, range_header)`, called before a request is forwarded."""


class CountingProxy:
    """Forwards HTTP requests to `upstream`, one listening port per label.

    Attributes:
        body_bytes: Per label, the response body bytes of GET requests.
        ranged_bytes: Per label, those of GET requests with a `Range` header.
        requests: Per label, the requests forwarded.
        hook: Called before each request is forwarded (see `Hook`).
    """

    def __init__(self, upstream: str, labels: Iterable[str] = ("main",)) -> None:
        parsed = urllib.parse.urlparse(upstream)
        self._host, self._port = parsed.hostname or "127.0.0.1", parsed.port or 80
        self.body_bytes: collections.Counter[str] = collections.Counter()
        self.ranged_bytes: collections.Counter[str] = collections.Counter()
        self.requests: collections.Counter[str] = collections.Counter()
        self.hook: Hook | None = None
        self._lock = threading.Lock()
        self._servers: dict[str, http.server.ThreadingHTTPServer] = {}
        for label in labels:
            server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler(label))
            server.daemon_threads = True
            threading.Thread(target=server.serve_forever, daemon=True).start()
            self._servers[label] = server

    def url(self, label: str = "main") -> str:
        """The proxy's http://127.0.0.1:PORT for `label`."""
        return f"http://127.0.0.1:{self._servers[label].server_address[1]}"

    def reset(self) -> None:
        with self._lock:
            self.body_bytes.clear()
            self.ranged_bytes.clear()
            self.requests.clear()

    def stop(self) -> None:
        for server in self._servers.values():
            server.shutdown()
            server.server_close()

    def _count(self, label: str, method: str, ranged: bool, nbytes: int) -> None:
        with self._lock:
            self.requests[label] += 1
            if method == "GET":
                self.body_bytes[label] += nbytes
                if ranged:
                    self.ranged_bytes[label] += nbytes

    def _handler(self, label: str) -> type[http.server.BaseHTTPRequestHandler]:
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:  # quiet
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    parts = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0], 16)
                        if size == 0:
                            self.rfile.readline()
                            return b"".join(parts)
                        parts.append(self.rfile.read(size))
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _forward(self) -> None:
                body = self._body()
                ranged = self.headers.get("Range")
                if proxy.hook is not None:
                    proxy.hook(label, self.command, self.path, ranged)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                connection = http.client.HTTPConnection(proxy._host, proxy._port, timeout=60)
                try:
                    connection.request(self.command, self.path, body=body or None, headers=headers)
                    response = connection.getresponse()
                    data = response.read()
                finally:
                    connection.close()
                proxy._count(label, self.command, ranged is not None, len(data))
                self.send_response(response.status, response.reason)
                for key, value in response.getheaders():
                    if key.lower() not in _HOP:
                        self.send_header(key, value)
                length = response.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", length or str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = _forward

        return Handler
