"""Deadlines of every object-store request: connect timeout, request timeout, retries.

Without them a bucket run with no network (no credentials and the default
AWS endpoint unreachable, or `AWS_ENDPOINT_URL` naming a closed port) waited
on TensorStore's own defaults (32 retries with back-off up to 32 s, no
request timeout): minutes with no word. Now every request ends within
`timeout` seconds with `StorageTimeoutError` naming the URL, the endpoint
and the fix.

Defaults fit a real cloud: a connection is made within seconds or not at
all; one request of at most `shardckpt.storage.ranged.PART` bytes (4 MiB) or
one listing page finishes within two minutes on any working link, and a few
retries ride out a store's transient 5xx / throttling answers.

Override them through the environment (`SHARDCKPT_STORAGE_TIMEOUT`,
`SHARDCKPT_STORAGE_CONNECT_TIMEOUT`, `SHARDCKPT_STORAGE_RETRIES`) or with
keywords, for a block of code::

    with shardckpt.storage.deadline(timeout=10, retries=1):
        shardckpt.load_sharded(model, "s3://bucket/ckpt")
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import threading
from collections.abc import Iterator
from typing import Any

from shardckpt.errors import ConfigurationError

TIMEOUT_S = 120.0
"""Seconds one request may take, its retries included."""
CONNECT_TIMEOUT_S = 10.0
"""Seconds to open a connection (curl's connect timeout inside TensorStore)."""
RETRIES = 4
"""Attempts TensorStore makes at a request that failed in a retryable way."""

ENV_TIMEOUT = "SHARDCKPT_STORAGE_TIMEOUT"
ENV_CONNECT_TIMEOUT = "SHARDCKPT_STORAGE_CONNECT_TIMEOUT"
ENV_RETRIES = "SHARDCKPT_STORAGE_RETRIES"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Deadline:
    """The limits of object-store requests.

    Attributes:
        timeout: Seconds one request may take, retries included.
        connect_timeout: Seconds to open a connection.
        retries: Attempts at a request that failed in a retryable way (>= 1).
    """

    timeout: float = TIMEOUT_S
    connect_timeout: float = CONNECT_TIMEOUT_S
    retries: int = RETRIES

    def __post_init__(self) -> None:
        for name in ("timeout", "connect_timeout"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"deadline {name} must be a positive number of seconds. Received: {name}={value!r}")
        if self.retries < 1:
            raise ValueError(f"deadline retries must be at least 1. Received: retries={self.retries!r}")

    def context(self, driver: str) -> dict[str, Any]:
        """TensorStore context resources bounding retries of `driver` ("gcs", "s3")."""
        return {
            f"{driver}_request_retries": {
                "max_retries": self.retries,
                "initial_delay": "0.5s",
                "max_delay": f"{max(1.0, min(8.0, self.timeout / 4)):g}s",
            }
        }


def positive_from_env(name: str, default: float, *, unit: str = "seconds", whole: bool = False,
                      meaning: str = "") -> float:
    """A positive, finite number from environment variable `name`; `default` where it is unset or empty.

    Args:
        name: The variable.
        default: Its value when unset or set empty.
        unit: What the number counts, for the message ("seconds").
        whole: Only whole numbers are taken (at least 1).
        meaning: What the setting does, for the message (": how long ...").

    Raises:
        ConfigurationError: the variable holds anything else ("abc", "0",
            "-5", "nan", "inf"; "2.5" where `whole`), naming it, its value
            and the fix.
    """
    text = os.environ.get(name)
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    # inf is refused too: a wait or a request that may last for good is what these limits prevent,
    # and the transport's whole seconds and the coordination client's milliseconds cannot hold it.
    if not (math.isfinite(value) and value > 0) or (whole and value != int(value)):
        must = f"a whole number of {unit}, at least 1" if whole else f"a positive number of {unit}"
        raise ConfigurationError(f"{name} must be {must}{meaning}. Fix: set it to {must}, or unset it for the "
                                 f"default ({default:g}). Received: {name}={text!r}")
    return value


def _from_env() -> Deadline:
    """The environment's deadline (defaults where a variable is unset or empty).

    Raises:
        ConfigurationError: a variable holds anything but a positive, finite
            number of seconds, or retries that are not a whole number >= 1.
    """
    return Deadline(
        timeout=positive_from_env(ENV_TIMEOUT, TIMEOUT_S),
        connect_timeout=positive_from_env(ENV_CONNECT_TIMEOUT, CONNECT_TIMEOUT_S),
        retries=int(positive_from_env(ENV_RETRIES, RETRIES, unit="attempts", whole=True)),
    )


_lock = threading.Lock()
_override: Deadline | None = None  # process-wide: reads run on worker threads


def current() -> Deadline:
    """The deadline in force: `deadline(...)`'s, else the environment's, else the defaults."""
    return _override if _override is not None else _from_env()


@contextlib.contextmanager
def deadline(
    *, timeout: float | None = None, connect_timeout: float | None = None, retries: int | None = None
) -> Iterator[Deadline]:
    """Sets the deadline of object-store requests for the block (every thread).

    Args:
        timeout: Seconds one request may take, retries included.
        connect_timeout: Seconds to open a connection. TensorStore reads it
            once, when its first request of the process goes out.
        retries: Attempts at a request that failed in a retryable way.

    Yields:
        The `Deadline` in force.
    """
    global _override
    base = current()
    new = Deadline(
        timeout=base.timeout if timeout is None else timeout,
        connect_timeout=base.connect_timeout if connect_timeout is None else connect_timeout,
        retries=base.retries if retries is None else retries,
    )
    with _lock:
        previous, _override = _override, new
    try:
        yield new
    finally:
        with _lock:
            _override = previous


def configure_transport() -> None:
    """Hands the connect and stall timeouts to TensorStore's HTTP transport.

    TensorStore reads these variables once, when it makes its first HTTP
    request; a user's own `TENSORSTORE_CURL_*` settings win.
    """
    limits = current()
    os.environ.setdefault("TENSORSTORE_CURL_CONNECT_TIMEOUT_SECONDS", str(max(1, round(limits.connect_timeout))))
    # A transfer that receives nothing for `timeout` seconds is dropped (and retried).
    os.environ.setdefault("TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS", str(max(1, round(limits.timeout))))
    os.environ.setdefault("TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES", "1")


def wait(future: Any, *, timeout: float | None = None) -> Any:
    """`future.result()` within the deadline; a late one is cancelled.

    Raises:
        TimeoutError: the deadline passed (callers translate it, naming the URL).
    """
    limit = current().timeout if timeout is None else timeout
    try:
        return future.result(timeout=limit)
    except TimeoutError:
        future.cancel()
        raise
