"""Stands for ``causal_conv1d_cuda``, the compiled extension of causal-conv1d 1.5.0, whose three
entry points mamba_ssm calls directly. The signatures are the C++ ones: every argument
positional and required (``None`` for an absent optional), flags as bools, results written
into the buffers passed (``final_states_out``, ``dx``, ``conv_state``).

::

    causal_conv1d_fwd(x, weight, bias, seq_idx, initial_states, final_states_out,
                      silu_activation) -> out
        x: [batch, dim, seqlen]; weight: [dim, width]; bias: [dim] or None;
        seq_idx: [batch, seqlen] or None; initial_states: [batch, dim, width - 1] or None;
        final_states_out: [batch, dim, width - 1] or None, written in place when given.
        out: a new [batch, dim, seqlen] in x's dtype and memory order. Not differentiable.

    causal_conv1d_bwd(x, weight, bias, dout, seq_idx, initial_states, dfinal_states, dx,
                      return_dinitial_states, silu_activation) -> [dx, dweight, dbias, dinit]
        dout: [batch, dim, seqlen]; dfinal_states: [batch, dim, width - 1] or None;
        dx: [batch, dim, seqlen] buffer (written and returned) or None (allocated).
        A list: dx; dweight [dim, width] in weight's dtype; dbias [dim] in bias's dtype or
        None without bias; dinitial_states [batch, dim, width - 1] in x's dtype, laid out
        [batch, width - 1, dim], when return_dinitial_states, else None (without
        initial_states: the gradient at a zero initial state).

    causal_conv1d_update(x, conv_state, weight, bias, silu_activation, cache_seqlens,
                         conv_state_indices) -> out
        x: [batch, dim, seqlen] (or [batch, dim]); conv_state: [N, dim, state_len], updated
        in place; cache_seqlens, conv_state_indices: [batch] or None. out: like x.

The arrays go through ``cupyconv``, so they are checked there (ValueError/TypeError naming the
argument) and every restriction lifted in ``cupyconv.compat`` is lifted here too.
"""

from __future__ import annotations

import cupyconv

from .._validate import check_flag
from ._common import no_grad, require_torch

__all__ = ["causal_conv1d_bwd", "causal_conv1d_fwd", "causal_conv1d_update"]


def causal_conv1d_fwd(
    x, weight, bias, seq_idx, initial_states, final_states_out, silu_activation, /
):  # fmt: skip
    """Forward: returns a new out; writes final_states_out in place when it is given
    (module docstring)."""
    silu = check_flag(silu_activation, "silu_activation")
    with no_grad(x):
        res = cupyconv.causal_conv1d_fn(
            x, weight, bias, seq_idx, initial_states, final_states_out is not None,
            final_states_out, "silu" if silu else None,
        )  # fmt: skip
    return res if final_states_out is None else res[0]


def causal_conv1d_bwd(
    x, weight, bias, dout, seq_idx, initial_states, dfinal_states, dx, return_dinitial_states,
    silu_activation, /,
):  # fmt: skip
    """Backward: ``[dx, dweight, dbias, dinitial_states]`` (module docstring); dx written into
    the given buffer when there is one."""
    silu = check_flag(silu_activation, "silu_activation")
    want_dinit = check_flag(return_dinitial_states, "return_dinitial_states")
    dinit = None
    if want_dinit:  # laid out [batch, width - 1, dim], as the extension allocates it
        require_torch(x, "x (with return_dinitial_states=True)")
        batch, dim = x.shape[0], x.shape[1]
        shape = (batch, weight.shape[-1] - 1, dim)
        if initial_states is None:  # the gradient at a zero initial state
            initial_states = x.new_zeros(shape).transpose(1, 2)
        dinit = x.new_empty(shape).transpose(1, 2)
    dx, dweight, dbias, dinit = cupyconv.causal_conv1d_bwd(
        x, weight, bias, dout, seq_idx, initial_states, dfinal_states, dx, want_dinit,
        "silu" if silu else None, dinitial_states_out=dinit,
    )  # fmt: skip
    return [dx, dweight, dbias, dinit]


def causal_conv1d_update(
    x, conv_state, weight, bias, silu_activation, cache_seqlens, conv_state_indices, /
):  # fmt: skip
    """Decode update: returns out like x; conv_state updated in place (module docstring)."""
    silu = check_flag(silu_activation, "silu_activation")
    return cupyconv.causal_conv1d_update(
        x, conv_state, weight, bias, "silu" if silu else None, cache_seqlens, conv_state_indices
    )
