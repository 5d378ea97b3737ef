"""Work on a thread of its own whose outcome a caller waits for as a `Future`.

A save hands work to threads that outlive the call starting them (a value
file written out while the next transaction is encoded, a copy compiled while
training starts); whoever waits gets the result or what the work raised.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any


def start(action: Callable[..., Any], *args: Any, name: str) -> concurrent.futures.Future:
    """Runs `action(*args)` on a new daemon thread named `name`.

    Returns:
        A future holding `action`'s result, or what it raised (any
        `BaseException`: the thread itself never raises).
    """
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            result = action(*args)
        except BaseException as e:  # handed to whoever waits on `future`
            future.set_exception(e)
        else:
            future.set_result(result)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future
