"""The forward operator, ``causal_conv1d_fn``: GPU arrays launch the kernels its plan picks
(``cupyconv/_forward_plan.py``, ``kernels/fwd_*.cu``); CPU arrays run the float64 reference.

A call goes straight through: describe and check the arguments once (``_ForwardCall``), then
either the reference, or: look the plan up, allocate the outputs, pack the arguments, launch,
return the results in the caller's framework.
"""

from __future__ import annotations

from . import _fast, reference
from . import _validate as v
from ._arrays import Array, dense_strides, empty, result, stream_of, stream_ptr, strides_like
from ._forward_plan import (
    POINTERS,
    forward_args,
    plan_final_states,
    plan_forward,
    with_final_states,
)
from ._host import host, output
from ._launch import Replay, launch

__all__ = ["causal_conv1d_fn"]


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
    followed by the activation, plus seq_idx masking and initial/final states
    (``docs/semantics.md``). Runs on the GPU for GPU arrays and through the float64 reference
    for CPU arrays.

    x:              [batch, dim, seqlen], any strides; float32, float16, bfloat16 or float64
    weight:         [dim, width], 1 <= width <= 256, any float dtype
    bias:           [dim] or None, any float dtype
    seq_idx:        [batch, seqlen] int32/int64 or None; tokens of different ids do not mix,
                    negative ids are padding (output 0)
    initial_states: [batch, dim, width - 1] or None: the inputs before t = 0
    return_final_states: also return final_states [batch, dim, width - 1] (dtype of x), written
                    into final_states_out when given, else laid out [batch, width - 1, dim]
    activation:     None, "silu" or "swish"
    out:            optional [batch, dim, seqlen] buffer of x's dtype, any strides, not
                    overlapping x
    Returns out, or (out, final_states). Results come back in x's framework, on x's device and
    (for torch) on the current stream. torch tensors are differentiable in x, weight, bias and
    initial_states, and work under torch.compile (``cupyconv/_torch_ops.py``).
    """
    fw = _fast.framework(x)
    if fw is _fast.Torch and (_torch_ops or _load_torch_ops()).needs_op(
        x, weight, bias, initial_states
    ):  # autograd records the call, or torch.compile traces it: the torch layer
        return _torch_ops.causal_conv1d_fn(
            x, weight, bias, seq_idx, initial_states, return_final_states, final_states_out,
            activation, out,
        )  # fmt: skip
    if fw is None and type(x).__module__.startswith("jax") and out is None:
        return _jax_eager(
            x, weight, bias, seq_idx, initial_states, return_final_states, final_states_out,
            activation,
        )  # fmt: skip
    key, inputs = lean_key(
        fw, x, weight, bias, seq_idx, initial_states, return_final_states, final_states_out,
        activation, out,
    )  # fmt: skip
    results = lean_call(key, inputs, return_final_states)
    if results is not None:
        return results
    call = _ForwardCall(
        x, weight, bias, seq_idx, initial_states, return_final_states, final_states_out,
        activation, out,
    )  # fmt: skip
    return _forward_gpu(call, fw, key) if call.conv.x.on_gpu else _forward_cpu(call)


_torch_ops = None  # cupyconv._torch_ops, imported with the first torch tensor (it imports torch)


def lean_key(
    fw, x, weight, bias, seq_idx, initial_states, return_final_states, final_states_out,
    activation, out,
):  # fmt: skip
    """(signature, inputs) of a call for the lean path (``cupyconv/_fast.py``): inputs are the
    arrays in the kernels' pointer order up to the last output buffer given; (None, None) where
    the call cannot take it."""
    if fw is None or (final_states_out is not None and out is None):
        return None, None
    final = return_final_states if type(return_final_states) is bool else None
    given = () if out is None else (out,)
    if final and final_states_out is not None:
        given += (final_states_out,)
    inputs = (x, weight, bias, seq_idx, initial_states, *given)
    key = _fast.signature(fw, inputs, "fwd", activation, final, written=given)
    return key, inputs


def lean_call(key, inputs, return_final_states):
    """The results of a call with signature ``key`` on the lean path, or None where it has no
    FastCall or a guard sends it the full way."""
    if key is None:
        return None
    made = _fast.run(key, inputs[0])
    if made is None:
        return None
    results = inputs + made  # the kernels' pointer order: ..., out, final_states
    return (results[5], results[6]) if return_final_states else results[5]


def _jax_eager(
    x, weight, bias, seq_idx, initial_states, return_final_states, final_states_out, activation
):  # fmt: skip
    """JAX arrays on a GPU (outside jit): cupyconv.jax's jitted function, which launches on
    XLA's stream with XLA's buffers; other JAX arrays: the usual path."""
    arrays = [a for a in (x, weight, bias, seq_idx, initial_states) if a is not None]
    try:
        platforms = {d.platform for d in x.devices()}
    except Exception:  # noqa: BLE001 - a traced value or no JAX array: the usual path says so
        platforms = set()
    all_jax = all(type(a).__module__.startswith("jax") for a in arrays)
    if platforms != {"gpu"} or final_states_out is not None or not all_jax:
        call = _ForwardCall(
            x, weight, bias, seq_idx, initial_states, return_final_states, final_states_out,
            activation, None,
        )  # fmt: skip
        return _forward_gpu(call) if call.conv.x.on_gpu else _forward_cpu(call)
    from . import jax as cupyconv_jax

    return cupyconv_jax.eager(
        x, weight, bias, seq_idx, initial_states, return_final_states, activation
    )


def _load_torch_ops():
    """cupyconv._torch_ops, imported once (the backward's entry uses it too)."""
    global _torch_ops
    from . import _torch_ops as module

    _torch_ops = module
    return module


class _ForwardCall:
    """The arguments of one forward call, described and checked once."""

    __slots__ = ("conv", "final_states_out", "out", "silu", "return_final_states", "device")

    def __init__(
        self, x, weight, bias, seq_idx, initial_states, return_final_states, final_states_out,
        activation, out,
    ):  # fmt: skip
        self.silu = v.check_activation(activation)
        self.return_final_states = v.check_flag(return_final_states, "return_final_states")
        self.conv = a = v.conv_args(x, weight, bias, seq_idx, initial_states)
        final = None
        if return_final_states:
            final = v.optional(final_states_out, "final_states_out", 3)
            v.shape(final, "final_states_out", v.state_shape(a), v.STATE_SHAPE)
            v.same_dtype(final, "final_states_out", a.x, "x")
        self.final_states_out = final
        self.out = v.optional(out, "out", 3)
        v.shape(self.out, "out", a.x.shape, "(batch, dim, seqlen) of x")
        v.same_dtype(self.out, "out", a.x, "x")
        inputs = a.named()
        self.device = v.same_device(inputs + (("final_states_out", final), ("out", self.out)))
        v.writable(self.out, "out", inputs)
        v.writable(final, "final_states_out", inputs + (("out", self.out),))

    def plans(self, out: Array | None = None) -> list:
        """The launches of this call on the GPU as (Launch, main_blocks) pairs (none for empty
        arrays), with ``out`` the output written (default: a dense one like x). With tokens,
        the final states come from extra blocks of the main launch, else from a launch of
        their own."""
        a = self.conv
        batch, dim, seqlen = a.x.shape
        final = self.return_final_states and batch * dim * (a.width - 1) > 0
        if batch * dim * seqlen == 0:
            return [(plan_final_states(a.x, a.width), 0)] if final else []
        target = out or self.out or a.x
        has_seq = a.seq_idx is not None
        plan = plan_forward(a.x, target, a.weight, a.initial_states, a.width, has_seq, self.device)
        main_blocks = plan.grid
        if final:
            plan = with_final_states(plan, a.x, a.width)
        return [(plan, main_blocks)]


def _forward_gpu(call: _ForwardCall, fw=None, key=None):
    """Launch the call's kernels; with a signature ``key``, leave its FastCall behind."""
    a = call.conv
    x = a.x
    batch, dim, seqlen = x.shape
    out = call.out or empty(x, x.shape, strides_like(x), x.dtype)
    final = None
    if call.return_final_states:
        shape = (batch, dim, a.width - 1)  # laid out [batch, width - 1, dim]
        final = call.final_states_out or empty(x, shape, dense_strides(shape, (0, 2, 1)), x.dtype)
    stream = stream_of(x)
    seq_idx = a.seq_idx if seqlen > 0 else None  # no token, no segment id to read
    launches = [
        (
            plan,
            forward_args(
                plan, x, a.weight, a.bias, seq_idx, a.initial_states, out, final, a.width,
                call.silu, main_blocks,
            ),
        )
        for plan, main_blocks in call.plans(out)
    ]  # fmt: skip
    for plan, args in launches:
        launch(plan, call.device, args, stream)
    if key is not None and launches and _fast.may_repeat(fw, call.out, call.final_states_out):
        given = [a for a in (call.out, call.final_states_out) if a is not None]
        arrays = (x, a.weight, a.bias, a.seq_idx, a.initial_states, *given)
        outputs = (_fast.output_spec(fw, out, x), final and _fast.output_spec(fw, final))
        replay = Replay(launches, call.device, POINTERS, stream_ptr(stream))
        fast = _fast.FastCall(
            fw, call.device, replay, outputs[len(given) :], _fast.written_guards(5, len(given)),
            tuple(b and _fast.span(b) for b in arrays),
        )  # fmt: skip
        _fast.store(key, fast)
    result_out = call.out.obj if call.out is not None else result(x, out)
    if final is None:
        return result_out
    given = call.final_states_out
    return result_out, given.obj if given is not None else result(x, final)


def _forward_cpu(call: _ForwardCall):
    a = call.conv
    res = reference.causal_conv1d_fn(
        host(a.x), host(a.weight), host(a.bias), host(a.seq_idx), host(a.initial_states),
        return_final_states=call.return_final_states,
        activation="silu" if call.silu else None,
    )  # fmt: skip
    out64, final64 = res if call.return_final_states else (res, None)
    out = output(call.out, a.x, out64)
    if final64 is None:
        return out
    return out, output(call.final_states_out, a.x, final64, order=(0, 2, 1))
