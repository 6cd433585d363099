"""The backward operator, ``causal_conv1d_bwd``. In this version it runs on CPU arrays, through
the float64 reference; GPU arrays raise NotImplementedError."""

from __future__ import annotations

from . import _validate as v
from . import reference
from ._arrays import stride_order
from ._host import gpu_pending, host, new_host, output

__all__ = ["causal_conv1d_bwd"]


def causal_conv1d_bwd(
    x, weight, bias, dout, seq_idx=None, initial_states=None, dfinal_states=None, dx=None,
    return_dinitial_states=False, activation=None,
):  # fmt: skip
    """The vector-Jacobian product of ``causal_conv1d_fn`` (CPU arrays in this version).

    x, dout: [batch, dim, seqlen]; weight: [dim, width]; bias: [dim] or None;
    seq_idx: [batch, seqlen] or None; initial_states, dfinal_states: [batch, dim, width - 1] or
    None; dx: optional [batch, dim, seqlen] buffer of x's dtype.
    Returns (dx, dweight, dbias, dinitial_states): dx in x's dtype, dweight/dbias in the dtypes
    of weight/bias (dbias None without bias), dinitial_states (x's dtype) when
    return_dinitial_states and initial_states is given, else None.
    """
    silu = v.check_activation(activation)
    want_dinit = v.check_flag(return_dinitial_states, "return_dinitial_states")
    a = v.conv_args(x, weight, bias, seq_idx, initial_states)
    g = v.array(dout, "dout", 3)
    v.shape(g, "dout", a.x.shape, "(batch, dim, seqlen) of x")
    dfinal = v.optional(dfinal_states, "dfinal_states", 3)
    v.shape(dfinal, "dfinal_states", v.state_shape(a), v.STATE_SHAPE)
    dxa = v.optional(dx, "dx", 3)
    v.shape(dxa, "dx", a.x.shape, "(batch, dim, seqlen) of x")
    v.same_dtype(dxa, "dx", a.x, "x")
    inputs = a.named() + (("dout", g), ("dfinal_states", dfinal))
    v.same_device(inputs + (("dx", dxa),))
    v.writable(dxa, "dx", inputs)
    if a.x.on_gpu:
        raise gpu_pending("causal_conv1d_bwd")
    dx64, dw64, db64, dinit64 = reference.causal_conv1d_bwd(
        host(a.x), host(a.weight), host(a.bias), host(g), host(a.seq_idx),
        host(a.initial_states), host(dfinal), activation="silu" if silu else None,
    )  # fmt: skip
    dx_out = output(dxa, a.x, dx64)
    dbias = None if a.bias is None else new_host(a.bias, db64)
    dinit = None
    if want_dinit and a.initial_states is not None:  # dtype of x, laid out like initial_states
        dinit = new_host(a.x, dinit64, order=stride_order(a.initial_states))
    return dx_out, new_host(a.weight, dw64), dbias, dinit
