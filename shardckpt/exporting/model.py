"""What of a model is exported: checks made before anything is written, and values.

- A quantized model is refused (its int8/int4 variables and scales are not
  the float tensors Hugging Face or keras-hub's float presets hold).
- A LoRA-enabled layer exports its merged kernel (`layer.kernel`: base +
  A @ B x scale, computed by XLA in the kernel's sharding), as Keras' own
  `save_weights` does; its factors are not exported.
- Every variable must hold a value (a lazily built, never loaded model has
  nothing to export).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from shardckpt import dtypes
from shardckpt.errors import UnloadedVariableError, UnsupportedModelError
from shardckpt.structure import lora_layers


def quantized_layers(model: Any) -> list[str]:
    out = []
    for layer in model._flatten_layers(include_self=False):
        mode = getattr(layer, "quantization_mode", None) or getattr(getattr(layer, "dtype_policy", None), "quantization_mode", None)
        if mode:
            out.append(f"{layer.name} ({mode})")
    return out


def check_exportable(model: Any) -> None:
    """Raises before anything is written if `model` cannot be exported.

    Raises:
        UnsupportedModelError: a quantized model.
        UnloadedVariableError: a variable has no value.
    """
    quantized = quantized_layers(model)
    if quantized:
        raise UnsupportedModelError(
            f"{type(model).__name__} is quantized ({', '.join(quantized[:3])}"
            f"{', ...' if len(quantized) > 3 else ''}): int8 / int4 kernels hold integers and float8 "
            "layers carry scales and amax histories, none of which a reader of the format "
            "dequantizes. Fix: export the float model (before `quantize()`)."
        )
    for v in model.weights:
        if getattr(v, "_value", 1) is None:
            raise UnloadedVariableError(
                f"Variable {v.path!r} of {type(model).__name__} holds no value (built under "
                "lazy_init and never loaded). Fix: load the model (load_sharded / from_preset) "
                "before exporting it."
            )


def value_getters(model: Any) -> dict[int, Callable[[], Any]]:
    """`id(variable) -> () -> array to export`: merged kernels for LoRA layers, else the value."""
    return {id(base): _merged(layer, merged) for layer, base, merged, _ in lora_layers(model)}


def lora_factors(model: Any) -> set[int]:
    """`id`s of the LoRA factor variables (merged into their kernels, never exported)."""
    return {id(f) for *_, factors in lora_layers(model) for f in factors}


def lora_bases(model: Any) -> set[int]:
    """`id`s of the base variables of LoRA-enabled layers (exported merged)."""
    return {id(base) for _, base, _, _ in lora_layers(model)}


def _merged(layer: Any, attribute: str) -> Callable[[], Any]:
    return lambda: getattr(layer, attribute)


def value_of(variable: Any, getters: dict[int, Callable[[], Any]]) -> Any:
    get = getters.get(id(variable))
    return get() if get is not None else variable.value


def overflowed(value: Any, stored: np.dtype) -> int:
    """How many finite values of `value` its cast into `stored` turns into inf (NaN without inf).

    Counted where the value lives (one fused reduction per device for a
    sharded `jax.Array`, no gather); every process calls it for every
    array, in one order, as it calls the writes.
    """
    # Only values beyond the target's largest finite one can become inf. Their largest magnitude
    # is a reduction that holds nothing; the count below may hold a whole cast copy (seen: 64 MiB
    # for a 64 MiB kernel on CPU, where the export's budget was 1 MiB), so it runs only then.
    if value.size == 0:
        return 0
    if isinstance(value, np.ndarray):
        if max(abs(float(np.fmax.reduce(value, axis=None))),
               abs(float(np.fmin.reduce(value, axis=None)))) <= dtypes.largest(stored):
            return 0
        with np.errstate(over="ignore"):
            return dtypes.overflowed(value, value.astype(stored))
    if float(_largest_magnitude()(value)) <= dtypes.largest(stored):
        return 0
    return int(_count_overflows(np.dtype(stored))(value))


@functools.cache
def _largest_magnitude() -> Callable[[Any], Any]:
    import jax
    import jax.numpy as jnp

    # abs fuses into the reduction (a `where` skipping NaN does not: 30 MiB for a 64 MiB kernel on
    # CPU). NaN or inf anywhere makes the result fail the comparison, and the count runs.
    return jax.jit(lambda x: jnp.max(jnp.abs(x)))


@functools.lru_cache(maxsize=8)
def _count_overflows(stored: np.dtype) -> Callable[[Any], Any]:
    import jax
    import jax.numpy as jnp

    # Not finite rather than inf: a dtype without inf (float8_e4m3fn) takes what is beyond its range as NaN.
    return jax.jit(lambda x: jnp.sum(~jnp.isfinite(x.astype(stored)) & jnp.isfinite(x), dtype=jnp.int32))
