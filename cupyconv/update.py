"""The decode update, ``causal_conv1d_update``. In this version it runs on CPU arrays, through
the float64 reference; GPU arrays raise NotImplementedError."""

from __future__ import annotations

from . import _validate as v
from . import reference
from ._host import gpu_pending, host, new_host, write_host

__all__ = ["causal_conv1d_update"]


def causal_conv1d_update(
    x,
    conv_state,
    weight,
    bias=None,
    activation=None,
    cache_seqlens=None,
    conv_state_indices=None,
):
    """One decode step (or a few tokens) against a rolling state, updating ``conv_state`` in
    place (CPU arrays in this version).

    x:          [batch, dim] (one token) or [batch, dim, seqlen] (seqlen new tokens)
    conv_state: [N, dim, state_len], state_len >= width - 1, any strides and float dtype;
                N == batch unless conv_state_indices is given
    weight:     [dim, width]; bias: [dim] or None
    cache_seqlens: [batch] int32/int64 or None: circular mode (tokens already written)
    conv_state_indices: [batch] int32/int64 or None: row b uses conv_state[indices[b]];
                negative entries are padding rows (output 0, state untouched). Entries must
                be below N and distinct (checked on CPU arrays; on GPU arrays, where reading
                them would synchronise, only in ``cupyconv.debug()`` mode: there an entry
                past the pool reads and writes outside conv_state, and repeated entries
                leave the state of the row in question undefined)
    Returns out with the shape and dtype of x.
    """
    silu = v.check_activation(activation)
    xa = v.array(x, "x", (2, 3))
    batch, dim = xa.shape[:2]
    state = v.array(conv_state, "conv_state", 3)
    w, b, width = v.filter_args(weight, bias, dim)
    lens = v.optional(cache_seqlens, "cache_seqlens", 1, kind="index")
    v.shape(lens, "cache_seqlens", (batch,), "(batch,) of x")
    idx = v.optional(conv_state_indices, "conv_state_indices", 1, kind="index")
    v.shape(idx, "conv_state_indices", (batch,), "(batch,) of x")
    n_rows = None if idx is not None else batch
    rows = "batch = x.shape[0]" if idx is None else "pool size"
    v.shape(state, "conv_state", (n_rows, dim, None), f"({rows}, dim = x.shape[1], state_len)")
    if state.shape[2] < width - 1:
        raise ValueError(
            f"conv_state.shape[2] (state_len) must be at least width - 1 = {width - 1}; "
            f"got {state.shape[2]}"
        )
    others = (("weight", w), ("bias", b), ("cache_seqlens", lens), ("conv_state_indices", idx))
    v.same_device((("x", xa), ("conv_state", state)) + others)
    v.writable(state, "conv_state", (("x", xa),) + others)
    v.state_indices_values(idx, state.shape[0])
    if xa.on_gpu:
        raise gpu_pending("causal_conv1d_update")
    out64, state64 = reference.causal_conv1d_update(
        host(xa), host(state), host(w), host(b), activation="silu" if silu else None,
        cache_seqlens=host(lens), conv_state_indices=host(idx),
    )  # fmt: skip
    out = new_host(xa, out64)
    write_host(state, state64)
    return out
