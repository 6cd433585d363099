"""Checks of every public call, before anything is launched or written.

Each failure raises ValueError or TypeError naming the argument, what was expected and what was
given. The checks read metadata only, with one exception: the values of index arguments
(cu_seqlens, conv_state_indices) are checked where reading them is free, on CPU arrays. On GPU
arrays that would need a host synchronisation, so there their values are the caller's
responsibility, unless debug mode is on (``debug()`` or the environment variable
CUPYCONV_DEBUG=1, read when cupyconv is imported), which copies them to the host and checks
them too.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterable

import numpy as np

from ._arrays import Array, describe, describe_optional, remember
from ._overlap import views_overlap
from .reference import check_activation  # noqa: F401 - re-exported: True for SiLU

MAX_WIDTH = 256
FLOAT_DTYPES = ("float32", "float16", "bfloat16", "float64")
INDEX_DTYPES = ("int32", "int64")


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
    if isinstance(a.dtype, np.dtype) and not a.dtype.isnative:
        native = a.dtype.newbyteorder("=")
        raise TypeError(
            f"{name} must be in the machine's byte order; got a byte-swapped {native.name} "
            f"array (dtype {a.dtype.str}; convert it with .astype({native.name!r}))"
        )
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
    """An output buffer must be writable now (so that nothing is written before a refusal):
    not a JAX array, not read-only, not a torch tensor that autograd tracks or an inference
    tensor outside inference mode; no element twice; and no byte shared with any of the other
    arguments, given as (name, array) pairs (``_overlap.views_overlap``: exact)."""
    if a is None:
        return
    if a.kind == "jax":
        raise TypeError(
            f"{name} must be a mutable array; got a JAX array (JAX arrays are immutable)"
        )
    if a.kind == "numpy" and not a.native.flags.writeable:
        raise ValueError(f"{name} must be writable; got a read-only numpy array")
    if a.kind == "torch":
        _torch_writable(a.obj, name)
    if _self_overlapping(a):
        raise ValueError(
            f"{name} must not have overlapping elements; got shape {a.shape} strides {a.strides}"
        )
    for n, other in inputs:
        if other is not None and other.device == a.device and views_overlap(a, other):
            raise ValueError(f"{name} must not share memory with {n}")


def _torch_writable(t, name: str) -> None:
    if t.requires_grad:
        raise ValueError(
            f"{name} must not require grad: cupyconv writes it in place, which autograd cannot "
            f"record; got a tensor with requires_grad=True (pass {name}.detach())"
        )
    if t.is_inference():
        import torch

        if not torch.is_inference_mode_enabled():
            raise ValueError(
                f"{name} is an inference tensor, which torch lets only code inside "
                "torch.inference_mode() write; call cupyconv inside it"
            )


_overlapping: dict[tuple, bool] = {}


def _self_overlapping(a: Array) -> bool:
    """Whether two elements of ``a`` may share memory, by its shape and byte strides: the
    layout is refused unless its dims, by stride, each step past the extent of the ones below
    (memoised)."""
    key = (a.shape, a.byte_strides, a.itemsize)
    found = _overlapping.get(key)
    if found is None:
        found = remember(_overlapping, key, _layout_overlaps(*key))
    return found


def _layout_overlaps(shape, byte_strides, itemsize) -> bool:
    if any(n == 0 for n in shape):
        return False
    dims = sorted((abs(s), n) for s, n in zip(byte_strides, shape) if n > 1)
    extent = itemsize
    for stride, n in dims:
        if stride < extent:
            return True
        extent = stride * n
    return False


# ---- index values ----------------------------------------------------------------------------


class _Debug(threading.local):
    depth = 0  # nested ``debug()`` blocks in this thread


_debug = _Debug()


@contextlib.contextmanager
def debug():
    """Debug mode in this thread, for the duration of a ``with`` block: the values of index
    arguments on GPU arrays are copied to the host and checked as on CPU arrays (each such
    call synchronises with the GPU). The environment variable CUPYCONV_DEBUG=1 (read when
    cupyconv is imported) turns it on everywhere."""
    depth = _debug.depth
    _debug.depth = depth + 1
    try:
        yield
    finally:
        _debug.depth = depth


DEBUG_ENV = os.environ.get("CUPYCONV_DEBUG", "") not in ("", "0")  # read once: calls are hot


def debug_enabled() -> bool:
    return DEBUG_ENV or _debug.depth > 0


def index_values(a: Array | None) -> np.ndarray | None:
    """The values of index array ``a`` where they may be read: always on the CPU, on a GPU in
    debug mode (a copy to the host); else None."""
    if a is None or (a.on_gpu and not debug_enabled()):
        return None
    if not a.on_gpu:
        return np.asarray(a.obj.numpy() if a.kind == "torch" else a.native)
    if a.kind == "torch":
        return a.obj.detach().cpu().numpy()
    import cupy

    return cupy.asnumpy(cupy.asarray(a.native))


def cu_seqlens_values(cu: Array, tokens: int) -> None:
    """cu_seqlens starts at 0, never decreases, and ends at most at the number of tokens."""
    values = index_values(cu)
    if values is None:
        return
    if values[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0; got {values[0]}")
    steps = np.diff(values)
    if (steps < 0).any():
        i = int(np.argmax(steps < 0))
        raise ValueError(
            f"cu_seqlens must be non-decreasing; got {values[i]} then {values[i + 1]} at "
            f"positions {i} and {i + 1}"
        )
    if values[-1] > tokens:
        raise ValueError(
            f"cu_seqlens must end at most at the number of tokens x.shape[0] = {tokens}; "
            f"got {values[-1]}"
        )


def state_indices_values(idx: Array | None, pool: int) -> None:
    """conv_state_indices: each below the pool size conv_state.shape[0], or negative (padding)."""
    values = index_values(idx)
    if values is None:
        return
    bad = values >= pool
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(
            f"conv_state_indices must be below conv_state.shape[0] = {pool} (or negative for "
            f"padding rows); got {values[i]} at position {i}"
        )
