"""Stands for ``causal_conv1d.causal_conv1d_interface`` (causal-conv1d 1.5.0): the same
functions, arguments, defaults and results, computed by cupyconv.

::

    causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None,
                     return_final_states=False, final_states_out=None, activation=None)
        -> out, or (out, final_states) when return_final_states
    CausalConv1dFn.apply(<the same arguments, in the same order>)
    causal_conv1d_update(x, conv_state, weight, bias=None, activation=None,
                         cache_seqlens=None, conv_state_indices=None) -> out
    causal_conv1d_ref(x, weight, bias=None, initial_states=None, return_final_states=False,
                      final_states_out=None, activation=None)
    causal_conv1d_update_ref(x, conv_state, weight, bias=None, activation=None,
                             cache_seqlens=None) -> out

The ``_ref`` functions are torch code computing in the dtype of ``weight``, as the reference
library's are; cupyconv's own float64 oracle is ``cupyconv.reference``.
"""

from __future__ import annotations

import cupyconv

from ... import _validate as v
from .. import causal_conv1d_cuda  # noqa: F401  (an attribute of the 1.5.0 module too)
from .._common import check_activation, records_grad, require_torch, shape_of, torch_module

__all__ = [
    "CausalConv1dFn",
    "causal_conv1d_fn",
    "causal_conv1d_ref",
    "causal_conv1d_update",
    "causal_conv1d_update_ref",
]


def causal_conv1d_fn(
    x,
    weight,
    bias=None,
    seq_idx=None,
    initial_states=None,
    return_final_states=False,
    final_states_out=None,
    activation=None,
):
    """Causal depthwise conv1d, ``cupyconv.causal_conv1d_fn`` with 1.5.0's arguments.

    x:              [batch, dim, seqlen], any strides
    weight:         [dim, width]; bias: [dim] or None
    seq_idx:        [batch, seqlen] or None (negative ids: padding, output 0)
    initial_states: [batch, dim, width - 1] or None
    return_final_states: also return final_states [batch, dim, width - 1] in x's dtype, laid
                    out [batch, width - 1, dim], or written into final_states_out when it is
                    given (and then that same tensor is returned); final_states_out without
                    return_final_states is ignored
    activation:     None, "silu" or "swish"
    Returns out [batch, dim, seqlen] (x's dtype and memory order), or (out, final_states).
    torch tensors are differentiable in x, weight, bias and initial_states, through
    final_states too. When autograd records the call, final_states_out receives a recorded
    copy of the final states (it joins the graph, as its own tensor object).
    """
    check_activation(activation)
    return_final_states = v.check_flag(return_final_states, "return_final_states")
    if (
        return_final_states
        and final_states_out is not None
        and records_grad(x, weight, bias, initial_states)
    ):  # cupyconv does not write a caller's buffer under autograd: a recorded copy instead
        _check_final_states_out(final_states_out, x, weight)
        out, final = cupyconv.causal_conv1d_fn(
            x, weight, bias, seq_idx, initial_states, True, None, activation
        )
        final_states_out.copy_(final)
        return out, final_states_out
    return cupyconv.causal_conv1d_fn(
        x, weight, bias, seq_idx, initial_states, return_final_states, final_states_out,
        activation,
    )  # fmt: skip


def _check_final_states_out(final, x, weight) -> None:
    require_torch(final, "final_states_out")
    shape_of(
        final, "final_states_out", (x.shape[0], x.shape[1], weight.shape[-1] - 1),
        "(batch, dim, width - 1) from x and weight",
    )  # fmt: skip
    if final.dtype != x.dtype:
        raise ValueError(
            f"final_states_out must have the dtype of x ({x.dtype}); got {final.dtype}"
        )
    if final.requires_grad:
        raise ValueError(
            "final_states_out must not require grad: it receives the final states; got a "
            "tensor with requires_grad=True"
        )


class CausalConv1dFn:
    """1.5.0's ``torch.autograd.Function`` of the forward, as callers use it:
    ``CausalConv1dFn.apply(x, weight, bias, seq_idx, initial_states, return_final_states,
    final_states_out, activation)``, the arguments of :func:`causal_conv1d_fn` in its order.
    Autograd is cupyconv's (custom operators under torch.compile); this class only keeps the
    name and the entry point."""

    @staticmethod
    def apply(
        x,
        weight,
        bias=None,
        seq_idx=None,
        initial_states=None,
        return_final_states=False,
        final_states_out=None,
        activation=None,
    ):
        return causal_conv1d_fn(
            x, weight, bias, seq_idx, initial_states, return_final_states, final_states_out,
            activation,
        )  # fmt: skip


def causal_conv1d_update(
    x,
    conv_state,
    weight,
    bias=None,
    activation=None,
    cache_seqlens=None,
    conv_state_indices=None,
):
    """A decode step, ``cupyconv.causal_conv1d_update``: updates conv_state in place.

    x:          [batch, dim] (one token) or [batch, dim, seqlen]
    conv_state: [batch, dim, state_len], state_len >= width - 1 (a pool [N, dim, state_len]
                with conv_state_indices), any strides
    weight:     [dim, width]; bias: [dim] or None
    cache_seqlens: [batch] int32 or None: conv_state is a circular buffer; the tokens are
                written from index cache_seqlens % state_len on (the caller advances it)
    conv_state_indices: [batch] int32 or None: row b uses conv_state[conv_state_indices[b]];
                -1 marks a padding row (output 0, no state touched)
    activation: None, "silu" or "swish"
    Returns out with the shape and dtype of x. Not differentiable.
    """
    check_activation(activation)
    return cupyconv.causal_conv1d_update(
        x, conv_state, weight, bias, activation, cache_seqlens, conv_state_indices
    )


def causal_conv1d_ref(
    x,
    weight,
    bias=None,
    initial_states=None,
    return_final_states=False,
    final_states_out=None,
    activation=None,
):
    """The reference library's torch reference of the forward: ``F.conv1d`` in the dtype of
    weight, the result cast back to x's dtype (differentiable like any torch code).

    x:              [batch, dim, seqlen] torch tensor
    weight:         [dim, width]; bias: [dim] or None (cast to weight's dtype)
    initial_states: [batch, dim, width - 1] or None (cast to weight's dtype)
    final_states_out: [batch, dim, width - 1] or None: receives final_states (copy_)
    Returns out [batch, dim, seqlen], or (out, final_states) when return_final_states:
    final_states [batch, dim, width - 1] in x's dtype are the last width - 1 positions of
    the history (initial_states or zeros, then x), i.e. what causal_conv1d_update continues
    from. Equivalent to ``F.conv1d(x, weight.unsqueeze(1), bias, padding=width - 1,
    groups=dim)[..., :seqlen]`` and the activation.
    """
    check_activation(activation)
    require_torch(x, "x")
    F = torch_module().nn.functional
    dtype_in = x.dtype
    dim, width = weight.shape
    seqlen = x.shape[-1]
    history = x.to(weight.dtype)  # positions -(width - 1) .. seqlen - 1 with initial states
    if initial_states is not None:
        history = torch_module().cat([initial_states.to(weight.dtype), history], dim=-1)
    pad = width - 1 if initial_states is None else 0
    b = None if bias is None else bias.to(weight.dtype)
    out = F.conv1d(history, weight.unsqueeze(1), b, padding=pad, groups=dim)[..., :seqlen]
    out = (out if activation is None else F.silu(out)).to(dtype_in)
    if not return_final_states:
        return out
    kept = min(width - 1, history.shape[-1])  # the last width - 1 positions, zeros before
    final = F.pad(history[..., history.shape[-1] - kept :], (width - 1 - kept, 0)).to(dtype_in)
    if final_states_out is not None:
        final = final_states_out.copy_(final)
    return out, final


def causal_conv1d_update_ref(
    x, conv_state, weight, bias=None, activation=None, cache_seqlens=None
):  # fmt: skip
    """The reference library's torch reference of the decode step (``F.conv1d`` in weight's
    dtype); updates conv_state in place with exact copies of x.

    x:          [batch, dim] or [batch, dim, seqlen] torch tensor
    conv_state: [batch, dim, state_len], state_len >= width - 1
    weight:     [dim, width]; bias: [dim] or None
    cache_seqlens: [batch] or None: circular mode, tokens written from cache_seqlens %
                state_len on (with seqlen > state_len the later tokens win)
    Returns out with the shape and dtype of x.
    """
    check_activation(activation)
    require_torch(x, "x")
    torch = torch_module()
    F = torch.nn.functional
    dtype_in = x.dtype
    one_token = x.dim() == 2
    if one_token:
        x = x.unsqueeze(-1)
    batch, dim, seqlen = x.shape
    width = weight.shape[1]
    state_len = conv_state.shape[-1]
    shape_of(conv_state, "conv_state", (batch, dim, state_len), "(batch, dim, state_len) of x")
    shape_of(weight, "weight", (dim, width), "(dim, width) with dim = x.shape[1]")
    if state_len < width - 1:
        raise ValueError(
            f"conv_state.shape[2] (state_len) must be at least width - 1 = {width - 1}; "
            f"got {state_len}"
        )
    new = x.to(conv_state.dtype)
    if cache_seqlens is None:  # sliding: the state holds the last state_len inputs
        both = torch.cat([conv_state, new], dim=-1)  # [batch, dim, state_len + seqlen]
        history = both[..., state_len - (width - 1) :].to(weight.dtype)
        conv_state.copy_(both[..., both.shape[-1] - state_len :])
    else:  # circular: read the width - 1 inputs before cache_seqlens, then write the tokens
        start = cache_seqlens.to(torch.long)[:, None]  # [batch, 1]
        before = torch.arange(-(width - 1), 0, device=x.device)
        read_at = torch.remainder(start + before, max(state_len, 1))[:, None, :]
        past = conv_state.gather(2, read_at.expand(-1, dim, -1))  # [batch, dim, width - 1]
        history = torch.cat([past.to(weight.dtype), x.to(weight.dtype)], dim=-1)
        kept = min(seqlen, state_len)  # the later tokens win a slot
        write_at = start + torch.arange(seqlen - kept, seqlen, device=x.device)
        write_at = torch.remainder(write_at, max(state_len, 1))[:, None, :]
        conv_state.scatter_(2, write_at.expand(-1, dim, -1), new[..., seqlen - kept :])
    b = None if bias is None else bias.to(weight.dtype)
    out = F.conv1d(history, weight.unsqueeze(1), b, padding=0, groups=dim)
    out = out[..., out.shape[-1] - seqlen :]
    if one_token:
        out = out.squeeze(-1)
    return (out if activation is None else F.silu(out)).to(dtype_in)
