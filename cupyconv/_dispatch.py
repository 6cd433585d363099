"""The dispatch table, the typed argument builder and the launcher of the forward kernels.

Layer between the validated public functions (``ops.py``) and the device code
(``kernels/fwd.cu``): everything here works on ``Array`` descriptions (pointers, shapes, element
strides), never on framework objects.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ._arrays import Array
from ._compile import get_kernel

C_TYPES = {
    "float32": "float",
    "float16": "__half",
    "bfloat16": "__nv_bfloat16",
    "float64": "double",
}
# Same codes as `enum DtypeCode` in kernels/common.cuh.
DTYPE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2, "float64": 3, "int32": 4, "int64": 5}
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}

TC_MAX = 17  # fwd_tc<T, K, SEQ> up to this width; wider time-contiguous input: fwd_wide
CL_MAX = 8  # fwd_cl<T, K, SEQ> up to this width; wider channel-contiguous input: general
WIDE_CHUNK = 16  # taps per chunk in fwd_wide (CH in fwd.cu)
TC_THREADS = 256
TILE_THREADS = 128  # fwd_wide and fwd_cl blocks
GENERAL_THREADS = 256
SMEM_BUDGET = 48 * 1024
MAX_GRID = 2**31 - 1
WIDTHS = range(1, 257)


def forward_kernels(dtype: str, width: int, seq: bool) -> dict[str, str]:
    """The dispatch table: the forward template instance for each layout, for x of ``dtype``."""
    t = C_TYPES[dtype]
    s = "true" if seq else "false"
    return {
        "time": f"fwd_tc<{t}, {width}, {s}>" if width <= TC_MAX else f"fwd_wide<{t}, {s}>",
        "channel": f"fwd_cl<{t}, {width}, {s}>" if width <= CL_MAX else f"fwd_general<{t}>",
        "general": f"fwd_general<{t}>",
        "final_states": f"fwd_final_states<{t}>",
    }


def all_forward_instances(dtypes=tuple(C_TYPES), widths=WIDTHS) -> list[str]:
    """Every forward template instance the dispatcher can produce for these dtypes and widths."""
    return sorted(
        {
            name
            for d in dtypes
            for w in widths
            for seq in (False, True)
            for name in forward_kernels(d, w, seq).values()
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


_plans: dict[tuple, Launch] = {}


def plan_forward(x: Array, out: Array, width: int, has_seq: bool) -> Launch:
    """Pick the kernel and launch shape from the strides of x (and out); memoised per layout."""
    key = (x.dtype_name, width, has_seq, x.shape, x.strides, x.ptr % 16, out.strides, out.ptr % 16)
    plan = _plans.get(key)
    if plan is None:
        plan = _plans[key] = _plan_forward(x, out, width, has_seq)
    return plan


def _plan_forward(x: Array, out: Array, width: int, has_seq: bool) -> Launch:
    batch, dim, seqlen = x.shape
    itemsize = ITEMSIZE[x.dtype_name]
    table = forward_kernels(x.dtype_name, width, has_seq)
    _, x_c, x_l = x.strides
    if x_l == 1 or (seqlen == 1 and x_c != 1):
        if width <= TC_MAX:
            return _plan_tc(x, out, table["time"], itemsize)
        return _plan_wide(x, out, width, has_seq, table["time"], itemsize)
    if x_c == 1 and width <= CL_MAX:
        return _plan_cl(x, out, table["channel"], itemsize)
    total = batch * dim * seqlen
    grid = min(-(-total // GENERAL_THREADS), MAX_GRID)
    channel_fastest = int(abs(x_c) < abs(x_l))
    return Launch(table["general"], grid, (GENERAL_THREADS, 1), 0, channel_fastest, False, False)


def _time_vec(a: Array, itemsize: int) -> bool:
    return (a.strides[2] == 1 or a.shape[2] == 1) and _aligned(
        a, itemsize, _outer_strides(a, (0, 1))
    )


def _plan_tc(x, out, name, itemsize) -> Launch:
    batch, dim, seqlen = x.shape
    vn = 16 // itemsize  # elements per vector
    nv = min(4, _pow2_at_least(-(-seqlen // (32 * vn))))  # vectors per lane (tile_a)
    warps = batch * dim * -(-seqlen // (32 * nv * vn))
    grid = min(-(-warps // (TC_THREADS // 32)), MAX_GRID)
    x_vec, out_vec = _time_vec(x, itemsize), _time_vec(out, itemsize)
    return Launch(name, grid, (TC_THREADS, 1), 0, nv, x_vec, out_vec)


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


def _plan_cl(x, out, name, itemsize) -> Launch:
    batch, dim, seqlen = x.shape
    v = (8 if itemsize == 2 else 16) // itemsize  # channels per thread (V in fwd_cl)
    cg = min(32, _pow2_at_least(-(-dim // v)))
    ty = TILE_THREADS // cg
    n_tiles = batch * -(-dim // (cg * v)) * -(-seqlen // (ty * 32))
    x_vec = _aligned(x, itemsize, _outer_strides(x, (0, 2)), v * itemsize)
    out_vec = out.strides[1] == 1 and _aligned(
        out, itemsize, _outer_strides(out, (0, 2)), v * itemsize
    )
    return Launch(name, min(n_tiles, MAX_GRID), (cg, ty), 0, cg, x_vec, out_vec)


def plan_final_states(x: Array, width: int) -> Launch:
    batch, dim, _ = x.shape
    total = batch * dim * (width - 1)
    grid = min(-(-total // GENERAL_THREADS), MAX_GRID)
    name = forward_kernels(x.dtype_name, width, False)["final_states"]
    return Launch(name, grid, (GENERAL_THREADS, 1), 0, 0, False, False)


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
    "silu_act", "x_vec", "out_vec", "tile_a",
)  # fmt: skip
_FWD_STRUCT = np.dtype((np.void, 8 * len(FWD_FIELDS)))


def _operand(a: Array | None, ndim: int) -> tuple:
    """(pointer, strides...) of an optional operand, zeros when absent."""
    return (0,) * (1 + ndim) if a is None else (a.ptr, *a.strides)


def forward_args(
    launch: Launch, x, weight, bias, seq_idx, initial_states, out, final_states, width, silu
) -> tuple:
    """The kernel arguments: the pointers of x, weight, bias, seq_idx, initial_states, out and
    final_states (0 when absent), then FwdParams as a numpy void scalar (fields in FWD_FIELDS
    order, each an int64)."""
    x_ptr, *x_strides = _operand(x, 3)
    w_ptr, *w_strides = _operand(weight, 2)
    b_ptr, *b_strides = _operand(bias, 1)
    s_ptr, *s_strides = _operand(seq_idx, 2)
    i_ptr, *i_strides = _operand(initial_states, 3)
    o_ptr, *o_strides = _operand(out, 3)
    f_ptr, *f_strides = _operand(final_states, 3)
    values = (
        *x.shape, width,
        *x_strides, *w_strides, *b_strides, *s_strides, *i_strides, *o_strides, *f_strides,
        _code(weight), _code(bias), _code(seq_idx), _code(initial_states),
        int(silu), int(launch.x_vec), int(launch.out_vec), launch.tile_a,
    )  # fmt: skip
    params = np.array(values, dtype=np.int64).view(_FWD_STRUCT)[0]
    return (x_ptr, w_ptr, b_ptr, s_ptr, i_ptr, o_ptr, f_ptr, params)


def _code(a: Array | None) -> int:
    return 0 if a is None else DTYPE_CODES[a.dtype_name]


def launch(file: str, plan: Launch, device: int, args: tuple, stream) -> None:
    import cupy

    kernel = get_kernel(file, plan.name, device)
    if cupy.cuda.runtime.getDevice() == device:
        kernel((plan.grid,), plan.block, args, plan.smem, stream)
    else:
        with cupy.cuda.Device(device):
            kernel((plan.grid,), plan.block, args, plan.smem, stream)
