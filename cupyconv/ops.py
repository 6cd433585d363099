"""The public operators: validated entry points that run the kernels on GPU arrays and the
float64 reference on CPU arrays.

Shapes use the vocabulary batch (B), dim (C), seqlen (L), width (K), state_len (S).
"""

from __future__ import annotations

import sys

import numpy as np

from . import _validate as v
from . import reference
from ._arrays import Array, dense_strides, empty, result, stream_of, stride_order, strides_like
from ._dispatch import forward_args, launch, plan_final_states, plan_forward

__all__ = [
    "causal_conv1d_fn",
    "causal_conv1d_bwd",
    "causal_conv1d_update",
    "causal_conv1d_varlen_states",
    "warmup",
]


# ---- forward ---------------------------------------------------------------------------------


def causal_conv1d_fn(
    x,
    weight,
    bias=None,
    seq_idx=None,
    initial_states=None,
    return_final_states=False,
    final_states_out=None,
    activation=None,
    *,
    out=None,
):
    """Causal depthwise conv1d: ``out[b,c,t] = act(bias[c] + sum_k weight[c,k] * x[b,c,t-K+1+k])``.

    Equivalent to ``F.conv1d(x, weight.unsqueeze(1), bias, padding=K-1, groups=dim)[..., :seqlen]``
    followed by the activation, plus seq_idx masking and initial/final states (see the contract).

    x:              [batch, dim, seqlen], any strides; float32, float16, bfloat16 or float64
    weight:         [dim, width], 1 <= width <= 256, any float dtype
    bias:           [dim] or None, any float dtype
    seq_idx:        [batch, seqlen] int32/int64 or None; tokens of different ids do not mix,
                    negative ids are padding (output 0)
    initial_states: [batch, dim, width - 1] or None: the inputs before t = 0
    return_final_states: also return final_states [batch, dim, width - 1] (dtype of x), written
                    into final_states_out when given
    activation:     None, "silu" or "swish"
    out:            optional [batch, dim, seqlen] buffer of x's dtype, any strides, not
                    overlapping x
    Returns out, or (out, final_states). Results come back in x's framework, on x's device and
    (for torch) on the current stream.
    """
    call = _forward_call(
        x,
        weight,
        bias,
        seq_idx,
        initial_states,
        return_final_states,
        final_states_out,
        activation,
        out,
    )
    if not call.x.on_gpu:
        return _forward_cpu(call)
    return _forward_gpu(call)


class _ForwardCall:
    __slots__ = (
        "x",
        "weight",
        "bias",
        "seq_idx",
        "initial_states",
        "final_states_out",
        "out",
        "width",
        "silu",
        "return_final_states",
        "device",
    )


def _forward_call(
    x,
    weight,
    bias,
    seq_idx,
    initial_states,
    return_final_states,
    final_states_out,
    activation,
    out,
) -> _ForwardCall:
    call = _ForwardCall()
    call.silu = v.check_activation(activation)
    call.return_final_states = v.check_flag(return_final_states, "return_final_states")
    call.x = x = v.array(x, "x", 3)
    batch, dim, seqlen = x.shape
    call.weight = weight = v.array(weight, "weight", 2)
    v.shape(weight, "weight", (dim, None), "(dim, width) with dim = x.shape[1]")
    call.width = width = v.width(weight)
    call.bias = bias = v.optional(bias, "bias", 1)
    v.shape(bias, "bias", (dim,), "(dim,) with dim = x.shape[1]")
    call.seq_idx = seq_idx = v.optional(seq_idx, "seq_idx", 2, kind="index")
    v.shape(seq_idx, "seq_idx", (batch, seqlen), "(batch, seqlen) of x")
    call.initial_states = init = v.optional(initial_states, "initial_states", 3)
    state_shape = (batch, dim, width - 1)
    v.shape(init, "initial_states", state_shape, "(batch, dim, width - 1) from x and weight")
    final = v.optional(final_states_out, "final_states_out", 3) if return_final_states else None
    call.final_states_out = final
    v.shape(final, "final_states_out", state_shape, "(batch, dim, width - 1) from x and weight")
    v.same_dtype(final, "final_states_out", x, "x")
    call.out = out = v.optional(out, "out", 3)
    v.shape(out, "out", x.shape, "(batch, dim, seqlen) of x")
    v.same_dtype(out, "out", x, "x")
    inputs = (("x", x), ("weight", weight), ("bias", bias), ("seq_idx", seq_idx))
    inputs += (("initial_states", init),)
    call.device = v.same_device(inputs + (("final_states_out", final), ("out", out)))
    v.writable(out, "out", inputs)
    v.writable(final, "final_states_out", inputs + (("out", out),))
    return call


def _forward_gpu(call: _ForwardCall):
    x = call.x
    batch, dim, seqlen = x.shape
    width = call.width
    out = call.out or empty(x, x.shape, strides_like(x), x.dtype)
    final = None
    if call.return_final_states:
        # Laid out [batch, width - 1, dim], viewed as [batch, dim, width - 1].
        final = call.final_states_out or empty(
            x, (batch, dim, width - 1), dense_strides((batch, dim, width - 1), (0, 2, 1)), x.dtype
        )
    stream = stream_of(x)
    seq_idx = call.seq_idx if seqlen > 0 else None  # no token, no segment id to read

    def run(plan, final_states):
        args = forward_args(
            plan, x, call.weight, call.bias, seq_idx, call.initial_states, out, final_states,
            width, call.silu,
        )  # fmt: skip
        launch("fwd.cu", plan, call.device, args, stream)

    if batch * dim * seqlen > 0:
        plan = plan_forward(
            x, out, call.weight, call.initial_states, width, seq_idx is not None, call.device
        )
        run(plan, None)
    if final is not None and batch * dim * (width - 1) > 0:
        run(plan_final_states(x, width), final)
    result_out = _returned(x, out, call.out)
    if final is None:
        return result_out
    return result_out, _returned(x, final, call.final_states_out)


def _returned(x: Array, made: Array, given: Array | None):
    return given.obj if given is not None else result(x, made)


def warmup(
    x,
    weight,
    bias=None,
    seq_idx=None,
    initial_states=None,
    return_final_states=False,
    final_states_out=None,
    activation=None,
    *,
    out=None,
) -> None:
    """Compile and load the kernels that ``causal_conv1d_fn`` with these arguments would launch,
    without launching them (call before capturing a CUDA graph). CPU arrays need nothing."""
    call = _forward_call(
        x,
        weight,
        bias,
        seq_idx,
        initial_states,
        return_final_states,
        final_states_out,
        activation,
        out,
    )
    if not call.x.on_gpu or call.x.shape[0] * call.x.shape[1] * call.x.shape[2] == 0:
        return
    from ._compile import get_kernel

    target = call.out or call.x
    get_kernel(
        "fwd.cu",
        plan_forward(
            call.x,
            target,
            call.weight,
            call.initial_states,
            call.width,
            call.seq_idx is not None,
            call.device,
        ).name,
        call.device,
    )
    if call.return_final_states and call.width > 1:
        get_kernel("fwd.cu", plan_final_states(call.x, call.width).name, call.device)


# ---- the CPU path: the float64 reference, results in the caller's dtype and framework ------


def _host(a: Array | None) -> np.ndarray | None:
    """A numpy view (or, for torch bfloat16, a float32 copy) of a CPU array."""
    if a is None:
        return None
    if a.kind == "torch":
        t = a.obj.detach()
        if a.dtype_name == "bfloat16":
            t = t.float()
        return t.numpy()
    return a.native


def _new_host(like: Array, values: np.ndarray, order=None):
    """``values`` (float64) rounded to the dtype of ``like``, in ``like``'s framework; dense,
    dims outermost first in ``order`` (default: the stride order of ``like``)."""
    order = stride_order(like) if order is None else order
    if like.kind == "jax":
        import jax.numpy as jnp

        return jnp.asarray(values.astype(like.dtype))
    if like.kind == "torch":
        torch = sys.modules["torch"]
        t = torch.empty_strided(
            values.shape, dense_strides(values.shape, order), dtype=like.obj.dtype
        )
        return t.copy_(torch.from_numpy(values))
    made = np.empty(tuple(values.shape[d] for d in order), like.dtype).transpose(np.argsort(order))
    made[...] = values
    return made


def _write_host(dst: Array, values: np.ndarray):
    """Write float64 ``values`` into the caller's CPU buffer ``dst`` (rounded to its dtype)."""
    if dst.kind == "torch":
        torch = sys.modules["torch"]
        dst.obj.copy_(torch.from_numpy(values))
    else:
        dst.native[...] = values.astype(dst.dtype)
    return dst.obj


def _forward_cpu(call: _ForwardCall):
    res = reference.causal_conv1d_fn(
        _host(call.x),
        _host(call.weight),
        _host(call.bias),
        _host(call.seq_idx),
        _host(call.initial_states),
        return_final_states=call.return_final_states,
        activation="silu" if call.silu else None,
    )
    out64, final64 = res if call.return_final_states else (res, None)
    out = _write_host(call.out, out64) if call.out is not None else _new_host(call.x, out64)
    if final64 is None:
        return out
    if call.final_states_out is not None:
        return out, _write_host(call.final_states_out, final64)
    return out, _new_host(call.x, final64, order=(0, 2, 1))


def _gpu_pending(op: str):
    return NotImplementedError(
        f"{op} on GPU arrays is not available in this version of cupyconv; "
        "CPU arrays (numpy, CPU torch/JAX) run through the float64 reference"
    )


# ---- backward --------------------------------------------------------------------------------


def causal_conv1d_bwd(
    x,
    weight,
    bias,
    dout,
    seq_idx=None,
    initial_states=None,
    dfinal_states=None,
    dx=None,
    return_dinitial_states=False,
    activation=None,
):
    """The vector-Jacobian product of ``causal_conv1d_fn``.

    x, dout: [batch, dim, seqlen]; weight: [dim, width]; bias: [dim] or None;
    seq_idx: [batch, seqlen] or None; initial_states, dfinal_states: [batch, dim, width - 1] or
    None; dx: optional [batch, dim, seqlen] buffer of x's dtype.
    Returns (dx, dweight, dbias, dinitial_states): dx in x's dtype, dweight/dbias in the dtypes
    of weight/bias (dbias None without bias), dinitial_states (x's dtype) when
    return_dinitial_states and initial_states is given, else None.
    """
    silu = v.check_activation(activation)
    want_dinit = v.check_flag(return_dinitial_states, "return_dinitial_states")
    xa = v.array(x, "x", 3)
    batch, dim, seqlen = xa.shape
    w = v.array(weight, "weight", 2)
    v.shape(w, "weight", (dim, None), "(dim, width) with dim = x.shape[1]")
    width = v.width(w)
    b = v.optional(bias, "bias", 1)
    v.shape(b, "bias", (dim,), "(dim,) with dim = x.shape[1]")
    g = v.array(dout, "dout", 3)
    v.shape(g, "dout", xa.shape, "(batch, dim, seqlen) of x")
    s = v.optional(seq_idx, "seq_idx", 2, kind="index")
    v.shape(s, "seq_idx", (batch, seqlen), "(batch, seqlen) of x")
    state_shape = (batch, dim, width - 1)
    init = v.optional(initial_states, "initial_states", 3)
    v.shape(init, "initial_states", state_shape, "(batch, dim, width - 1) from x and weight")
    dfinal = v.optional(dfinal_states, "dfinal_states", 3)
    v.shape(dfinal, "dfinal_states", state_shape, "(batch, dim, width - 1) from x and weight")
    dxa = v.optional(dx, "dx", 3)
    v.shape(dxa, "dx", xa.shape, "(batch, dim, seqlen) of x")
    v.same_dtype(dxa, "dx", xa, "x")
    inputs = (("x", xa), ("weight", w), ("bias", b), ("dout", g), ("seq_idx", s))
    inputs += (("initial_states", init), ("dfinal_states", dfinal))
    v.same_device(inputs + (("dx", dxa),))
    v.writable(dxa, "dx", inputs)
    if xa.on_gpu:
        raise _gpu_pending("causal_conv1d_bwd")
    dx64, dw64, db64, dinit64 = reference.causal_conv1d_bwd(
        _host(xa),
        _host(w),
        _host(b),
        _host(g),
        _host(s),
        _host(init),
        _host(dfinal),
        activation="silu" if silu else None,
    )
    dx_out = _write_host(dxa, dx64) if dxa is not None else _new_host(xa, dx64)
    dbias = None if b is None else _new_host(b, db64)
    dinit = None
    if want_dinit and init is not None:  # dtype of x, laid out like initial_states
        dinit = _new_host(xa, dinit64, order=stride_order(init))
    return dx_out, _new_host(w, dw64), dbias, dinit


# ---- decode update ---------------------------------------------------------------------------


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
    place.

    x:          [batch, dim] (one token) or [batch, dim, seqlen] (seqlen new tokens)
    conv_state: [N, dim, state_len], state_len >= width - 1, any strides and float dtype;
                N == batch unless conv_state_indices is given
    weight:     [dim, width]; bias: [dim] or None
    cache_seqlens: [batch] int32/int64 or None: circular mode (tokens already written)
    conv_state_indices: [batch] int32/int64 or None: row b uses conv_state[indices[b]];
                negative entries are padding rows (output 0, state untouched)
    Returns out with the shape and dtype of x.
    """
    silu = v.check_activation(activation)
    xa = v.array(x, "x", (2, 3))
    batch, dim = xa.shape[:2]
    state = v.array(conv_state, "conv_state", 3)
    w = v.array(weight, "weight", 2)
    v.shape(w, "weight", (dim, None), "(dim, width) with dim = x.shape[1]")
    width = v.width(w)
    b = v.optional(bias, "bias", 1)
    v.shape(b, "bias", (dim,), "(dim,) with dim = x.shape[1]")
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
    if xa.on_gpu:
        raise _gpu_pending("causal_conv1d_update")
    x_host = _host(xa)
    out64, state64 = reference.causal_conv1d_update(
        x_host,
        _host(state),
        _host(w),
        _host(b),
        activation="silu" if silu else None,
        cache_seqlens=_host(lens),
        conv_state_indices=_host(idx),
    )
    out = _new_host(xa, out64)
    _write_host(state, state64)
    return out


# ---- packed-sequence states ------------------------------------------------------------------


def causal_conv1d_varlen_states(x, cu_seqlens, state_len):
    """The conv states of packed sequences.

    x: [total_tokens, dim]; cu_seqlens: [N + 1] int32/int64, sorted, starting at 0;
    state_len: int >= 0. Returns states [N, dim, state_len] (dtype of x): states[n] holds the
    last min(len_n, state_len) tokens of sequence n, right-aligned, zeros before them; laid out
    [N, state_len, dim].
    """
    xa = v.array(x, "x", 2)
    cu = v.array(cu_seqlens, "cu_seqlens", 1, kind="index")
    if isinstance(state_len, bool) or not isinstance(state_len, (int, np.integer)):
        raise TypeError(f"state_len must be an int; got {type(state_len).__name__}")
    if state_len < 0:
        raise ValueError(f"state_len must be >= 0; got {state_len}")
    if cu.shape[0] < 1:
        raise ValueError(f"cu_seqlens must have shape (N + 1,) with N >= 0; got {cu.shape}")
    v.same_device((("x", xa), ("cu_seqlens", cu)))
    if xa.on_gpu:
        raise _gpu_pending("causal_conv1d_varlen_states")
    states64 = reference.causal_conv1d_varlen_states(_host(xa), _host(cu), int(state_len))
    return _new_host(xa, states64, order=(0, 2, 1))
