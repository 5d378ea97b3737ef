"""Symbolic tensors: what a keras-hub conversion hook does, as index remaps.

keras-hub's Hugging Face converters read each stored tensor with numpy, then
transpose, reshape, slice, cast, stack or concatenate it on the host before
assigning it to a Keras variable. `shardckpt.formats.hf_record` runs those
converters unchanged on `Tensor`s from this module instead of data. A
`Tensor` carries no values; it implements the numpy operations the hooks use
and records what they mean for the position of every element:

- `Strided`: a view of ONE stored tensor: shape, strides and offset in
  elements, exactly as numpy would describe `hook(stored)` if it returned a
  view. Transposes, reshapes and basic slices are computed by numpy itself
  on a data-less array (a fake base address, 1-byte elements: strides and
  offsets come out in elements) with `reshape(copy=False)`, so numpy decides
  what is a view and nothing is ever dereferenced. A reshape numpy could
  only do by copying raises `Unsupported` rather than reading anything.
- `Concat`: parts along an axis (`np.stack` is a concatenation of parts
  given a new axis of length 1): MoE experts, fused gate/up projections.
- `Cast`: `astype` (elementwise, so it commutes with every index remap).

Reading a box of a converted variable (`Tensor.read`) is then a box of each
source it touches: for a `Strided` one, a strided view of the memory-mapped
stored tensor, so a device's piece reads only the bytes its elements live in,
and a replicated variable reads its tensor once. Nothing of the size of a
tensor is built to plan (no index arrays), so planning costs the same for a
70B model as for a tiny one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from shardckpt import dtypes

Box = tuple[slice, ...]
Fetch = Callable[[str, int, tuple[int, ...], tuple[int, ...]], np.ndarray]
"""`(key, first, shape, strides) -> stored.flat[first + i . strides]` for every
index `i` of `shape` (strides in elements): a read-only view of the stored
tensor's memory map (`strided`), or for a file in a bucket a read of just
those elements (`SafetensorsReader.read_strided`).
See `shardckpt.formats.base.strided`."""


# A base address for the data-less arrays numpy computes views on. It is never
# dereferenced; only differences of addresses (offsets) are used.
_BASE = 1 << 44


class Unsupported(ValueError):
    """A hook does something that is not an index remap without a copy."""


class Tensor:
    """A value a conversion hook computes, without its data."""

    shape: tuple[int, ...]
    dtype: np.dtype

    # numpy calls in hooks (np.transpose(x), np.stack([...])) come here.
    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        handler = _FUNCTIONS.get(func)
        if handler is None:
            raise Unsupported(f"numpy.{func.__name__} on a stored tensor is not an index remap shardckpt plans")
        return handler(*args, **kwargs)

    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        raise Unsupported("a hook needs the values of a stored tensor (arithmetic), not only their positions")

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        raise Unsupported(f"numpy.{ufunc.__name__} computes on the values of a stored tensor")

    def _arithmetic(self, *args: Any) -> Any:
        raise Unsupported("a hook computes on the values of a stored tensor (arithmetic)")

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _arithmetic
    __truediv__ = __rtruediv__ = __pow__ = __neg__ = __matmul__ = __rmatmul__ = _arithmetic

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def T(self) -> Tensor:
        return self.transpose()

    def __len__(self) -> int:
        return self.shape[0]

    def transpose(self, *axes: Any) -> Tensor:
        order: Any = axes
        if len(axes) == 1 and (axes[0] is None or isinstance(axes[0], (tuple, list))):
            order = axes[0]  # numpy's transpose(None) and transpose((1, 0)) forms
        perm = tuple(range(self.ndim))[::-1] if not order else tuple(int(a) % self.ndim for a in order)
        return self._transpose(perm)

    def reshape(self, *shape: Any, order: str = "C") -> Tensor:
        if order != "C":
            raise Unsupported(f"reshape(order={order!r})")
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        return self._reshape(_resolve_shape(shape, self.size))

    def squeeze(self, axis: Any = None) -> Tensor:
        return _squeeze(self, axis)

    def swapaxes(self, axis1: int, axis2: int) -> Tensor:
        return _swapaxes(self, axis1, axis2)

    def astype(self, dtype: Any, copy: bool = True) -> Tensor:
        dtype = np.dtype(dtype)
        if dtype == self.dtype:
            return self
        return Cast(self, dtype)

    def __getitem__(self, index: Any) -> Tensor:
        raise NotImplementedError

    def _transpose(self, perm: tuple[int, ...]) -> Tensor:
        raise NotImplementedError

    def _reshape(self, shape: tuple[int, ...]) -> Tensor:
        raise NotImplementedError

    def sources(self) -> list[str]:
        """Stored keys this value is made of."""
        raise NotImplementedError

    def read(self, box: Box, fetch: Fetch) -> np.ndarray:
        """Returns `box` of this value as a new array of `self.dtype`."""
        out = np.empty(tuple(s.stop - s.start for s in box), self.dtype)
        self.read_into(box, fetch, out)
        return out

    def read_into(self, box: Box, fetch: Fetch, out: np.ndarray) -> None:
        """Writes `box` of this value into `out` (cast to `out.dtype`)."""
        raise NotImplementedError

    def view(self, box: Box, fetch: Fetch) -> np.ndarray | None:
        """`box` as a view of a stored tensor without a copy, if it is one."""
        return None

    def write(self, value: np.ndarray, store: Callable[[str], np.ndarray]) -> None:
        """The inverse: puts `value` where its elements come from (fixtures)."""
        raise NotImplementedError


def _resolve_shape(shape: Sequence[Any], size: int) -> tuple[int, ...]:
    dims = [int(d) for d in shape]
    if dims.count(-1) == 1:
        known = math.prod(d for d in dims if d != -1)
        dims[dims.index(-1)] = size // known if known else 0
    if math.prod(dims) != size:
        raise ValueError(f"cannot reshape a tensor of size {size} into shape {tuple(dims)}")
    return tuple(dims)


def _fake(shape: tuple[int, ...], strides: tuple[int, ...], offset: int) -> np.ndarray:
    """A data-less uint8 array: numpy's view arithmetic, in elements, never read."""

    class _Interface:
        __array_interface__ = {  # noqa: RUF012 (numpy's protocol: a class attribute)
            "shape": shape,
            "typestr": "|u1",
            "data": (_BASE + offset, True),
            "strides": strides,
            "version": 3,
        }

    return np.asarray(_Interface())


def _describe(fake: np.ndarray) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    return tuple(fake.shape), tuple(fake.strides), fake.__array_interface__["data"][0] - _BASE


def _check_basic(index: Any) -> tuple[Any, ...]:
    index = index if isinstance(index, tuple) else (index,)
    for item in index:
        if not (item is None or item is Ellipsis or isinstance(item, (slice, int, np.integer))):
            raise Unsupported(f"indexing a stored tensor with {type(item).__name__} (advanced indexing copies)")
    return index


class Strided(Tensor):
    """A view of one stored tensor: `element[i] = stored.flat[offset + i . strides]`."""

    def __init__(
        self, key: str, dtype: np.dtype, shape: tuple[int, ...], strides: tuple[int, ...], offset: int = 0
    ) -> None:
        self.key = key
        self.dtype = np.dtype(dtype)
        self.shape = tuple(shape)
        self.strides = tuple(strides)
        self.offset = offset

    @classmethod
    def stored(cls, key: str, dtype: np.dtype, shape: tuple[int, ...]) -> Strided:
        """The whole stored tensor `key`, C-contiguous."""
        strides = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
        return cls(key, dtype, shape, strides, 0)

    def _fake(self) -> np.ndarray:
        return _fake(self.shape, self.strides, self.offset)

    def _from(self, fake: np.ndarray) -> Strided:
        return Strided(self.key, self.dtype, *_describe(fake))

    def _transpose(self, perm: tuple[int, ...]) -> Tensor:
        return self._from(self._fake().transpose(perm))

    def _reshape(self, shape: tuple[int, ...]) -> Tensor:
        try:
            return self._from(np.reshape(self._fake(), shape, copy=False))
        except ValueError as e:
            raise Unsupported(
                f"reshaping {self.key!r} (as {self.shape}) to {shape} reorders elements beyond a view"
            ) from e

    def __getitem__(self, index: Any) -> Tensor:
        return self._from(self._fake()[_check_basic(index)])

    def sources(self) -> list[str]:
        return [self.key]

    def view(self, box: Box, fetch: Fetch) -> np.ndarray:
        shape = tuple(s.stop - s.start for s in box)
        # The box's first element; the fetch reads only the box's elements.
        first = self.offset + sum(s.start * st for s, st in zip(box, self.strides, strict=True))
        return fetch(self.key, first, shape, self.strides)

    def read_into(self, box: Box, fetch: Fetch, out: np.ndarray) -> None:
        out[...] = self.view(box, fetch)

    def write(self, value: np.ndarray, store: Callable[[str], np.ndarray]) -> None:
        base = store(self.key)
        itemsize = base.dtype.itemsize
        target = np.ndarray(
            self.shape,
            base.dtype,
            buffer=base,
            offset=self.offset * itemsize,
            strides=tuple(s * itemsize for s in self.strides),
        )
        target[...] = value


class Cast(Tensor):
    """`child.astype(dtype)`: keras-hub's casts inside hooks, kept in order."""

    def __init__(self, child: Tensor, dtype: np.dtype) -> None:
        self.child = child
        self.dtype = np.dtype(dtype)
        self.shape = child.shape

    def _transpose(self, perm: tuple[int, ...]) -> Tensor:
        return Cast(self.child._transpose(perm), self.dtype)

    def _reshape(self, shape: tuple[int, ...]) -> Tensor:
        return Cast(self.child._reshape(shape), self.dtype)

    def __getitem__(self, index: Any) -> Tensor:
        return Cast(self.child[index], self.dtype)

    def sources(self) -> list[str]:
        return self.child.sources()

    def read_into(self, box: Box, fetch: Fetch, out: np.ndarray) -> None:
        out[...] = self.child.read(box, fetch).astype(self.dtype)

    def write(self, value: np.ndarray, store: Callable[[str], np.ndarray]) -> None:
        self.child.write(value, store)


class Concat(Tensor):
    """Parts joined along `axis` (np.concatenate; np.stack after expand_dims)."""

    def __init__(self, parts: Sequence[Tensor], axis: int) -> None:
        if not parts:
            raise ValueError("need at least one array to concatenate")
        first = parts[0].shape
        axis = axis % len(first)
        for p in parts:
            if len(p.shape) != len(first) or any(a != b for i, (a, b) in enumerate(zip(p.shape, first)) if i != axis):
                raise ValueError(f"all parts must match except along axis {axis}: {first} vs {p.shape}")
        self.parts = list(parts)
        self.axis = axis
        self.dtype = np.result_type(*[p.dtype for p in parts])
        self.shape = first[:axis] + (sum(p.shape[axis] for p in parts),) + first[axis + 1 :]

    def _spans(self) -> list[tuple[int, int, Tensor]]:
        out, start = [], 0
        for p in self.parts:
            out.append((start, start + p.shape[self.axis], p))
            start += p.shape[self.axis]
        return out

    def _transpose(self, perm: tuple[int, ...]) -> Tensor:
        return Concat([p._transpose(perm) for p in self.parts], perm.index(self.axis))

    def _reshape(self, shape: tuple[int, ...]) -> Tensor:
        if shape == self.shape:
            return self
        # Adding or removing length-1 axes away from the joined axis only.
        old = [d for d in self.shape if d != 1]
        new = [d for d in shape if d != 1]
        if old != new or self.shape[self.axis] == 1:
            raise Unsupported(f"reshaping a concatenation {self.shape} to {shape}")
        nonunit_before = sum(1 for d in self.shape[: self.axis] if d != 1)
        axis = [i for i, d in enumerate(shape) if d != 1][nonunit_before]
        parts = []
        for p in self.parts:
            part_shape = list(shape)
            part_shape[axis] = p.shape[self.axis]
            parts.append(p._reshape(tuple(part_shape)))
        return Concat(parts, axis)

    def __getitem__(self, index: Any) -> Tensor:
        index = _check_basic(index)
        if any(i is None or i is Ellipsis for i in index):
            raise Unsupported("None/Ellipsis indexing of a concatenation")
        index = index + (slice(None),) * (self.ndim - len(index))
        own = index[self.axis]
        if isinstance(own, slice) and own.indices(self.shape[self.axis]) == (0, self.shape[self.axis], 1):
            rest = tuple(index)
            squeezed = sum(1 for i in index[: self.axis] if not isinstance(i, slice))
            return Concat([p[rest] for p in self.parts], self.axis - squeezed)
        raise Unsupported("slicing a concatenation along its joined axis")

    def sources(self) -> list[str]:
        return [k for p in self.parts for k in p.sources()]

    def read_into(self, box: Box, fetch: Fetch, out: np.ndarray) -> None:
        want = box[self.axis]
        for start, stop, part in self._spans():
            lo, hi = max(start, want.start), min(stop, want.stop)
            if lo >= hi:
                continue
            sub = box[: self.axis] + (slice(lo - start, hi - start),) + box[self.axis + 1 :]
            dst = (slice(None),) * self.axis + (slice(lo - want.start, hi - want.start),)
            part.read_into(sub, fetch, out[dst])

    def write(self, value: np.ndarray, store: Callable[[str], np.ndarray]) -> None:
        for start, stop, part in self._spans():
            part.write(value[(slice(None),) * self.axis + (slice(start, stop),)], store)


def _as_tensor(x: Any) -> Tensor:
    if isinstance(x, Tensor):
        return x
    raise Unsupported(f"combining a stored tensor with a {type(x).__name__} computed on the host")


def _transpose(a: Any, axes: Any = None) -> Tensor:
    return _as_tensor(a).transpose(axes)


def _reshape(a: Any, *args: Any, **kwargs: Any) -> Tensor:
    shape = kwargs.pop("shape", kwargs.pop("newshape", None))
    if args:
        shape = args[0]
    order = kwargs.pop("order", "C")
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    return _as_tensor(a).reshape(shape, order=order)


def _concatenate(arrays: Sequence[Any], axis: int = 0, **kwargs: Any) -> Tensor:
    if kwargs.get("out") is not None or kwargs.get("dtype") is not None:
        raise Unsupported("np.concatenate with out= or dtype=")
    return Concat([_as_tensor(a) for a in arrays], axis)


def _expand_dims(a: Any, axis: int) -> Tensor:
    t = _as_tensor(a)
    axis = axis % (t.ndim + 1)
    return t.reshape(t.shape[:axis] + (1,) + t.shape[axis:])


def _stack(arrays: Sequence[Any], axis: int = 0, **kwargs: Any) -> Tensor:
    if kwargs.get("out") is not None or kwargs.get("dtype") is not None:
        raise Unsupported("np.stack with out= or dtype=")
    return Concat([_expand_dims(a, axis) for a in arrays], axis)


def _squeeze(a: Any, axis: Any = None) -> Tensor:
    t = _as_tensor(a)
    axes = range(t.ndim) if axis is None else ((axis,) if isinstance(axis, int) else axis)
    drop = {int(x) % t.ndim for x in axes if t.shape[int(x) % t.ndim] == 1}
    return t.reshape(tuple(d for i, d in enumerate(t.shape) if i not in drop))


def _swapaxes(a: Any, axis1: int, axis2: int) -> Tensor:
    t = _as_tensor(a)
    perm = list(range(t.ndim))
    perm[axis1], perm[axis2] = perm[axis2], perm[axis1]
    return t.transpose(perm)


def _moveaxis(a: Any, source: int, destination: int) -> Tensor:
    t = _as_tensor(a)
    perm = [i for i in range(t.ndim) if i != source % t.ndim]
    perm.insert(destination % t.ndim, source % t.ndim)
    return t.transpose(perm)


def _shape(a: Any) -> tuple[int, ...]:
    return _as_tensor(a).shape


_FUNCTIONS: dict[Any, Callable[..., Any]] = {
    np.transpose: _transpose,
    np.reshape: _reshape,
    np.concatenate: _concatenate,
    np.stack: _stack,
    np.expand_dims: _expand_dims,
    np.squeeze: _squeeze,
    np.swapaxes: _swapaxes,
    np.moveaxis: _moveaxis,
    np.shape: _shape,
}


def without_float_casts(tensor: Tensor) -> Tensor:
    """`tensor` without its casts from one floating-point dtype to another.

    For a caller that casts to its own dtype once: a hook that rounds
    through float16 (keras-hub's Mistral converter), followed by a cast to
    bfloat16, rounds twice; without the hook's cast the stored values are
    rounded once. Integer casts are kept.
    """
    if isinstance(tensor, Cast):
        child = without_float_casts(tensor.child)
        if dtypes.is_float(tensor.dtype) and dtypes.is_float(child.dtype):
            return child
        return Cast(child, tensor.dtype)
    if isinstance(tensor, Concat):
        return Concat([without_float_casts(p) for p in tensor.parts], tensor.axis)
    return tensor
