"""The lean host path: a call whose arrays have the layout of an earlier, fully checked call
reuses what that call worked out.

The first GPU call with a given *signature* goes the whole way: describe and check every
argument, plan, allocate, launch. The signature is, for every array argument, its framework,
shape, strides, dtype, device and the low bits of its address (what the checks and the plan
read), with the call's other arguments; it is read in one pass with the arrays' addresses. The
call then leaves a :class:`FastCall` under its signature: the launches ready to run again
(``_launch.Replay``: kernel handles, launch shapes, parameter buffers), and the shapes, strides
and dtypes of the outputs it allocates. A later call with the same signature allocates its
outputs and launches on the addresses:

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

from ._arrays import current_stream_reader, remember, strides_like
from ._overlap import byte_span

_calls: dict[tuple, FastCall] = {}
_torch = None  # the torch module, set when a torch FastCall is made


def lookup(sig: tuple | None) -> FastCall | None:
    """The FastCall of a call with signature ``sig`` (``signature``), if one was left."""
    return None if sig is None else _calls.get(sig[0])


def store(sig: tuple | None, call: FastCall) -> None:
    if sig is not None:
        remember(_calls, sig[0], call)


class Torch:
    """torch tensors on the fast path."""

    @staticmethod
    def describe(arrays, key: list, ptrs: list) -> None:
        """Append the layout of each of ``arrays`` to ``key`` and its address to ``ptrs``
        (None and 0 for an absent one)."""
        for t in arrays:
            if t is None:
                key.append(None)
                ptrs.append(0)
            else:
                key += (t.shape, t.stride(), t.dtype, t.device, t.is_neg())
                ptrs.append(t.data_ptr())

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

    @staticmethod
    def stream_reader():
        """A function of the device giving the current stream's raw handle."""
        return current_stream_reader()


class Cupy:
    """CuPy arrays on the fast path."""

    @staticmethod
    def describe(arrays, key: list, ptrs: list) -> None:
        for a in arrays:
            if a is None:
                key.append(None)
                ptrs.append(0)
            else:
                data = a.data
                key += (a.shape, a.strides, a.dtype, data.device_id)
                ptrs.append(data.ptr)

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
        with cupy.cuda.Device(like.data.device_id):
            memory = cupy.cuda.alloc(Cupy.nbytes(spec))
        return cupy.ndarray(shape, dtype, memory, strides)

    @staticmethod
    def nbytes(spec) -> int:
        """The bytes an array of output spec ``spec`` spans."""
        shape, strides, dtype = spec
        return sum((n - 1) * s for n, s in zip(shape, strides)) + dtype.itemsize

    @staticmethod
    def stream_reader():
        import cupy

        get = cupy.cuda.get_current_stream
        return lambda device: get().ptr


def framework(x):
    """The fast-path framework of array ``x`` (Torch, Cupy), or None."""
    fw = _frameworks.get(type(x), _UNKNOWN)
    if fw is _UNKNOWN:
        module = type(x).__module__
        fw = Torch if module.startswith("torch") else Cupy if module.startswith("cupy") else None
        _frameworks[type(x)] = fw
    return fw


_frameworks: dict[type, type | None] = {}
_UNKNOWN = object()


def signature(fw, arrays, *others, written=(), known=None) -> tuple | None:
    """(key, addresses) of a call with ``arrays`` (None for absent ones) and the other
    arguments ``others``: the key holds their layouts, the low four bits of their addresses,
    the other arguments and what decides whether the buffers ``written`` (arrays the call
    writes in place) may be written; the addresses are the arrays' (0 for absent ones), for
    the launch. None where an array's attributes cannot be read this way. ``known``: the
    layouts of the leading arrays, taken before (``signatures``); their addresses are read
    again."""
    key, ptrs = [fw, *others], []
    try:
        if known is not None:
            layouts, count = known
            key += layouts
            ptrs = fw.ptrs(arrays[:count])
            arrays = arrays[count:]
        fw.describe(arrays, key, ptrs)
        low = 0
        for p in ptrs:
            low = low << 4 | p & 15
        key.append(low)
        for a in written:
            key += fw.written(a)
    except Exception:  # noqa: BLE001 - an array the fast path cannot read: the full path
        return None
    return tuple(key), ptrs


def known_of(sig: tuple | None, others: int, count: int) -> tuple | None:
    """The layouts of the ``count`` arrays of signature ``sig`` (of a call on exactly those
    arrays, with ``others`` other arguments and no buffer written) and their number, for
    ``signature(..., known=)`` of a later call on them (a torch autograd backward on the
    forward's inputs): read once for both calls. None where ``sig`` is None."""
    return None if sig is None else (list(sig[0][1 + others : -1]), count)


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

    __slots__ = ("fw", "device", "replay", "outputs", "checks", "stream", "like")

    def __init__(self, fw, device, replay, outputs, guards=(), spans=()):
        global _torch
        if fw is Torch:
            _torch = sys.modules["torch"]
        self.fw, self.device, self.replay, self.outputs = fw, device, replay, outputs
        # (written, other, lo, hi) of every guard between arrays the signature has (an absent
        # one stays absent under the same signature): the ranges meet where lo <= other -
        # written <= hi (the addresses' difference)
        self.checks = tuple(
            (w, o, spans[w][0] - spans[o][1], spans[w][1] - spans[o][0])
            for w, o in guards
            if spans[w] and spans[o]
        )
        self.stream = fw.stream_reader()
        self.like = fw is Torch and outputs == (LIKE,)  # one output: torch.empty_like(x)

    def __call__(self, ptrs: list[int], like) -> tuple | None:
        """Launch on the inputs at ``ptrs`` (the operator's input arrays' addresses, in its
        kernels' pointer order, from ``signature``; the outputs' are appended); ``like``: the
        call's x. Returns the new outputs, or None where a guard failed (take the full
        path). Written out in one frame: each call layer costs a decode step 0.2-0.3 us."""
        for w, o, lo, hi in self.checks:  # = self.clear(ptrs)
            if ptrs[o] and lo <= ptrs[o] - ptrs[w] <= hi:
                return None
        if self.like:
            made = (_torch.empty_like(like),)
            ptrs.append(made[0].data_ptr())
        else:
            made = self.made(like, ptrs)
        self.replay.run(ptrs, self.stream(self.device))
        return made

    def clear(self, ptrs) -> bool:
        """Whether the guards hold for the inputs at ``ptrs`` (addresses, 0 when absent)."""
        for w, o, lo, hi in self.checks:
            if ptrs[o] and lo <= ptrs[o] - ptrs[w] <= hi:
                return False
        return True

    def made(self, like, ptrs: list[int]) -> tuple:
        """The outputs, allocated (None for one the call does not make); their addresses are
        appended to ``ptrs``."""
        fw = self.fw
        made = tuple([None if s is None else fw.empty(s, like) for s in self.outputs])
        ptrs += fw.ptrs(made)
        return made


def span(a) -> tuple[int, int]:
    """The first and last byte of ``Array`` a relative to its address (a non-empty view)."""
    lo, hi = byte_span(a)
    return lo - a.ptr, hi - a.ptr
