"""Third-party log lines that a shardckpt save triggers and that mean nothing to users.

Orbax logs (through absl, at WARNING) "Skipping merge of OCDBT checkpoints:
No per-process OCDBT checkpoint subdirs found ..." for every single-process
item it saves: there is nothing to merge, and nothing is wrong. The filter
sits on the `absl` logger only while an `OrbaxCheckpoint` is inside `fit`,
and drops only that message.
"""

from __future__ import annotations

import logging
import threading

_NOISE = ("Skipping merge of OCDBT checkpoints",)


class _DropOrbaxNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(text in message for text in _NOISE)


_filter = _DropOrbaxNoise()
_lock = threading.Lock()
_users = 0


def start() -> None:
    """Installs the filter (counted: nested callbacks each call start/stop)."""
    global _users
    with _lock:
        if _users == 0:
            logging.getLogger("absl").addFilter(_filter)
        _users += 1


def stop() -> None:
    """Removes the filter once its last user stops."""
    global _users
    with _lock:
        _users = max(0, _users - 1)
        if _users == 0:
            logging.getLogger("absl").removeFilter(_filter)
