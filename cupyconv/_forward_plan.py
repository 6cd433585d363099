"""The forward's plan: which kernel a call launches, with what launch shape and parameters.

Everything here works on ``Array`` descriptions (pointers, shapes, element strides), never on
framework objects. The kernels live in ``kernels/fwd_*.cu``; what they share with this plan is
defined here once and reaches them through the generated prelude:

- ``CONSTANTS``: launch constants the same for every instance (``constexpr int`` in C++);
- the parameter structs: every forward kernel takes ``FIELDS`` (set from the call) followed by
  the fields its own plan sets (``Kernel.plan_fields``), one struct per kernel.

Choices that differ between instances (widths, vectors per lane, warps per block, tile steps)
are template arguments, written into the instance names by :func:`forward_kernels`.
"""

from __future__ import annotations

import dataclasses

from ._arrays import Array, remember, rows_aligned
from ._compile import C_TYPES, Source
from ._launch import (
    LEAST_SMEM_LIMIT,
    MAX_GRID,
    Kernel,
    Launch,
    ParamBlock,
    acc_bytes,
    bind_sources,
    blocks_fit,
    dtype_code,
    even_spans,
    fast_divisor,
    mma_steps,
    multiprocessors,
    pack,
    resident_blocks,
    shared_memory_limit,
)  # fmt: skip

# Launch constants shared with the kernels. Measurements behind each number:
# benchmarks/NOTES.md, "Occupancy and tile sizes".
CONSTANTS = {
    "GENERAL_RUN": 8,  # fwd_general: consecutive outputs per thread
    "TIME_WIDE_WARPS": 4,  # fwd_time_wide: independent warps per block, at most
    "TIME_WIDE_RUN": 16,  # fwd_time_wide: consecutive outputs a lane computes at once
    "MMA_WARPS": 4,  # fwd_mma: warps per block (time-contiguous x: one row each)
    "MMA_CL_CHANNELS": 16,  # fwd_mma: channels a channel-contiguous block computes (its rows)
    "MMA_CL_SM_WARPS": 24,  # fwd_mma: channel-contiguous warps an SM its register budget is for
    "MMA_CL_SPAN": 2048,  # fwd_mma: most steps a channel-contiguous item spans
    "MMA_CL_TWO_ROWS_STEPS": 11,  # fwd_mma: channel-contiguous rows in two buffers up to this KS
    "MMA_SPAN_STEP": 512,  # fwd_mma: tiles span a multiple of this many outputs
    "MMA_CL_GROUP": 32,  # fwd_mma_cl: channels a block
    "MMA_CL_WARPS": 8,  # fwd_mma_cl: warps a block (4 channels each), one barrier a step
    "MMA_CL_FEW_WARPS": 4,  # fwd_mma_cl below MMA_CL_MORE_WARPS: 8 channels a warp, 2 barriers
    "MMA_CL_MORE_WARPS": 5,  # fwd_mma_cl: the KS from which blocks have MMA_CL_WARPS warps
    "MMA_CL_STEP": 16,  # fwd_mma_cl: positions a step (one k-step)
    "CHANNEL_WARPS": 4,  # fwd_channel: warps per block (1 and 2 measured the same)
    "CHANNEL_WIDE_WARPS": 16,  # fwd_channel_wide: warps per block (one block an SM)
    "CHANNEL_WIDE_RUN": 8,  # fwd_channel_wide: outputs a lane computes at once, per channel
    "SPLIT_CL_WARPS": 8,  # fwd_split_cl: warps a block (two channels each)
    "SPLIT_CL_CHANNELS": 16,  # fwd_split_cl: channels a block (a position's 64 bytes)
    "SPLIT_CL_STAGE_BLOCK": 296,  # fwd_split_cl: words a staged block of 16 positions takes
    "SPLIT_CL_STEP": 256,  # fwd_split_cl: outputs a step (a TT of 128 ran slower from KS 4)
    "SPLIT_CL_BLOCKS": 2,  # fwd_split_cl: blocks an SM its registers are budgeted for (128)
}
TIME_MAX_WIDTH = 17  # fwd_time up to this width; wider time-contiguous x: fwd_time_wide
# fwd_mma (16-bit x, tensor cores) from these widths on: time-contiguous x (fwd_time is faster
# up to 13), channel-contiguous x with weights of x's dtype (fwd_mma_cl; fwd_channel is as fast
# at width 9 and slower from 10) and with other weights (fwd_mma, the taps split; fwd_channel is
# faster up to 15); benchmarks/NOTES.md, "fwd_mma on both layouts", "fwd_channel at widths 9 to
# 16" and "The tensor-core crossovers again".
MMA_MIN_WIDTH, MMA_CL_MIN_WIDTH, MMA_CL_SPLIT_MIN_WIDTH = 14, 10, 16
# fwd_mma on a split window (time-contiguous float32 x, float16 x with other weights: x and the
# taps split into bfloat16 parts) from this width on: fwd_time serves the narrower ones, faster
# (benchmarks/NOTES.md, "fwd_mma on float32 x, and float16 x with other weights").
MMA_XSPLIT_MIN_WIDTH = TIME_MAX_WIDTH + 1
MMA_SPAN = 2048  # fwd_mma: most outputs a time-contiguous item spans
MMA_XSPLIT_SPAN = 1024  # the same for a split window (float32 rows: 12 bytes an input with it)
# fwd_mma_time (time-contiguous 16-bit x with rows on 8-byte boundaries, weights of x's dtype)
# up to MMA_TIME_MAX_STEPS k-steps: chunks of (groups of 128 positions, warps a block) for rows
# of up to so many bytes (a row in one chunk), and MMA_TIME_LONG_CHUNK for longer rows.
MMA_TIME_MAX_STEPS = 3
MMA_TIME_CHUNKS = ((1024, (4, 4)), (2048, (8, 2)))
MMA_TIME_LONG_CHUNK = (16, 1)
# A row's last chunk, where the row ends inside it, runs fwd_mma_time's checked path: rows that
# do take fwd_mma_time only when they hold at least MMA_TIME_MIN_CHUNKS chunks ((8, 5120, 2000)
# at width 16, one such chunk a row: 0.75 of the copy against fwd_mma's 0.82).
MMA_TIME_MIN_CHUNKS = 4
# fwd_mma on time-contiguous x: the grid sweeps the items (a warp's next item n_warps on, the
# taps installed every item) where items span at least MMA_SWEEP_SPAN outputs and a row's A
# fragments (KS, twice with split weights) are at most MMA_SWEEP_FRAGMENTS; elsewhere each warp
# takes a run of consecutive items (benchmarks/NOTES.md, "fwd_mma's item order").
MMA_SWEEP_SPAN, MMA_SWEEP_FRAGMENTS = 1024, 6
# fwd_mma's channel-contiguous form with taps of x's dtype up to KS = MMA_CL_TWO_ROWS_STEPS
# (width 161): buffers of rows tried in turn (two: an item's window while the item before's
# outputs go out, one barrier an item; one: the outputs out between two barriers), each at the
# longest span whose blocks fit the device; the first that fits is taken. Wider filters (where
# two buffers lost 2-4 % even without spills, 7-27 % with them) and split taps keep one buffer
# (benchmarks/NOTES.md, "fwd_mma's channel-contiguous rows in two buffers"). On sm_90 the
# spans reach MMA_CL_SPAN = 2048 in two buffers at KS 8 (the whole 232,448 bytes) and in one from
# KS 12: half the window's D positions an output of the spans of 1024 (widths 100 / 177 / 193 /
# 256 1.5-4.8 % faster on an H100: "fwd_mma's channel-contiguous spans of 2048").
MMA_CL_ROW_BUFFERS = (2, 1)
# fwd_mma_cl (channel-contiguous 16-bit x) up to KS = MMA_CL_MAX_STEPS (width 97; fwd_mma beyond,
# where fwd_mma_cl's blocks measured slower from KS 9: benchmarks/NOTES.md, "The waiting branches
# measured, on an H100"; KS 6 / 7 10-22 % faster than fwd_mma: "fwd_mma_cl in 8-warp blocks at
# KS 2 and 6-7"), and fwd_mma's channel-contiguous form where its block does not fit the device
# (KS 7 on sm_86 / sm_89, whose blocks take at most LEAST_SMEM_LIMIT bytes); pieces of rows of
# a row in 1, 2, 3 .. pieces of about equal length, from MMA_CL_LONGEST steps down to
# MMA_CL_SHORTEST: of the spans whose items all run at once with at least MMA_CL_ROUND blocks an
# SM, the one of the fewest items (fewer, longer pieces: benchmarks/NOTES.md, "fwd_mma_cl's pieces
# in one round"); where no span does, the least rounds of items times their steps (a row of 2048
# in three pieces at KS 5 to 7 on two blocks an SM: "fwd_mma_cl's equal pieces").
MMA_CL_MAX_STEPS, MMA_CL_LONGEST, MMA_CL_SHORTEST, MMA_CL_ROUND = 7, 1024, 256, 1.9
CHANNEL_MAX_WIDTH = 16  # fwd_channel up to this width; wider channel-contiguous x: the others
# fwd_split_cl: float32 channel-contiguous x from SPLIT_CL_MIN_WIDTH, past fwd_channel's widths
# (fwd_channel_wide was as fast at width 17 on an H100 and slower beyond), items of up to
# SPLIT_CL_SPAN positions, halved (down to one step) while they would not fill the device twice.
# benchmarks/NOTES.md, "fwd_split_cl" and "fwd_split_cl without its output tile".
SPLIT_CL_MIN_WIDTH, SPLIT_CL_SPAN = 17, 2048
# fwd_time: (16-byte vectors per lane, warps per block) on rows of up to TIME_SHORT_ROW bytes,
# and on longer rows.
TIME_SHORT_CHUNK, TIME_LONG_CHUNK, TIME_SHORT_ROW = (2, 4), (8, 1), 1024
# fwd_channel: (time steps per tile, bytes of a lane's channel vector) by itemsize, up to
# CHANNEL_NARROW_WIDTH and above it (half the channels a lane, twice the steps a tile: its taps
# and window of K rows in registers).
CHANNEL_TILES = {2: ((16, 8), (32, 4)), 4: ((16, 16), (32, 8)), 8: ((8, 16), (32, 8))}
CHANNEL_NARROW_WIDTH = 8
CHANNEL_WIDE_STEPS = 256  # fwd_channel_wide: most time steps a tile
GENERAL_THREADS = 256  # fwd_general and fwd_final_states: threads per block
WIDTHS = range(1, 257)
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


def mma_cl_warps(ks: int, split: bool) -> int:
    """fwd_mma on channel-contiguous x: warps a block (each computes MMA_CL_CHANNELS / warps
    rows). 8 where the A fragments (4 registers a k-step, twice split) take at most 20 of the 80
    registers a thread has at MMA_CL_SM_WARPS warps an SM, else 16 (one block an SM);
    benchmarks/NOTES.md, "fwd_mma on channel-contiguous x (version 3)"."""
    return 8 if 4 * ks * (2 if split else 1) <= 20 else 16


#: The parameter fields every forward kernel takes from the call, after its seven pointers
#: (x, weight, bias, seq_idx, initial_states, out, final_states; 0 when absent). The blocks of
#: a launch past ``main_blocks`` write the final states (``with_final_states``).
FIELDS = (
    "batch", "dim", "seqlen", "width",
    "x_batch_stride", "x_c_stride", "x_l_stride",
    "weight_c_stride", "weight_width_stride", "bias_stride",
    "seq_batch_stride", "seq_l_stride",
    "init_batch_stride", "init_c_stride", "init_l_stride",
    "out_batch_stride", "out_c_stride", "out_l_stride",
    "final_batch_stride", "final_c_stride", "final_l_stride",
    "weight_dtype", "bias_dtype", "seq_dtype", "init_dtype",
    "silu_act", "main_blocks",
)  # fmt: skip
POINTERS = 7


# Every forward kernel is a programmatic dependent launch (``Launch.pdl``): each waits for the
# kernel before it in final_states_blocks, its first step (kernels/fwd_common.cuh).
_ALIGNED = ("x_aligned", "out_aligned")  # rows of x / out start on the kernel's vectors
TIME = Kernel(
    "fwd_time", "fwd_time.cu", "FwdTimeParams", (*_ALIGNED, "chunk_divisor", "dim_divisor"),
    pdl=True,
)  # fmt: skip
MMA = Kernel(
    "fwd_mma", "fwd_mma.cu", "FwdMmaParams",
    (
        *_ALIGNED, "span", "run", "sweep", "row_len", "two_rows", "staging_at", "weights_at",
        "out_at",
    ),
    pdl=True,
)  # fmt: skip
MMA_TIME = Kernel(
    "fwd_mma_time", "fwd_mma_time.cu", "FwdMmaTimeParams",
    ("out_aligned", "chunk_divisor", "dim_divisor"), pdl=True,
)  # fmt: skip
MMA_CL = Kernel(
    "fwd_mma_cl", "fwd_mma_cl.cu", "FwdMmaClParams",
    (*_ALIGNED, "span", "pieces", "group_divisor", "piece_divisor", "taps_at"),
    pdl=True,
)  # fmt: skip
TIME_WIDE = Kernel(
    "fwd_time_wide", "fwd_time_wide.cu", "FwdTimeWideParams",
    ("out_aligned", "cols", "tap_slots", "ids_at", "warp_bytes"),
    pdl=True,
)  # fmt: skip
CHANNEL = Kernel(
    "fwd_channel", "fwd_channel.cu", "FwdChannelParams",
    ("out_aligned", "strip_divisor", "step_divisor"),
    pdl=True,
)  # fmt: skip
SPLIT_CL = Kernel(
    "fwd_split_cl", "fwd_split_cl.cu", "FwdSplitClParams",
    ("span", "tap_row", "stage_at"), pdl=True,
)  # fmt: skip
CHANNEL_WIDE = Kernel(
    "fwd_channel_wide", "fwd_channel_wide.cu", "FwdChannelWideParams",
    (*_ALIGNED, "steps", "weights_at", "buffer_bytes", "buffers"),
    pdl=True,
)  # fmt: skip
GENERAL = Kernel(
    "fwd_general", "fwd_general.cu", "FwdGeneralParams", ("channels_fastest",), pdl=True
)
FINAL_STATES = Kernel("fwd_final_states", "fwd_general.cu", "FwdFinalParams", pdl=True)
KERNELS = (
    TIME, MMA, MMA_TIME, MMA_CL, TIME_WIDE, CHANNEL, SPLIT_CL, CHANNEL_WIDE, GENERAL, FINAL_STATES,
)  # fmt: skip

SOURCES = bind_sources(
    KERNELS, "cupyconv/_forward_plan.py (CONSTANTS, FIELDS, KERNELS)", CONSTANTS, FIELDS
)


def forward_kernels(dtype: str, width: int, seq: bool) -> dict[str, tuple[Source, str]]:
    """The dispatch table: the forward kernel (source, template instance) for each layout of x
    of ``dtype``. "time_short"/"time_long" serve time-contiguous rows of at most / more than
    TIME_SHORT_ROW bytes; "channel" channel-contiguous x in lane vectors (up to
    CHANNEL_MAX_WIDTH, with seq_idx up to CHANNEL_NARROW_WIDTH), "channel_wide" other channel-
    contiguous x above CHANNEL_NARROW_WIDTH without seq_idx; "general" any strides;
    "final_states" the final states. Where the states allow them (``states_staged``), "mma"
    replaces the time-contiguous kernels from MMA_MIN_WIDTH on and "mma_cl" "channel" from
    MMA_CL_MIN_WIDTH on ("mma_split", "mma_cl_split": weights of another dtype than x, float16
    x with them time-contiguous only, from MMA_XSPLIT_MIN_WIDTH on; "mma_cl_split" from
    MMA_CL_SPLIT_MIN_WIDTH on); "mma_cl" is fwd_mma_cl up to MMA_CL_MAX_STEPS k-steps, with
    fwd_mma's channel-contiguous form as "mma_cl_fallback" where its block needs more shared
    memory than LEAST_SMEM_LIMIT;
    "mma_time_<groups>" fwd_mma_time up to MMA_TIME_MAX_STEPS for each chunk shape;
    time-contiguous float32 x takes fwd_mma from MMA_XSPLIT_MIN_WIDTH on, split into bfloat16
    parts, channel-contiguous float32 x fwd_split_cl ("split_cl") from SPLIT_CL_MIN_WIDTH on,
    where the states allow it and its block fits, else "channel_wide"."""
    t = C_TYPES[dtype]
    s = "true" if seq else "false"
    steps, lane_bytes = channel_tile(ITEMSIZE[dtype], width)
    table = {"general": (GENERAL, f"fwd_general<{t}>")}
    for kind, (vectors, warps) in (
        ("time_short", TIME_SHORT_CHUNK),
        ("time_long", TIME_LONG_CHUNK),
    ):
        if width <= TIME_MAX_WIDTH:
            table[kind] = (TIME, f"fwd_time<{t}, {width}, {s}, {vectors}, {warps}>")
        else:
            table[kind] = (TIME_WIDE, f"fwd_time_wide<{t}, {s}>")
    if dtype == "float32" and not seq and width >= MMA_XSPLIT_MIN_WIDTH:
        name = f"fwd_mma<{t}, {mma_steps(width)}, true, 0>"  # any weights: split
        table["mma"] = table["mma_split"] = (MMA, name)
    if dtype in ("bfloat16", "float16") and not seq:
        ks = mma_steps(width)
        for cl, cl_kind in ((False, ""), (True, "_cl")):
            for split in (False, True):
                cl_least = MMA_CL_SPLIT_MIN_WIDTH if split else MMA_CL_MIN_WIDTH
                if width < (cl_least if cl else MMA_MIN_WIDTH):
                    continue
                if split and dtype == "float16" and (cl or width < MMA_XSPLIT_MIN_WIDTH):
                    continue  # (float16 x with other weights: the CUDA-core kernels)
                warps = mma_cl_warps(ks, split) if cl else 0
                name = f"fwd_mma<{t}, {ks}, {str(split).lower()}, {warps}>"
                kernel = MMA
                if cl and ks <= MMA_CL_MAX_STEPS and not split:
                    if mma_cl_shared_memory(ks)[1] > LEAST_SMEM_LIMIT:
                        table["mma_cl_fallback"] = (kernel, name)  # where its block won't fit
                    kernel, name = MMA_CL, f"fwd_mma_cl<{t}, {ks}>"
                table["mma" + cl_kind + ("_split" if split else "")] = (kernel, name)
        if width >= MMA_MIN_WIDTH and ks <= MMA_TIME_MAX_STEPS:
            for groups, warps in (*(c for _, c in MMA_TIME_CHUNKS), MMA_TIME_LONG_CHUNK):
                name = f"fwd_mma_time<{t}, {ks}, {groups}, {warps}>"
                table[f"mma_time_{groups}"] = (MMA_TIME, name)
    if width <= (CHANNEL_NARROW_WIDTH if seq else CHANNEL_MAX_WIDTH):
        table["channel"] = (CHANNEL, f"fwd_channel<{t}, {width}, {s}, {steps}, {lane_bytes}>")
    if width > CHANNEL_NARROW_WIDTH and not seq:
        table["channel_wide"] = (CHANNEL_WIDE, f"fwd_channel_wide<{t}>")
    if dtype == "float32" and not seq and width >= SPLIT_CL_MIN_WIDTH:
        table["split_cl"] = (SPLIT_CL, f"fwd_split_cl<{t}, {mma_steps(width)}>")
    table["final_states"] = (FINAL_STATES, f"fwd_final_states<{t}>")  # as plan_final_states
    return {kind: (kernel.source, name) for kind, (kernel, name) in table.items()}


def states_staged(x: Array, initial_states: Array | None) -> bool:
    """Whether fwd_mma may stage initial_states with x: of x's dtype, or none. Which dtypes of
    x and the weights take it on which layouts, the dispatch table says: 16-bit x with weights
    of x's dtype; bfloat16 x with other weights (split into two bfloat16 parts); float32 x, and
    float16 x with other weights, time-contiguous (x split into two bfloat16 parts too: exactly
    for float16, within 2^-16 of each term for float32)."""
    return initial_states is None or initial_states.dtype_name == x.dtype_name


def all_forward_instances(dtypes=tuple(C_TYPES), widths=WIDTHS) -> dict[Source, list[str]]:
    """Every forward template instance the dispatcher can produce for these dtypes and widths,
    by source."""
    found: dict[Source, set[str]] = {}
    for d in dtypes:
        for w in widths:
            for seq in (False, True):
                for source, name in forward_kernels(d, w, seq).values():
                    found.setdefault(source, set()).add(name)
    return {source: sorted(names) for source, names in found.items()}


# ---- launch shapes ---------------------------------------------------------------------------


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
    the dtypes of x and the weights and whether the states allow tensor cores
    (``states_staged``); memoised per layout."""
    mma = None
    if width >= min(MMA_MIN_WIDTH, MMA_CL_MIN_WIDTH) and states_staged(x, initial_states):
        mma = "mma" if weight.dtype_name == x.dtype_name else "mma_split"
    key = (
        device, x.dtype_name, width, has_seq, mma, x.shape, x.strides, x.ptr % 16, out.strides,
        out.ptr % 16,
    )  # fmt: skip
    plan = _plans.get(key)
    if plan is None:
        plan = remember(_plans, key, _plan_forward(x, out, width, has_seq, device, mma))
    return plan


def _plan_forward(
    x: Array, out: Array, width: int, has_seq: bool, device: int, mma: str | None
) -> Launch:
    batch, dim, seqlen = x.shape
    itemsize = ITEMSIZE[x.dtype_name]
    table = forward_kernels(x.dtype_name, width, has_seq)
    _, x_c, x_l = x.strides
    time_major = x_l == 1 or (seqlen == 1 and x_c != 1)
    kind = (mma if time_major else mma.replace("mma", "mma_cl")) if mma else None
    if kind in table and (time_major or x_c == 1):
        source, name = table[kind]
        if source is MMA_CL.source:
            if mma_cl_shared_memory(mma_steps(width))[1] <= shared_memory_limit(device):
                return _plan_mma_cl(x, out, width, name, device)
            source, name = table["mma_cl_fallback"]
        chunk = _mma_time_chunk(seqlen, itemsize) if kind == "mma" else None
        if chunk and f"mma_time_{chunk[0]}" in table and rows_aligned(x, 2, 8):
            return _plan_mma_time(x, out, chunk, table[f"mma_time_{chunk[0]}"][1])
        return _plan_mma(x, out, width, name, device, not time_major, kind.endswith("_split"))
    if time_major and width <= TIME_MAX_WIDTH:
        short = seqlen * itemsize <= TIME_SHORT_ROW
        name = table["time_short" if short else "time_long"][1]
        return _plan_time(x, out, TIME_SHORT_CHUNK if short else TIME_LONG_CHUNK, name, itemsize)
    if time_major:
        plan = _plan_time_wide(x, out, width, has_seq, table["time_long"][1], itemsize, device)
        if plan is not None:
            return plan
    if x_c == 1 and "channel" in table and _channel_vectors(x, itemsize, width):
        return _plan_channel(x, out, table["channel"][1], itemsize, width)
    if x_c == 1 and "split_cl" in table and mma:  # (mma: the states allow tensor cores)
        plan = _plan_split_cl(x, width, table["split_cl"][1], device)
        if plan is not None:
            return plan
    if x_c == 1 and "channel_wide" in table:
        plan = _plan_channel_wide(x, out, width, table["channel_wide"][1], itemsize, device)
        if plan is not None:
            return plan
    runs = batch * dim * -(-seqlen // CONSTANTS["GENERAL_RUN"])
    grid = min(-(-runs // GENERAL_THREADS), MAX_GRID)
    return GENERAL.launch(
        table["general"][1], grid, (GENERAL_THREADS, 1), channels_fastest=abs(x_c) < abs(x_l)
    )


def _time_vectors(a: Array, itemsize: int) -> bool:
    """Whether the time-contiguous rows of ``a`` start on 16-byte boundaries."""
    return rows_aligned(a, 2)


def _plan_time(x, out, chunk, name, itemsize) -> Launch:
    batch, dim, seqlen = x.shape
    vectors, warps = chunk
    per_row = -(-seqlen // (32 * vectors * 16 // itemsize))  # chunks, one per warp
    grid = min(-(-(batch * dim * per_row) // warps), MAX_GRID)
    return TIME.launch(
        name, grid, (32 * warps, 1), x_aligned=_time_vectors(x, itemsize),
        out_aligned=_time_vectors(out, itemsize), chunk_divisor=fast_divisor(per_row),
        dim_divisor=fast_divisor(dim),
    )  # fmt: skip


def _mma_time_chunk(seqlen: int, itemsize: int) -> tuple[int, int] | None:
    """fwd_mma_time's chunk (groups, warps) for rows of ``seqlen``: the MMA_TIME_CHUNKS shape
    that holds the row, else MMA_TIME_LONG_CHUNK; None where the row ends inside a chunk and
    holds fewer than MMA_TIME_MIN_CHUNKS."""
    row = seqlen * itemsize
    chunk = next((c for most, c in MMA_TIME_CHUNKS if row <= most), MMA_TIME_LONG_CHUNK)
    span = 128 * chunk[0]
    return chunk if seqlen % span == 0 or seqlen >= MMA_TIME_MIN_CHUNKS * span else None


def _plan_mma_time(x, out, chunk, name) -> Launch:
    batch, dim, seqlen = x.shape
    groups, warps = chunk
    per_row = -(-seqlen // (128 * groups))  # chunks, one per warp
    grid = min(-(-(batch * dim * per_row) // warps), MAX_GRID)
    return MMA_TIME.launch(
        name, grid, (32 * warps, 1), out_aligned=rows_aligned(out, 2, 4),
        chunk_divisor=fast_divisor(per_row), dim_divisor=fast_divisor(dim),
    )  # fmt: skip


def _plan_mma(x, out, width, name, device, channel_last, split) -> Launch:
    """A persistent grid in which each warp (time-contiguous x: MMA_WARPS independent warps a
    block, two rows of shared memory each, one computed while the next is staged) or block
    (channel-contiguous x: mma_cl_warps warps sharing a tile of MMA_CL_CHANNELS channels) takes
    a run of items: spans of up to MMA_SPAN (MMA_CL_SPAN) outputs of a row. Spans shrink while
    the blocks an SM is compiled for would not fit its shared memory, or the items would not
    fill the device twice over. The block's shared memory: the rows (D inputs before the span,
    then the span; channel-contiguous rows padded to 8 mod 16 elements against bank conflicts,
    up to MMA_CL_TWO_ROWS_STEPS with taps of x's dtype in two buffers where they fit at some span),
    for channel-contiguous x the staging area of the next item's window (for a split window each
    warp's high and low bfloat16 rows), then each row's (time-contiguous: each warp's) zero-
    padded taps (2 D + 32 floats), then for channel-contiguous x each warp's output block (16
    steps of MMA_CL_CHANNELS channels)."""
    batch, dim, seqlen = x.shape
    ks = mma_steps(width)
    d = 16 * (ks - 1)
    step = CONSTANTS["MMA_SPAN_STEP"]
    itemsize = ITEMSIZE[x.dtype_name]
    # float32 x, float16 x with split weights: the window split into two bfloat16 rows a warp
    xsplit = itemsize == 4 or (split and x.dtype_name == "float16")
    if channel_last:
        warps = mma_cl_warps(ks, split)
        rows = channels = CONSTANTS["MMA_CL_CHANNELS"]  # rows and channels of an item
        per_sm = CONSTANTS["MMA_CL_SM_WARPS"] // warps  # blocks an SM is compiled for
    else:
        warps, channels, per_sm = CONSTANTS["MMA_WARPS"], 1, 1
        rows = 2 * warps

    def layout(span, buffers):
        row_len = d + span + ((8 - d - span) % 16 if channel_last else 0)
        staging_at = -(-rows * row_len * itemsize * buffers // 16) * 16
        staged = (d + span) * channels * 2 if channel_last else warps * row_len * 4 * xsplit
        weights_at = staging_at + staged
        out_at = weights_at + (channels if channel_last else warps) * (2 * d + 32) * 4
        return (
            row_len,
            staging_at,
            weights_at,
            out_at,
            out_at + (warps * 512 if channel_last else 0),
        )

    def items(span):  # (channels, batch row, span)
        return -(-dim // channels) * batch * -(-seqlen // span)

    longest = CONSTANTS["MMA_CL_SPAN"] if channel_last else MMA_XSPLIT_SPAN if xsplit else MMA_SPAN
    two_rows = channel_last and not split and ks <= CONSTANTS["MMA_CL_TWO_ROWS_STEPS"]
    for buffers in MMA_CL_ROW_BUFFERS if two_rows else (1,):
        span = min(longest, -(-seqlen // step) * step)
        while span > step and not blocks_fit(device, layout(span, buffers)[4], per_sm):
            span = span // 2 // step * step
        if blocks_fit(device, layout(span, buffers)[4], per_sm):
            break
    resident = resident_blocks(device, MMA.source, name, 32 * warps, layout(span, buffers)[4])
    per_block = 1 if channel_last else warps  # items a block computes at once
    while span > step and items(span) < 2 * resident * per_block:
        span = span // 2 // step * step
    row_len, staging_at, weights_at, out_at, smem = layout(span, buffers)
    resident = resident_blocks(device, MMA.source, name, 32 * warps, smem)
    spans = -(-seqlen // span)
    # channel-contiguous x: units of `run` spans of a row, at least two a block where the rows
    # alone are fewer
    run = min(spans, max(1, items(span) // (2 * resident))) if channel_last else 0
    units = (
        -(-dim // channels) * batch * -(-spans // run) if channel_last else -(-items(span) // warps)
    )
    grid = min(units, resident, MAX_GRID)
    along = 1 if channel_last else 2
    fragments = ks * (2 if split or itemsize == 4 else 1)  # (float32 x: its taps always split)
    sweep = not channel_last and span >= MMA_SWEEP_SPAN and fragments <= MMA_SWEEP_FRAGMENTS
    return MMA.launch(
        name, grid, (32 * warps, 1), smem,
        x_aligned=rows_aligned(x, along), out_aligned=rows_aligned(out, along),
        span=span, run=run, sweep=sweep, row_len=row_len, two_rows=buffers == 2,
        staging_at=staging_at, weights_at=weights_at, out_at=out_at,
    )  # fmt: skip


def mma_cl_one_barrier(ks: int) -> bool:
    """Whether fwd_mma_cl at KS k-steps runs blocks of MMA_CL_WARPS warps with one barrier a
    step (else MMA_CL_FEW_WARPS warps with two): from KS MMA_CL_MORE_WARPS on. KS 5 12 %
    faster that way on the H200; KS 2 faster on an H100 (8 %) but 14 % slower on the H200, KS 3
    with one barrier the same (benchmarks/NOTES.md, "fwd_mma_cl in 8-warp blocks at KS 2 and
    6-7", "The H200 against the H100 at KS 2-3"). The kernel's ``fwd_mma_cl_one_barrier`` is
    the same rule."""
    return ks >= CONSTANTS["MMA_CL_MORE_WARPS"]


def mma_cl_block_warps(ks: int) -> int:
    """fwd_mma_cl's warps a block at KS k-steps (the kernel's ``fwd_mma_cl_warps``)."""
    return CONSTANTS["MMA_CL_WARPS" if mma_cl_one_barrier(ks) else "MMA_CL_FEW_WARPS"]


def mma_cl_shared_memory(ks: int) -> tuple[int, int]:
    """fwd_mma_cl at KS k-steps: (where the taps start, bytes of shared memory a block). The ring
    (MMA_CL_GROUP channels x 16 RB + 1 rows of 16 bytes), 2 + ONE staging buffers of a step (16
    positions x 8 units x 2 bytes a channel), then each warp's taps (its channels' D + 32 word
    pairs) and biases; with one barrier a step (ONE: ``mma_cl_one_barrier``), RB = KS + ONE."""
    group, step = CONSTANTS["MMA_CL_GROUP"], CONSTANTS["MMA_CL_STEP"]
    one = int(mma_cl_one_barrier(ks))
    taps_at = group * (16 * (ks + one) + 1) * 16 + (2 + one) * step * 8 * group * 2
    return taps_at, taps_at + group * (16 * ks + 16 + 1) * 4


def _plan_mma_cl(x, out, width, name, device) -> Launch:
    """A persistent grid of blocks of ``mma_cl_block_warps`` warps, each taking items
    (MMA_CL_GROUP channels, 8 units: pieces of ``span`` steps of the batch rows) in turn, with
    the shared memory of ``mma_cl_shared_memory``."""
    batch, dim, seqlen = x.shape
    ks = mma_steps(width)
    warps = mma_cl_block_warps(ks)
    step = CONSTANTS["MMA_CL_STEP"]
    taps_at, smem = mma_cl_shared_memory(ks)
    groups = -(-dim // CONSTANTS["MMA_CL_GROUP"])

    def items(span):  # (channel groups, 8 pieces)
        return groups * -(-(batch * -(-seqlen // span)) // 8)

    def time(span):  # a persistent grid's rounds of items, each (span + the D before it) long
        return -(-items(span) // resident) * (span + step * (ks - 1))

    resident = resident_blocks(device, MMA_CL.source, name, 32 * warps, smem)
    spans = even_spans(seqlen, step, MMA_CL_LONGEST, MMA_CL_SHORTEST)
    fewest = MMA_CL_ROUND * multiprocessors(device)  # items of one round at MMA_CL_ROUND an SM
    one_round = [s for s in spans if fewest <= items(s) <= resident]
    if one_round:  # the fewest items, the shortest of those (a unit group may have empty columns)
        span = min(one_round, key=lambda s: (items(s), s))
    else:  # the least rounds times their steps, the shorter span on a tie
        span = min(spans, key=lambda s: (time(s), s))
    pieces = -(-seqlen // span)
    return MMA_CL.launch(
        name, min(items(span), resident, MAX_GRID), (32 * warps, 1), smem,
        x_aligned=rows_aligned(x, 1), out_aligned=rows_aligned(out, 1), span=span, pieces=pieces,
        group_divisor=fast_divisor(groups), piece_divisor=fast_divisor(pieces), taps_at=taps_at,
    )  # fmt: skip


def _plan_time_wide(x, out, width, has_seq, name, itemsize, device) -> Launch | None:
    """Each warp's shared memory: two buffers of a span's width - 1 + 32 TIME_WIDE_RUN inputs,
    as TIME_WIDE_RUN columns of ``cols`` slots (odd, so that the lanes' staging stores meet at
    most two to a bank), then the row's taps (a multiple of 4), then
    with seq_idx two buffers of the inputs' int64 segment ids. TIME_WIDE_WARPS warps a block,
    fewer where they would not fit the device (float64 with seq_idx at the widest filters on
    sm_86); None where one warp does not fit: the general kernel then."""
    batch, dim, _ = x.shape
    run, acc = CONSTANTS["TIME_WIDE_RUN"], acc_bytes(itemsize)
    cols = -(-(width - 1 + 32 * run) // run) | 1
    taps = -(-width // 4) * 4
    ids_at = -(-(2 * cols * run + taps) * acc // 16) * 16
    warp_bytes = ids_at + (2 * cols * run * 8 if has_seq else 0)
    warps = CONSTANTS["TIME_WIDE_WARPS"]
    while warps > 1 and warps * warp_bytes > shared_memory_limit(device):
        warps //= 2
    if warps * warp_bytes > shared_memory_limit(device):
        return None
    smem = warps * warp_bytes
    rows = -(-(batch * dim) // warps)
    grid = min(rows, resident_blocks(device, TIME_WIDE.source, name, 32 * warps, smem))
    return TIME_WIDE.launch(
        name, grid, (32 * warps, 1), smem, out_aligned=_time_vectors(out, itemsize), cols=cols,
        tap_slots=taps, ids_at=ids_at, warp_bytes=warp_bytes,
    )  # fmt: skip


def channel_tile(itemsize: int, width: int) -> tuple[int, int]:
    """fwd_channel's (time steps per tile, bytes of a lane's channel vector) for ``width``."""
    return CHANNEL_TILES[itemsize][width > CHANNEL_NARROW_WIDTH]


def _channel_vectors(a: Array, itemsize: int, width: int) -> bool:
    """Whether channel-contiguous ``a`` splits into fwd_channel's aligned lane vectors."""
    nbytes = channel_tile(itemsize, width)[1]
    return a.shape[1] % (nbytes // itemsize) == 0 and rows_aligned(a, 1, nbytes)


def _plan_channel(x, out, name, itemsize, width) -> Launch:
    batch, dim, seqlen = x.shape
    steps, lane_bytes = channel_tile(itemsize, width)
    v = lane_bytes // itemsize  # channels per lane
    strips, steps_per_row = -(-dim // (32 * v)), -(-seqlen // steps)
    warps = CONSTANTS["CHANNEL_WARPS"]
    grid = min(-(-(batch * steps_per_row * strips) // warps), MAX_GRID)  # a tile a warp
    return CHANNEL.launch(
        name, grid, (32 * warps, 1),
        out_aligned=_channel_vectors(out, itemsize, width),
        strip_divisor=fast_divisor(strips), step_divisor=fast_divisor(steps_per_row),
    )  # fmt: skip


def split_cl_shared_memory(ks: int) -> tuple[int, int, int]:
    """fwd_split_cl's block at ``ks`` k-steps: (tap_row, stage_at, bytes). Two tap tables (high
    and low parts) of tap_row words a channel (16 (KS - 1) + 48: the pairs a lane's A fragments
    reach, from word 17 to 16 (KS - 1) + 46), then two staging buffers of KS - 1 + TT / 16 blocks
    of SPLIT_CL_STAGE_BLOCK words (the step's outputs go back into its buffer)."""
    channels, tt = CONSTANTS["SPLIT_CL_CHANNELS"], CONSTANTS["SPLIT_CL_STEP"]
    tap_row = 16 * (ks - 1) + 48
    stage_at = 2 * channels * tap_row * 4
    stage_bytes = (ks - 1 + tt // 16) * CONSTANTS["SPLIT_CL_STAGE_BLOCK"] * 4
    return tap_row, stage_at, stage_at + 2 * stage_bytes


def _plan_split_cl(x, width, name, device) -> Launch | None:
    """Blocks of SPLIT_CL_WARPS warps, one an item (SPLIT_CL_CHANNELS channels of a piece of
    ``span`` positions of a batch row; a block takes the next item of the grid's stride past
    MAX_GRID); None where its block does not fit the device's shared memory (fwd_channel_wide
    then)."""
    batch, dim, seqlen = x.shape
    ks = mma_steps(width)
    tap_row, stage_at, smem = split_cl_shared_memory(ks)
    if smem > shared_memory_limit(device):
        return None
    threads, tt = 32 * CONSTANTS["SPLIT_CL_WARPS"], CONSTANTS["SPLIT_CL_STEP"]
    groups = -(-dim // CONSTANTS["SPLIT_CL_CHANNELS"])
    resident = resident_blocks(device, SPLIT_CL.source, name, threads, smem)
    span = SPLIT_CL_SPAN
    while span > tt and batch * groups * -(-seqlen // span) < 2 * resident:
        span //= 2
    items = batch * groups * -(-seqlen // span)
    return SPLIT_CL.launch(
        name, min(items, MAX_GRID), (threads, 1), smem, span=span, tap_row=tap_row,
        stage_at=stage_at,
    )  # fmt: skip


def _plan_channel_wide(x, out, width, name, itemsize, device) -> Launch | None:
    """The tile's steps and the block's shared memory: one or two buffers of the tile's steps +
    K - 1 input rows and its K tap rows, each row 32 lanes' 8-byte slots. Two buffers (the
    next tile copied while this one is computed) of up to CHANNEL_WIDE_STEPS steps where they
    fit a block, halving the steps down to CHANNEL_WIDE_WARPS x CHANNEL_WIDE_RUN, else one;
    None where even one buffer of the shortest tiles does not fit (from width 135 on sm_86 and
    sm_89): the general kernel then."""
    batch, dim, seqlen = x.shape
    lanes = 8 // acc_bytes(itemsize)  # channels a lane
    least = CONSTANTS["CHANNEL_WIDE_WARPS"] * CONSTANTS["CHANNEL_WIDE_RUN"]
    longest = min(CHANNEL_WIDE_STEPS, -(-seqlen // least) * least)
    limit = shared_memory_limit(device)

    def inputs_bytes(steps):  # (the taps' rows follow the inputs')
        return (steps + width - 1) * 32 * 8

    def buffer_bytes(steps):
        return inputs_bytes(steps) + width * 32 * 8

    for buffers in (2, 1):
        steps = longest
        while steps > least and buffers * buffer_bytes(steps) > limit:
            steps = max(least, steps // 2 // least * least)
        if buffers * buffer_bytes(steps) <= limit:
            break
    else:
        return None
    threads = 32 * CONSTANTS["CHANNEL_WIDE_WARPS"]
    smem = buffers * buffer_bytes(steps)
    tiles = batch * -(-seqlen // steps) * -(-dim // (32 * lanes))
    grid = min(tiles, resident_blocks(device, CHANNEL_WIDE.source, name, threads, smem))
    nbytes = lanes * itemsize
    return CHANNEL_WIDE.launch(
        name, grid, (threads, 1), smem, x_aligned=rows_aligned(x, 1, nbytes),
        out_aligned=rows_aligned(out, 1, nbytes), steps=steps,
        weights_at=inputs_bytes(steps), buffer_bytes=buffer_bytes(steps), buffers=buffers,
    )  # fmt: skip


def plan_final_states(x: Array, width: int) -> Launch:
    """fwd_final_states alone (x without tokens): one thread per element; memoised per shape."""
    batch, dim, _ = x.shape
    key = (x.dtype_name, batch, dim, width)
    plan = _plans.get(key)
    if plan is None:
        grid = _final_blocks(batch * dim * (width - 1), GENERAL_THREADS, 0)
        name = f"fwd_final_states<{C_TYPES[x.dtype_name]}>"
        plan = remember(_plans, key, FINAL_STATES.launch(name, grid, (GENERAL_THREADS, 1)))
    return plan


def with_final_states(plan: Launch, x: Array, width: int) -> Launch:
    """``plan`` with blocks added past its own (``main_blocks`` = plan.grid) that write the
    final states, one thread per element, grid-stride; memoised."""
    batch, dim, _ = x.shape
    key = (plan, batch, dim, width)
    fused = _plans.get(key)
    if fused is None:
        threads = plan.block[0] * plan.block[1]
        extra = _final_blocks(batch * dim * (width - 1), threads, plan.grid)
        fused = remember(_plans, key, dataclasses.replace(plan, grid=plan.grid + extra))
    return fused


FINAL_BLOCKS = 1024  # most blocks writing final states (grid-stride beyond)


def _final_blocks(elements: int, threads: int, main_blocks: int) -> int:
    return max(1, min(-(-elements // threads), FINAL_BLOCKS, MAX_GRID - main_blocks))


# ---- the typed argument builder --------------------------------------------------------------

_ZEROS = {n: (0,) * n for n in (1, 2, 3)}


def forward_args(
    launch: Launch, x, weight, bias, seq_idx, initial_states, out, final_states, width, silu,
    main_blocks,
) -> ParamBlock:  # fmt: skip
    """The kernel arguments: the pointers of x, weight, bias, seq_idx, initial_states, out and
    final_states (0 when absent), then the kernel's struct: FIELDS, then the plan's fields.
    ``main_blocks``: the blocks of the launch before those that write the final states."""
    s, i, f = seq_idx, initial_states, final_states
    return pack((
        x.ptr, weight.ptr, bias.ptr if bias else 0, s.ptr if s else 0, i.ptr if i else 0,
        out.ptr, f.ptr if f else 0,
        *x.shape, width, *x.strides, *weight.strides,
        *(bias.strides if bias else _ZEROS[1]), *(s.strides if s else _ZEROS[2]),
        *(i.strides if i else _ZEROS[3]), *out.strides, *(f.strides if f else _ZEROS[3]),
        dtype_code(weight), dtype_code(bias), dtype_code(seq_idx), dtype_code(initial_states),
        int(silu), main_blocks, *launch.plan_fields,
    ))  # fmt: skip
