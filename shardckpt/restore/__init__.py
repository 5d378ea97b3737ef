"""Restore: `load_sharded(model, path)` and `lazy_init()`.

The pipeline, one module per step: `keys` (Keras variable <-> checkpoint key,
and matching them), `targets` (the sharding each variable gets), `readplan`
(which boxes each device needs, pure), `strategies` (one variable's reads ->
`jax.Array` -> variable, by the reader's capabilities), `engine` (the whole
load: check everything, then load variable by variable), `slots` (optimizer
slots the load gave no value moved next to their variables), `hostmem`
(giving replaced values back to the OS) and `lazy` (building a model with no
initializer run).
"""

from shardckpt.lazy import lazy_init
from shardckpt.restore.engine import LoadReport, load_sharded

__all__ = ["LoadReport", "lazy_init", "load_sharded"]
