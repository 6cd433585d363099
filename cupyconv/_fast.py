"""The lean host path: a call whose arrays have the layout of an earlier, fully checked call
reuses what that call worked out.

The first GPU call with a given *signature* goes the whole way: describe and check every
argument, plan, allocate, launch. The signature is, for every array argument, its framework,
shape, strides, dtype, device and the low bits of its address (what the checks and the plan
read), with the call's other arguments. The call then leaves a :class:`FastCall` under its
signature: the launches ready to run again (``_launch.Replay``: kernel handles, launch shapes,
parameter buffers), and the shapes, strides and dtypes of the outputs it allocates. A later call
with the same signature reads its arrays' addresses, allocates its outputs, and launches:

- every check of the full path depends on the signature alone, except that a buffer written in
  place must not share memory with an input: for those pairs the fast call compares the byte
  ranges, and where they meet it takes the full path, which decides exactly;
- torch tensors are read through their attributes (about 0.1 us each), their outputs come from
  torch's allocator and the kernels run on torch's current stream; CuPy arrays likewise with
  CuPy's allocator and current stream. Other arrays always take the full path.

Nothing here checks or plans: a missing entry, an attribute that raises (a sparse tensor) or a
range overlap all mean "take the full path".
"""

from __future__ import annotations

import sys

from ._arrays import _torch_stream, remember, strides_like
from ._overlap import byte_span

_calls: dict[tuple, FastCall] = {}
_torch = None  # the torch module, set when a torch FastCall is made


def lookup(key: tuple | None) -> FastCall | None:
    return None if key is None else _calls.get(key)


def store(key: tuple | None, call: FastCall) -> None:
    if key is not None:
        remember(_calls, key, call)


class Torch:
    """torch tensors on the fast path."""

    @staticmethod
    def signature(t):
        if t is None:
            return None
        return (t.shape, t.stride(), t.dtype, t.device, t.is_neg(), t.data_ptr() & 15)

    @staticmethod
    def ptrs(ts) -> list[int]:
        return [0 if t is None else t.data_ptr() for t in ts]

    @staticmethod
    def written(t) -> tuple:
        """What decides whether buffer ``t`` may be written (besides its memory)."""
        return (t.requires_grad, t.is_inference())

    @staticmethod
    def empty(spec, like):
        if spec is LIKE:
            return _torch.empty_like(like)
        shape, strides, dtype, device = spec
        return _torch.empty_strided(shape, strides, dtype=dtype, device=device)

    stream = staticmethod(_torch_stream)


class Cupy:
    """CuPy arrays on the fast path."""

    @staticmethod
    def signature(a):
        if a is None:
            return None
        data = a.data
        return (a.shape, a.strides, a.dtype, data.device_id, data.ptr & 15)

    @staticmethod
    def ptrs(arrays) -> list[int]:
        return [0 if a is None else a.data.ptr for a in arrays]

    @staticmethod
    def written(a) -> tuple:
        return ()

    @staticmethod
    def empty(spec, like):
        import cupy

        shape, strides, dtype = spec  # byte strides
        size = sum((n - 1) * s for n, s in zip(shape, strides)) + dtype.itemsize
        with cupy.cuda.Device(like.data.device_id):
            memory = cupy.cuda.alloc(size)
        return cupy.ndarray(shape, dtype, memory, strides)

    @staticmethod
    def stream(device: int) -> int:
        import cupy

        return cupy.cuda.get_current_stream().ptr


def framework(x):
    """The fast-path framework of array ``x`` (Torch, Cupy), or None."""
    module = type(x).__module__
    if module.startswith("torch"):
        return Torch
    if module.startswith("cupy"):
        return Cupy
    return None


def signature(fw, arrays, *others, written=(), known=()) -> tuple | None:
    """The signature of a call with ``arrays`` (None for absent ones) and the other arguments
    ``others``, and what decides whether the buffers ``written`` (arrays the call writes in
    place) may be written; None where an array's attributes cannot be read this way.
    ``known``: the signatures of the leading arrays, taken before (``signatures``)."""
    sig = fw.signature
    try:
        key = (fw, *others, *known, *[sig(a) for a in arrays[len(known) :]])
        return key + tuple([fw.written(a) for a in written]) if written else key
    except Exception:  # noqa: BLE001 - an array the fast path cannot read: the full path
        return None


def signatures(fw, arrays) -> tuple | None:
    """The signatures of ``arrays``, for ``signature(..., known=)`` of a later call on them
    (a torch autograd backward on the forward's inputs); None where one cannot be read."""
    sig = fw.signature
    try:
        return tuple([sig(a) for a in arrays])
    except Exception:  # noqa: BLE001 - an array the fast path cannot read: the full path
        return None


def may_repeat(fw, *written) -> bool:
    """Whether a call that wrote the buffers ``written`` (``Array``s, None for absent ones) may
    leave a FastCall: not with a torch inference tensor among them, writable only inside
    inference mode, which can change from call to call."""
    return fw is not Torch or not any(a is not None and a.obj.is_inference() for a in written)


def written_guards(first: int, count: int) -> tuple:
    """Guards for ``count`` written buffers at input positions ``first``, ``first + 1``, ...:
    each against every input before it."""
    return tuple((w, o) for w in range(first, first + count) for o in range(w))


LIKE = "like"  # an output spec: the shape, dtype and memory order of the first input


def output_spec(fw, a, like=None) -> tuple | str:
    """What ``fw.empty`` needs to allocate an array like the ``Array`` ``a`` made by the full
    path: (shape, strides, dtype) in the framework's terms (and torch's device), or LIKE when
    that is what the framework's ``empty_like`` of ``like`` (the call's x) gives."""
    if fw is Torch and like is not None and a.shape == like.shape and a.dtype == like.dtype:
        if a.strides == strides_like(like):
            return LIKE
    if fw is Torch:
        return (a.shape, a.strides, a.obj.dtype, a.obj.device)
    return (a.shape, a.native.strides, a.native.dtype)


class FastCall:
    """What a call signature needs per call: ``replay`` (the launches), ``outputs`` (specs of
    the arrays it allocates, None for an output it does not make; their pointers follow the
    inputs'), ``guards`` (pairs of input positions (written, other) whose byte ranges must not
    meet), ``spans`` (each input's byte range relative to its address, None when absent)."""

    __slots__ = ("fw", "device", "replay", "outputs", "guards", "spans")

    def __init__(self, fw, device, replay, outputs, guards=(), spans=()):
        global _torch
        if fw is Torch:
            _torch = sys.modules["torch"]
        self.fw, self.device, self.replay = fw, device, replay
        self.outputs, self.guards, self.spans = outputs, guards, spans

    def __call__(self, inputs: tuple, like) -> tuple | None:
        """Launch on ``inputs`` (the operator's input arrays, in its kernels' pointer order);
        returns the new outputs, or None where a guard failed (take the full path)."""
        fw = self.fw
        ptrs = fw.ptrs(inputs)
        if self.guards and not self.clear(ptrs):
            return None
        empty = fw.empty
        made = tuple([None if s is None else empty(s, like) for s in self.outputs])
        ptrs += fw.ptrs(made)
        self.replay.run(ptrs, fw.stream(self.device))
        return made

    def clear(self, ptrs) -> bool:
        """Whether the guards hold for the inputs at ``ptrs`` (addresses, 0 when absent)."""
        spans = self.spans
        for w, o in self.guards:
            if ptrs[o]:
                lo, hi = spans[w]
                olo, ohi = spans[o]
                if ptrs[w] + lo <= ptrs[o] + ohi and ptrs[o] + olo <= ptrs[w] + hi:
                    return False
        return True


def span(a) -> tuple[int, int]:
    """The first and last byte of ``Array`` a relative to its address (a non-empty view)."""
    lo, hi = byte_span(a)
    return lo - a.ptr, hi - a.ptr
