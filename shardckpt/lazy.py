"""`lazy_init()`: build Keras models with no initializer run and no weight memory.

Keras 3 can create variables inside a `StatelessScope(initialize_variables=False)`
and leave them uninitialised: shape and dtype are known, `_value` is `None`,
and the initializer is kept for later. Keras also appends such variables to a
global "uninitialised" list that the next plain `StatelessScope` exit
initialises in one go, which would silently fill the model with random weights
(on one device) long after the build. `lazy_init()` therefore takes its
variables off that list and swaps their initializer for a sentinel that raises
`UnloadedVariableError` naming the variable, so a value is never invented.

A `StatelessScope` also records, without applying, every `assign` made inside
it: a layer whose `build()` fills a variable (`self.table.assign(...)` after
`add_weight`) would lose that value, and a load that finds no such array in the
checkpoint would give the variable its initializer's value instead of the one a
normal build gives. `lazy_init()` keeps the last value assigned to each of its
variables; `original_initializer` then returns it.

The uninitialised-variable list and the variables' pending initializers are
Keras internals (see `shardckpt._keras`); there is no public API for deferred
building.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax
import keras

from shardckpt import _keras
from shardckpt.errors import UnloadedVariableError

_PENDING = "uninitialized_variables"  # Keras' global list, see module docstring.


class _Assigned:
    """Initializer returning the value a lazily built layer assigned to its variable (see module docstring)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __call__(self, shape: Any = None, dtype: Any = None, **kwargs: Any) -> Any:
        return self.value if dtype is None else keras.ops.cast(self.value, dtype)


class _Unloaded:
    """Initializer stand-in for a lazily built variable that has no value yet."""

    def __init__(self, path: str, initializer: Any) -> None:
        self.path = path
        self.initializer = initializer  # the layer's own (or what build assigned), for strict=False

    def __call__(self, shape: Any = None, dtype: Any = None, **kwargs: Any) -> Any:
        raise UnloadedVariableError(
            f"Variable {self.path!r} was built under shardckpt.lazy_init() and has "
            "no value yet. Fix: call shardckpt.load_sharded(model, path) before "
            "using the model (with layout= or a Keras distribution set where there are "
            "several devices; strict=False initialises variables the checkpoint "
            "lacks), or build the model outside lazy_init()."
        )


@contextlib.contextmanager
def lazy_init() -> Iterator[None]:
    """Builds models without running initializers or allocating weights.

    Variables created inside the context have shapes and dtypes but no values;
    `shardckpt.load_sharded` gives them values directly in their target
    sharding. Reading an unloaded variable raises `UnloadedVariableError`.

    Example:

    ```python
    with shardckpt.lazy_init():
        model = build_model()
    shardckpt.load_sharded(model, "model.weights.h5")
    ```

    Yields:
        None.
    """
    before = {id(v) for v in _keras.get_global_attribute(_PENDING, []) or []}
    scope = keras.StatelessScope(initialize_variables=False)
    try:
        with scope:
            yield
    finally:
        pending = _keras.get_global_attribute(_PENDING, []) or []
        ours = [v for v in pending if id(v) not in before]
        _keras.set_global_attribute(_PENDING, [v for v in pending if id(v) in before])
        for variable in ours:
            init = _keras.initializer(variable)
            if _keras.current_value(variable) is None and not isinstance(init, _Unloaded):
                # The scope's recorded updates are keyed by id(variable); the last one is the value.
                assigned = scope.get_current_value(variable)
                if assigned is not None and not isinstance(assigned, jax.core.Tracer):
                    init = _Assigned(assigned)
                _keras.set_initializer(variable, _Unloaded(variable.path, init))


def is_unloaded(variable: Any) -> bool:
    """Returns True for a variable built lazily that has not received a value."""
    return _keras.current_value(variable) is None and isinstance(_keras.initializer(variable), _Unloaded)


def original_initializer(variable: Any) -> Any:
    """Returns the layer's own initializer of a lazily built variable.

    Where the layer assigned the variable a value while it was built lazily
    (in its `build()`), an initializer returning that value: what a normal
    build leaves in the variable.
    """
    init = _keras.initializer(variable)
    return init.initializer if isinstance(init, _Unloaded) else init
