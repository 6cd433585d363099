"""``cupyconv.warmup``: compile and load, ahead of time, the kernels a call would launch."""

from __future__ import annotations

import inspect

from ._arrays import CPU
from ._compile import get_kernel
from .backward import _BackwardCall, causal_conv1d_bwd
from .forward import _ForwardCall, causal_conv1d_fn
from .update import _UpdateCall, causal_conv1d_update

__all__ = ["warmup"]

# Each operator's call description (its arguments under the operator's own names).
_CALLS = {
    causal_conv1d_fn: _ForwardCall,
    causal_conv1d_bwd: _BackwardCall,
    causal_conv1d_update: _UpdateCall,
}


def warmup(*args, **kwargs) -> None:
    """Compile and load the kernels a call would launch, without launching them: call it
    before capturing a CUDA graph (no kernel can be compiled during a capture), or to move the
    first call's compile time elsewhere. CPU arrays need nothing.

        cupyconv.warmup(x, weight, bias, activation="silu")        # causal_conv1d_fn
        cupyconv.warmup(cupyconv.causal_conv1d_bwd, x, weight, bias, dout, activation="silu")
        cupyconv.warmup(cupyconv.causal_conv1d_update, x, conv_state, weight, bias, "silu")

    Without an operator first, the arguments are those of ``causal_conv1d_fn``; with one of
    ``causal_conv1d_fn``, ``causal_conv1d_bwd``, ``causal_conv1d_update`` first, those of that
    operator. (``causal_conv1d_varlen_states`` runs one kernel per dtype, compiled on its first
    call.) The arguments are checked as the call would check them.
    """
    op = causal_conv1d_fn
    if args and callable(args[0]) and args[0] in _CALLS:
        op, args = args[0], args[1:]
    bound = inspect.signature(op).bind(*args, **kwargs)
    bound.apply_defaults()
    call = _CALLS[op](**bound.arguments)
    if call.device == CPU:
        return
    if op is causal_conv1d_fn:
        plans = [plan for plan, _ in call.plans()]
    elif op is causal_conv1d_update:
        plans = [p for p in (call.plan(),) if p is not None]
    else:
        plans = call.plan().launches if call.conv.x.shape[1] > 0 else ()
    for plan in plans:
        get_kernel(plan.source, plan.name, call.device)
