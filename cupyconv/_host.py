"""The CPU path's input and output: CPU arrays into the float64 reference, its results back in
the caller's dtype and framework (numpy, CPU torch, CPU JAX)."""

from __future__ import annotations

import sys

import numpy as np

from ._arrays import Array, dense_strides, stride_order


def host(a: Array | None) -> np.ndarray | None:
    """A numpy view (or, for torch bfloat16, a float32 copy) of a CPU array."""
    if a is None:
        return None
    if a.kind == "torch":
        t = a.obj.detach().resolve_neg()  # (a lazily negated view: its values, copied)
        if a.dtype_name == "bfloat16":
            t = t.float()
        return t.numpy()
    return a.native


def new_host(like: Array, values: np.ndarray, order=None):
    """``values`` (float64) rounded to the dtype of ``like``, in ``like``'s framework; dense,
    dims outermost first in ``order`` (default: the stride order of ``like``)."""
    order = stride_order(like) if order is None else order
    if like.kind == "jax":  # on the device of like (a CPU)
        import jax

        return jax.device_put(values.astype(like.dtype), next(iter(like.obj.devices())))
    if like.kind == "torch":
        torch = sys.modules["torch"]
        t = torch.empty_strided(
            values.shape, dense_strides(values.shape, order), dtype=like.obj.dtype
        )
        return t.copy_(torch.from_numpy(values))
    made = np.empty(tuple(values.shape[d] for d in order), like.dtype).transpose(np.argsort(order))
    made[...] = values
    return made


def write_host(dst: Array, values: np.ndarray):
    """Write float64 ``values`` into the caller's CPU buffer ``dst`` (rounded to its dtype)."""
    if dst.kind == "torch":
        torch = sys.modules["torch"]
        dst.obj.copy_(torch.from_numpy(values))
    else:
        dst.native[...] = values.astype(dst.dtype)
    return dst.obj


def output(given: Array | None, like: Array, values: np.ndarray, order=None):
    """``values`` written into the caller's buffer ``given`` when there is one, else a new
    array like ``like`` (``new_host``)."""
    return write_host(given, values) if given is not None else new_host(like, values, order)
