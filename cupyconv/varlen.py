"""The states of packed sequences, ``causal_conv1d_varlen_states``. In this version it runs on
CPU arrays, through the float64 reference; GPU arrays raise NotImplementedError."""

from __future__ import annotations

import numpy as np

from . import _validate as v
from . import reference
from ._host import gpu_pending, host, new_host

__all__ = ["causal_conv1d_varlen_states"]

MAX_STATE_LEN = 2**31 - 1


def causal_conv1d_varlen_states(x, cu_seqlens, state_len):
    """The conv states of packed sequences (CPU arrays in this version).

    x: [total_tokens, dim]; cu_seqlens: [N + 1] int32/int64, non-decreasing, starting at 0 and
    ending at most at total_tokens (checked on CPU arrays; on GPU arrays only in
    ``cupyconv.debug()`` mode, since reading them would synchronise); state_len: int >= 0.
    Returns states [N, dim, state_len] (dtype of x): states[n] holds the last
    min(len_n, state_len) tokens of sequence n, right-aligned, zeros before them; laid out
    [N, state_len, dim].
    """
    xa = v.array(x, "x", 2)
    cu = v.array(cu_seqlens, "cu_seqlens", 1, kind="index")
    if isinstance(state_len, bool) or not isinstance(state_len, (int, np.integer)):
        raise TypeError(f"state_len must be an int; got {type(state_len).__name__}")
    if not 0 <= state_len <= MAX_STATE_LEN:
        raise ValueError(f"state_len must be between 0 and {MAX_STATE_LEN}; got {state_len}")
    if cu.shape[0] < 1:
        raise ValueError(f"cu_seqlens must have shape (N + 1,) with N >= 0; got {cu.shape}")
    v.same_device((("x", xa), ("cu_seqlens", cu)))
    v.cu_seqlens_values(cu, xa.shape[0])
    if xa.on_gpu:
        raise gpu_pending("causal_conv1d_varlen_states")
    states64 = reference.causal_conv1d_varlen_states(host(xa), host(cu), int(state_len))
    return new_host(xa, states64, order=(0, 2, 1))
