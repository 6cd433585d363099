"""The decode update, ``causal_conv1d_update``: GPU arrays launch ``conv_update``
(``cupyconv/_update_plan.py``, ``kernels/update.cu``); CPU arrays run the float64 reference.

A call: describe and check the arguments once (``_UpdateCall``), then either the reference,
or: look the plan up, allocate out, pack the arguments, launch. Later calls with the same
layout take the lean path (``cupyconv/_fast.py``).
"""

from __future__ import annotations

from . import _fast, forward, reference
from . import _validate as v
from ._arrays import empty, result, stream_of, stream_ptr, strides_like
from ._host import host, new_host, write_host
from ._launch import Replay, launch
from ._update_plan import POINTERS, is_lean, plan_update, takes_fast_path, update_args

__all__ = ["causal_conv1d_update"]

# Positions among the update's inputs (x, weight, bias, conv_state, cache_seqlens,
# conv_state_indices): conv_state is written, so it must not share memory with the others.
_GUARDS = ((3, 0), (3, 1), (3, 2), (3, 4), (3, 5))


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
    conv_state: [N, dim, state_len], state_len >= width - 1, any strides and float dtype
                (a float32 state with float16/bfloat16 x: computed in float32, stored in
                float32); N == batch unless conv_state_indices is given
    weight:     [dim, width], 1 <= width <= 256; bias: [dim] or None
    activation: None, "silu" or "swish"
    cache_seqlens: [batch] int32/int64 or None. None: sliding mode (conv_state holds the last
                state_len inputs, oldest first, and afterwards the last state_len entries of
                concat(conv_state, x)). Given: circular mode, cache_seqlens[b] tokens already
                written; with p = cache_seqlens[b] mod state_len the width - 1 inputs before
                token 0 are read at p - width + 1 .. p - 1 (mod state_len) and token i is
                written at p + i (mod state_len), later tokens over earlier ones. The caller
                advances cache_seqlens.
    conv_state_indices: [batch] int32/int64 or None: row b uses conv_state[indices[b]];
                negative entries are padding rows (output 0, state untouched). Entries must
                be below N (checked on CPU arrays; on GPU arrays, where reading them would
                synchronise, only in ``cupyconv.debug()`` mode: there an entry past the pool
                reads and writes outside conv_state). Two batch rows with the same
                non-negative entry are the caller's error: that state row's result is then
                undefined (not checked, on any device).
    Returns out with the shape and dtype of x, in x's framework; the kernel runs on the
    caller's stream (torch's current stream for torch tensors).
    """
    fw = _fast.framework(x)
    if fw is _fast.Torch:
        torch_ops = forward._torch_ops or forward._load_torch_ops()
        if torch_ops.traced(x):  # torch.compile, torch.export: the operator
            return torch_ops.causal_conv1d_update(
                x, conv_state, weight, bias, activation, cache_seqlens, conv_state_indices
            )
    key = None
    if fw is not None and (conv_state_indices is None or not v.debug_enabled()):
        if fw is _fast.Torch:
            key = _torch_signature(
                x, weight, bias, conv_state, cache_seqlens, conv_state_indices, activation
            )
        else:
            inputs = (x, weight, bias, conv_state, cache_seqlens, conv_state_indices)
            key = _fast.signature(fw, inputs, "update", activation, written=(conv_state,))
        made = _fast.run(key, x)
        if made is not None:
            return made[0]
    call = _UpdateCall(x, conv_state, weight, bias, activation, cache_seqlens, conv_state_indices)
    return _update_gpu(call, fw, key) if call.x.on_gpu else _update_cpu(call)


def _torch_signature(x, weight, bias, state, lens, idx, activation):
    """``_fast.signature`` of an update on torch tensors, unrolled: it runs on every decode
    step, where the loop over the arrays cost as much again. Without the address bits: the
    update's plan does not depend on its arrays' alignment."""
    try:
        ptrs = [
            x.data_ptr(), weight.data_ptr(), 0 if bias is None else bias.data_ptr(),
            state.data_ptr(), 0 if lens is None else lens.data_ptr(),
            0 if idx is None else idx.data_ptr(),
        ]  # fmt: skip
        key = (
            _TORCH_UPDATE, activation, x.shape, state.is_inference(), bias is None, lens is None,
            idx is None,
        )  # fmt: skip
    except Exception:  # noqa: BLE001 - an argument the lean path cannot read: the full path
        return None
    tensors = (x, weight, state) if bias is None else (x, weight, state, bias)
    if lens is not None or idx is not None:
        tensors += tuple([t for t in (lens, idx) if t is not None])
    return key, ptrs, tensors


_TORCH_UPDATE = "update, torch"  # the first item of _torch_signature's keys


class _UpdateCall:
    """The arguments of one update call, described and checked once."""

    __slots__ = ("x", "state", "weight", "bias", "lens", "idx", "width", "silu", "device")

    def __init__(self, x, conv_state, weight, bias, activation, cache_seqlens, conv_state_indices):
        self.silu = v.check_activation(activation)
        self.x = xa = v.array(x, "x", (2, 3))
        batch, dim = xa.shape[:2]
        self.state = state = v.array(conv_state, "conv_state", 3)
        self.weight, self.bias, self.width = w, b, width = v.filter_args(weight, bias, dim)
        self.lens = lens = v.optional(cache_seqlens, "cache_seqlens", 1, kind="index")
        v.shape(lens, "cache_seqlens", (batch,), "(batch,) of x")
        self.idx = idx = v.optional(conv_state_indices, "conv_state_indices", 1, kind="index")
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
        self.device = v.same_device((("x", xa), ("conv_state", state)) + others)
        v.writable(state, "conv_state", (("x", xa),) + others)
        v.state_indices_values(idx, state.shape[0])

    def plan(self):
        """The launch of this call, or None when there is nothing to compute."""
        batch, dim = self.x.shape[:2]
        seqlen = self.x.shape[2] if len(self.x.shape) == 3 else 1
        if batch * dim * seqlen == 0:
            return None
        x, state, circular = self.x, self.state, self.lens is not None
        fast = takes_fast_path(x.dtype_name, state.dtype_name, self.width, state.shape[2], circular)
        lean = is_lean(x, self.weight, self.bias, state, self.lens, self.idx, circular)
        return plan_update(x.dtype_name, batch, dim, self.width, fast, lean)


def _update_gpu(call: _UpdateCall, fw=None, key=None):
    """Launch the update; with a signature ``key``, leave its FastCall behind."""
    x = call.x
    out = empty(x, x.shape, strides_like(x), x.dtype)
    plan = call.plan()
    if plan is not None:
        args = update_args(
            plan, x, call.weight, call.bias, call.state, call.lens, call.idx, out, call.silu
        )
        stream = stream_of(x)
        launch(plan, call.device, args, stream)
        if key is not None and _fast.may_repeat(fw, call.state):
            inputs = (x, call.weight, call.bias, call.state, call.lens, call.idx)
            spans = tuple(a and _fast.span(a) for a in inputs)
            replay = Replay([(plan, args)], call.device, POINTERS, stream_ptr(stream))
            outputs = (_fast.output_spec(fw, out, x),)
            fast = _fast.FastCall(fw, call.device, replay, outputs, _GUARDS, spans)
            _fast.store(key, fast)
    return result(x, out)


def _update_cpu(call: _UpdateCall):
    out64, state64 = reference.causal_conv1d_update(
        host(call.x), host(call.state), host(call.weight), host(call.bias),
        activation="silu" if call.silu else None, cache_seqlens=host(call.lens),
        conv_state_indices=host(call.idx),
    )  # fmt: skip
    out = new_host(call.x, out64)
    write_host(call.state, state64)
    return out
