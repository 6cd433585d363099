"""The backward operator, ``causal_conv1d_bwd``: GPU arrays launch the kernels its plan picks
(``cupyconv/_backward_plan.py``, ``kernels/bwd_*.cu``); CPU arrays run the float64 reference.

A call: describe and check the arguments once (``_BackwardCall``), then either the reference,
or: look the plan up, allocate the outputs and the plan's scratch, pack the arguments, launch,
return the results in the caller's framework.
"""

from __future__ import annotations

import numpy as np

from . import _fast, forward, reference
from . import _validate as v
from ._arrays import dense_strides, empty, result, stream_of, stream_ptr, stride_order, strides_like
from ._backward_plan import POINTERS, backward_args, plan_backward
from ._host import host, output
from ._launch import Replay, launch

__all__ = ["causal_conv1d_bwd"]


def causal_conv1d_bwd(
    x, weight, bias, dout, seq_idx=None, initial_states=None, dfinal_states=None, dx=None,
    return_dinitial_states=False, activation=None, *, dweight_out=None, dbias_out=None,
    dinitial_states_out=None,
):  # fmt: skip
    """The vector-Jacobian product of ``causal_conv1d_fn`` (docs/semantics.md, "Backward").

    x, dout:        [batch, dim, seqlen], any strides
    weight:         [dim, width]; bias: [dim] or None
    seq_idx:        [batch, seqlen] or None
    initial_states: [batch, dim, width - 1] or None
    dfinal_states:  [batch, dim, width - 1] or None: the gradient of final_states
    dx:             optional [batch, dim, seqlen] buffer of x's dtype, any strides
    dweight_out, dbias_out, dinitial_states_out (keyword only): optional buffers for the other
                    results (the dtypes and shapes of weight, bias, initial_states)
    Returns (dx, dweight, dbias, dinitial_states): dx in x's dtype and stride order; dweight
    and dbias accumulated in float32 (float64 for float64 x) without floating-point atomics,
    bitwise the same from run to run, in the dtypes of weight and bias (dbias None without
    bias); dinitial_states in x's dtype, laid out like initial_states, when
    return_dinitial_states and initial_states is given, else None. SiLU's derivative is taken
    at the recomputed pre-activation.
    """
    fw = _fast.framework(x)
    if fw is _fast.Torch:  # traced by torch.compile: the custom operators
        torch_ops = forward._torch_ops or forward._load_torch_ops()
        if torch_ops.traced(x):
            return torch_ops.causal_conv1d_bwd(
                x, weight, bias, dout, seq_idx, initial_states, dfinal_states, dx,
                return_dinitial_states, activation, dweight_out, dbias_out, dinitial_states_out,
            )  # fmt: skip
    key, inputs = lean_key(
        fw, x, weight, bias, dout, seq_idx, initial_states, dfinal_states, dx,
        return_dinitial_states, activation, dweight_out, dbias_out, dinitial_states_out,
    )  # fmt: skip
    made = _fast.run(key, x)
    if made is not None:
        if len(inputs) == 7:  # the results are new arrays
            return made[:4]
        return inputs[7:]  # the results are the caller's buffers (None where not made)
    call = _BackwardCall(
        x, weight, bias, dout, seq_idx, initial_states, dfinal_states, dx,
        return_dinitial_states, activation, dweight_out, dbias_out, dinitial_states_out,
    )  # fmt: skip
    return _backward_gpu(call, fw, key) if call.conv.x.on_gpu else _backward_cpu(call)


def lean_key(
    fw, x, weight, bias, dout, seq_idx, initial_states, dfinal_states, dx,
    return_dinitial_states, activation, dweight_out, dbias_out, dinitial_states_out,
):  # fmt: skip
    """(signature, inputs) of a call for the lean path (``cupyconv/_fast.py``): inputs are the
    arrays in the kernels' pointer order (x, weight, bias, seq_idx, initial_states, dout,
    dfinal_states, then with output buffers dx, dweight, dbias, dinitial_states, None where
    absent); (None, None) where the call cannot take it. Output buffers: none, or one for
    every result the call makes (dx, dweight, dbias with bias, dinitial_states when asked for
    with initial_states)."""
    if fw is None:
        return None, None
    want = return_dinitial_states if type(return_dinitial_states) is bool else None
    inputs = (x, weight, bias, seq_idx, initial_states, dout, dfinal_states)
    makes_dinit = bool(want) and initial_states is not None
    dinit = dinitial_states_out if makes_dinit else None  # (ignored where not made)
    if dx is None and dweight_out is None and dbias_out is None and dinit is None:
        return _fast.signature(fw, inputs, "bwd", activation, want), inputs
    if dx is None or dweight_out is None or (dbias_out is None) != (bias is None):
        return None, None
    if (dinit is None) == makes_dinit:
        return None, None
    buffers = (dx, dweight_out, dbias_out, dinit)
    written = [b for b in buffers if b is not None]
    inputs += buffers
    return _fast.signature(fw, inputs, "bwd", activation, want, written=written), inputs


class _BackwardCall:
    """The arguments of one backward call, described and checked once."""

    __slots__ = (
        "conv", "dout", "dfinal", "dx", "dweight", "dbias", "dinit", "want_dinit", "silu", "device",
    )  # fmt: skip

    def __init__(
        self, x, weight, bias, dout, seq_idx, initial_states, dfinal_states, dx,
        return_dinitial_states, activation, dweight_out, dbias_out, dinitial_states_out,
    ):  # fmt: skip
        self.silu = v.check_activation(activation)
        want = v.check_flag(return_dinitial_states, "return_dinitial_states")
        self.conv = a = v.conv_args(x, weight, bias, seq_idx, initial_states)
        self.want_dinit = want and a.initial_states is not None
        self.dout = g = v.array(dout, "dout", 3)
        v.shape(g, "dout", a.x.shape, "(batch, dim, seqlen) of x")
        self.dfinal = v.optional(dfinal_states, "dfinal_states", 3)
        v.shape(self.dfinal, "dfinal_states", v.state_shape(a), v.STATE_SHAPE)
        self.dx = v.optional(dx, "dx", 3)
        v.shape(self.dx, "dx", a.x.shape, "(batch, dim, seqlen) of x")
        v.same_dtype(self.dx, "dx", a.x, "x")
        self.dweight = v.optional(dweight_out, "dweight_out", 2)
        v.shape(self.dweight, "dweight_out", a.weight.shape, "(dim, width) of weight")
        v.same_dtype(self.dweight, "dweight_out", a.weight, "weight")
        self.dbias = v.optional(dbias_out, "dbias_out", 1)
        if self.dbias is not None:
            if a.bias is None:
                raise ValueError("dbias_out must be None when bias is None; got an array")
            v.shape(self.dbias, "dbias_out", a.bias.shape, "(dim,) of bias")
            v.same_dtype(self.dbias, "dbias_out", a.bias, "bias")
        self.dinit = None
        if self.want_dinit:
            self.dinit = v.optional(dinitial_states_out, "dinitial_states_out", 3)
            v.shape(self.dinit, "dinitial_states_out", v.state_shape(a), v.STATE_SHAPE)
            v.same_dtype(self.dinit, "dinitial_states_out", a.x, "x")
        inputs = a.named() + (("dout", g), ("dfinal_states", self.dfinal))
        outputs = (
            ("dx", self.dx), ("dweight_out", self.dweight), ("dbias_out", self.dbias),
            ("dinitial_states_out", self.dinit),
        )  # fmt: skip
        self.device = v.same_device(inputs + outputs)
        for i, (name, buffer) in enumerate(outputs):
            v.writable(buffer, name, inputs + outputs[:i])

    def plan(self, dx=None):
        """The backward plan of this call on the GPU, with ``dx`` the dx written (default: the
        caller's buffer, or a new one like x)."""
        a = self.conv
        x = a.x
        dx = dx or self.dx or empty(x, x.shape, strides_like(x), x.dtype)
        states = self.want_dinit or self.dfinal is not None
        has_seq = a.seq_idx is not None
        weight_dtype = a.weight.dtype_name
        return plan_backward(x, self.dout, dx, a.width, has_seq, states, weight_dtype, self.device)


def _acc_dtype(x) -> np.dtype:
    return np.dtype(np.float64 if x.dtype_name == "float64" else np.float32)


def _backward_gpu(call: _BackwardCall, fw=None, key=None):
    """Launch the call's kernels; with a signature ``key``, leave its FastCall behind."""
    a = call.conv
    x, w = a.x, a.weight
    batch, dim, seqlen = x.shape
    dx = call.dx or empty(x, x.shape, strides_like(x), x.dtype)
    dweight = call.dweight or empty(w, w.shape, strides_like(w), w.dtype)
    dbias = None
    if a.bias is not None:
        dbias = call.dbias or empty(a.bias, a.bias.shape, (1,), a.bias.dtype)
    dinit = None
    if call.want_dinit:
        init = a.initial_states
        dinit = call.dinit or empty(x, init.shape, strides_like(init), x.dtype)
    given = (call.dx, call.dweight, call.dbias, call.dinit)
    made = (dx, dweight, dbias, dinit)
    if dim > 0:
        stream = stream_of(x)
        launches, partials, scratch = _launches(call, dx, dweight, dbias, dinit)
        for step, args in launches:
            launch(step, call.device, args, stream)
        if key is not None and _fast.may_repeat(fw, *given):
            replay = Replay(launches, call.device, POINTERS, stream_ptr(stream))
            _fast.store(key, _fast_call(call, fw, replay, made, partials, scratch))
    return tuple(
        None if m is None else g.obj if g is not None else result(x, m) for g, m in zip(given, made)
    )


def _fast_call(call: _BackwardCall, fw, replay, results, partials, scratch) -> _fast.FastCall:
    """The FastCall of a call: it allocates the results it makes and the plan's scratch; with
    output buffers (given for every result), only the scratch, and guards the buffers' memory
    against the inputs' and each other's."""
    a = call.conv
    if call.dx is None:
        made = (*results, partials, scratch)
        outputs = tuple(m and _fast.output_spec(fw, m, a.x) for m in made)
        return _fast.FastCall(fw, call.device, replay, outputs)
    arrays = (
        a.x, a.weight, a.bias, a.seq_idx, a.initial_states, call.dout, call.dfinal, call.dx,
        call.dweight, call.dbias, call.dinit,
    )  # fmt: skip
    outputs = tuple(m and _fast.output_spec(fw, m) for m in (partials, scratch))
    spans = tuple(b and _fast.span(b) for b in arrays)
    return _fast.FastCall(fw, call.device, replay, outputs, _fast.written_guards(7, 4), spans)


def _launches(call: _BackwardCall, dx, dweight, dbias, dinit):
    """The call's (Launch, parameters) pairs, with the partials and scratch they need."""
    a = call.conv
    x = a.x
    plan = call.plan(dx)
    acc = _acc_dtype(x)
    partials = None  # a single part: dweight and dbias are written directly
    if plan.n_parts != 1:
        parts = (plan.n_parts, x.shape[1], a.width + 1)
        partials = empty(x, parts, dense_strides(parts, (0, 1, 2)), acc)
    scratch = None
    if plan.scratch_strides is not None:
        scratch = empty(x, x.shape, plan.scratch_strides, acc)
    seq_idx = a.seq_idx if x.shape[2] > 0 else None  # no token, no segment id to read
    launches = [
        (
            step,
            backward_args(
                step, plan, x, a.weight, a.bias, seq_idx, a.initial_states, call.dout,
                call.dfinal, dx, dweight, dbias, dinit, partials, scratch, a.width, call.silu,
            ),
        )
        for step in plan.launches
    ]  # fmt: skip
    return launches, partials, scratch


def _backward_cpu(call: _BackwardCall):
    a = call.conv
    dx64, dw64, db64, dinit64 = reference.causal_conv1d_bwd(
        host(a.x), host(a.weight), host(a.bias), host(call.dout), host(a.seq_idx),
        host(a.initial_states), host(call.dfinal), activation="silu" if call.silu else None,
    )  # fmt: skip
    dx = output(call.dx, a.x, dx64)
    dweight = output(call.dweight, a.weight, dw64)
    dbias = None if a.bias is None else output(call.dbias, a.bias, db64)
    dinit = None
    if call.want_dinit:  # dtype of x, laid out like initial_states
        dinit = output(call.dinit, a.x, dinit64, order=stride_order(a.initial_states))
    return dx, dweight, dbias, dinit
