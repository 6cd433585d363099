"""The lean host path: a call whose arrays have the layout of an earlier, fully checked call
reuses what that call worked out.

The first GPU call with a given layout goes the whole way: describe and check every argument,
plan, allocate, launch. It then leaves a :class:`FastCall` behind: the launches ready to run
again (``_launch.Replay``: kernel handles, launch shapes, parameter buffers), and the shapes,
strides and dtypes of the outputs it allocates. A later call with the same *signature*
allocates its outputs and launches on its arrays' addresses. The signature is, for every array
argument, its framework, shape, strides, dtype, device and the low bits of its address (what
the checks and the plan read; the update's plan reads no address, and its key holds none),
with the call's other arguments:

- CuPy arrays: read from their attributes into the key of a dict of FastCalls;
- torch tensors: the key holds x's shape, the low address bits and the other arguments; the
  rest of the layouts is checked by each FastCall under that key with torch's own layout
  check, one C++ call for all the tensors (``TensorGuards``, what torch.compile's guards
  use: type, dispatch keys (device type, negated and conjugated views, inference tensors),
  dtype, device index, requires_grad, sizes, strides); reading the same through the
  tensors' attributes costs about 0.15 us an attribute, 3.5 us for a decode step's four
  tensors. Where torch lacks it, torch tensors always take the full path.

Every check of the full path depends on the signature alone, except that a buffer written in
place must not share memory with an input: for those pairs the fast call compares the byte
ranges, and where they meet it takes the full path, which decides exactly. Outputs come from
the framework's allocator and the kernels run on its current stream. Other arrays always take
the full path. torch autograd's calls, which write no buffer of the caller's, take
``run_torch``: the same lookup and launch with ``signature``'s key built inline.

Nothing here checks or plans: a missing entry, an attribute that raises (a sparse tensor) or a
range overlap all mean "take the full path".
"""

from __future__ import annotations

import sys

from ._arrays import current_stream_reader, remember, strides_like
from ._overlap import byte_span

_calls: dict[tuple, FastCall | tuple] = {}  # by key: a FastCall, or torch's candidates
_torch = None  # the torch module, set when a torch FastCall is made
TORCH_CANDIDATES = 8  # most torch FastCalls under one key (the newest first)


def lookup(sig: tuple | None) -> FastCall | None:
    """The FastCall of a call with signature ``sig`` (``signature``), if one was left."""
    if sig is None:
        return None
    found = _calls.get(sig[0])
    if found is None or sig[2] is None:  # (CuPy: the key holds every layout)
        return found
    for fast in found:  # torch: the candidate whose tensors' layouts these are
        if fast.layout.check(*sig[2]):
            return fast
    return None


def run(sig: tuple | None, like) -> tuple | None:
    """Launch a call with signature ``sig`` (``signature``; ``like``: the call's x) on the
    FastCall left for it: its new outputs (their addresses appended to the signature's). None
    where none was left or a guard failed: take the full path. ``lookup`` and the launch in
    one frame: each call layer costs a decode step 0.2-0.3 us."""
    if sig is None:
        return None
    key, ptrs, tensors = sig
    found = _calls.get(key)
    if found is None:
        return None
    if tensors is None:  # CuPy: the key holds every layout
        fast = found
    else:  # torch: the candidate whose tensors' layouts these are
        for fast in found:
            if fast.layout.check(*tensors):
                break
        else:
            return None
    for w, o, lo, hi in fast.checks:  # = fast.clear(ptrs)
        if ptrs[o] and lo <= ptrs[o] - ptrs[w] <= hi:
            return None
    if fast.like:
        made = (_torch.empty_like(like),)
        ptrs.append(made[0].data_ptr())
    else:
        made = fast.made(like, ptrs)
    fast.replay.run(ptrs, fast.stream(fast.device))
    return made


def run_torch(arrays: tuple, others: tuple, like) -> list | None:
    """``run(signature(Torch, arrays, *others), like)`` for torch tensors that the call does
    not write, without those functions' layers (the key, the candidates' check and the outputs
    inline): the new outputs as a list, None where the call takes the full path. (torch
    autograd's training step runs a forward and a backward through here; each frame and each
    object the pair touches costs it on the host.)"""
    try:  # = Torch.signature(arrays, others, ())
        ptrs, low = _addresses(arrays)
        found = _calls.get((Torch, *others, like.shape, low))
    except Exception:  # noqa: BLE001 - a tensor the fast path cannot read: the full path
        return None
    if found is None:
        return None
    tensors = [t for t in arrays if t is not None]
    for fast in found:  # (no written buffer, so no overlap guard)
        if fast.layout.check(*tensors):
            break
    else:
        return None
    made = []
    for spec in fast.outputs:  # = fast.made(like, ptrs)
        if spec is None:
            made.append(None)
            ptrs.append(0)
        else:
            t = (
                _torch.empty_like(like) if spec is LIKE
                else _torch.empty_strided(spec[0], spec[1], dtype=spec[2], device=spec[3])
            )  # fmt: skip
            made.append(t)
            ptrs.append(t.data_ptr())
    fast.replay.run(ptrs, fast.stream(fast.device))
    return made


def store(sig: tuple | None, call: FastCall) -> None:
    """Leave ``call`` under signature ``sig`` (torch: where its layout check can be made)."""
    if sig is None:
        return
    key, _, tensors = sig
    if tensors is not None:
        call.layout = Torch.layout_check(tensors)
        if call.layout is None:
            return
        call = (call, *_calls.get(key, ())[: TORCH_CANDIDATES - 1])
    remember(_calls, key, call)


class Torch:
    """torch tensors on the fast path."""

    @staticmethod
    def signature(arrays, others: tuple, written) -> tuple:
        """``signature`` of torch tensors: the key holds x's shape (what tells a call's
        candidates apart: batch and sequence lengths vary, weights stay), which arrays are
        present with their address bits and, for each written buffer, whether it is an
        inference tensor (writable only inside inference mode, which the layout check does
        not tell apart); the present tensors follow, for the layout check."""
        ptrs, low = _addresses(arrays)
        key = (Torch, *others, arrays[0].shape, low, *[t.is_inference() for t in written])
        return key, ptrs, tuple([t for t in arrays if t is not None])

    @staticmethod
    def layout_check(tensors):
        """torch's layout check of ``tensors`` (``TensorGuards``): ``check(*others)`` is true
        where ``others`` have the same types, dispatch keys, dtypes, devices, requires_grad,
        sizes and strides, under the same thread-local dispatch state, and no tensor comes
        twice. None where torch has none that checks these very tensors true."""
        global _guards
        if _guards is None:
            try:
                from torch._C._dynamo.guards import TensorGuards as _guards
            except ImportError:
                _guards = False
        if not _guards:
            return None
        try:
            guard = _guards(*tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None)
            return guard if guard.check(*tensors) else None
        except Exception:  # noqa: BLE001 - another torch's signature: the full path always
            return None

    @staticmethod
    def ptrs(ts) -> list[int]:
        return [0 if t is None else t.data_ptr() for t in ts]

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


_guards = None  # torch's TensorGuards class, imported with the first torch FastCall (False: none)


def _addresses(tensors) -> tuple[list[int], int]:
    """The tensors' addresses (0 for None) and the signature's bits of them: 5 a tensor,
    whether present and the address's low 4 bits (what the plans read of it)."""
    ptrs, low = [], 0
    for t in tensors:
        if t is None:
            ptrs.append(0)
            low <<= 5
        else:
            p = t.data_ptr()
            ptrs.append(p)
            low = low << 5 | 16 | p & 15
    return ptrs, low


class Cupy:
    """CuPy arrays on the fast path."""

    @staticmethod
    def signature(arrays, others: tuple, written) -> tuple:
        """``signature`` of CuPy arrays: every layout in the key."""
        key, ptrs, low = [Cupy, *others], [], 0
        for a in arrays:
            if a is None:
                key.append(None)
                ptrs.append(0)
            else:
                data = a.data
                key += (a.shape, a.strides, a.dtype, data.device_id)
                ptrs.append(data.ptr)
                low = low << 4 | data.ptr & 15
        key.append(low)
        return tuple(key), ptrs, None

    @staticmethod
    def ptrs(arrays) -> list[int]:
        return [0 if a is None else a.data.ptr for a in arrays]

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


def signature(fw, arrays, *others, written=()) -> tuple | None:
    """(key, addresses, tensors) of a call with ``arrays`` (x first; None for absent ones) and
    the other arguments ``others``, ``written`` the arrays it writes in place: the key of its
    FastCalls, the arrays' addresses (0 for absent ones) for the launch, and for torch the
    tensors its FastCall's layout check takes (None for CuPy, whose key holds the layouts).
    None where an array's attributes cannot be read this way."""
    try:
        return fw.signature(arrays, others, written)
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
    meet), ``spans`` (each input's byte range relative to its address, None when absent).
    ``store`` gives a torch FastCall its ``layout`` check; ``run`` launches it."""

    __slots__ = ("fw", "device", "replay", "outputs", "checks", "stream", "like", "layout")

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
        self.layout = None  # torch: the layout check of the tensors it was made for (store)

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
