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

TC_MAX = 17        # fwd_tc<T, K, SEQ> up to this width; wider time-contiguous input: fwd_wide
CL_MAX = 8         # fwd_cl<T, K, SEQ> up to this width; wider channel-contiguous input: general
WIDE_CHUNK = 16    # taps per chunk in fwd_wide (CH in fwd.cu)
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


def plan_forward(x: Array, out: Array, width: int, has_seq: bool) -> Launch:
    """Pick the kernel and launch shape from the strides of x (and out)."""
    batch, dim, seqlen = x.shape
    itemsize = ITEMSIZE[x.dtype_name]
    table = forward_kernels(x.dtype_name, width, has_seq)
    _, x_c, x_l = x.strides
    if x_l == 1 or (seqlen == 1 and x_c != 1):
        if width <= TC_MAX:
            return _plan_tc(x, out, table["time"], itemsize)
        return _plan_wide(x, width, has_seq, table["time"], itemsize)
    if x_c == 1 and width <= CL_MAX:
        return _plan_cl(x, out, table["channel"], itemsize)
    total = batch * dim * seqlen
    grid = min(-(-total // GENERAL_THREADS), MAX_GRID)
    channel_fastest = int(abs(x_c) < abs(x_l))
    return Launch(table["general"], grid, (GENERAL_THREADS, 1), 0, channel_fastest, False, False)


def _time_vec(a: Array, itemsize: int) -> bool:
    return (a.strides[2] == 1 or a.shape[2] == 1) and _aligned(a, itemsize, _outer_strides(a, (0, 1)))


def _plan_tc(x, out, name, itemsize) -> Launch:
    batch, dim, seqlen = x.shape
    n = 64 // itemsize  # outputs per thread (N in fwd_tc)
    total = batch * dim * -(-seqlen // n)
    grid = min(-(-total // TC_THREADS), MAX_GRID)
    return Launch(
        name, grid, (TC_THREADS, 1), 0, 0, _time_vec(x, itemsize), _time_vec(out, itemsize)
    )


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
    out_vec = out.strides[1] == 1 and _aligned(out, itemsize, _outer_strides(out, (0, 2)), v * itemsize)
    return Launch(name, min(n_tiles, MAX_GRID), (cg, ty), 0, cg, x_vec, out_vec)


def plan_final_states(x: Array, width: int) -> Launch:
    batch, dim, _ = x.shape
    total = batch * dim * (width - 1)
    grid = min(-(-total // GENERAL_THREADS), MAX_GRID)
    name = forward_kernels(x.dtype_name, width, False)["final_states"]
    return Launch(name, grid, (GENERAL_THREADS, 1), 0, 0, False, False)


# ---- the typed argument builder (C-signature order of FWD_SIGNATURE in kernels/fwd.cu) -------


def _ptr(a: Array | None):
    return np.uint64(0) if a is None else np.uint64(a.ptr)


def _strides(a: Array | None, n: int):
    return [np.int64(0)] * n if a is None else [np.int64(s) for s in a.strides]


def _code(a: Array | None):
    return np.int32(0) if a is None else np.int32(DTYPE_CODES[a.dtype_name])


def forward_args(
    launch: Launch, x, weight, bias, seq_idx, initial_states, out, final_states, width, silu
) -> tuple:
    batch, dim, seqlen = x.shape
    return (
        _ptr(x),
        _ptr(weight),
        _ptr(bias),
        _ptr(seq_idx),
        _ptr(initial_states),
        _ptr(out),
        _ptr(final_states),
        np.int64(batch),
        np.int64(dim),
        np.int64(seqlen),
        np.int32(width),
        *_strides(x, 3),
        *_strides(weight, 2),
        *_strides(bias, 1),
        *_strides(seq_idx, 2),
        *_strides(initial_states, 3),
        *_strides(out, 3),
        *_strides(final_states, 3),
        _code(weight),
        _code(bias),
        _code(seq_idx),
        _code(initial_states),
        np.int32(silu),
        np.int32(launch.x_vec),
        np.int32(launch.out_vec),
        np.int32(launch.tile_a),
    )


def launch(file: str, plan: Launch, device: int, args: tuple, stream) -> None:
    import cupy

    kernel = get_kernel(file, plan.name, device)
    with cupy.cuda.Device(device):
        kernel((plan.grid,), plan.block, args, plan.smem, stream)
