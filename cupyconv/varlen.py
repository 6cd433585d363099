"""The states of packed sequences, ``causal_conv1d_varlen_states``: GPU arrays launch
``varlen_states`` (``cupyconv/_varlen_plan.py``, ``kernels/varlen.cu``); CPU arrays run the
float64 reference. Later calls with the same layout take the lean path (``cupyconv/_fast.py``).
"""

from __future__ import annotations

import numpy as np

from . import _fast, reference
from . import _validate as v
from ._arrays import dense_strides, empty, result, stream_of, stream_ptr
from ._host import host, new_host
from ._launch import Replay, launch
from ._varlen_plan import POINTERS, plan_varlen, varlen_args

__all__ = ["causal_conv1d_varlen_states"]

MAX_STATE_LEN = 2**31 - 1


def causal_conv1d_varlen_states(x, cu_seqlens, state_len):
    """The conv states of packed sequences, for the update after a packed prefill.

    x: [total_tokens, dim]; cu_seqlens: [N + 1] int32/int64, non-decreasing, starting at 0 and
    ending at most at total_tokens (checked on CPU arrays; on GPU arrays only in
    ``cupyconv.debug()`` mode, since reading them would synchronise); state_len: int >= 0.
    Returns states [N, dim, state_len] (dtype of x): states[n] holds the last
    min(len_n, state_len) tokens of sequence n, right-aligned, zeros before them; laid out
    [N, state_len, dim]. Results come back in x's framework, on x's device and (for torch) on
    the current stream.
    """
    fw = _fast.framework(x)
    key = None
    if fw is not None and not v.debug_enabled() and type(state_len) is int:
        key = _fast.signature(fw, (x, cu_seqlens), "varlen", state_len)
        made = _fast.run(key, x)
        if made is not None:
            return made[0]
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
        return _varlen_gpu(xa, cu, int(state_len), fw, key)
    states64 = reference.causal_conv1d_varlen_states(host(xa), host(cu), int(state_len))
    return new_host(xa, states64, order=(0, 2, 1))


def _varlen_gpu(x, cu, state_len: int, fw, key):
    """Launch varlen_states; with a signature ``key``, leave its FastCall behind."""
    shape = (cu.shape[0] - 1, x.shape[1], state_len)
    states = empty(x, shape, dense_strides(shape, (0, 2, 1)), x.dtype)
    if 0 not in shape:
        plan = plan_varlen(x.dtype_name, *shape)
        args = varlen_args(plan, x, cu, states)
        stream = stream_of(x)
        launch(plan, x.device, args, stream)
        if key is not None:
            replay = Replay([(plan, args)], x.device, POINTERS, stream_ptr(stream))
            outputs = (_fast.output_spec(fw, states),)
            _fast.store(key, _fast.FastCall(fw, x.device, replay, outputs))
    return result(x, states)
