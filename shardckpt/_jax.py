"""Every use of JAX internals, in one place: the upgrade surface behind the JAX pin.

- `jax._src.distributed.global_state` (training.preemption): the handle of
  JAX's preemption sync manager of a `jax.distributed` run; JAX's own
  `multihost_utils.reached_preemption_sync_point` reads it the same way and
  there is no public accessor.
- `jax._src.distributed.global_state.client` (training.agreement): the
  client of JAX's coordination service (its key-value store), through which
  the processes of a multi-process bucket save agree on the commit; JAX's
  own `multihost_utils` reaches it the same way and has no public accessor.
"""

from __future__ import annotations

from typing import Any

from jax._src import distributed


def preemption_sync_manager() -> Any:
    """JAX's preemption sync manager, or None outside a `jax.distributed` run."""
    state = distributed.global_state
    return state.preemption_sync_manager if state.client is not None else None


def distributed_client() -> Any:
    """The client of JAX's coordination service, or None outside a `jax.distributed` run."""
    return distributed.global_state.client
