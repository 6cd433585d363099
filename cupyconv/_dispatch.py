"""The dispatch table, the typed argument builder and the launcher of the forward kernels.

Layer between the validated public functions (``ops.py``) and the device code
(``kernels/fwd.cu``): everything here works on ``Array`` descriptions (pointers, shapes, element
strides), never on framework objects.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ._arrays import Array, remember
from ._compile import get_kernel, get_raw_kernel

C_TYPES = {
    "float32": "float",
    "float16": "__half",
    "bfloat16": "__nv_bfloat16",
    "float64": "double",
}
# Same codes as `enum DtypeCode` in kernels/common.cuh.
DTYPE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2, "float64": 3, "int32": 4, "int64": 5}
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}

TC_MAX = 17  # fwd_tc<T, K, SEQ, ...> up to this width; wider time-contiguous input: fwd_mma
MMA_MAX = 129  # fwd_mma<T, KS> (16-bit x, tensor cores) up to this width; wider: fwd_wide
MMA_SPAN = 1024  # fwd_mma: outputs per tile (NB in fwd.cu)
CL_MAX = 8  # fwd_cl<T, K, SEQ, ...> up to this width; wider channel-contiguous input: general
TC_VECTORS = (2, 8)  # fwd_tc: 16-byte vectors per lane (NV) on rows up to TC_SHORT_ROW bytes,
TC_SHORT_ROW = 1024  # and on longer rows
CL_STEPS = {2: 16, 4: 16, 8: 8}  # fwd_cl: time steps per tile (R in fwd.cu) by itemsize
CL_WIDE_STEPS = 256  # fwd_cl_wide: time steps per tile (tile_a; 4 warps x a multiple of 8)
STAGED_THREADS = 128  # fwd_cl, fwd_mma, fwd_cl_wide blocks: 4 warps (CL_BLOCK_WARPS in fwd.cu)
TC_BLOCK_WARPS = {2: 4, 8: 1}  # fwd_tc: warps per block by NV (tc_block_warps in fwd.cu)
WIDE_CHUNK = 16  # taps per chunk in fwd_wide (CH in fwd.cu)
TILE_THREADS = 128  # fwd_wide blocks
GENERAL_THREADS = 256
GENERAL_RUN = 8  # fwd_general: outputs per thread (R in fwd.cu)
SMEM_BUDGET = 48 * 1024
MAX_GRID = 2**31 - 1
WIDTHS = range(1, 257)


def forward_kernels(
    dtype: str, width: int, seq: bool, vectors: int = TC_VECTORS[1]
) -> dict[str, str]:
    """The dispatch table: the forward template instance for each layout, for x of ``dtype``
    (``vectors``: 16-byte vectors per lane in a chunk of fwd_tc). "time" is for time-contiguous
    x; "time_mma" replaces it above TC_MAX where tensor cores are exact (``tensor_cores``)."""
    t = C_TYPES[dtype]
    s = "true" if seq else "false"
    tc = f"fwd_tc<{t}, {width}, {s}, {vectors}>"
    cl = f"fwd_cl<{t}, {width}, {s}, {CL_STEPS[ITEMSIZE[dtype]]}>"
    table = {
        "time": tc if width <= TC_MAX else f"fwd_wide<{t}, {s}>",
        "channel": cl if width <= CL_MAX else f"fwd_general<{t}>" if seq else f"fwd_cl_wide<{t}>",
        "general": f"fwd_general<{t}>",
        "final_states": f"fwd_final_states<{t}>",
    }
    if TC_MAX < width <= MMA_MAX and dtype in ("bfloat16", "float16") and not seq:
        table["time_mma"] = f"fwd_mma<{t}, {_mma_steps(width)}>"
    return table


def _mma_steps(width: int) -> int:
    """KS of fwd_mma: k-steps of 16 inputs, D = 16 (KS - 1) >= width - 1."""
    return -(-(width - 1) // 16) + 1


def tensor_cores(x: Array, weight: Array, initial_states: Array | None) -> bool:
    """Whether fwd_mma computes exactly what the float32 kernels do: bfloat16 x (any weights,
    split into two bfloat16 parts), or float16 x and weights; initial_states (staged with x)
    of x's dtype."""
    if x.dtype_name == "bfloat16":
        ok = True
    else:
        ok = x.dtype_name == "float16" and weight.dtype_name == "float16"
    return ok and (initial_states is None or initial_states.dtype_name == x.dtype_name)


def all_forward_instances(dtypes=tuple(C_TYPES), widths=WIDTHS) -> list[str]:
    """Every forward template instance the dispatcher can produce for these dtypes and widths."""
    return sorted(
        {
            name
            for d in dtypes
            for w in widths
            for seq in (False, True)
            for nv in TC_VECTORS
            for name in forward_kernels(d, w, seq, nv).values()
        }
    )


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _aligned(a: Array, itemsize: int, strides, nbytes: int = 16) -> bool:
    """Base pointer and the given strides (element counts) aligned to ``nbytes``."""
    return a.ptr % nbytes == 0 and all((s * itemsize) % nbytes == 0 for s in strides)


def _outer_strides(a: Array, dims) -> list[int]:
    return [a.strides[d] for d in dims if a.shape[d] > 1]


@dataclass(frozen=True)
class Launch:
    name: str
    grid: int
    block: tuple[int, int]
    smem: int
    tile_a: int
    x_vec: bool
    out_vec: bool
    divisors: tuple[int, int] = (0, 0)  # div_a, div_b of FwdParams


_plans: dict[tuple, Launch] = {}


def plan_forward(
    x: Array,
    out: Array,
    weight: Array,
    initial_states: Array | None,
    width: int,
    has_seq: bool,
    device: int,
) -> Launch:
    """Pick the kernel and launch shape from the strides of x (and out) and, for wide filters,
    whether tensor cores are exact for the operands (``tensor_cores``); memoised per layout."""
    mma = width > TC_MAX and tensor_cores(x, weight, initial_states)
    key = (
        device, x.dtype_name, width, has_seq, mma, x.shape, x.strides, x.ptr % 16, out.strides,
        out.ptr % 16,
    )  # fmt: skip
    plan = _plans.get(key)
    if plan is None:
        plan = remember(_plans, key, _plan_forward(x, out, width, has_seq, device, mma))
    return plan


def _plan_forward(
    x: Array, out: Array, width: int, has_seq: bool, device: int, mma: bool
) -> Launch:
    batch, dim, seqlen = x.shape
    itemsize = ITEMSIZE[x.dtype_name]
    nv = TC_VECTORS[seqlen * itemsize > TC_SHORT_ROW]
    table = forward_kernels(x.dtype_name, width, has_seq, nv)
    _, x_c, x_l = x.strides
    if x_l == 1 or (seqlen == 1 and x_c != 1):
        if width <= TC_MAX:
            return _plan_tc(x, out, nv, table["time"], itemsize)
        if mma and "time_mma" in table:
            return _plan_mma(x, out, width, table["time_mma"], device)
        return _plan_wide(x, out, width, has_seq, table["time"], itemsize)
    if x_c == 1 and width <= CL_MAX and _cl_vectors(x, itemsize):
        return _plan_cl(x, out, table["channel"], itemsize)
    if x_c == 1 and width > CL_MAX and not has_seq:
        return _plan_cl_wide(x, width, table["channel"], itemsize, device)
    runs = batch * dim * -(-seqlen // GENERAL_RUN)
    grid = min(-(-runs // GENERAL_THREADS), MAX_GRID)
    channel_fastest = int(abs(x_c) < abs(x_l))
    return Launch(table["general"], grid, (GENERAL_THREADS, 1), 0, channel_fastest, False, False)


def _time_vec(a: Array, itemsize: int) -> bool:
    return (a.strides[2] == 1 or a.shape[2] == 1) and _aligned(
        a, itemsize, _outer_strides(a, (0, 1))
    )


def _plan_tc(x, out, nv, name, itemsize) -> Launch:
    batch, dim, seqlen = x.shape
    per_row = -(-seqlen // (32 * nv * 16 // itemsize))  # chunks, one per warp
    warps = TC_BLOCK_WARPS[nv]
    grid = min(-(-(batch * dim * per_row) // warps), MAX_GRID)
    x_vec, out_vec = _time_vec(x, itemsize), _time_vec(out, itemsize)
    divisors = (fast_divisor(per_row), fast_divisor(dim))  # fwd_tc's chunks_per_row, dim
    return Launch(name, grid, (32 * warps, 1), 0, 0, x_vec, out_vec, divisors)


def _plan_mma(x, out, width, name, device) -> Launch:
    batch, dim, seqlen = x.shape
    ks = _mma_steps(width)
    d = 16 * (ks - 1)
    window, params, wpad = (d + MMA_SPAN) // 8, (d + 3) // 2, (2 * d + 32) // 4  # WV, PW, WPAD
    warp_vecs = 2 * (window + params) + wpad + MMA_SPAN * 2 // 16  # fwd.cu: WARP_VECS
    warps = STAGED_THREADS // 32
    smem = warps * warp_vecs * 16
    tiles = batch * dim * -(-seqlen // MMA_SPAN)
    grid = min(-(-tiles // warps), resident_blocks(device, name, STAGED_THREADS, smem))
    x_vec, out_vec = _time_vec(x, 2), _time_vec(out, 2)
    return Launch(name, grid, (STAGED_THREADS, 1), smem, 0, x_vec, out_vec)


def _plan_wide(x, out, width, has_seq, name, itemsize) -> Launch:
    batch, dim, seqlen = x.shape
    n = 32 // itemsize  # outputs per thread
    acc = 8 if itemsize == 8 else 4
    tpr = min(TILE_THREADS, _pow2_at_least(-(-seqlen // n)))
    halo = (width - 1 + 3) // 4 * 4
    kp = -(-(halo + 1) // WIDE_CHUNK) * WIDE_CHUNK
    slots = -(-(kp + tpr * n) // 32) * 32
    slots += slots // 32 * 4
    per_row = (slots + kp) * acc + (slots * 8 if has_seq else 0)
    rows = TILE_THREADS // tpr
    while rows > 1 and rows * per_row > SMEM_BUDGET:
        rows //= 2
    n_tiles = -(-(batch * dim) // rows) * -(-seqlen // (tpr * n))
    x_vec, out_vec = _time_vec(x, itemsize), _time_vec(out, itemsize)
    return Launch(name, min(n_tiles, MAX_GRID), (tpr, rows), rows * per_row, tpr, x_vec, out_vec)


def _cl_bytes(itemsize: int) -> int:
    """Bytes of a lane's channel vector in fwd_cl (BYTES in fwd.cu): 4 channels of 16 bits."""
    return 8 if itemsize == 2 else 16


def _cl_vectors(a: Array, itemsize: int) -> bool:
    """Whether channel-contiguous ``a`` splits into fwd_cl's aligned lane vectors."""
    nbytes = _cl_bytes(itemsize)
    whole = a.shape[1] % (nbytes // itemsize) == 0
    return whole and _aligned(a, itemsize, _outer_strides(a, (0, 2)), nbytes)


def _plan_cl(x, out, name, itemsize) -> Launch:
    batch, dim, seqlen = x.shape
    v = _cl_bytes(itemsize) // itemsize  # channels per lane
    strips, steps = -(-dim // (32 * v)), -(-seqlen // CL_STEPS[itemsize])
    grid = min(-(-(batch * steps * strips) // (STAGED_THREADS // 32)), MAX_GRID)  # a tile a warp
    out_vec = out.strides[1] == 1 and _cl_vectors(out, itemsize)
    divisors = (fast_divisor(strips), fast_divisor(steps))  # fwd_cl's n_strips, steps_per_row
    return Launch(name, grid, (STAGED_THREADS, 1), 0, 0, True, out_vec, divisors)


def _plan_cl_wide(x, width, name, itemsize, device) -> Launch:
    batch, dim, seqlen = x.shape
    acc = 8 if itemsize == 8 else 4
    tt = CL_WIDE_STEPS
    smem = ((tt + width - 1) + width) * 32 * acc  # input rows and weights, as A
    tiles = batch * -(-seqlen // tt) * -(-dim // 32)
    grid = min(tiles, resident_blocks(device, name, STAGED_THREADS, smem))
    return Launch(name, grid, (STAGED_THREADS, 1), smem, tt, False, False)


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


def plan_final_states(x: Array, width: int) -> Launch:
    batch, dim, _ = x.shape
    total = batch * dim * (width - 1)
    grid = min(-(-total // GENERAL_THREADS), MAX_GRID)
    name = forward_kernels(x.dtype_name, width, False)["final_states"]
    return Launch(name, grid, (GENERAL_THREADS, 1), 0, 0, False, False)


# ---- occupancy: how many blocks of a kernel the device holds at once ------------------------

_resident: dict[tuple, int] = {}


def resident_blocks(device: int, name: str, threads: int, smem: int) -> int:
    """Blocks of ``threads`` threads and ``smem`` bytes of dynamic shared memory of kernel
    ``name`` that fit on the whole device at once (the grid of a grid-stride kernel that runs
    in one wave). Sets the kernel's shared-memory carveout to the maximum."""
    key = (device, name, threads, smem)
    blocks = _resident.get(key)
    if blocks is None:
        from cupy.cuda import runtime as rt

        raw = get_raw_kernel("fwd.cu", name, device)
        if smem:
            raw.preferred_shared_memory_carveout = 100  # all of L1 that can be shared memory
        if smem > 48 * 1024:
            raw.max_dynamic_shared_size_bytes = smem

        def attr(a):
            return rt.deviceGetAttribute(a, device)

        warps = -(-threads // 32)
        regs_per_warp = -(-raw.num_regs * 32 // 256) * 256  # allocated per warp, 256 at a time
        block_smem = smem + raw.shared_size_bytes + attr(rt.cudaDevAttrReservedSharedMemoryPerBlock)
        per_sm = min(
            attr(rt.cudaDevAttrMaxRegistersPerMultiprocessor) // regs_per_warp // warps,
            attr(rt.cudaDevAttrMaxSharedMemoryPerMultiprocessor) // block_smem,
            attr(rt.cudaDevAttrMaxThreadsPerMultiProcessor) // (warps * 32),
            attr(rt.cudaDevAttrMaxBlocksPerMultiprocessor),
        )
        blocks = _resident[key] = max(1, per_sm) * attr(rt.cudaDevAttrMultiProcessorCount)
    return blocks


# ---- the typed argument builder: seven pointers, then struct FwdParams of kernels/fwd.cu ------

FWD_FIELDS = (
    "batch", "dim", "seqlen", "width",
    "x_batch_stride", "x_c_stride", "x_l_stride",
    "weight_c_stride", "weight_width_stride", "bias_stride",
    "seq_batch_stride", "seq_l_stride",
    "init_batch_stride", "init_c_stride", "init_l_stride",
    "out_batch_stride", "out_c_stride", "out_l_stride",
    "final_batch_stride", "final_c_stride", "final_l_stride",
    "weight_dtype", "bias_dtype", "seq_dtype", "init_dtype",
    "silu_act", "x_vec", "out_vec", "tile_a", "div_a", "div_b",
)  # fmt: skip


_ZEROS = {n: (0,) * n for n in (1, 2, 3)}


def forward_args(
    launch: Launch, x, weight, bias, seq_idx, initial_states, out, final_states, width, silu
) -> ParamBlock:
    """The kernel arguments: the pointers of x, weight, bias, seq_idx, initial_states, out and
    final_states (0 when absent), then FwdParams (fields in FWD_FIELDS order), packed for the
    launcher; memoised per distinct value."""
    s, i, f = seq_idx, initial_states, final_states
    values = (
        x.ptr, weight.ptr, bias.ptr if bias else 0, s.ptr if s else 0, i.ptr if i else 0,
        out.ptr, f.ptr if f else 0,
        *x.shape, width, *x.strides, *weight.strides,
        *(bias.strides if bias else _ZEROS[1]), *(s.strides if s else _ZEROS[2]),
        *(i.strides if i else _ZEROS[3]), *out.strides, *(f.strides if f else _ZEROS[3]),
        _code(weight), _code(bias), _code(seq_idx), _code(initial_states),
        int(silu), int(launch.x_vec), int(launch.out_vec), launch.tile_a, *launch.divisors,
    )  # fmt: skip
    block = _blocks.get(values)
    if block is None:
        block = remember(_blocks, values, ParamBlock(values))
    return block


FWD_POINTERS = 7  # x, weight, bias, seq_idx, initial_states, out, final_states


class ParamBlock:
    """Kernel parameters as cuLaunchKernel takes them in its ``extra`` argument: one buffer laid
    out as the kernel declares its parameters (8-byte pointers, then the 8-byte fields of
    FwdParams: no padding anywhere). ``words`` holds, as int64, the ``extra`` list
    [BUFFER_POINTER, &words[6], BUFFER_SIZE, &words[5], END], the buffer's size, then the
    buffer; ``extra`` is its address. Never written after it is built, so launches from any
    thread may share it."""

    __slots__ = ("words", "extra")
    HEADER = 6
    BUFFER_POINTER, BUFFER_SIZE, END = 1, 2, 0  # CU_LAUNCH_PARAM_* of the CUDA driver API

    def __init__(self, values: tuple[int, ...]):
        words = np.empty(self.HEADER + len(values), np.int64)
        addr = words.ctypes.data
        buffer, size = addr + 8 * self.HEADER, addr + 8 * (self.HEADER - 1)
        words[: self.HEADER] = (
            self.BUFFER_POINTER, buffer, self.BUFFER_SIZE, size, self.END, 8 * len(values)
        )  # fmt: skip
        words[self.HEADER :] = values
        words.flags.writeable = False
        self.words, self.extra = words, addr

    @property
    def pointers(self) -> tuple[int, ...]:
        return tuple(int(v) for v in self.words[self.HEADER : self.HEADER + FWD_POINTERS])

    @property
    def fields(self) -> dict[str, int]:
        values = self.words[self.HEADER + FWD_POINTERS :]
        return dict(zip(FWD_FIELDS, (int(v) for v in values), strict=True))


_blocks: dict[tuple, ParamBlock] = {}


def _code(a: Array | None) -> int:
    return 0 if a is None else DTYPE_CODES[a.dtype_name]


# ---- the launcher ----------------------------------------------------------------------------

_CUDA_ERROR_INVALID_CONTEXT = 201


def launch(file: str, plan: Launch, device: int, args: ParamBlock, stream) -> None:
    """Launch ``plan`` with ``args`` on ``stream`` (an object with ``.ptr``, or None for CuPy's
    current stream) through the driver API."""
    import cupy

    function = get_kernel(file, plan.name, device).ptr
    stream_ptr = (stream or cupy.cuda.get_current_stream()).ptr
    if cupy.cuda.runtime.getDevice() == device:
        _launch(cupy, function, plan, stream_ptr, args.extra, device)
    else:
        with cupy.cuda.Device(device):
            _launch(cupy, function, plan, stream_ptr, args.extra, device)


def _launch(cupy, function: int, plan: Launch, stream: int, extra: int, device: int) -> None:
    driver = cupy.cuda.driver
    bx, by = plan.block
    for attempt in range(2):
        try:
            return driver.launchKernel(
                function, plan.grid, 1, 1, bx, by, 1, plan.smem, stream, 0, extra
            )
        except driver.CUDADriverError as e:
            if e.status != _CUDA_ERROR_INVALID_CONTEXT or attempt:
                raise
            # A thread that has not used CUDA yet has no current context: make the device's
            # primary context (where the kernel was loaded) current, and launch again.
            cupy.cuda.runtime.setDevice(device)
