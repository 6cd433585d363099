"""Stands for ``causal_conv1d.causal_conv1d_varlen`` (causal-conv1d 1.5.0): the conv states of
packed sequences (no triton needed).

::

    causal_conv1d_varlen_states(x, cu_seqlens, state_len) -> states
    causal_conv1d_varlen_states_ref(x, cu_seqlens, state_len) -> states
        x:          [total_tokens, dim]
        cu_seqlens: [batch + 1], sorted, starting at 0: sequence n is x[cu[n]:cu[n + 1]]
        states:     [batch, dim, state_len] in x's dtype, laid out [batch, state_len, dim]:
                    states[n] holds the last min(len_n, state_len) tokens of sequence n,
                    right-aligned, zeros before them (never a token of another sequence)
"""

from __future__ import annotations

import cupyconv

from .._common import require_torch, torch_module

__all__ = ["causal_conv1d_varlen_states", "causal_conv1d_varlen_states_ref"]


def causal_conv1d_varlen_states(x, cu_seqlens, state_len):
    """The conv states of packed sequences, ``cupyconv.causal_conv1d_varlen_states``
    (module docstring for the shapes). Forward only."""
    return cupyconv.causal_conv1d_varlen_states(x, cu_seqlens, state_len)


def causal_conv1d_varlen_states_ref(x, cu_seqlens, state_len):
    """The same in torch ops (a gather, no host synchronisation); empty sequences give zeros.

    x: [total_tokens, dim] torch tensor; cu_seqlens: [batch + 1]; state_len: int.
    Returns states [batch, dim, state_len], laid out [batch, state_len, dim].
    """
    require_torch(x, "x")
    torch = torch_module()
    tokens, dim = x.shape
    batch = cu_seqlens.shape[0] - 1
    states = x.new_zeros(batch, state_len, dim)
    if tokens > 0 and batch > 0 and state_len > 0:
        cu = cu_seqlens.to(device=x.device, dtype=torch.long)
        # position of states[n, j]: the token state_len - j before the end of sequence n
        at = cu[1:, None] - state_len + torch.arange(state_len, device=x.device)
        inside = (at >= cu[:-1, None])[:, :, None]  # [batch, state_len, 1]
        rows = x[at.clamp(0, tokens - 1)]  # [batch, state_len, dim]
        states = torch.where(inside, rows, states)
    return states.transpose(1, 2)
