"""Launching a planned kernel: the launch description every operator's plan returns, the packed
parameter block, the launch on a stream through the driver API, and the occupancy query.

Operator-agnostic: a :class:`Launch` carries its own source, so nothing here names a kernel.
"""

from __future__ import annotations

import struct
import threading
from dataclasses import dataclass

import numpy as np

from ._arrays import remember
from ._compile import DTYPE_CODES, Source, get_kernel, get_raw_kernel, is_loaded, prelude

MAX_GRID = 2**31 - 1  # most blocks along x
# The least opt-in dynamic shared memory a block of the supported devices may have (sm_86,
# sm_89: 99 KiB; sm_80 163 KiB, sm_90 227 KiB): instances that need more have a fallback.
LEAST_SMEM_LIMIT = 101376


@dataclass(frozen=True)
class Launch:
    """One kernel launch as a plan decides it: template instance ``name`` of ``source``,
    ``grid`` blocks of ``block`` = (x, y) threads with ``smem`` bytes of dynamic shared memory,
    and ``plan_fields``: the values of the parameter fields the plan sets, which follow the
    call's own fields in the kernel's parameter struct. ``pdl``: launched as a programmatic
    dependent launch where the device takes it (sm_90; ``_pdl``): the kernel may be scheduled
    while the kernel before it finishes, and begins with ``wait_for_previous_kernel()``
    (kernels/common.cuh)."""

    source: Source
    name: str
    grid: int
    block: tuple[int, int]
    smem: int = 0
    plan_fields: tuple[int, ...] = ()
    pdl: bool = False


class Kernel:
    """A kernel template of an operator: its source file, its parameter struct, the fields of
    that struct its plan sets (after the operator's own fields), and whether its launches are
    programmatic dependent launches (``Launch.pdl``). ``source`` (the file with the operator's
    prelude) is set by :func:`bind_sources`."""

    __slots__ = ("template", "file", "params", "plan_fields", "pdl", "source")

    def __init__(
        self, template: str, file: str, params: str, plan_fields: tuple[str, ...] = (),
        pdl: bool = False,
    ):  # fmt: skip
        self.template, self.file, self.params = template, file, params
        self.plan_fields, self.pdl, self.source = plan_fields, pdl, None

    def __repr__(self) -> str:
        return f"Kernel({self.template!r})"

    def launch(self, name: str, grid: int, block: tuple[int, int], smem: int = 0, **fields):
        """A Launch of instance ``name``, with the plan fields given by name."""
        if set(fields) != set(self.plan_fields):
            raise TypeError(f"{self.template} takes {self.plan_fields}; got {tuple(fields)}")
        values = tuple(int(fields[f]) for f in self.plan_fields)
        return Launch(self.source, name, grid, block, smem, values, self.pdl)


def bind_sources(kernels, origin: str, constants: dict[str, int], fields: tuple[str, ...]):
    """Give every kernel of an operator its Source: its file after the operator's prelude
    (``constants``, and one parameter struct per kernel: ``fields`` then its plan fields).
    Returns the sources by file name."""
    text = prelude(origin, constants, {k.params: fields + k.plan_fields for k in kernels})
    sources: dict[str, Source] = {}
    for k in kernels:
        k.source = sources.setdefault(k.file, Source(k.file, text))
    return sources


def dtype_code(a) -> int:
    """The dtype code of an optional array description (0 when absent)."""
    return 0 if a is None else DTYPE_CODES[a.dtype_name]


class ParamBlock:
    """Kernel parameters as cuLaunchKernel takes them in its ``extra`` argument: one buffer laid
    out as the kernels declare their parameters (8-byte pointers, then the 8-byte fields of the
    parameter struct: no padding anywhere). ``words`` holds, as int64, the ``extra`` list
    [BUFFER_POINTER, &words[6], BUFFER_SIZE, &words[5], END], the buffer's size, then the
    buffer; ``extra`` is its address. Never written after it is built, so launches from any
    thread may share it."""

    __slots__ = ("words", "extra")
    HEADER = 6
    BUFFER_POINTER, BUFFER_SIZE, END = 1, 2, 0  # CU_LAUNCH_PARAM_* of the CUDA driver API

    def __init__(self, values: tuple[int, ...], writable: bool = False):
        words = np.empty(self.HEADER + len(values), np.int64)
        addr = words.ctypes.data
        buffer, size = addr + 8 * self.HEADER, addr + 8 * (self.HEADER - 1)
        words[: self.HEADER] = (
            self.BUFFER_POINTER, buffer, self.BUFFER_SIZE, size, self.END, 8 * len(values)
        )  # fmt: skip
        words[self.HEADER :] = values
        words.flags.writeable = writable
        self.words, self.extra = words, addr

    @property
    def values(self) -> tuple[int, ...]:
        """The packed parameters, in order."""
        return tuple(int(v) for v in self.words[self.HEADER :])


_blocks: dict[tuple, ParamBlock] = {}


def pack(values: tuple[int, ...]) -> ParamBlock:
    """The parameter block of ``values`` (pointers, then struct fields); memoised per value."""
    block = _blocks.get(values)
    if block is None:
        block = remember(_blocks, values, ParamBlock(values))
    return block


_CUDA_ERROR_INVALID_CONTEXT = 201


def launch(plan: Launch, device: int, params: ParamBlock, stream) -> None:
    """Launch ``plan`` with ``params`` on ``stream`` (an object with ``.ptr``, or None for
    CuPy's current stream) through the driver API."""
    cupy = _cupy or _load_cupy()
    stream_ptr = (stream or cupy.cuda.get_current_stream()).ptr
    function = loaded_kernel(plan, device, stream_ptr)
    pdl = (
        PdlLaunch(function, plan.grid, plan.block, plan.smem) if plan.pdl and _pdl(device) else None
    )
    args = (function, plan.grid, plan.block, plan.smem, stream_ptr, params.extra, device, pdl)
    if cupy.cuda.runtime.getDevice() == device:
        _launch(cupy, *args)
    else:
        with cupy.cuda.Device(device):
            _launch(cupy, *args)


def loaded_kernel(plan: Launch, device: int, stream_ptr: int) -> int:
    """The handle of ``plan``'s kernel on ``device``, compiled and loaded first if need be;
    refused while ``stream_ptr`` is capturing a CUDA graph (loading a module there would break
    the capture)."""
    if not is_loaded(plan.source, plan.name, device):
        import cupy

        if cupy.cuda.runtime.streamIsCapturing(stream_ptr):
            raise RuntimeError(
                f"cupyconv kernel {plan.name} is not compiled yet and the stream is capturing a "
                "CUDA graph, where it cannot be compiled or loaded; call cupyconv.warmup(...) "
                "with the same arguments (or run the call once) before the capture"
            )
    return get_kernel(plan.source, plan.name, device).ptr


def _launch(
    cupy, function: int, grid, block, smem, stream: int, extra: int, device: int, pdl=None
) -> None:
    """One launch through the driver API: CuPy's cuLaunchKernel, or ``pdl`` (the same launch as
    a ``PdlLaunch``)."""
    driver = cupy.cuda.driver
    bx, by = block
    for attempt in range(2):
        try:
            if pdl is None:
                return driver.launchKernel(function, grid, 1, 1, bx, by, 1, smem, stream, 0, extra)
            return pdl(stream, extra)
        except driver.CUDADriverError as e:
            if e.status != _CUDA_ERROR_INVALID_CONTEXT or attempt:
                raise
            # A thread that has not used CUDA yet has no current context: make the device's
            # primary context (where the kernel was loaded) current, and launch again.
            cupy.cuda.runtime.setDevice(device)


# ---- programmatic dependent launch (PDL) -----------------------------------------------------

_pdl_devices: dict[int, bool] = {}
_bindings = None  # cuda.bindings.driver, imported with the first device that takes PDL


def _pdl(device: int) -> bool:
    """Whether launches on ``device`` whose plan asks for it are programmatic dependent launches:
    compute capability 9.0 or newer, a driver of CUDA 12.3 or newer (which captures them into
    CUDA graphs), and cuda.bindings (cuLaunchKernelEx, which CuPy does not have) importable.
    Elsewhere they launch as any other kernel (its wait is then a no-op)."""
    found = _pdl_devices.get(device)
    if found is None:
        global _bindings
        import cupy

        found = (
            int(cupy.cuda.Device(device).compute_capability) >= 90
            and cupy.cuda.runtime.driverGetVersion() >= 12030
        )
        if found:
            try:
                from cuda.bindings import driver
            except ImportError:
                found = False
            else:
                _bindings = driver
        _pdl_devices[device] = found
    return found


class PdlLaunch:
    """A kernel's launch as a programmatic dependent launch: cuda.bindings' cuLaunchKernelEx of
    ``function`` (a loaded kernel's handle) on ``grid`` x ``block`` threads with ``smem`` bytes
    of dynamic shared memory and the programmatic stream serialization attribute. Its
    configuration is built once; its stream is set when it changes. One thread's (a Replay
    keeps one a thread)."""

    __slots__ = ("config", "function", "stream")

    def __init__(self, function: int, grid: int, block: tuple[int, int], smem: int):
        b = _bindings
        config = b.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = grid, 1, 1
        config.blockDimX, config.blockDimY, config.blockDimZ = *block, 1
        config.sharedMemBytes = smem
        attribute = b.CUlaunchAttribute()
        attribute.id = b.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attribute.value.programmaticStreamSerializationAllowed = 1
        config.attrs, config.numAttrs = [attribute], 1
        self.config, self.function, self.stream = config, b.CUfunction(function), None

    def __call__(self, stream: int, extra: int) -> None:
        """Launch on ``stream`` with the parameters at ``extra``; a driver error raises as
        CuPy's would. (``Replay.run`` has this inline.)"""
        if stream != self.stream:
            self.set_stream(stream)
        (err,) = _bindings.cuLaunchKernelEx(self.config, self.function, None, extra)
        if err:
            raise _DriverError(int(err))

    def set_stream(self, stream: int) -> None:
        self.config.hStream, self.stream = _bindings.CUstream(stream), stream


class Replay:
    """The launches of one call, ready to run again with other arrays of the same layout: the
    kernel handles, the launch shapes, and a parameter buffer per launch of which only the
    leading ``n_pointers`` words (the arrays' addresses, the same for every launch of an
    operator) change from call to call. Built from a call that was checked in full; what it
    skips on later calls is what depended only on the layout (``cupyconv/_fast.py``).

    The kernels take their parameters when they are launched (cuLaunchKernel copies them), so
    one buffer serves every call of a thread; each thread has its own (``_Steps``).
    """

    __slots__ = ("device", "pack", "local")

    def __init__(self, launches, device: int, n_pointers: int, stream_ptr: int):
        """``launches``: (Launch, ParamBlock) pairs of the call, in order."""
        self.device, self.pack = device, struct.Struct(f"<{n_pointers}q").pack_into
        _cupy or _load_cupy()  # what run() calls
        steps = tuple(
            (loaded_kernel(plan, device, stream_ptr), plan.grid, *plan.block, plan.smem,
             plan.pdl and _pdl(device), params.values)
            for plan, params in launches
        )  # fmt: skip
        self.local = _Steps(steps)

    def run(self, pointers, stream_ptr: int) -> None:
        """Launch every kernel on ``stream_ptr`` with the arrays at ``pointers``."""
        if _get_device() != self.device:
            with _cupy.cuda.Device(self.device):
                return self.run(pointers, stream_ptr)
        pack = self.pack
        for function, grid, bx, by, smem, pdl, words, extra in self.local.steps:
            pack(words, _POINTERS_AT, *pointers)
            try:
                if pdl is None:
                    _launch_kernel(function, grid, 1, 1, bx, by, 1, smem, stream_ptr, 0, extra)
                else:  # PdlLaunch.__call__ inline: a decode step pays each Python frame
                    if stream_ptr != pdl.stream:
                        pdl.set_stream(stream_ptr)
                    (err,) = _bindings.cuLaunchKernelEx(pdl.config, pdl.function, None, extra)
                    if err:
                        raise _DriverError(int(err))
            except _DriverError:  # a thread without a current context: _launch retries
                _launch(_cupy, function, grid, (bx, by), smem, stream_ptr, extra, self.device, pdl)


_POINTERS_AT = 8 * ParamBlock.HEADER  # the byte offset of the pointers in a ParamBlock's words


class _Steps(threading.local):
    """A Replay's launches with this thread's parameter buffers (and PDL launch configurations,
    whose stream is set per launch): built again, from the same launches, in each thread that
    runs it (``threading.local`` calls ``__init__`` there)."""

    def __init__(self, steps):
        self.steps = tuple(
            (function, grid, bx, by, smem, PdlLaunch(function, grid, (bx, by), smem) if pdl
             else None, block.words, block.extra)
            for function, grid, bx, by, smem, pdl, values in steps
            for block in (ParamBlock(values, writable=True),)
        )  # fmt: skip


_cupy = None  # the cupy module, imported with the first launch
_get_device = _launch_kernel = _DriverError = None  # its functions a Replay calls per launch


def _load_cupy():
    global _cupy, _get_device, _launch_kernel, _DriverError
    import cupy

    _get_device = cupy.cuda.runtime.getDevice
    _launch_kernel, _DriverError = cupy.cuda.driver.launchKernel, cupy.cuda.driver.CUDADriverError
    _cupy = cupy
    return cupy


# ---- occupancy: how many blocks of a kernel the device holds at once ------------------------

_resident: dict[tuple, int] = {}
_dynamic_smem: dict[tuple, int] = {}  # the dynamic shared memory each kernel is allowed
_carveout: dict[tuple, int] = {}  # the shared-memory carveout each kernel asks for, in percent


def resident_blocks(device: int, source: Source, name: str, threads: int, smem: int) -> int:
    """Blocks of ``threads`` threads and ``smem`` bytes of dynamic shared memory of kernel
    ``name`` that fit on the whole device at once (the grid of a grid-stride kernel that runs
    in one wave), counting the kernel's static shared memory too. A kernel with shared memory
    asks for the dynamic size it needs and for the least carveout (the part of the SM's L1 that
    is shared memory) that holds those blocks, the rest staying L1 cache."""
    key = (device, source.file, name, threads, smem)
    blocks = _resident.get(key)
    if blocks is None:
        from cupy.cuda import runtime as rt

        raw = get_raw_kernel(source, name, device)
        # The limits are the kernel's, not the launch's: they only ever grow, or a launch planned
        # earlier with more shared memory than a later one would be refused by the driver (or,
        # for the carveout, run fewer blocks at once).
        kernel = (device, source.file, name)
        allowed = _dynamic_smem.get(kernel, 48 * 1024)
        if smem > allowed:
            raw.max_dynamic_shared_size_bytes = smem
            _dynamic_smem[kernel] = smem

        def attr(a):
            return rt.deviceGetAttribute(a, device)

        warps = -(-threads // 32)
        regs_per_warp = -(-raw.num_regs * 32 // 256) * 256  # allocated per warp, 256 at a time
        block_smem = smem + raw.shared_size_bytes + attr(rt.cudaDevAttrReservedSharedMemoryPerBlock)
        sm_smem = attr(rt.cudaDevAttrMaxSharedMemoryPerMultiprocessor)
        per_sm = min(
            attr(rt.cudaDevAttrMaxRegistersPerMultiprocessor) // regs_per_warp // warps,
            sm_smem // block_smem,
            attr(rt.cudaDevAttrMaxThreadsPerMultiProcessor) // (warps * 32),
            attr(rt.cudaDevAttrMaxBlocksPerMultiprocessor),
        )
        if smem or raw.shared_size_bytes:  # (the driver rounds up to a size the SM has)
            carveout = min(100, -(-100 * max(1, per_sm) * block_smem // sm_smem))
            if carveout > _carveout.get(kernel, 0):
                raw.preferred_shared_memory_carveout = _carveout[kernel] = carveout
        blocks = _resident[key] = max(1, per_sm) * multiprocessors(device)
    return blocks


def blocks_fit(device: int, smem: int, blocks: int) -> bool:
    """Whether ``blocks`` blocks of ``smem`` bytes of dynamic shared memory each fit on one SM of
    ``device`` at once (with the shared memory the driver reserves per block)."""
    sm = _sm_smem.get(device)
    if sm is None:
        from cupy.cuda import runtime as rt

        sm = _sm_smem[device] = tuple(
            rt.deviceGetAttribute(a, device)
            for a in (
                rt.cudaDevAttrMaxSharedMemoryPerMultiprocessor,
                rt.cudaDevAttrReservedSharedMemoryPerBlock,
            )
        )
    total, reserved = sm
    return smem <= shared_memory_limit(device) and blocks * (smem + reserved) <= total


_sm_smem: dict[int, tuple[int, int]] = {}
_smem_limit: dict[int, int] = {}


def shared_memory_limit(device: int) -> int:
    """The most dynamic shared memory one block of a kernel without static shared memory can
    be launched with on ``device`` (the opt-in limit: 227 KiB on sm_90, 163 KiB on sm_80,
    99 KiB on sm_86 and sm_89); a plan that needs more takes a variant that needs less."""
    limit = _smem_limit.get(device)
    if limit is None:
        from cupy.cuda import runtime as rt

        limit = _smem_limit[device] = rt.deviceGetAttribute(
            rt.cudaDevAttrMaxSharedMemoryPerBlockOptin, device
        )
    return limit


_sm_count: dict[int, int] = {}


def multiprocessors(device: int) -> int:
    """The SMs of ``device``."""
    count = _sm_count.get(device)
    if count is None:
        from cupy.cuda import runtime as rt

        count = _sm_count[device] = rt.deviceGetAttribute(rt.cudaDevAttrMultiProcessorCount, device)
    return count


def acc_bytes(itemsize: int) -> int:
    """Bytes of the accumulation type of x's dtype (double for float64, else float)."""
    return 8 if itemsize == 8 else 4


def piece_spans(seqlen: int, step: int, longest: int, shortest: int) -> list[int]:
    """The spans a channel-contiguous kernel may cut rows into: ``longest`` positions (the row,
    where shorter), then half, a quarter .. down to ``shortest``, each a multiple of ``step``."""
    spans = [min(longest, -(-seqlen // step) * step)]
    while spans[-1] > shortest:
        spans.append(max(shortest, spans[-1] // 2 // step * step))
    return spans


def even_spans(seqlen: int, step: int, longest: int, shortest: int) -> list[int]:
    """The spans that cut rows of ``seqlen`` into 1, 2, 3 .. pieces of about equal length (each
    ceil(seqlen / n) rounded up to a multiple of ``step``), from ``longest`` down to
    ``shortest``, longest first; rows shorter than ``shortest`` take one piece."""
    spans: list[int] = []
    n = max(1, -(-seqlen // longest))
    while True:
        piece = -(-seqlen // n)
        span = -(-piece // step) * step
        if span < shortest and spans:
            return spans
        spans.append(span)
        if span <= shortest:
            return spans
        n = max(n + 1, -(-seqlen // (span - step)))  # the fewest pieces of a shorter span


def waves(items: int, resident: int, fill: float) -> float:
    """The waves of a persistent grid of ``resident`` blocks over ``items`` items of one length,
    a last partial wave counted at least ``fill`` of a full one."""
    full, rest = divmod(items, resident)
    return full + (max(rest / resident, fill) if rest else 0)


def mma_steps(width: int) -> int:
    """KS of the tensor-core kernels (fwd_mma, bwd_mma, bwd_mma_block; ``ToeplitzTaps`` in
    kernels/mma_common.cuh) for filters of ``width`` >= 2: k-steps of 16 window inputs, with
    D = 16 (KS - 1) >= width - 1 inputs before a block's first output."""
    return -(-(width - 1) // 16) + 1


def fast_divisor(d: int) -> int:
    """The divisor d (>= 1) as divmod_fast in kernels/common.cuh takes it: m | k << 32 such that
    a // d == a * m >> k for every 0 <= a < 2**31 (m = ceil(2**k / d) with k = 31 + ceil(log2 d):
    m d - 2**k < d <= 2**(k - 31), which makes the quotient exact; Granlund and Montgomery,
    "Division by invariant integers using multiplication", 1994). 0 for d >= 2**31, where every
    such a // d is 0."""
    if d >= 2**31:
        return 0
    k = 31 + (d - 1).bit_length()
    return -(-(1 << k) // d) | k << 32
