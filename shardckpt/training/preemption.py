"""Noticing a preemption and agreeing, across processes, on the step to stop at.

Spot VMs and cluster schedulers send SIGTERM some seconds before they kill a
job. `PreemptionWatch` turns that notice into a step at which every process
saves and stops:

* One process: a SIGTERM handler, installed for the duration of `fit` only,
  sets a flag; the callback reads it at each step boundary.
* Several processes with JAX's preemption service (`jax.distributed` starts it
  by default, `jax_enable_preemption_service`): JAX catches the signal itself
  and `multihost_utils.reached_preemption_sync_point` names the same step on
  every process. No Python handler is installed (it would replace JAX's).
* Several processes without it: the local flags are all-gathered at each step
  boundary (`process_allgather`, XLA runs the collective), so all processes see
  the same answer at the same step.

A second SIGTERM while the first is being handled gives the signal back to
the previous handler (by default: terminate), so a job whose save hangs, or
whose `fit` ended by an exception before the handler was removed, can still be
stopped.

Several callbacks in one `fit` each have a watch. The process has one handler
per signal (`_Handlers`), installed by the first watch to start and removed,
putting back the handler found then, by the last to stop, whatever their order:
a notice reaches every watch, so each callback saves its own stopping step.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
from typing import Any

import jax
import numpy as np

from shardckpt import _jax

_log = logging.getLogger("shardckpt")


_jax_steps_used = 0
"""Steps this process has passed to JAX's sync manager in earlier `fit`s.

JAX's manager never forgets a notice: it answers True again whenever it is
asked about the step it agreed on. Each `fit` counts its steps on from where
the previous one stopped, so a later `fit` in the same process never meets
that step again (every process runs the same `fit`s, so the counts agree)."""


def _jax_sync_manager() -> Any:
    """JAX's preemption sync manager, or None when this run has none."""
    if jax.process_count() == 1:
        return None
    return _jax.preemption_sync_manager()


class PreemptionWatch:
    """Watches for a preemption notice during one `fit`.

    Args:
        signals: The signals taken as a preemption notice.

    Example:

    ```python
    watch = PreemptionWatch()
    watch.start()
    try:
        for step in steps:
            train(step)
            if watch.reached(step):
                save_and_stop()
    finally:
        watch.stop()
    ```
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM,)) -> None:
        self.signals = signals
        self.notice = threading.Event()
        self._installed = False
        self._jax: Any = None  # JAX's (untyped, private) preemption sync manager while attached
        self._jax_base = 0  # `_jax_steps_used` when this fit started
        self.mode = "off"

    def start(self) -> None:
        """Installs the handlers (or attaches to JAX's preemption service)."""
        self.notice.clear()
        self._jax = _jax_sync_manager()
        if self._jax is not None:
            self.mode = "jax"
            self._jax_base = _jax_steps_used
            return
        if threading.current_thread() is not threading.main_thread():
            # Python only lets the main thread install signal handlers.
            _log.warning("OrbaxCheckpoint: fit runs outside the main thread; no save on SIGTERM.")
            self.mode = "off"
            return
        _HANDLERS.add(self)
        self._installed = True
        self.mode = "signal" if jax.process_count() == 1 else "signal+allgather"

    def stop(self) -> None:
        """Puts back the handlers that were there before the first watch started."""
        if self._installed:
            _HANDLERS.remove(self)
            self._installed = False
        self._jax = None
        self.mode = "off"

    def reached(self, step: int) -> bool:
        """True at the step where every process must save and stop.

        Must be called at every step boundary, on every process, with the same
        increasing `step` (the callback passes its count of batch-end calls).
        """
        if self._jax is not None:
            from jax.experimental import multihost_utils

            global _jax_steps_used
            step += self._jax_base
            _jax_steps_used = max(_jax_steps_used, step + 1)
            return bool(multihost_utils.reached_preemption_sync_point(step))
        if self.mode == "signal+allgather":
            from jax.experimental import multihost_utils

            flags = multihost_utils.process_allgather(np.array([self.notice.is_set()], np.int32))
            return bool(np.max(flags))
        return self.notice.is_set()


@dataclasses.dataclass(kw_only=True, eq=False)
class PreemptionStop:
    """The callback's `save_on_preemption` and what it did in the last `fit`.

    The callback saves and stops when `reached` says so; this keeps the
    watch, the mode it ran in and the step that was committed.

    Attributes:
        enabled: Save and stop on a notice (`save_on_preemption`).
        step: The step committed on a notice during the last `fit`, or None.
        mode: How the last `fit` watched: "off", "signal", "jax" (JAX's
            preemption service) or "signal+allgather".
    """

    enabled: bool = True
    step: int | None = dataclasses.field(default=None, init=False)
    mode: str = dataclasses.field(default="off", init=False)
    _watch: PreemptionWatch = dataclasses.field(default_factory=PreemptionWatch, init=False, repr=False)

    def start(self) -> None:
        """Starts watching for one `fit` (when enabled)."""
        self.step = None
        if self.enabled:
            self._watch.start()
        self.mode = self._watch.mode

    def reached(self, ends: int) -> bool:
        """True at the batch end where every process saves and stops (see `PreemptionWatch.reached`)."""
        return self.enabled and self._watch.reached(ends)

    def stop(self) -> None:
        """Stops watching; `mode` keeps saying how the `fit` watched."""
        self._watch.stop()


class _Handlers:
    """The process's one handler per signal, shared by the started watches.

    Python keeps one handler per signal: a second watch installing its own
    would hide the first (which then never saves), and stopping in start
    order would leave a stopped watch's handler installed after `fit`.
    """

    def __init__(self) -> None:
        self._watches: list[PreemptionWatch] = []
        self._previous: dict[int, Any] = {}
        # Re-entrant: the handler runs on the main thread, maybe inside add/remove.
        self._lock = threading.RLock()

    def add(self, watch: PreemptionWatch) -> None:
        with self._lock:
            # A watch that got a notice belongs to a fit that ended there (saved and stopped, or
            # raised before stopping its watch): kept, its notice made this fit's first SIGTERM a
            # "second notice", which ends the process instead of saving.
            self._watches = [w for w in self._watches if w is watch or not w.notice.is_set()]
            for sig in watch.signals:
                if sig not in self._previous:
                    self._previous[sig] = signal.signal(sig, self._handle)
            if watch not in self._watches:  # (a fit that raised never stopped its watch)
                self._watches.append(watch)

    def remove(self, watch: PreemptionWatch) -> None:
        with self._lock:
            self._watches = [w for w in self._watches if w is not watch]
            wanted = {sig for w in self._watches for sig in w.signals}
            for sig in [sig for sig in self._previous if sig not in wanted]:
                signal.signal(sig, self._previous.pop(sig))

    def _handle(self, signum: int, frame: Any) -> None:
        watches = [w for w in self._watches if signum in w.signals]
        if any(w.notice.is_set() for w in watches):
            # Second notice: whoever sends it wants the process gone now.
            previous = self._previous.get(signum, signal.SIG_DFL)
            for w in watches:
                w.stop()
            if callable(previous):
                previous(signum, frame)
            else:
                signal.signal(signum, previous)
                os.kill(os.getpid(), signum)
            return
        for w in watches:
            w.notice.set()
        _log.warning("OrbaxCheckpoint: %s received; saving at the next step boundary, then stopping fit.",
                     signal.Signals(signum).name)


_HANDLERS = _Handlers()
