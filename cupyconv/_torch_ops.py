"""torch autograd and torch.compile support: custom operators over the direct path (imported
when a torch tensor arrives; it imports torch).

Six ``torch.library.custom_op`` operators in the ``cupyconv`` namespace; their bodies run the
direct path of ``forward.py``, ``backward.py`` and ``update.py``, which checks every argument:

    causal_conv1d_fwd(x, weight, bias?, seq_idx?, initial_states?, activation?) -> out
    causal_conv1d_fwd_final_states(<the same>) -> (out, final_states)
        new tensors; differentiable in x, weight, bias and initial_states (``register_autograd``:
        the backward recomputes the pre-activation, the output is not saved)
    causal_conv1d_bwd(x, weight, bias?, dout, seq_idx?, initial_states?, dfinal_states?,
                      return_dinitial_states, activation?) -> [dx, dweight, dbias?, dinit?]
        new tensors: dbias with bias, dinitial_states when asked for and initial_states is given
    causal_conv1d_fwd_into(x, weight, bias?, seq_idx?, initial_states?, activation?,
                           out!, final_states_out!?) -> ()
    causal_conv1d_bwd_into(x, weight, bias?, dout, seq_idx?, initial_states?, dfinal_states?,
                           activation?, dx!, dweight_out!, dbias_out!?, dinitial_states_out!?)
        -> ()
        the same written into output buffers (``!``: declared in ``mutates_args``); final_states
        and dinitial_states are computed when their buffer is given. They serve traced calls
        that pass buffers; the entries below allocate the buffers the caller did not pass.
    causal_conv1d_update(x, conv_state!, weight, bias?, activation?, cache_seqlens?,
                         conv_state_indices?) -> out
        the decode update for traced calls (inference only); eager calls take the direct path.

(torch takes an autograd formula only for an operator that writes none of its arguments, and
functionalizes a writing operator only when it returns nothing or plain tensors; a list return
costs a pytree pass per autograd call, hence two forward operators.)

The fake implementations and the entries allocate like the direct path: dense tensors in the
stride order of the array they follow (``_arrays.strides_like``, torch's ``empty_like`` rule),
final_states laid out [batch, width - 1, dim], dinitial_states in x's dtype and the stride order
of initial_states.

Routing (``needs_op``, ``traced``): an eager call comes here only when autograd records it
(grad mode on and x, weight, bias or initial_states requiring grad); eager inference takes the
direct path and skips the dispatcher. An eager call that autograd records runs ``_Eager``, a
``torch.autograd.Function`` over the same direct paths and the same backward formula (a custom
operator's dispatch costs several times an autograd.Function's on the host). torch.compile,
torch.export and other tracers (FakeTensor or FunctionalTensor inputs) always get the operators,
so dynamo never traces into the direct path.
"""

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor

from . import _fast, backward, forward, update
from . import _validate as v
from ._arrays import dense_strides, stride_order

Tensor = torch.Tensor

# ---- routing ---------------------------------------------------------------------------------

_TRACER_TENSORS = (FakeTensor, FunctionalTensor)
_grad_enabled = torch.is_grad_enabled
_is_compiling = torch.compiler.is_compiling


def needs_op(x, weight, bias, initial_states) -> bool:
    """Whether a ``causal_conv1d_fn`` call with torch tensor x goes through the operators:
    autograd records it, or a tracer runs it. (A few attribute reads: every eager call with a
    torch tensor pays them.)"""
    if _grad_enabled() and (
        x.requires_grad
        or getattr(weight, "requires_grad", False)
        or (bias is not None and getattr(bias, "requires_grad", False))
        or (initial_states is not None and getattr(initial_states, "requires_grad", False))
    ):
        return True
    return traced(x)


def traced(x) -> bool:
    """Whether torch.compile / torch.export or another tracer runs this call."""
    return _is_compiling() or (type(x) is not Tensor and isinstance(x, _TRACER_TENSORS))


def _records_grad(*tensors) -> bool:
    return _grad_enabled() and any(getattr(t, "requires_grad", False) for t in tensors)


def _torch_tensors(named) -> None:
    """The operators take torch tensors only: refuse another framework's array by name."""
    for name, t in named:
        if t is not None and not isinstance(t, Tensor):
            raise TypeError(
                f"{name} must be a torch tensor like x when autograd or torch.compile records "
                f"the call; got {type(t).__name__}"
            )


# ---- allocation, as the direct path allocates -------------------------------------------------


class _Layout:
    """Shape and strides of a tensor, as ``_arrays.stride_order`` reads them."""

    __slots__ = ("shape", "strides")

    def __init__(self, t: Tensor):
        self.shape, self.strides = tuple(t.shape), tuple(t.stride())


def _new_like(t: Tensor, dtype=None) -> Tensor:
    """A new dense tensor of t's shape on t's device, dims in t's stride order."""
    shape = tuple(t.shape)
    strides = dense_strides(shape, stride_order(_Layout(t)))
    return t.new_empty_strided(shape, strides, dtype=t.dtype if dtype is None else dtype)


def _new_final_states(x: Tensor, weight: Tensor) -> Tensor:
    """final_states: [batch, dim, width - 1] in x's dtype, laid out [batch, width - 1, dim]."""
    shape = (x.shape[0], x.shape[1], weight.shape[-1] - 1)
    return x.new_empty_strided(shape, dense_strides(shape, (0, 2, 1)))


# ---- the entries (from forward.causal_conv1d_fn and backward.causal_conv1d_bwd) -------------


def causal_conv1d_fn(
    x, weight, bias, seq_idx, initial_states, return_final_states, final_states_out, activation,
    out,
):  # fmt: skip
    """``cupyconv.causal_conv1d_fn`` through the operators (same arguments and results).

    Without output buffers: ``causal_conv1d_fwd`` or ``causal_conv1d_fwd_final_states``
    (differentiable). With ``out`` or ``final_states_out``: ``causal_conv1d_fwd_into``, which
    autograd cannot record, so a call that autograd records refuses them (as torch refuses
    ``out=`` there).
    """
    v.check_activation(activation)
    return_final_states = v.check_flag(return_final_states, "return_final_states")
    if not return_final_states:
        final_states_out = None  # ignored, as in the reference library
    _torch_tensors(
        (("weight", weight), ("bias", bias), ("seq_idx", seq_idx),
         ("initial_states", initial_states), ("final_states_out", final_states_out),
         ("out", out))
    )  # fmt: skip
    args = (x, weight, bias, seq_idx, initial_states, activation)
    if out is None and final_states_out is None:
        if not traced(x):
            return _eager_apply(*args, return_final_states)
        if return_final_states:
            return torch.ops.cupyconv.causal_conv1d_fwd_final_states(*args)
        return torch.ops.cupyconv.causal_conv1d_fwd(*args)
    if _records_grad(x, weight, bias, initial_states):
        name = "out" if out is not None else "final_states_out"
        raise ValueError(
            f"{name} must be None when autograd records the call (grad mode is on and x, "
            "weight, bias or initial_states requires grad): a write into a caller's buffer "
            f"cannot be differentiated; call without {name}, or under torch.no_grad()"
        )
    out = _new_like(x) if out is None else out
    final = final_states_out
    if return_final_states and final is None:
        final = _new_final_states(x, weight)
    torch.ops.cupyconv.causal_conv1d_fwd_into(*args, out, final)
    return (out, final) if return_final_states else out


def causal_conv1d_bwd(
    x, weight, bias, dout, seq_idx, initial_states, dfinal_states, dx, return_dinitial_states,
    activation, dweight_out, dbias_out, dinitial_states_out,
):  # fmt: skip
    """``cupyconv.causal_conv1d_bwd`` through the operators (same arguments and results), for
    traced calls: ``causal_conv1d_bwd`` without buffers, else ``causal_conv1d_bwd_into``."""
    v.check_activation(activation)
    want_dinit = v.check_flag(return_dinitial_states, "return_dinitial_states")
    want_dinit = want_dinit and initial_states is not None
    if not want_dinit:
        dinitial_states_out = None  # ignored, as by the direct path
    _torch_tensors(
        (("weight", weight), ("bias", bias), ("dout", dout), ("seq_idx", seq_idx),
         ("initial_states", initial_states), ("dfinal_states", dfinal_states), ("dx", dx),
         ("dweight_out", dweight_out), ("dbias_out", dbias_out),
         ("dinitial_states_out", dinitial_states_out))
    )  # fmt: skip
    args = (x, weight, bias, dout, seq_idx, initial_states, dfinal_states)
    if dx is None and dweight_out is None and dbias_out is None and dinitial_states_out is None:
        grads = torch.ops.cupyconv.causal_conv1d_bwd(*args, want_dinit, activation)
        dbias = grads[2] if bias is not None else None
        return grads[0], grads[1], dbias, grads[-1] if want_dinit else None
    dx = _new_like(x) if dx is None else dx
    dweight = _new_like(weight) if dweight_out is None else dweight_out
    dbias = dbias_out
    if dbias is None and bias is not None:
        dbias = _new_like(bias)
    dinit = dinitial_states_out
    if dinit is None and want_dinit:
        dinit = _new_like(initial_states, dtype=x.dtype)
    torch.ops.cupyconv.causal_conv1d_bwd_into(*args, activation, dx, dweight, dbias, dinit)
    return dx, dweight, dbias, dinit


# ---- the operators ---------------------------------------------------------------------------


def _direct_forward(*args):
    """The direct path of ``forward.causal_conv1d_fn`` (its arguments, in its order)."""
    call = forward._ForwardCall(*args)
    return forward._forward_gpu(call) if call.conv.x.on_gpu else forward._forward_cpu(call)


def _direct_backward(*args):
    """The direct path of ``backward.causal_conv1d_bwd`` (its arguments, in its order)."""
    call = backward._BackwardCall(*args)
    return backward._backward_gpu(call) if call.conv.x.on_gpu else backward._backward_cpu(call)


@torch.library.custom_op("cupyconv::causal_conv1d_fwd", mutates_args=())
def _fwd(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    seq_idx: Tensor | None,
    initial_states: Tensor | None,
    activation: str | None,
) -> Tensor:
    """out, a new tensor."""
    return _direct_forward(x, weight, bias, seq_idx, initial_states, False, None, activation, None)


@torch.library.custom_op("cupyconv::causal_conv1d_fwd_final_states", mutates_args=())
def _fwd_final_states(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    seq_idx: Tensor | None,
    initial_states: Tensor | None,
    activation: str | None,
) -> tuple[Tensor, Tensor]:
    """(out, final_states), new tensors."""
    return _direct_forward(x, weight, bias, seq_idx, initial_states, True, None, activation, None)


@torch.library.custom_op("cupyconv::causal_conv1d_bwd", mutates_args=())
def _bwd(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    dout: Tensor,
    seq_idx: Tensor | None,
    initial_states: Tensor | None,
    dfinal_states: Tensor | None,
    return_dinitial_states: bool,
    activation: str | None,
) -> list[Tensor]:
    """[dx, dweight] + [dbias] with bias + [dinitial_states] when asked for and
    initial_states is given, new tensors."""
    grads = _direct_backward(
        x, weight, bias, dout, seq_idx, initial_states, dfinal_states, None,
        return_dinitial_states, activation, None, None, None,
    )  # fmt: skip
    return [g for g in grads if g is not None]


@torch.library.custom_op(
    "cupyconv::causal_conv1d_fwd_into", mutates_args=("out", "final_states_out")
)
def _fwd_into(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    seq_idx: Tensor | None,
    initial_states: Tensor | None,
    activation: str | None,
    out: Tensor,
    final_states_out: Tensor | None,
) -> None:
    """Writes out, and final_states into final_states_out when it is given."""
    _direct_forward(
        x, weight, bias, seq_idx, initial_states, final_states_out is not None, final_states_out,
        activation, out,
    )  # fmt: skip


@torch.library.custom_op(
    "cupyconv::causal_conv1d_bwd_into",
    mutates_args=("dx", "dweight_out", "dbias_out", "dinitial_states_out"),
)
def _bwd_into(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    dout: Tensor,
    seq_idx: Tensor | None,
    initial_states: Tensor | None,
    dfinal_states: Tensor | None,
    activation: str | None,
    dx: Tensor,
    dweight_out: Tensor,
    dbias_out: Tensor | None,
    dinitial_states_out: Tensor | None,
) -> None:
    """Writes dx, dweight_out, dbias_out (given with bias, else None), and dinitial_states
    into dinitial_states_out when it is given."""
    _direct_backward(
        x, weight, bias, dout, seq_idx, initial_states, dfinal_states, dx,
        dinitial_states_out is not None, activation, dweight_out, dbias_out, dinitial_states_out,
    )  # fmt: skip


@torch.library.custom_op("cupyconv::causal_conv1d_update", mutates_args=("conv_state",))
def _update(
    x: Tensor,
    conv_state: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    activation: str | None,
    cache_seqlens: Tensor | None,
    conv_state_indices: Tensor | None,
) -> Tensor:
    """out, a new tensor; conv_state updated in place (inference only: no autograd)."""
    call = update._UpdateCall(
        x, conv_state, weight, bias, activation, cache_seqlens, conv_state_indices
    )
    return update._update_gpu(call) if call.x.on_gpu else update._update_cpu(call)


def causal_conv1d_update(x, conv_state, weight, bias, activation, cache_seqlens, indices):
    """``cupyconv.causal_conv1d_update`` for traced calls: the operator."""
    _torch_tensors(
        (("conv_state", conv_state), ("weight", weight), ("bias", bias),
         ("cache_seqlens", cache_seqlens), ("conv_state_indices", indices))
    )  # fmt: skip
    return torch.ops.cupyconv.causal_conv1d_update(
        x, conv_state, weight, bias, activation, cache_seqlens, indices
    )


# ---- fake implementations: the allocations of the real ones ----------------------------------


@_update.register_fake
def _(x, conv_state, weight, bias, activation, cache_seqlens, conv_state_indices):
    return _new_like(x)


@_fwd.register_fake
def _(x, weight, bias, seq_idx, initial_states, activation):
    return _new_like(x)


@_fwd_final_states.register_fake
def _(x, weight, bias, seq_idx, initial_states, activation):
    return _new_like(x), _new_final_states(x, weight)


@_bwd.register_fake
def _(x, weight, bias, dout, seq_idx, initial_states, dfinal_states, want_dinit, activation):
    made = [_new_like(x), _new_like(weight)]
    if bias is not None:
        made.append(_new_like(bias))
    if want_dinit and initial_states is not None:
        made.append(_new_like(initial_states, dtype=x.dtype))
    return made


@_fwd_into.register_fake
def _(x, weight, bias, seq_idx, initial_states, activation, out, final_states_out):
    return None


@_bwd_into.register_fake
def _(
    x, weight, bias, dout, seq_idx, initial_states, dfinal_states, activation, dx, dweight_out,
    dbias_out, dinitial_states_out,
):  # fmt: skip
    return None


# ---- autograd of the forward operators -------------------------------------------------------


def _setup_context(ctx, inputs, output):
    x, weight, bias, seq_idx, initial_states, activation = inputs
    ctx.save_for_backward(x, weight, bias, seq_idx, initial_states)  # not the output
    ctx.activation = activation
    ctx.set_materialize_grads(False)  # the gradient of an output nothing used stays None


def _operator_backward(
    ctx, x, weight, bias, dout, seq_idx, initial_states, dfinal, want_dinit, act
):  # fmt: skip
    grads = torch.ops.cupyconv.causal_conv1d_bwd(
        x, weight, bias, dout, seq_idx, initial_states, dfinal, want_dinit, act
    )
    dbias = grads[2] if bias is not None else None
    return grads[0], grads[1], dbias, grads[-1] if want_dinit else None


def _eager_backward(
    ctx, x, weight, bias, dout, seq_idx, initial_states, dfinal, want_dinit, act
):  # fmt: skip
    """The public backward, for the eager calls ``_Eager.backward`` does not take on the lean
    path."""
    return backward.causal_conv1d_bwd(
        x, weight, bias, dout, seq_idx, initial_states, dfinal, None, want_dinit, act
    )


def _gradients(ctx, dout, dfinal_states, run_backward):
    """The gradients of (x, weight, bias, seq_idx, initial_states), by ``run_backward`` (the
    operator, or the direct path)."""
    x, weight, bias, seq_idx, initial_states = ctx.saved_tensors
    if dout is None:  # only final_states was used
        dout = torch.zeros_like(x)
    need_x, need_weight, need_bias, _, need_init = ctx.needs_input_grad[:5]
    want_dinit = need_init and initial_states is not None
    dx, dweight, dbias, dinit = run_backward(
        ctx, x, weight, bias, dout, seq_idx, initial_states, dfinal_states, want_dinit,
        ctx.activation,
    )  # fmt: skip
    if want_dinit and dinit.dtype != initial_states.dtype:  # autograd expects its own dtype
        dinit = dinit.to(initial_states.dtype)
    return (
        dx if need_x else None,
        dweight if need_weight else None,
        dbias if need_bias and bias is not None else None,
        None,  # seq_idx
        dinit,
    )


def _operator_autograd(ctx, dout, dfinal_states=None):
    """The gradients through the operator causal_conv1d_bwd: dout, and dfinal_states for
    causal_conv1d_fwd_final_states, None where nothing used that output."""
    return (*_gradients(ctx, dout, dfinal_states, _operator_backward), None)  # activation


_fwd.register_autograd(_operator_autograd, setup_context=_setup_context)
_fwd_final_states.register_autograd(_operator_autograd, setup_context=_setup_context)


class _Eager(torch.autograd.Function):
    """Eager calls that autograd records: the forward operators' autograd without their
    dispatch (the direct paths, the same backward formula)."""

    @staticmethod
    def forward(ctx, x, weight, bias, seq_idx, initial_states, activation, return_final_states):
        # The lean path (``_fast.py``; return_final_states is a bool here), else the public
        # function (grad mode is off in here).
        arrays = (x, weight, bias, seq_idx, initial_states)
        made = _fast.run_torch(arrays, ("fwd", activation, return_final_states), x)
        if made is None:
            res = forward.causal_conv1d_fn(*arrays, return_final_states, None, activation)
        else:
            res = (made[0], made[1]) if return_final_states else made[0]
        _setup_context(ctx, (*arrays, activation), res)
        return res

    @staticmethod
    def backward(ctx, dout, dfinal_states=None):
        # A training step's backward (no dinitial_states asked): the lean path (``_fast.py``) in
        # place, without _gradients' layers (1.5 us of the step on the CPU); else through them.
        need = ctx.needs_input_grad
        if dout is not None and not need[4]:
            inputs = (*ctx.saved_tensors, dout, dfinal_states)  # (x, weight, bias, seq_idx, init)
            made = _fast.run_torch(inputs, ("bwd", ctx.activation, False), inputs[0])
            if made is not None:
                dbias = made[2] if need[2] else None  # (None without a bias)
                return made[0] if need[0] else None, made[1] if need[1] else None, dbias, *_NONES
        return (*_gradients(ctx, dout, dfinal_states, _eager_backward), None, None)


_NONES = (None, None, None, None)  # the gradients of seq_idx, initial_states and the two flags


_transforms_active = torch._C._are_functorch_transforms_active
_unwrap_if_dead = torch._C._functorch.unwrap_if_dead
_c_apply = super(torch.autograd.Function, _Eager).apply  # the C apply under Function.apply


def _eager_apply(x, weight, bias, seq_idx, initial_states, activation, return_final_states):
    """``_Eager.apply``: where no functorch transform is active, what ``Function.apply`` runs
    then (each tensor that outlived its transform unwrapped, then the C apply) without its
    Python layer (about 1.5 us of an eager training step's forward)."""
    if _transforms_active():
        return _Eager.apply(
            x, weight, bias, seq_idx, initial_states, activation, return_final_states
        )
    return _c_apply(
        _unwrap_if_dead(x), _unwrap_if_dead(weight),
        None if bias is None else _unwrap_if_dead(bias),
        None if seq_idx is None else _unwrap_if_dead(seq_idx),
        None if initial_states is None else _unwrap_if_dead(initial_states),
        activation, return_final_states,
    )  # fmt: skip
