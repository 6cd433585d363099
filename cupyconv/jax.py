"""cupyconv for JAX: ``causal_conv1d_fn`` as a differentiable JAX function that runs eagerly and
under ``jax.jit``, ``jax.grad``, ``jax.vmap`` and ``jax.lax.scan``.

    import cupyconv.jax
    out = cupyconv.jax.causal_conv1d_fn(x, weight, bias, activation="silu")

A thin adapter over cupyconv's public functions (``docs/semantics.md``), imported only by those
who want it (the core never imports JAX):

- GPU arrays: ``jax.experimental.buffer_callback`` hands a Python function XLA's CUDA stream and
  the device buffers of the inputs and of the results XLA allocated. The buffers are wrapped as
  CuPy arrays without a copy and passed to ``cupyconv.causal_conv1d_fn`` /
  ``cupyconv.causal_conv1d_bwd`` as their output buffers, on that stream: no host round trip,
  no copy.
- CPU arrays: ``jax.pure_callback`` runs the same public functions on the host arrays, i.e. the
  float64 reference, with results rounded to the input dtypes.

The path is chosen by where the arrays live: the device of concrete arrays, and under a
transformation (``jit``, ``grad``, ``scan``) the platform XLA lowers for, through
``jax.lax.platform_dependent``. ``final_states`` (and every other result) is a dense row-major
JAX array: ``[batch, dim, width - 1]`` as its shape says (the core lays it out
``[batch, width - 1, dim]``; XLA arrays have one layout).

``channel_last=True`` takes and gives the sequence arrays as ``[batch, seqlen, dim]`` (x, dout,
out, dx) and the states as ``[batch, width - 1, dim]``: the layout of a model that keeps its
activations [batch, seqlen, dim]. The kernels read those buffers in place, as the core reads a
channel-last view, so no transpose runs around the call.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import numpy as np

from . import _fast
from ._arrays import remember
from ._validate import MAX_WIDTH
from .backward import _BackwardCall
from .backward import causal_conv1d_bwd as _core_bwd
from .backward import lean_key as _backward_lean_key
from .forward import _ForwardCall
from .forward import causal_conv1d_fn as _core_fn
from .forward import lean_key as _forward_lean_key

try:  # a GPU buffer callback: JAX versions that have one
    from jax.experimental.buffer_callback import buffer_callback as _buffer_callback
except ImportError:
    _buffer_callback = None

__all__ = ["causal_conv1d_bwd", "causal_conv1d_fn"]


def causal_conv1d_fn(
    x,
    weight,
    bias=None,
    seq_idx=None,
    initial_states=None,
    return_final_states=False,
    activation=None,
    *,
    channel_last=False,
):
    """Causal depthwise conv1d (``cupyconv.causal_conv1d_fn``) for JAX arrays, differentiable in
    x, weight, bias and initial_states (seq_idx has no gradient).

    x:              [batch, dim, seqlen]; float32, float16, bfloat16 or float64
    weight:         [dim, width], 1 <= width <= 256, any float dtype
    bias:           [dim] or None, any float dtype
    seq_idx:        [batch, seqlen] int32/int64 or None; tokens of different ids do not mix,
                    negative ids are padding (output 0)
    initial_states: [batch, dim, width - 1] or None: the inputs before t = 0
    return_final_states: also return final_states [batch, dim, width - 1] (dtype of x,
                    row-major), the initial_states of the next chunk
    activation:     None, "silu" or "swish"
    channel_last:   x, initial_states, out and final_states as [batch, seqlen, dim] and
                    [batch, width - 1, dim] arrays instead (seq_idx stays [batch, seqlen])
    Returns out [batch, dim, seqlen] (dtype of x, row-major), or (out, final_states). No output
    buffers: JAX arrays are immutable. Arguments may be JAX arrays (concrete or traced) or numpy
    arrays; invalid ones raise ValueError/TypeError naming the argument, at trace time under jit.
    """
    args = _arrays(x=x, weight=weight, bias=bias, seq_idx=seq_idx, initial_states=initial_states)
    channel_last = _check_channel_last(channel_last, x, weight, bias, initial_states=initial_states)
    call = _ForwardCall(
        *_stand_ins(args, channel_last), return_final_states=return_final_states,
        final_states_out=None, activation=activation, out=None,
    )  # fmt: skip
    return _conv(*args, call.silu, call.return_final_states, channel_last)


def causal_conv1d_bwd(
    x,
    weight,
    bias,
    dout,
    seq_idx=None,
    initial_states=None,
    dfinal_states=None,
    *,
    return_dinitial_states=False,
    activation=None,
    channel_last=False,
):
    """The vector-Jacobian product of ``causal_conv1d_fn`` (``cupyconv.causal_conv1d_bwd``) for
    JAX arrays; what ``jax.grad`` of ``causal_conv1d_fn`` runs.

    x, dout:        [batch, dim, seqlen]
    weight:         [dim, width]; bias: [dim] or None
    seq_idx:        [batch, seqlen] or None
    initial_states, dfinal_states: [batch, dim, width - 1] or None
    Returns (dx, dweight, dbias, dinitial_states): dx [batch, dim, seqlen] in x's dtype, dweight
    and dbias in the dtypes of weight and bias (dbias None without bias), dinitial_states
    [batch, dim, width - 1] in x's dtype when return_dinitial_states and initial_states is
    given, else None. No dx buffer: JAX arrays are immutable. channel_last: x, dout and dx as
    [batch, seqlen, dim], the states as [batch, width - 1, dim] (``causal_conv1d_fn``).
    """
    args = _arrays(
        x=x, weight=weight, bias=bias, dout=dout, seq_idx=seq_idx,
        initial_states=initial_states, dfinal_states=dfinal_states,
    )  # fmt: skip
    channel_last = _check_channel_last(
        channel_last, x, weight, bias, dout=dout, initial_states=initial_states,
        dfinal_states=dfinal_states,
    )  # fmt: skip
    call = _BackwardCall(
        *_stand_ins(args, channel_last), dx=None, return_dinitial_states=return_dinitial_states,
        activation=activation, dweight_out=None, dbias_out=None, dinitial_states_out=None,
    )  # fmt: skip
    dx, dweight, dbias, dinit = _backward(*args, call.silu, channel_last)
    return dx, dweight, dbias, dinit if call.want_dinit else None


def eager(x, weight, bias, seq_idx, initial_states, return_final_states, activation):
    """``causal_conv1d_fn`` on concrete JAX GPU arrays, through a jitted function kept per
    configuration: JAX dispatches it without retracing, XLA allocates the results and the
    kernels run on its stream (what ``cupyconv.causal_conv1d_fn`` does with such arrays)."""
    key = (type(return_final_states), return_final_states, activation)  # 1 is not True
    jitted = _eager.get(key)
    if jitted is None:
        fn = functools.partial(
            causal_conv1d_fn, return_final_states=return_final_states, activation=activation
        )
        jitted = remember(_eager, key, jax.jit(fn))
    return jitted(x, weight, bias, seq_idx, initial_states)


_eager: dict = {}


# ---- the differentiable function ---------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _conv(x, weight, bias, seq_idx, initial_states, silu, final, channel_last):
    return _forward((x, weight, bias, seq_idx, initial_states), silu, final, channel_last)


def _conv_fwd(x, weight, bias, seq_idx, initial_states, silu, final, channel_last):
    arrays = (x, weight, bias, seq_idx, initial_states)
    # saved: the inputs (the output is not)
    return _forward(arrays, silu, final, channel_last), arrays


def _conv_bwd(silu, final, channel_last, saved, cotangents):
    x, weight, bias, seq_idx, initial_states = saved
    dout, dfinal = cotangents if final else (cotangents, None)
    dx, dweight, dbias, dinit = _backward(
        x, weight, bias, dout, seq_idx, initial_states, dfinal, silu, channel_last
    )
    if dinit is not None:  # x's dtype; a cotangent takes its primal's
        dinit = dinit.astype(initial_states.dtype)
    return dx, dweight, dbias, None, dinit


_conv.defvjp(_conv_fwd, _conv_bwd)


def _forward(arrays, silu: bool, final: bool, channel_last: bool):
    """out, or (out, final_states), of validated arrays (x, weight, bias, seq_idx,
    initial_states)."""
    results = _run(_Forward(silu, final, _types(*arrays), channel_last), arrays)
    return tuple(results) if final else results[0]


def _backward(x, weight, bias, dout, seq_idx, initial_states, dfinal, silu, channel_last):
    """(dx, dweight, dbias or None, dinitial_states or None) of validated arrays."""
    arrays = (x, weight, bias, dout, seq_idx, initial_states, dfinal)
    op = _Backward(silu, _types(*arrays), channel_last)
    results = iter(_run(op, arrays))
    dx, dweight = next(results), next(results)
    dbias = None if bias is None else next(results)
    dinit = None if initial_states is None else next(results)
    return dx, dweight, dbias, dinit


# ---- the two operators as callbacks ------------------------------------------------------------


_ops: dict = {}


@dataclasses.dataclass(frozen=True)
class _Op:
    """The static configuration of one operator call (frozen dataclasses, the fields in each
    subclass), with ``types``: (shape, dtype) per input, None where absent, and
    ``channel_last``: the sequence and state arrays (every 3-D one) come as [batch, *, dim]
    (``core``). A subclass gives ``results()``, the ShapeDtypeStructs of its results, and
    ``__call__(inputs, outs=None)``: cupyconv's public function on ``inputs`` (numpy or CuPy
    arrays in the core's [batch, dim, *] view), written into ``outs`` when given; returns the
    tuple of results.

    ``_run`` keeps one instance per configuration (``_ops``), so that its bound methods, the
    callbacks JAX caches on, are equal from call to call (a bound method compares its instance
    by identity): eager calls compile once per configuration. ``lean``, outside the
    comparison: the replay the instance's calls take once ``learn`` found one (a FastCall and
    the low address bits of its arrays).
    """

    lean: list = dataclasses.field(default_factory=list, compare=False, repr=False, kw_only=True)

    def core(self, arrays) -> tuple:
        """``arrays`` in the core's order (``_core_order``) for this call's layout."""
        return _core_order(arrays, self.channel_last)

    def host(self, *arrays) -> tuple:
        """Runs on the host with CPU arrays (JAX or numpy): cupyconv's CPU path, numpy results."""
        inputs = self.core(None if a is None else np.asarray(a) for a in arrays)
        return tuple(np.asarray(r) for r in self.core(self(inputs)))

    def launch(self, ctx, outs, *buffers) -> None:
        """Runs inside XLA's execution with device buffers: wraps them as CuPy arrays (no copy)
        and launches on ``ctx.stream``. Buffers of bfloat16 report ``'<V2'``: dtypes come from
        the traced types. Once a configuration has run, later runs with buffers aligned alike
        replay its launches on the buffers' addresses (``cupyconv/_fast.py``)."""
        if self.lean:
            fast, aligned = self.lean
            ptrs = self.pointers(
                [0 if b is None else b.__cuda_array_interface__["data"][0] for b in buffers],
                [b.__cuda_array_interface__["data"][0] for b in outs],
            )
            if [p & 15 for p in ptrs] == aligned and fast.clear(ptrs):
                if any(fast.outputs):
                    _replay_with_scratch(fast, ptrs, ctx.stream)
                else:  # nothing to allocate: 0 for each absent output
                    fast.replay.run(ptrs + [0] * len(fast.outputs), ctx.stream)
                return
        import cupy

        device = int(outs[0].__dlpack_device__()[1])
        with cupy.cuda.Device(device), _external_stream(cupy, ctx.stream):
            inputs = self.core(
                None if b is None else _cupy_view(cupy, b, t[1], device)
                for b, t in zip(buffers, self.types)
            )
            results = self.core(
                _cupy_view(cupy, b, r.dtype, device) for b, r in zip(outs, self.results())
            )
            self(inputs, results)
            self.learn(inputs, results)

    def pointers(self, inputs: list[int], results: list[int]) -> list[int]:
        """The addresses of the call's input and result buffers (0 for absent ones) in its
        kernels' pointer order: those of the arrays of ``learn``'s lean key."""
        raise NotImplementedError

    def learn(self, inputs, results) -> None:
        """Keep the lean-path replay the call on these CuPy views left behind, if any."""


@dataclasses.dataclass(frozen=True)
class _Forward(_Op):
    """causal_conv1d_fn over (x, weight, bias, seq_idx, initial_states) -> (out, [final])."""

    silu: bool
    final: bool
    types: tuple
    channel_last: bool = False

    def results(self) -> tuple:
        x_shape, dtype = self.types[0]
        batch, dim = (x_shape[0], x_shape[2]) if self.channel_last else x_shape[:2]
        width = self.types[1][0][1]
        final = (batch, width - 1, dim) if self.channel_last else (batch, dim, width - 1)
        shapes = [x_shape, final] if self.final else [x_shape]
        return tuple(jax.ShapeDtypeStruct(s, dtype) for s in shapes)

    def pointers(self, inputs: list[int], results: list[int]) -> list[int]:
        return inputs + results

    def learn(self, inputs, results) -> None:
        out, final = results[0], results[1] if self.final else None
        activation = "silu" if self.silu else None
        key, arrays = _forward_lean_key(
            _fast.Cupy, *inputs, self.final, final, activation, out
        )  # fmt: skip
        fast = _fast.lookup(key)
        if fast is not None and len(arrays) == len(inputs) + len(results):
            aligned = [0 if a is None else a.data.ptr & 15 for a in arrays]
            self.lean[:] = fast, aligned

    def __call__(self, inputs, outs=None) -> tuple:
        x, weight, bias, seq_idx, initial_states = inputs
        out, final = (None, None) if outs is None else (outs[0], outs[1] if self.final else None)
        res = _core_fn(
            x, weight, bias, seq_idx, initial_states, self.final, final,
            "silu" if self.silu else None, out=out,
        )  # fmt: skip
        return tuple(res) if self.final else (res,)


@dataclasses.dataclass(frozen=True)
class _Backward(_Op):
    """causal_conv1d_bwd over (x, weight, bias, dout, seq_idx, initial_states, dfinal_states)
    -> (dx, dweight, [dbias], [dinitial_states])."""

    silu: bool
    types: tuple
    channel_last: bool = False

    def results(self) -> tuple:
        x, weight, bias, _, _, initial_states, _ = self.types
        found = [x, weight]
        if bias is not None:
            found.append(bias)
        if initial_states is not None:
            found.append((initial_states[0], x[1]))  # dtype of x
        return tuple(jax.ShapeDtypeStruct(s, d) for s, d in found)

    def split(self, results, absent=None) -> tuple:
        """(dx, dweight, dbias, dinitial_states) of ``results`` (in the order of
        ``results()``), ``absent`` for the ones the call does not make."""
        _, _, bias, _, _, initial_states, _ = self.types
        found = iter(results)
        dx, dweight = next(found), next(found)
        dbias = absent if bias is None else next(found)
        return dx, dweight, dbias, absent if initial_states is None else next(found)

    def pointers(self, inputs: list[int], results: list[int]) -> list[int]:
        x, weight, bias, dout, seq_idx, initial_states, dfinal = inputs
        return [x, weight, bias, seq_idx, initial_states, dout, dfinal, *self.split(results, 0)]

    def learn(self, inputs, results) -> None:
        x, weight, bias, dout, seq_idx, initial_states, dfinal = inputs
        dx, dweight, dbias, dinit = self.split(results)
        key, arrays = _backward_lean_key(
            _fast.Cupy, x, weight, bias, dout, seq_idx, initial_states, dfinal, dx,
            initial_states is not None, "silu" if self.silu else None, dweight, dbias, dinit,
        )  # fmt: skip
        fast = _fast.lookup(key)
        if fast is not None and len(arrays) == 11:
            aligned = [0 if a is None else a.data.ptr & 15 for a in arrays]
            self.lean[:] = fast, aligned

    def __call__(self, inputs, outs=None) -> tuple:
        x, weight, bias, dout, seq_idx, initial_states, dfinal = inputs
        buffers = {}
        if outs is not None:
            names = ("dx", "dweight_out", "dbias_out", "dinitial_states_out")
            buffers = dict(zip(names, self.split(outs)))
        res = _core_bwd(
            x, weight, bias, dout, seq_idx, initial_states, dfinal,
            return_dinitial_states=initial_states is not None,
            activation="silu" if self.silu else None, **buffers,
        )  # fmt: skip
        return tuple(r for r in res if r is not None)


# ---- choosing the platform ---------------------------------------------------------------------


def _run(op, arrays: tuple) -> tuple:
    """``op``'s results on the platform of ``arrays``: their device when concrete, else the
    platform XLA lowers for."""
    op = _ops.get(op) or remember(_ops, op, op)  # one instance per configuration (see _Op)
    platform = _concrete_platform(arrays)
    if platform == "cpu":
        return _on_cpu(op, *arrays)
    if platform == "gpu":
        if _buffer_callback is None:
            raise _no_buffer_callback()
        return _on_gpu(op, *arrays)
    branches = {"cpu": functools.partial(_on_cpu, op)}
    if _buffer_callback is not None:
        branches["cuda"] = functools.partial(_on_gpu, op)
    return jax.lax.platform_dependent(*arrays, **branches)


def _concrete_platform(arrays) -> str | None:
    """'cpu' or 'gpu' for concrete arrays (checked to be on one device by ``_arrays``); None
    when any is traced."""
    platform = None
    for a in arrays:
        if isinstance(a, jax.core.Tracer):
            return None
        if a is not None and platform is None:
            platform = next(iter(a.devices())).platform
    if platform not in ("cpu", "gpu"):
        raise ValueError(f"cupyconv.jax runs on CPU and CUDA devices; got platform {platform!r}")
    return platform


def _no_buffer_callback() -> NotImplementedError:
    return NotImplementedError(
        "cupyconv.jax on GPU arrays needs jax.experimental.buffer_callback, which this JAX "
        f"({jax.__version__}) does not have; upgrade JAX"
    )


# ---- the two paths --------------------------------------------------------------------------


def _on_cpu(op, *arrays) -> tuple:
    """The float64 reference, through a host callback."""
    return jax.pure_callback(op.host, op.results(), *arrays, vmap_method="sequential")


def _on_gpu(op, *arrays) -> tuple:
    """cupyconv's kernels on XLA's stream, into XLA's buffers."""
    return tuple(_buffer_callback(op.launch, op.results(), vmap_method="sequential")(*arrays))


def _replay_with_scratch(fast, ptrs: list[int], stream: int) -> None:
    """``fast``'s launches on ``ptrs`` with the scratch its plan needs (dweight's partials)
    taken from CuPy's pool on XLA's stream, which orders the memory's reuse after them."""
    import cupy

    with cupy.cuda.Device(fast.device), _external_stream(cupy, stream):
        scratch = [s and cupy.cuda.alloc(_fast.Cupy.nbytes(s)) for s in fast.outputs]
        fast.replay.run(ptrs + [0 if m is None else m.ptr for m in scratch], stream)


def _external_stream(cupy, handle: int):
    """XLA's stream as CuPy's current stream (a context manager)."""
    return cupy.cuda.Stream.from_external(_XlaStream(handle))


class _XlaStream:
    """XLA's stream in the CUDA stream protocol (what ``cupy.cuda.Stream.from_external``
    takes)."""

    __slots__ = ("handle",)

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


def _cupy_view(cupy, buf, dtype, device: int):
    """A CuPy array over device buffer ``buf`` (``__cuda_array_interface__``), no copy."""
    cai = buf.__cuda_array_interface__
    shape = tuple(cai["shape"])
    dtype = np.dtype(dtype)
    memory = cupy.cuda.UnownedMemory(cai["data"][0], math.prod(shape) * dtype.itemsize, buf, device)
    return cupy.ndarray(
        shape, dtype, cupy.cuda.MemoryPointer(memory, 0), strides=cai.get("strides")
    )


# ---- arguments -----------------------------------------------------------------------------------


def _arrays(**named) -> tuple:
    """The arguments as JAX arrays, in the given order, None kept. Numpy arrays go to the device
    of the first concrete JAX array (else JAX's default device). TypeError for anything else;
    ValueError for concrete JAX arrays on different devices."""
    first = None  # (name, device) of the first concrete JAX array
    for name, a in named.items():
        if a is None or isinstance(a, np.ndarray):
            continue
        if not isinstance(a, jax.Array):
            raise TypeError(f"{name} must be a JAX or numpy array; got {type(a).__name__}")
        if isinstance(a, jax.core.Tracer):
            continue
        devices = a.devices()
        if len(devices) != 1:
            raise ValueError(
                f"{name} must live on one device; got a JAX array sharded over {len(devices)}"
            )
        (device,) = devices
        if first is None:
            first = (name, device)
        elif device != first[1]:
            raise ValueError(
                f"all arrays must be on one device; got {first[0]} on {first[1]} and {name} "
                f"on {device}"
            )
    device = None if first is None else first[1]
    return tuple(
        jax.device_put(a, device) if isinstance(a, np.ndarray) else a for a in named.values()
    )


def _stand_ins(arrays, channel_last: bool = False) -> tuple:
    """Data-free numpy arrays of the shapes and dtypes of ``arrays`` (zero strides), on which
    the core's own argument checks (``_ForwardCall``, ``_BackwardCall``) run: the same checks
    and messages as the core, on tracers too (``channel_last``: in the core's order)."""
    return _core_order(
        (None if a is None else np.broadcast_to(np.zeros((), a.dtype), a.shape) for a in arrays),
        channel_last,
    )


def _core_order(arrays, channel_last: bool) -> tuple:
    """``arrays`` (numpy or CuPy, None where absent) as the core takes them: with
    ``channel_last`` each 3-D one ([batch, *, dim]) viewed as [batch, dim, *], no copy (the
    same view turns the core's 3-D results back)."""
    if not channel_last:
        return tuple(arrays)
    return tuple(a.transpose(0, 2, 1) if a is not None and a.ndim == 3 else a for a in arrays)


def _check_channel_last(channel_last, x, weight, bias, **sequences) -> bool:
    """``channel_last`` as a bool. With it, the arrays whose shapes follow x's are checked in
    the terms the caller used (x [batch, seqlen, dim]): weight [dim, width], bias [dim], and
    the 3-D ``sequences`` (by name: dout, initial_states, dfinal_states). The core's checks
    then see the transposed views and find nothing more to say of those shapes (they would
    name them in [batch, dim, seqlen] terms)."""
    if type(channel_last) is not bool:
        raise TypeError(f"channel_last must be a bool; got {type(channel_last).__name__}")
    if not channel_last or x is None or weight is None or x.ndim != 3 or weight.ndim != 2:
        return channel_last  # (the core names what is wrong with x or weight)
    batch, seqlen, dim = x.shape
    width = weight.shape[1]
    # name: (array, its shape, the shape in words, the shape as the message shows it)
    expected = {
        "weight": (weight, (dim, width), "(dim, width) with dim = x.shape[2]", f"({dim}, *)")
    }
    if bias is not None:
        expected["bias"] = (bias, (dim,), "(dim,) with dim = x.shape[2]", (dim,))
    if 1 <= width <= MAX_WIDTH:  # (else the core names the width)
        for name, a in sequences.items():
            if name == "dout":
                expected[name] = (a, x.shape, "(batch, seqlen, dim) of x", x.shape)
            else:
                states = (batch, width - 1, dim)
                expected[name] = (a, states, "(batch, width - 1, dim) from x and weight", states)
    for name, (a, want, described, shown) in expected.items():
        if a is not None and tuple(a.shape) != tuple(want):
            raise ValueError(
                f"{name} must have shape {described} = {shown} (channel_last); got {tuple(a.shape)}"
            )
    return channel_last


def _types(*arrays) -> tuple:
    """((shape, dtype) or None) per array: the static part of a call."""
    return tuple(None if a is None else (tuple(a.shape), np.dtype(a.dtype)) for a in arrays)
