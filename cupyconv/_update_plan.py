"""The decode update's plan: the kernel instance, its launch shape and its parameters.

Works on ``Array`` descriptions only. The kernel lives in ``kernels/update.cu``; its launch
constants and parameter struct are generated from ``CONSTANTS``, ``FIELDS`` and ``UPDATE``
below (as the forward's are, ``cupyconv/_forward_plan.py``).

A block takes ``UPDATE_THREADS`` neighbouring channels of ``UPDATE_ROWS`` batch rows (a thread:
one channel of those rows, channels fastest); widths up to ``UPDATE_WINDOW`` keep the taps and
a window of inputs in registers (width as a template argument), wider filters take the run-time
width instance (``conv_update<T, 0>``). The layout of a decode step (one token, channels
contiguous, a dense state, one dtype, int32 indices: :func:`is_lean`) takes
``conv_update_lean<T, K, R>``: 32-bit offsets, unit strides known at compile time, R rows a
thread.
"""

from __future__ import annotations

from ._arrays import Array, remember, strides_like
from ._compile import C_TYPES
from ._launch import (
    MAX_GRID,
    Kernel,
    Launch,
    ParamBlock,
    bind_sources,
    dtype_code,
    fast_divisor,
    pack,
)

CONSTANTS = {
    "UPDATE_WINDOW": 16,  # conv_update: widest filter with its window in registers
    "UPDATE_THREADS": 128,  # conv_update: threads per block, one channel each
    "UPDATE_ROWS": 4,  # conv_update: batch rows per block
    "UPDATE_OCCUPANCY": 8,  # conv_update: blocks a SM for widths <= 8 of 2- and 4-byte x
}
POINTERS = 7

#: The parameter fields of conv_update, after its seven pointers (x, weight, bias, conv_state,
#: cache_seqlens, conv_state_indices, out; 0 when absent). 2-D x and out: seqlen 1, l strides 0.
FIELDS = (
    "batch", "dim", "seqlen", "width", "state_len", "state_len_divisor",
    "x_batch_stride", "x_c_stride", "x_l_stride",
    "weight_c_stride", "weight_width_stride", "bias_stride",
    "state_batch_stride", "state_c_stride", "state_l_stride",
    "lens_stride", "idx_stride",
    "out_batch_stride", "out_c_stride", "out_l_stride",
    "weight_dtype", "bias_dtype", "state_dtype", "lens_dtype", "idx_dtype",
    "silu_act",
)  # fmt: skip
PLAN_FIELDS = ("channel_tiles", "tiles_divisor")  # the channel tiles and their fast divisor
# Programmatic dependent launches (``Launch.pdl``): an update may be scheduled while the kernel
# before it finishes (in a decode step, the previous layer's); it waits before touching memory.
UPDATE = Kernel("conv_update", "update.cu", "UpdateParams", PLAN_FIELDS, pdl=True)
LEAN = Kernel("conv_update_lean", "update.cu", "UpdateParams", PLAN_FIELDS, pdl=True)
SOURCES = bind_sources(
    (UPDATE, LEAN), "cupyconv/_update_plan.py (CONSTANTS, FIELDS, UPDATE)", CONSTANTS, FIELDS
)
LEAN_WIDTHS = range(2, 9)  # conv_update_lean's widths


def lean_rows(width: int, batch: int) -> int:
    """The batch rows a thread of conv_update_lean takes (and a block: its threads take one
    channel each): four for widths up to 4 from 16 rows on, else two."""
    return 4 if width <= 4 and batch >= 16 else 2


def lean_name(dtype: str, width: int, rows: int) -> str:
    return f"{LEAN.template}<{C_TYPES[dtype]}, {width}, {rows}>"


def update_name(dtype: str, width: int, fast: bool = True) -> str:
    """The conv_update instance for x of ``dtype`` and filters of ``width``: the width-``width``
    fast path where ``fast`` allows it, else the general one (``conv_update<T, 0>``)."""
    k = width if fast and width <= CONSTANTS["UPDATE_WINDOW"] else 0
    return f"conv_update<{C_TYPES[dtype]}, {k}>"


def takes_fast_path(x_dtype: str, state_dtype: str, width: int, state_len: int, circular: bool):
    """Whether the width-templated path serves this update: a state of x's dtype, or float32
    with x of at most 4 bytes (x exact in the state's dtype), and in sliding mode a state row
    of ``width - 1`` entries (the window in registers is the new row)."""
    exact = state_dtype == x_dtype or (state_dtype == "float32" and x_dtype != "float64")
    return exact and (circular or state_len == width - 1)


_OFFSETS = 2**31  # conv_update_lean's offsets are 32-bit


def is_lean(x: Array, weight: Array, bias, state: Array, lens, idx, circular: bool) -> bool:
    """Whether conv_update_lean serves this update (``Array`` descriptions; out is made with
    ``strides_like(x)``): one token; x, weight, bias and state of one dtype of at most 4 bytes;
    x and out with channels contiguous, weight a dense [dim, width] of width 2 to 8, bias
    contiguous; a dense state (channel c's entries at c * state_len, contiguous; in sliding
    mode state_len == width - 1); int32 cache_seqlens and conv_state_indices, contiguous; every
    offset below 2^31."""
    dtype, dim, width = x.dtype_name, x.shape[1], weight.shape[1]
    state_len = state.shape[2]

    def unit(a, d):  # contiguous along dim d, or one element there
        return a.shape[d] == 1 or a.strides[d] == 1

    def extent(shape, strides):  # the largest offset, in elements
        return sum((k - 1) * abs(st) for k, st in zip(shape, strides))

    if dtype == "float64" or width not in LEAN_WIDTHS or (len(x.shape) == 3 and x.shape[2] != 1):
        return False
    if any(a is not None and a.dtype_name != dtype for a in (weight, bias, state)):
        return False
    for a in (lens, idx):
        if a is not None and (a.dtype_name != "int32" or not unit(a, 0)):
            return False
    dense_state = unit(state, 2) and (dim == 1 or state.strides[1] == state_len)
    out_strides = strides_like(x)
    return (
        unit(x, 1) and (dim == 1 or out_strides[1] == 1)
        and unit(weight, 1) and (dim == 1 or weight.strides[0] == width)
        and (bias is None or unit(bias, 0)) and dense_state
        and (circular or state_len == width - 1)
        and max(extent(a.shape, a.strides) for a in (x, weight, state)) < _OFFSETS
        and extent(x.shape, out_strides) < _OFFSETS
    )  # fmt: skip


def all_update_instances(dtypes=tuple(C_TYPES), widths=range(1, 257)) -> dict:
    """Every update template instance the plan can produce for these x dtypes and widths."""
    names = {update_name(d, w) for d in dtypes for w in widths}
    names |= {update_name(d, w, False) for d in dtypes for w in widths}
    names |= {  # batches 1 and 16: both row counts lean_rows picks
        lean_name(d, w, lean_rows(w, b))
        for d in dtypes if d != "float64" for w in widths if w in LEAN_WIDTHS for b in (1, 16)
    }  # fmt: skip
    return {UPDATE.source: sorted(names)}


_plans: dict[tuple, Launch] = {}


def plan_update(x_dtype: str, batch: int, dim: int, width: int, fast: bool, lean: bool) -> Launch:
    """The launch of an update of ``batch`` rows of ``dim`` channels (both > 0), on the fast
    path when ``fast`` (:func:`takes_fast_path`), the lean one when ``lean`` (:func:`is_lean`);
    memoised."""
    key = (x_dtype, batch, dim, width, fast, lean)
    plan = _plans.get(key)
    if plan is None:
        threads = CONSTANTS["UPDATE_THREADS"]
        tiles = -(-dim // threads)
        if lean:  # a block per channel tile and R rows: fewer than 2^31 (32-bit offsets)
            rows = lean_rows(width, batch)
            grid = tiles * -(-batch // rows)
            name, kernel = lean_name(x_dtype, width, rows), LEAN
        else:
            rows = CONSTANTS["UPDATE_ROWS"]
            grid = min(tiles * -(-batch // rows), MAX_GRID)
            name, kernel = update_name(x_dtype, width, fast), UPDATE
        plan = kernel.launch(
            name, grid, (threads, 1), channel_tiles=tiles, tiles_divisor=fast_divisor(tiles)
        )
        remember(_plans, key, plan)
    return plan


def _x3(a: Array) -> tuple[int, int, int]:
    """Strides of x or out as [batch, dim, seqlen] (2-D: one token, time stride 0)."""
    return a.strides if len(a.strides) == 3 else (*a.strides, 0)


def update_args(
    launch: Launch, x: Array, weight: Array, bias, conv_state: Array, cache_seqlens,
    conv_state_indices, out: Array, silu: bool,
) -> ParamBlock:  # fmt: skip
    """The kernel arguments: the seven pointers, then FIELDS, then the plan's fields."""
    b, lens, idx = bias, cache_seqlens, conv_state_indices
    seqlen = x.shape[2] if len(x.shape) == 3 else 1
    return pack((
        x.ptr, weight.ptr, b.ptr if b else 0, conv_state.ptr, lens.ptr if lens else 0,
        idx.ptr if idx else 0, out.ptr,
        x.shape[0], x.shape[1], seqlen, weight.shape[1], conv_state.shape[2],
        fast_divisor(conv_state.shape[2]) if conv_state.shape[2] else 0,
        *_x3(x), *weight.strides, b.strides[0] if b else 0, *conv_state.strides,
        lens.strides[0] if lens else 0, idx.strides[0] if idx else 0, *_x3(out),
        dtype_code(weight), dtype_code(b), dtype_code(conv_state), dtype_code(lens),
        dtype_code(idx), int(silu), *launch.plan_fields,
    ))  # fmt: skip
