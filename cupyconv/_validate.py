"""Checks of every public call, on metadata only, before anything is launched or written.

Each failure raises ValueError or TypeError naming the argument, what was expected and what was
given. Values are never read (that would need a host synchronisation): out-of-range seq_idx,
cache_seqlens, conv_state_indices or cu_seqlens values are the caller's responsibility.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from ._arrays import Array, describe, describe_optional, remember
from .reference import ACTIVATIONS

MAX_WIDTH = 256
FLOAT_DTYPES = ("float32", "float16", "bfloat16", "float64")
INDEX_DTYPES = ("int32", "int64")


def check_activation(activation) -> bool:
    """True for SiLU, False for the identity."""
    if not (activation is None or (isinstance(activation, str) and activation in ACTIVATIONS)):
        raise ValueError(f"activation must be one of {ACTIVATIONS}; got {activation!r}")
    return activation is not None


def check_flag(value, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool; got {type(value).__name__}")
    return bool(value)


def array(obj, name: str, ndim: int | tuple[int, ...], kind: str = "float") -> Array:
    """Describe a required array and check its number of dimensions and dtype kind."""
    if obj is None:
        raise TypeError(f"{name} must be an array; got None")
    return _checked(describe(obj, name), name, ndim, kind)


def optional(obj, name: str, ndim: int, kind: str = "float") -> Array | None:
    a = describe_optional(obj, name)
    return None if a is None else _checked(a, name, ndim, kind)


def _checked(a: Array, name: str, ndim, kind: str) -> Array:
    ndims = (ndim,) if isinstance(ndim, int) else ndim
    if a.ndim not in ndims:
        want = " or ".join(str(n) for n in ndims)
        raise ValueError(f"{name} must have {want} dimensions; got shape {a.shape}")
    allowed = FLOAT_DTYPES if kind == "float" else INDEX_DTYPES
    if a.dtype_name not in allowed:
        raise TypeError(f"{name} must have dtype among {', '.join(allowed)}; got {a.dtype_name}")
    return a


def shape(a: Array | None, name: str, expected: tuple, described: str) -> None:
    """``expected`` may hold None for a free size; ``described`` names the sizes in words,
    e.g. '(batch, dim, width - 1) from x and weight'."""
    if a is None:
        return
    if len(a.shape) == len(expected):
        for e, n in zip(expected, a.shape):  # a plain loop: this runs on every call
            if e is not None and e != n:
                break
        else:
            return
    want = "(" + ", ".join("*" if e is None else str(e) for e in expected) + ")"
    raise ValueError(f"{name} must have shape {described} = {want}; got {a.shape}")


def width(weight: Array) -> int:
    k = weight.shape[1]
    if not 1 <= k <= MAX_WIDTH:
        raise ValueError(f"weight.shape[1] (the width) must be between 1 and {MAX_WIDTH}; got {k}")
    return k


def filter_args(weight, bias, dim: int) -> tuple[Array, Array | None, int]:
    """weight [dim, width] and bias [dim] or None, described and checked: (weight, bias,
    width)."""
    w = array(weight, "weight", 2)
    shape(w, "weight", (dim, None), "(dim, width) with dim = x.shape[1]")
    k = width(w)
    b = optional(bias, "bias", 1)
    shape(b, "bias", (dim,), "(dim,) with dim = x.shape[1]")
    return w, b, k


class ConvArgs:
    """The arguments of a convolution of x [batch, dim, seqlen] that the forward and the
    backward share, described and checked once."""

    __slots__ = ("x", "weight", "bias", "seq_idx", "initial_states", "width")

    def named(self) -> tuple[tuple[str, Array | None], ...]:
        """(name, array) pairs, for the device and overlap checks."""
        return (
            ("x", self.x), ("weight", self.weight), ("bias", self.bias),
            ("seq_idx", self.seq_idx), ("initial_states", self.initial_states),
        )  # fmt: skip


def conv_args(x, weight, bias, seq_idx, initial_states) -> ConvArgs:
    """x [batch, dim, seqlen]; weight [dim, width]; bias [dim] or None; seq_idx [batch, seqlen]
    or None; initial_states [batch, dim, width - 1] or None."""
    a = ConvArgs()
    a.x = xa = array(x, "x", 3)
    batch, dim, seqlen = xa.shape
    a.weight, a.bias, a.width = filter_args(weight, bias, dim)
    a.seq_idx = optional(seq_idx, "seq_idx", 2, kind="index")
    shape(a.seq_idx, "seq_idx", (batch, seqlen), "(batch, seqlen) of x")
    a.initial_states = optional(initial_states, "initial_states", 3)
    shape(a.initial_states, "initial_states", state_shape(a), STATE_SHAPE)
    return a


STATE_SHAPE = "(batch, dim, width - 1) from x and weight"


def state_shape(a: ConvArgs) -> tuple[int, int, int]:
    batch, dim, _ = a.x.shape
    return (batch, dim, a.width - 1)


def same_device(arrays: Iterable[tuple[str, Array | None]]) -> int:
    """The common device of the given (name, array) pairs; ValueError naming two that differ."""
    present = [(n, a) for n, a in arrays if a is not None]
    first_name, first = present[0]
    for n, a in present[1:]:
        if a.device != first.device:
            raise ValueError(
                f"all arrays must be on one device; got {first_name} on {first.device_name} "
                f"and {n} on {a.device_name}"
            )
    return first.device


def same_dtype(a: Array | None, name: str, ref: Array, ref_name: str) -> None:
    if a is not None and a.dtype_name != ref.dtype_name:
        raise ValueError(
            f"{name} must have the dtype of {ref_name} ({ref.dtype_name}); got {a.dtype_name}"
        )


def writable(a: Array | None, name: str, inputs: Iterable[tuple[str, Array | None]]) -> None:
    """An output buffer must be writable, have no element twice, and share no memory with the
    inputs, given as (name, array) pairs."""
    if a is None:
        return
    if a.kind == "jax":
        raise TypeError(
            f"{name} must be a mutable array; got a JAX array (JAX arrays are immutable)"
        )
    if a.kind == "numpy" and not a.native.flags.writeable:
        raise ValueError(f"{name} must be writable; got a read-only numpy array")
    if _self_overlapping(a):
        raise ValueError(
            f"{name} must not have overlapping elements; got shape {a.shape} strides {a.strides}"
        )
    lo, hi = a.span()
    for n, other in inputs:
        if other is None or other.device != a.device:
            continue
        olo, ohi = other.span()
        if lo <= ohi and olo <= hi and _may_share(a, other):
            raise ValueError(f"{name} must not share memory with {n}")


def _may_share(a: Array, b: Array) -> bool:
    """Whether two arrays with overlapping byte spans can share an element. Exact when both
    have the same strides and itemsize (slices of one buffer, say); conservative otherwise."""
    itemsize = np.dtype(a.dtype).itemsize
    if a.strides != b.strides or np.dtype(b.dtype).itemsize != itemsize or _self_overlapping(a):
        return True
    offset, rem = divmod(b.ptr - a.ptr, itemsize)
    if rem:
        return True  # misaligned views of one buffer: treat as sharing
    dims = sorted(((abs(s), n) for s, n in zip(a.strides, a.shape) if n > 1), reverse=True)

    def reachable(rem: int, level: int) -> bool:  # rem == sum_k delta_k * s_k, |delta_k| < n_k?
        if level == len(dims):
            return rem == 0
        s, n = dims[level]
        for delta in {rem // s, -(-rem // s)}:
            if abs(delta) < n and reachable(rem - delta * s, level + 1):
                return True
        return False

    return reachable(offset, 0)


_overlapping: dict[tuple, bool] = {}


def _self_overlapping(a: Array) -> bool:
    """Whether two elements of ``a`` share memory (by its shape and strides; memoised)."""
    key = (a.shape, a.strides)
    found = _overlapping.get(key)
    if found is None:
        found = remember(_overlapping, key, _layout_overlaps(a.shape, a.strides))
    return found


def _layout_overlaps(shape, strides) -> bool:
    if any(n == 0 for n in shape):
        return False
    dims = sorted((abs(s), n) for s, n in zip(strides, shape) if n > 1)
    extent = 1
    for stride, n in dims:
        if stride < extent:
            return True
        extent = stride * n
    return False
