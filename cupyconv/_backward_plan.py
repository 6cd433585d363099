"""The backward's plan: which kernels a call launches, with what launch shapes and parameters,
and the scratch memory they need.

Works on ``Array`` descriptions only. The kernels live in ``kernels/bwd_*.cu``; their launch
constants and parameter structs are generated from ``CONSTANTS``, ``FIELDS`` and ``KERNELS``
below (as the forward's are, ``cupyconv/_forward_plan.py``).

A call runs one main kernel that writes dx and the partial sums of dweight and dbias (one
``[dim, width + 1]`` block of them per part of the data), ``bwd_states`` when dinitial_states
is asked for or dfinal_states given (the states' gradient, and dx at the last width - 1
positions again with the final states' gradient added), and ``bwd_reduce``, which adds the
partials in a fixed order: no floating-point atomics, every result bitwise the same from run to
run. A call of a single part has no partials: the main kernel writes dweight and dbias itself,
and no ``bwd_reduce`` runs. Calls no fast kernel takes run ``bwd_wide`` (CUDA cores, any
layout, width and dtypes) without seq_idx, where its block fits the device, else the general
path: ``bwd_dz`` writes dz into a scratch array, ``bwd_dx`` and ``bwd_weight`` read it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._arrays import Array, remember, rows_aligned
from ._compile import C_TYPES
from ._launch import (
    MAX_GRID,
    Kernel,
    Launch,
    ParamBlock,
    acc_bytes,
    bind_sources,
    dtype_code,
    fast_divisor,
    mma_steps,
    pack,
    piece_spans,
    resident_blocks,
    shared_memory_limit,
    waves,
)

# Launch constants shared with the kernels. Measurements behind the tile sizes, chunk shapes and
# register budget: benchmarks/NOTES.md, "Backward kernels (version 1)".
CONSTANTS = {
    "WEIGHT_THREADS": 256,  # bwd_weight: threads per block (one run of positions each)
    "WEIGHT_RUN": 16,  # bwd_weight: positions per run
    "MAX_STATE": 255,  # bwd_states: most state positions (width - 1)
    "WARPS_PER_SM": 20,  # bwd_time, bwd_channel: the register budget's occupancy target
    # bwd_channel_pair: its budget's warps an SM (128 registers; at 96, for 20 warps, width 4
    # spills 144 bytes and runs at half the speed)
    "CHANNEL_PAIR_WARPS_PER_SM": 16,
    "BWD_MMA_WARPS": 2,  # bwd_mma: warps per block (independent)
    "BWD_MMA_CL_WARPS": 16,  # bwd_mma, channel-contiguous x: warps a block, one channel each
    "BWD_MMA_LAGS": 5,  # bwd_mma: most block lags of dweight's C_d a warp holds (its k-steps)
    "BWD_MMA_BLOCK_WARPS": 4,  # bwd_mma_block: warps a block, a span each, sharing a channel
    "MMA_TIME_WARPS_PER_SM": 12,  # bwd_mma_time, 2 k-steps: its register budget's warps an SM
    "MMA_TIME_WIDE_WARPS_PER_SM": 8,  # bwd_mma_time, 3 k-steps: the same
    "MMA_TIME_STAGES": 3,  # bwd_mma_time: a warp's staged chunks (the one computed, those ahead)
    "WIDE_THREADS": 256,  # bwd_wide: threads a block, 16 a channel
    "WIDE_CHANNELS": 16,  # bwd_wide: channels a block
    "WIDE_BLOCKS": 2,  # bwd_wide: blocks an SM its register budget is set for (float64: 1)
    "WIDE_TILE": 256,  # bwd_wide: positions a tile (>= the widest filter's K - 1)
    "WIDE_BATCH": 8,  # bwd_wide: loads a thread has in flight while it stages rows
    "WIDE_BANK_RUN": 32,  # bwd_wide: a staged row gains WIDE_BANK_PAD slots every
    "WIDE_BANK_PAD": 4,  # WIDE_BANK_RUN slots (no bank conflicts)
    "REDUCE_WARPS": 8,  # bwd_reduce: warps a block (warp w: parts w, w + 8, ...)
    "BWD_CL_WARPS": 4,  # bwd_mma_cl: warps a block, 8 channels each
    "BWD_CL_STEP": 128,  # bwd_mma_cl: positions a step (8 columns of 16 outputs)
    "BWD_CL_DX_FROM": 10,  # bwd_mma_cl: from this KS on, BWD_CL_WARPS more warps a block for dx
}
# bwd_reduce: a thread adds REDUCE_SUMS of the call's dim (width + 1) sums where there are more
# than REDUCE_MANY (about one wave of 32-sum blocks on the H200), else one. Four a thread made
# (8, 5120, 2048) at widths 16 / 64 1-2 / 2.5 % faster, at width 4 (25,600 sums) 1.5 % slower
# (benchmarks/NOTES.md, "bwd_reduce's blocks, again").
REDUCE_SUMS, REDUCE_MANY = 4, 32768
TIME_MAX_WIDTH = 16  # bwd_time up to this width (then bwd_mma or bwd_wide)
# bwd_channel up to CHANNEL_SEQ_MAX_WIDTH with seq_idx (past it the rings spill thousands of
# bytes a thread: slow to compile, not measured), and up to CHANNEL_MAX_WIDTH below
# CHANNEL_WIDE_FROM (by x's dtype) without (then bwd_wide; bfloat16 x with bfloat16 weights
# takes bwd_mma from MMA_CL_MIN_WIDTH first). One channel a lane from CHANNEL_LANE_FROM, where
# two spill, keeps its rings in registers (12 warps an SM past width 16): (8, 5120, 2048), TB/s,
# width 12 bfloat16 1.93 against bwd_mma's 1.18, float32 3.35 against 2.45 with two channels a
# lane; width 16 bfloat16 / float16 / float32 1.58 / 1.59 / 3.15 against 1.18 (bwd_mma) / 0.55
# / 1.17 (bwd_wide); width 20 bfloat16 1.17 against bwd_mma's 1.09 (0.96 against 1.09 at 24),
# float32 2.24 / 1.80 / 1.06 at widths 20 / 24 / 31 against bwd_wide's 1.05 / 1.02 / 0.96; with
# seq_idx (no other fast kernel takes it) 0.32 / 0.17 at 20 / 24 against the general path's
# 0.04 / 0.03. At width 9 two channels a lane are 4-6 % faster (benchmarks/NOTES.md,
# "bwd_channel one channel a lane"). float64 (8 warps an SM, spills from width 23) 1.96 / 2.44 /
# 1.44 at widths 13 / 16 / 24 against bwd_wide's 0.92 / 0.94 / 0.87, 0.39 against 0.83 at 32;
# float16 0.86 / 0.59 at 25 / 32 against bwd_wide's 0.47 / 0.44; bfloat16 level with bwd_mma at
# 21, 5 / 11 % slower at 22 / 23 ("The channel-last crossovers, measured").
CHANNEL_MAX_WIDTH, CHANNEL_SEQ_MAX_WIDTH = 32, 24
CHANNEL_WIDE_FROM = {"float32": 33, "float16": 33, "bfloat16": 33, "float64": 25}
CHANNEL_LANE_FROM = 10
# bwd_mma (bfloat16 x and weights, no seq_idx) from MMA_MIN_WIDTH on, on rows of at most
# MMA_SHORT_ROW positions from MMA_SHORT_MIN_WIDTH (bwd_time below: on (8, 5120, 2048) 16 / 7 %
# faster at widths 11 / 12, level at 13; on (64, 1024, 512) 32 / 22 / 13 % faster at 12 / 13 /
# 14, level at 16; 5 % slower at 12 on (1, 4096, 16384): benchmarks/NOTES.md, "The tensor-core
# crossovers again"), for spans of up to MMA_SPAN positions (a multiple of 256); on
# channel-contiguous x from MMA_CL_MIN_WIDTH (past bwd_channel's widths), spans of up to
# MMA_CL_SPAN, where a block's shared memory fits the device.
MMA_MIN_WIDTH, MMA_SHORT_MIN_WIDTH, MMA_SHORT_ROW, MMA_SPAN = 12, 16, 512, 1024
MMA_CL_MIN_WIDTH, MMA_CL_SPAN = 21, 512
# bwd_mma_time (bwd_mma's calls up to MMA_TIME_MAX_STEPS k-steps whose x and dout rows start on
# 8-byte boundaries): chunks of MMA_TIME_CHUNK = (groups of 256 positions, warps a block), one
# wave of warps, each a run of the call's chunks in channel-major order; at 3 k-steps, rows made
# of whole chunks of MMA_TIME_LONG_CHUNK take those (8 warps an SM: 255 registers, no spills).
# Width 16 (8, 5120, 2048) 2.40 -> 2.55 TB/s with the chunks staged by cp.async, width 31 1.83 ->
# 2.07 in the long chunks (benchmarks/NOTES.md, "bwd_mma_time's chunks staged by cp.async";
# before: "bwd_mma_time: the backward's chunk in registers").
MMA_TIME_MAX_STEPS = 3
MMA_TIME_CHUNK, MMA_TIME_LONG_CHUNK = (2, 4), (4, 2)
MMA_CL_STEPS = 5  # bwd_mma on channel-contiguous x: most k-steps (widths up to 65)
# bwd_mma_cl (bfloat16 x and weights, channel-contiguous x, dout and dx in 16-byte aligned runs of
# 8 channels, no seq_idx) from MMA_CL_FROM on, where bwd_mma's channel-last form stops, and from
# MMA_CL_LONG_FROM (KS 5) where its pieces are MMA_CL_LONG_SPAN positions or more: a piece's
# steps reach 127 positions past it, which rows of 512 pay for in 6 steps for 4 steps' outputs
# (H100, TB/s at width 64 against bwd_mma's: (8, 5120, 2048) 0.82 / 0.74, (1, 4096, 16384) 0.88
# / 0.76, rows of 1024 level, of 512 0.61 / 0.73; KS 4 slower on every shape: benchmarks/NOTES.md,
# "bwd_mma_cl at KS 5 on long pieces"). Pieces of rows of MMA_CL_LONGEST positions or half, a
# quarter .. down to MMA_CL_SHORTEST: the longest whose estimated time is within MMA_CL_SLACK of
# the least (a wave of items counted at least MMA_CL_FILL as long as a full one; each piece's
# steps reach D or 127 positions past it).
MMA_CL_FROM = 66
MMA_CL_LONG_FROM, MMA_CL_LONG_SPAN = 50, 2048  # (MMA_CL_LONG_FROM <= MMA_CL_FROM)
MMA_CL_LONGEST, MMA_CL_SHORTEST, MMA_CL_FILL, MMA_CL_SLACK = 4096, 512, 0.8, 1.05
# bwd_mma on channel-contiguous x: whole channel groups a block up to this many k-steps (widths
# 16 / 31 / 48: 10-15 / 6 / 2-5 % faster than runs of the items; width 64: level or 1.5 %
# slower), evenly split runs beyond (benchmarks/NOTES.md, "bwd_mma's channel-last blocks on
# neighbouring channels").
MMA_CL_WHOLE_STEPS = 4
# bwd_mma_block (a block's warps share a channel and split dweight's lags) from this many k-steps
# on, for spans of up to MMA_BLOCK_SPAN positions a warp.
MMA_BLOCK_STEPS, MMA_BLOCK_SPAN = 6, 512
# bwd_time's chunks: (16-byte vectors a lane, warps a block, staging areas a warp) for rows of
# up to so many bytes (a row in one chunk), and TIME_LONG_CHUNK for longer rows. With two
# staging areas a run's next chunk is copied while one is computed; on the shortest rows the
# second area costs more than it gains (benchmarks/NOTES.md, "bwd_time's second staging area,
# and bwd_channel's groups").
TIME_CHUNKS = ((512, (1, 2, 1)), (1024, (2, 2, 2)), (2048, (4, 2, 2)))
TIME_LONG_CHUNK = (8, 1, 1)
# bwd_time: a warp takes runs of up to TIME_RUN chunks of a channel (taps loaded and dweight
# summed once a run), as long as the call keeps TIME_MIN_RUNS runs.
TIME_RUN, TIME_MIN_RUNS = 8, 16384
# bwd_channel: (time steps per tile, rounded up to a multiple of the width; bytes of a lane's
# channel vector, one element from CHANNEL_LANE_FROM; tiles staged a warp, two where more would
# leave a block fewer than 4 warps) by itemsize. 16-bit x: three tiles of 8 steps (two in
# flight): on the H200 0-3 % faster than two of 16 at width 4 and 6 % at width 5 (on H100s two of
# 16 are 1-1.4 % faster); more tiles in flight were slower (benchmarks/NOTES.md, "bwd_channel's
# staging depth", "bwd_channel's deeper staging, measured").
CHANNEL_TILE = {2: (8, 4, 3), 4: (16, 8, 2), 8: (8, 16, 2)}
CHANNEL_SMEM = 40 * 1024  # bwd_channel: most static shared memory per block
# bwd_channel_pair (16-bit x at CHANNEL_PAIR_WIDTHS, which divide its 8-step tile; no seq_idx,
# whole strips of 128 channels in 16-byte aligned rows): CHANNEL_PAIRS pairs of warps a block, a
# pair a group of four channels a lane, so that each staged row is 256 bytes. On the H200,
# against bwd_channel (TB/s, bfloat16 width 4): (8, 5120, 2048) 3.40 -> 3.55, its channel slice
# 3.30 -> 3.56, (1, 4096, 16384) 3.40 -> 3.51, (64, 1024, 512) 3.18 -> 3.22, width 2 3.33 ->
# 3.43, float16 3.34 -> 3.59 (benchmarks/NOTES.md, "bwd_channel_pair: warps in pairs on 256-byte
# rows"). Not width 8: four channels' 8 taps and windows a lane spill 1.3 KB at its 128
# registers (1.25 TB/s on an H100, where bwd_channel ran 2.1: "bwd_channel_pair at width 8").
CHANNEL_PAIRS = 2
CHANNEL_PAIR_WIDTHS = (1, 2, 4)
# bwd_channel: time steps a group (one group a warp) from CHANNEL_MIN_STEPS to CHANNEL_STEPS,
# the groups of a call at least CHANNEL_MIN_GROUPS where one wave of the device's warps holds
# them (``_channel_group_tiles``); up to CHANNEL_LONG_STEPS where groups of CHANNEL_STEPS would
# take more than one wave and those fit one (bfloat16 widths 3 / 5 / 6 / 7 on (8, 5120, 2048),
# tiles of 9 / 10 / 12 / 14 steps: 2.9 / 2.9 / 2.6 / 2.0 -> 3.4 / 3.3 / 2.95 / 2.5 TB/s; at 768,
# widths 7 / 8 / 9 there, three groups a row of 686 / 688 / 684 steps in 0.91 waves against
# 1.52 / 1.21 / 1.52, +1.4 / +11.6 / +5 % on an H100, width 6 -1.2 %; float32 in one wave of
# groups of 1026 steps, 4-5 % slower than in 1.7 waves; benchmarks/NOTES.md, "bwd_channel's
# groups in one wave", "bwd_channel's one-wave groups up to 768 steps").
CHANNEL_STEPS, CHANNEL_MIN_GROUPS, CHANNEL_MIN_STEPS, CHANNEL_LONG_STEPS = 512, 2048, 16, 768
# bwd_channel's block sums: where a call's batch rows fit one block's warps with groups of at most
# CHANNEL_BLOCK_STEPS steps, block s takes strip s and adds its warps' dweight / dbias itself:
# one part, so no partials to allocate and no bwd_reduce to launch, which is what a short call
# such as a (1, 256, 512) training step's spends its host time on; its GPU time is longer, a
# warp a scheduler (benchmarks/NOTES.md, "bwd_channel's block sums, and the step's lean path in
# one function").
CHANNEL_BLOCK_STEPS = 128
GENERAL_THREADS = 256  # bwd_dz, bwd_dx: threads per block
STATES_THREADS = 64  # bwd_states: threads per block
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}

#: The parameter fields every backward kernel takes from the call, after its thirteen pointers
#: (x, weight, bias, seq_idx, initial_states, dout, dfinal_states, dx, dweight, dbias,
#: dinitial_states, partials, scratch; 0 when absent). ``n_parts`` (parts of the dweight
#: partials) comes from the plan.
FIELDS = (
    "batch", "dim", "seqlen", "width",
    "x_batch_stride", "x_c_stride", "x_l_stride",
    "weight_c_stride", "weight_width_stride", "bias_stride",
    "seq_batch_stride", "seq_l_stride",
    "init_batch_stride", "init_c_stride", "init_l_stride",
    "dout_batch_stride", "dout_c_stride", "dout_l_stride",
    "dfinal_batch_stride", "dfinal_c_stride", "dfinal_l_stride",
    "dx_batch_stride", "dx_c_stride", "dx_l_stride",
    "dinit_batch_stride", "dinit_c_stride", "dinit_l_stride",
    "dweight_c_stride", "dweight_width_stride", "dbias_stride",
    "weight_dtype", "bias_dtype", "seq_dtype", "init_dtype", "dfinal_dtype",
    "silu_act", "n_parts",
)  # fmt: skip
POINTERS = 13
_SCRATCH = ("scratch_batch_stride", "scratch_c_stride", "scratch_l_stride")

# Every backward kernel is launched as a programmatic dependent launch (``Launch.pdl``; each
# begins with wait_for_previous_kernel()): on sm_90 its blocks are scheduled while the kernel
# before it (the call's main kernel before bwd_reduce, the call before) finishes, 2-5 % of a
# call on the H200 (benchmarks/NOTES.md, "Programmatic dependent launch of the backward").
TIME = Kernel(
    "bwd_time", "bwd_time.cu", "BwdTimeParams",
    (
        "x_aligned", "dout_aligned", "dx_aligned", "chunk_divisor", "dim_divisor", "runs",
        "run_chunks", "whole_rows",
    ),
    pdl=True,
)  # fmt: skip
CHANNEL = Kernel(
    "bwd_channel", "bwd_channel.cu", "BwdChannelParams",
    (
        "dout_aligned", "dx_aligned", "rows16", "strip_divisor", "group_divisor",
        "group_tiles", "block_sum",
    ),
    pdl=True,
)  # fmt: skip
CHANNEL_PAIR = Kernel(
    "bwd_channel_pair", "bwd_channel.cu", "BwdChannelParams", CHANNEL.plan_fields, pdl=True
)
DZ = Kernel("bwd_dz", "bwd_general.cu", "BwdDzParams", ("channels_fastest", *_SCRATCH), pdl=True)
DX = Kernel("bwd_dx", "bwd_general.cu", "BwdDxParams", ("channels_fastest", *_SCRATCH), pdl=True)
WEIGHT = Kernel("bwd_weight", "bwd_general.cu", "BwdWeightParams", _SCRATCH, pdl=True)
MMA = Kernel(
    "bwd_mma", "bwd_mma.cu", "BwdMmaParams",
    (
        "x_aligned", "dout_aligned", "dx_aligned", "span", "per", "whole", "warp_bytes",
        "dout_at", "x1_at", "dout1_at", "dzl_at", "frag_at", "pad_at", "stage_at",
    ),
    pdl=True,
)  # fmt: skip
MMA_TIME = Kernel(
    "bwd_mma_time", "bwd_mma_time.cu", "BwdMmaTimeParams",
    ("dx_aligned", "per"),
    pdl=True,
)  # fmt: skip
MMA_BLOCK = Kernel(
    "bwd_mma_block", "bwd_mma.cu", "BwdMmaBlockParams",
    (
        "x_aligned", "dout_aligned", "dx_aligned", "span", "per", "x1_at", "dout0_at",
        "dout1_at", "dzl0_at", "dzl1_at", "frag_at", "pad_at", "scratch_at", "flags_at",
    ),
    pdl=True,
)  # fmt: skip
WIDE = Kernel(
    "bwd_wide", "bwd_wide.cu", "BwdWideParams",
    (
        "x_channels_fastest", "dout_channels_fastest", "dx_channels_fastest", "seg_tiles",
        "row_slots", "tap_slots", "dz_at", "taps_at", "rtaps_at",
    ),
    pdl=True,
)  # fmt: skip
MMA_CL = Kernel(
    "bwd_mma_cl", "bwd_mma_cl.cu", "BwdMmaClParams",
    ("span", "pieces", "group_divisor", "piece_divisor", "taps_at"),
    pdl=True,
)  # fmt: skip
STATES = Kernel("bwd_states", "bwd_general.cu", "BwdStatesParams", pdl=True)
REDUCE = Kernel("bwd_reduce", "bwd_general.cu", "BwdReduceParams", pdl=True)
KERNELS = (
    TIME, CHANNEL, CHANNEL_PAIR, MMA, MMA_TIME, MMA_BLOCK, MMA_CL, WIDE, DZ, DX, WEIGHT, STATES,
    REDUCE,
)  # fmt: skip

SOURCES = bind_sources(
    KERNELS, "cupyconv/_backward_plan.py (CONSTANTS, FIELDS, KERNELS)", CONSTANTS, FIELDS
)


@dataclass(frozen=True)
class BackwardPlan:
    """The launches of one backward call, in order, and what they need besides the call's
    arrays: ``n_parts`` blocks of dweight partials (``[n_parts, dim, width + 1]``, accumulation
    dtype; none for a single part), and a scratch array of dz with ``scratch_strides`` (None:
    no scratch)."""

    launches: tuple[Launch, ...]
    n_parts: int
    scratch_strides: tuple[int, int, int] | None


def _time_name(dtype: str, width: int, seq: bool, chunk) -> str:
    vectors, warps, buffers = chunk
    s = str(seq).lower()
    return f"bwd_time<{C_TYPES[dtype]}, {width}, {s}, {vectors}, {warps}, {buffers}>"


def _channel_tile(dtype: str, width: int) -> tuple[int, int, int, int]:
    """bwd_channel's (R, BYTES, BUFS, WARPS): R time steps a tile (CHANNEL_TILE's, rounded up
    to a multiple of the width), BUFS tiles of x and dout rows staged per warp, and as many warps
    a block as fit CHANNEL_SMEM, at most 4."""
    steps, lane_bytes, bufs = CHANNEL_TILE[ITEMSIZE[dtype]]
    if width >= CHANNEL_LANE_FROM:
        lane_bytes = ITEMSIZE[dtype]
    r = -(-steps // width) * width
    tile = 2 * r * 32 * lane_bytes  # a tile's rows of x and dout
    if bufs * tile > CHANNEL_SMEM // 4:
        bufs = 2
    return r, lane_bytes, bufs, max(1, min(4, CHANNEL_SMEM // (bufs * tile)))


def _channel_takes(dtype: str, width: int, seq: bool) -> bool:
    """Whether bwd_channel serves channel-contiguous x of ``dtype`` at ``width`` (its vectors
    aside)."""
    if seq:
        return width <= min(CHANNEL_SEQ_MAX_WIDTH, CHANNEL_MAX_WIDTH)
    return width <= CHANNEL_MAX_WIDTH and width < CHANNEL_WIDE_FROM[dtype]


def _pair_takes(width: int) -> bool:
    """Whether bwd_channel_pair serves 16-bit x at ``width``: CHANNEL_PAIR_WIDTHS."""
    return width in CHANNEL_PAIR_WIDTHS


def _pair_name(dtype: str, width: int) -> str:
    steps, _, bufs = CHANNEL_TILE[2]
    return f"bwd_channel_pair<{C_TYPES[dtype]}, {width}, {steps}, {bufs}, {CHANNEL_PAIRS}>"


def _channel_pairs(x: Array, dout: Array, dx: Array, width: int, has_seq: bool) -> bool:
    """Whether bwd_channel_pair may serve the call: 16-bit x, no seq_idx, whole strips of 128
    channels in 16-byte aligned rows of x and dout, dout and dx in 8-byte lane vectors."""
    return (
        x.itemsize == 2 and not has_seq and _pair_takes(width) and x.shape[1] % 128 == 0
        and rows_aligned(x, 1) and rows_aligned(dout, 1) and _channel_vectors(dout, 8)
        and _channel_vectors(dx, 8)
    )  # fmt: skip


def _channel_name(dtype: str, width: int, seq: bool) -> str:
    r, lane_bytes, bufs, warps = _channel_tile(dtype, width)
    s = str(seq).lower()
    return f"bwd_channel<{C_TYPES[dtype]}, {width}, {s}, {r}, {lane_bytes}, {bufs}, {warps}>"


def _mma_name(width: int, channel_last: bool = False) -> str:
    steps = mma_steps(width)
    if not channel_last and steps >= MMA_BLOCK_STEPS:
        return f"bwd_mma_block<{C_TYPES['bfloat16']}, {steps}>"
    return f"bwd_mma<{C_TYPES['bfloat16']}, {steps}, {int(channel_last)}>"


def _time_rows(x: Array) -> bool:
    """Whether x's rows are time-contiguous (or one step long, with channels not contiguous)."""
    _, x_c, x_l = x.strides
    return x_l == 1 or (x.shape[2] == 1 and x_c != 1)


def _mma_time_name(width: int, chunk: tuple[int, int]) -> str:
    groups, warps = chunk
    return f"bwd_mma_time<{C_TYPES['bfloat16']}, {mma_steps(width)}, {groups}, {warps}>"


def takes_mma(x: Array, weight_dtype: str, width: int, has_seq: bool) -> bool:
    """Whether bwd_mma (or bwd_mma_block, from MMA_BLOCK_STEPS k-steps) serves the call:
    bfloat16 x and weights, time-contiguous x (or rows of one step), no seq_idx, width
    MMA_MIN_WIDTH or more (rows of at most MMA_SHORT_ROW positions: MMA_SHORT_MIN_WIDTH too)."""
    return (
        x.dtype_name == "bfloat16" and weight_dtype == "bfloat16" and not has_seq
        and width >= MMA_MIN_WIDTH
        and (x.shape[2] > MMA_SHORT_ROW or width >= MMA_SHORT_MIN_WIDTH) and _time_rows(x)
    )  # fmt: skip


def takes_mma_cl(x: Array, dout: Array, dx: Array, weight_dtype: str, width: int, has_seq):
    """Whether bwd_mma's channel-contiguous form may serve the call (if a block fits the
    device): bfloat16 x and weights, no seq_idx, width from MMA_CL_MIN_WIDTH to the widest
    MMA_CL_STEPS allow, and x, dout and dx channel-contiguous in 16-byte aligned runs of 8
    channels."""
    return (
        x.dtype_name == "bfloat16" and weight_dtype == "bfloat16" and not has_seq
        and MMA_CL_MIN_WIDTH <= width and mma_steps(width) <= MMA_CL_STEPS
        and x.shape[1] % 8 == 0 and all(rows_aligned(a, 1) for a in (x, dout, dx))
    )  # fmt: skip


def _cl_steps(width: int) -> int:
    """bwd_mma_cl's KS for ``width``: mma_steps, and 10 for width 129 (up to KS 9 its lags are
    held in one fragment of 128)."""
    return max(mma_steps(width), 10) if width > 128 else mma_steps(width)


def takes_cl_tensor(x: Array, dout: Array, dx: Array, weight_dtype: str, width: int, has_seq):
    """Whether bwd_mma_cl may serve the call (if a block fits the device; below MMA_CL_FROM, if
    its pieces are long enough): bfloat16 x and weights, no seq_idx, width MMA_CL_LONG_FROM or
    more, and x, dout and dx channel-contiguous in 16-byte aligned runs of 8 channels."""
    return (
        x.dtype_name == "bfloat16" and weight_dtype == "bfloat16" and not has_seq
        and width >= MMA_CL_LONG_FROM
        and x.shape[1] % 8 == 0 and all(rows_aligned(a, 1) for a in (x, dout, dx))
    )  # fmt: skip


def all_backward_instances(dtypes=tuple(C_TYPES), widths=range(1, 257)) -> dict:
    """Every backward template instance the plan can produce for these x dtypes and widths,
    by source."""
    found: dict = {}
    for d in dtypes:
        for k in (WIDE, DZ, DX, WEIGHT, STATES):
            found.setdefault(k.source, set()).add(f"{k.template}<{C_TYPES[d]}>")
        for per in (1, REDUCE_SUMS):
            found.setdefault(REDUCE.source, set()).add(f"bwd_reduce<{C_TYPES[d]}, {per}>")
        for w in widths:
            for seq in (False, True):
                if w <= TIME_MAX_WIDTH:
                    for chunk in (*(c for _, c in TIME_CHUNKS), TIME_LONG_CHUNK):
                        found.setdefault(TIME.source, set()).add(_time_name(d, w, seq, chunk))
                if _channel_takes(d, w, seq):
                    found.setdefault(CHANNEL.source, set()).add(_channel_name(d, w, seq))
            if ITEMSIZE[d] == 2 and _pair_takes(w):
                found.setdefault(CHANNEL_PAIR.source, set()).add(_pair_name(d, w))
            if d == "bfloat16" and w >= MMA_MIN_WIDTH:
                found.setdefault(MMA.source, set()).add(_mma_name(w))
                if mma_steps(w) <= MMA_TIME_MAX_STEPS:
                    long = (MMA_TIME_LONG_CHUNK,) if mma_steps(w) >= 3 else ()
                    for chunk in (MMA_TIME_CHUNK, *long):
                        found.setdefault(MMA_TIME.source, set()).add(_mma_time_name(w, chunk))
            if d == "bfloat16" and w >= MMA_CL_MIN_WIDTH and mma_steps(w) <= MMA_CL_STEPS:
                found.setdefault(MMA.source, set()).add(_mma_name(w, channel_last=True))
            if d == "bfloat16" and w >= MMA_CL_LONG_FROM:
                found.setdefault(MMA_CL.source, set()).add(_cl_name(w))
    return {source: sorted(names) for source, names in found.items()}


_plans: dict[tuple, BackwardPlan] = {}


def plan_backward(
    x: Array, dout: Array, dx: Array, width: int, has_seq: bool, states: bool,
    weight_dtype: str, device: int,
) -> BackwardPlan:  # fmt: skip
    """The kernels of a backward call on x [batch, dim, seqlen] (dim > 0), with bwd_states when
    ``states`` (dinitial_states asked for, or dfinal_states given); memoised per layout.
    Without tokens only bwd_states and the (zero) reductions run."""
    key = (
        x.dtype_name, weight_dtype, width, has_seq, states, x.shape, x.strides, x.ptr % 16,
        dout.strides, dout.ptr % 16, dx.strides, dx.ptr % 16, device,
    )  # fmt: skip
    plan = _plans.get(key)
    if plan is None:
        made = _plan_backward(x, dout, dx, width, has_seq, states, weight_dtype, device)
        plan = remember(_plans, key, made)
    return plan


def _grid(items: int, per_block: int) -> int:
    return max(1, min(-(-items // per_block), MAX_GRID))


def _plan_backward(x, dout, dx, width, has_seq, states, weight_dtype, device) -> BackwardPlan:
    batch, dim, seqlen = x.shape
    if batch * seqlen == 0:
        return _finish([], x, width, states, 0, None)
    t = C_TYPES[x.dtype_name]
    x_c = x.strides[1]
    itemsize = ITEMSIZE[x.dtype_name]
    if takes_mma(x, weight_dtype, width, has_seq):
        if _takes_mma_time(x, dout, width):
            return _plan_mma_time(x, dx, width, states, device)
        if mma_steps(width) >= MMA_BLOCK_STEPS:
            return _plan_mma_block(x, dout, dx, width, states, device)
        return _plan_mma(x, dout, dx, width, states, device)
    if takes_cl_tensor(x, dout, dx, weight_dtype, width, has_seq):
        plan = _plan_cl_tensor(x, width, states, device)
        if plan is not None:
            return plan
    if takes_mma_cl(x, dout, dx, weight_dtype, width, has_seq):
        plan = _plan_mma_cl(x, width, states, device)
        if plan is not None:
            return plan
    if _time_rows(x) and width <= TIME_MAX_WIDTH:
        return _plan_time(x, dout, dx, width, has_seq, states, itemsize)
    lane_bytes = _channel_tile(x.dtype_name, width)[1]
    channel = _channel_takes(x.dtype_name, width, has_seq)
    if x_c == 1 and channel and _channel_vectors(x, lane_bytes):
        return _plan_channel(x, dout, dx, width, has_seq, states, itemsize, device)
    if not has_seq:
        plan = _plan_wide(x, dout, dx, width, states, device)
        if plan is not None:
            return plan
    channels_fastest = _channels_fastest(x)
    if channels_fastest:  # dz laid out [batch, seqlen, dim]
        scratch = (seqlen * dim, 1, dim)
    else:
        scratch = (dim * seqlen, seqlen, 1)
    fields = dict(zip(_SCRATCH, scratch))
    runs = batch * -(-seqlen // CONSTANTS["WEIGHT_RUN"])
    n_parts = -(-runs // CONSTANTS["WEIGHT_THREADS"])
    elements = _grid(batch * dim * seqlen, GENERAL_THREADS)
    block = (GENERAL_THREADS, 1)
    launches = [
        DZ.launch(f"bwd_dz<{t}>", elements, block, channels_fastest=channels_fastest, **fields),
        DX.launch(f"bwd_dx<{t}>", elements, block, channels_fastest=channels_fastest, **fields),
        WEIGHT.launch(
            f"bwd_weight<{t}>",
            min(n_parts * dim, MAX_GRID),
            (CONSTANTS["WEIGHT_THREADS"], 1),
            **fields,
        ),
    ]
    return _finish(launches, x, width, states, n_parts, scratch)


def _plan_time(x, dout, dx, width, has_seq, states, itemsize) -> BackwardPlan:
    batch, dim, seqlen = x.shape
    row = seqlen * itemsize
    chunk = next((c for most, c in TIME_CHUNKS if row <= most), TIME_LONG_CHUNK)
    vectors, warps, _ = chunk
    span = 32 * vectors * 16 // itemsize  # positions of a chunk
    per_row = -(-seqlen // span)  # chunks of a row
    run = TIME_RUN
    while run > 1 and dim * -(-batch * per_row // run) < TIME_MIN_RUNS:
        run //= 2
    runs = -(-batch * per_row // run)  # a channel's runs, one per warp
    grid = _grid(dim * runs, warps)
    x_aligned, dout_aligned = rows_aligned(x, 2), rows_aligned(dout, 2)
    launch = TIME.launch(
        _time_name(x.dtype_name, width, has_seq, chunk), grid, (32 * warps, 1),
        x_aligned=x_aligned, dout_aligned=dout_aligned, dx_aligned=rows_aligned(dx, 2),
        chunk_divisor=fast_divisor(per_row), dim_divisor=fast_divisor(dim), runs=runs,
        run_chunks=run, whole_rows=seqlen == span and x_aligned and dout_aligned,
    )  # fmt: skip
    return _finish([launch], x, width, states, runs, None)


def _mma_layout(span: int, steps: int) -> dict:
    """One bwd_mma warp's shared memory for spans of ``span`` positions: byte offsets of its
    areas and their total ``warp_bytes``. With D = 16 (steps - 1) and TB = ceil(D / 128) blocks
    of dz past the span (a run's first item computes them, in buffer 0): buffer 0, x (D + span +
    128 TB inputs) then dout (span + 128 TB; dz's high half in its place); buffer 1, x (D +
    span) then dout (span + D); dz's low half, span + 128 TB; the fragments of z and dx, 512
    bytes a k-step each; the padded taps, forward and reversed, 2 D + 32 floats each."""
    d = 16 * (steps - 1)
    dz_len = span + 128 * -(-d // 128)
    dout_at = 2 * (d + dz_len)
    x1_at = dout_at + 2 * dz_len
    dout1_at = x1_at + 2 * (d + span)
    dzl_at = dout1_at + 2 * (span + d)
    frag_at = dzl_at + 2 * dz_len
    pad_at = frag_at + 2 * steps * 512
    return dict(
        warp_bytes=pad_at + 2 * (2 * d + 32) * 4,
        dout_at=dout_at, x1_at=x1_at, dout1_at=dout1_at, dzl_at=dzl_at, frag_at=frag_at,
        pad_at=pad_at,
    )  # fmt: skip


def _plan_mma(x, dout, dx, width, states, device) -> BackwardPlan:
    """A persistent grid of blocks of BWD_MMA_WARPS independent warps, each warp a run of
    items (spans of a row, channel-major). Spans start at MMA_SPAN (or the row rounded up to
    256) and halve, down to 256, while a block's shared memory would not fit the device (then
    blocks lose warps) or the items would not fill it twice over."""
    batch, dim, seqlen = x.shape
    steps, warps = mma_steps(width), CONSTANTS["BWD_MMA_WARPS"]
    name = _mma_name(width)

    def smem(span):
        return warps * _mma_layout(span, steps)["warp_bytes"]

    def items(span):
        return dim * batch * -(-seqlen // span)

    span, limit = min(MMA_SPAN, -(-seqlen // 256) * 256), shared_memory_limit(device)
    while span > 256 and smem(span) > limit:
        span = max(256, span // 512 * 256)
    while warps > 1 and smem(span) > limit:
        warps -= 1
    resident = resident_blocks(device, MMA.source, name, 32 * warps, smem(span))
    while span > 256 and items(span) < 2 * resident * warps:
        span = max(256, span // 512 * 256)
    resident = resident_blocks(device, MMA.source, name, 32 * warps, smem(span))
    grid = min(resident, -(-items(span) // warps), MAX_GRID)
    per = -(-items(span) // (grid * warps))
    launch = MMA.launch(
        name, grid, (32 * warps, 1), smem(span),
        x_aligned=rows_aligned(x, 2), dout_aligned=rows_aligned(dout, 2),
        dx_aligned=rows_aligned(dx, 2, 4), span=span, per=per, whole=0,
        **_mma_layout(span, steps), stage_at=0,
    )  # fmt: skip
    return _finish([launch], x, width, states, batch * -(-seqlen // span), None)


def _mma_time_chunk(x: Array, width: int) -> tuple[int, int]:
    """bwd_mma_time's chunk (groups of 256 positions, warps a block) for x at ``width``:
    MMA_TIME_LONG_CHUNK at 3 k-steps where the rows are made of whole long chunks, else
    MMA_TIME_CHUNK."""
    long = MMA_TIME_LONG_CHUNK
    if mma_steps(width) >= 3 and x.shape[2] % (256 * long[0]) == 0:
        return long
    return MMA_TIME_CHUNK


def _mma_time_chunks(x: Array, chunk: tuple[int, int]) -> tuple[int, int]:
    """bwd_mma_time's chunks (``chunk``) of a row, and of the call."""
    batch, dim, seqlen = x.shape
    per_row = -(-seqlen // (256 * chunk[0]))
    return per_row, batch * dim * per_row


def _takes_mma_time(x: Array, dout: Array, width: int) -> bool:
    """Whether bwd_mma_time serves a call bwd_mma would: up to MMA_TIME_MAX_STEPS k-steps, x
    and dout rows on 8-byte boundaries, fewer than 2^31 chunks (its indices are 32-bit)."""
    return (
        2 <= mma_steps(width) <= MMA_TIME_MAX_STEPS and rows_aligned(x, 2, 8)
        and rows_aligned(dout, 2, 8) and _mma_time_chunks(x, _mma_time_chunk(x, width))[1] < 2**31
    )  # fmt: skip


def _plan_mma_time(x, dx, width, states, device) -> BackwardPlan:
    """One wave of bwd_mma_time warps (``_mma_time_chunk``), each a run of ``per`` chunks of
    the call's in channel-major order (a part of the partials a chunk)."""
    batch = x.shape[0]
    chunk = _mma_time_chunk(x, width)
    warps = chunk[1]
    name = _mma_time_name(width, chunk)
    per_row, items = _mma_time_chunks(x, chunk)
    slots = resident_blocks(device, MMA_TIME.source, name, 32 * warps, 0) * warps
    per = -(-items // slots)
    launch = MMA_TIME.launch(
        name, _grid(-(-items // per), warps), (32 * warps, 1), dx_aligned=rows_aligned(dx, 2, 8),
        per=per,
    )  # fmt: skip
    return _finish([launch], x, width, states, batch * per_row, None)


def _mma_block_layout(span: int, steps: int) -> tuple[dict, int]:
    """A bwd_mma_block block's shared memory for spans of ``span`` positions a warp (BS =
    BWD_MMA_BLOCK_WARPS spans a block): byte offsets of its areas, and its total bytes. With D =
    16 (steps - 1) and TB = ceil(D / 128): buffer 0, x (D + BS + 128 TB), buffer 1, x (D + BS);
    dout (then dz's high half) and dz's low half, BS + 128 TB in buffer 0 and BS + D in buffer
    1; the fragments of z and dx, 512 bytes a k-step each; the padded taps, forward and
    reversed, 2 D + 32 floats each; a warp's scratch of max(256, 32 (N + 1)) floats (N = (D +
    32) / 32: a lag's C_d, or its dweight and dbias sums); an int a warp."""
    warps = CONSTANTS["BWD_MMA_BLOCK_WARPS"]
    d, bs = 16 * (steps - 1), warps * span
    more = 128 * -(-d // 128)
    scratch = max(256, 32 * ((d + 32) // 32 + 1))
    areas = (  # (the field of its offset, bytes), in order; buffer 0's x at 0
        (None, 2 * (d + bs + more)), ("x1_at", 2 * (d + bs)),
        ("dout0_at", 2 * (bs + more)), ("dout1_at", 2 * (bs + d)),
        ("dzl0_at", 2 * (bs + more)), ("dzl1_at", 2 * (bs + d)),
        ("frag_at", 2 * steps * 512), ("pad_at", 2 * (2 * d + 32) * 4),
        ("scratch_at", warps * scratch * 4), ("flags_at", 4 * warps),
    )  # fmt: skip
    layout, at = {}, 0
    for name, size in areas:
        if name:
            layout[name] = at
        at += size
    return layout, at


def _plan_mma_block(x, dout, dx, width, states, device) -> BackwardPlan:
    """A persistent grid of bwd_mma_block blocks, each a run of items (BWD_MMA_BLOCK_WARPS spans
    of a row, channel-major). Spans start at MMA_BLOCK_SPAN (or the row's share of a block,
    rounded up to 256) and halve, down to 256, while a block would not fit the device or the
    items would not fill it twice over."""
    batch, dim, seqlen = x.shape
    steps, warps = mma_steps(width), CONSTANTS["BWD_MMA_BLOCK_WARPS"]
    name = _mma_name(width)

    def items(span):
        return dim * batch * -(-seqlen // (warps * span))

    def smem_of(span):
        return _mma_block_layout(span, steps)[1]

    span = min(MMA_BLOCK_SPAN, -(-seqlen // (256 * warps)) * 256)
    limit = shared_memory_limit(device)
    while span > 256 and smem_of(span) > limit:
        span = max(256, span // 512 * 256)
    resident = resident_blocks(device, MMA_BLOCK.source, name, 32 * warps, smem_of(span))
    while span > 256 and items(span) < 2 * resident:
        span = max(256, span // 512 * 256)
    layout, smem = _mma_block_layout(span, steps)
    resident = resident_blocks(device, MMA_BLOCK.source, name, 32 * warps, smem)
    grid = min(resident, items(span), MAX_GRID)
    per = -(-items(span) // grid)
    launch = MMA_BLOCK.launch(
        name, grid, (32 * warps, 1), smem, x_aligned=rows_aligned(x, 2),
        dout_aligned=rows_aligned(dout, 2), dx_aligned=rows_aligned(dx, 2, 4), span=span,
        per=per, **layout,
    )  # fmt: skip
    return _finish([launch], x, width, states, batch * -(-seqlen // (warps * span)), None)


def _mma_cl_layout(span: int, steps: int) -> tuple[dict, int]:
    """A channel-contiguous bwd_mma block's shared memory: one warp's layout (``_mma_layout``)
    with the staging area's offset ``stage_at`` after the block's warps, and the block's total
    bytes (the staging area holds an item's rows of BWD_MMA_CL_WARPS channels, 2 bytes each:
    D + span + 128 TB of x and span + 128 TB of dout)."""
    d = 16 * (steps - 1)
    dz_len = span + 128 * -(-d // 128)
    warps = CONSTANTS["BWD_MMA_CL_WARPS"]
    layout = _mma_layout(span, steps)
    layout["stage_at"] = stage_at = warps * layout["warp_bytes"]
    return layout, stage_at + 2 * warps * (d + 2 * dz_len)


def _plan_mma_cl(x, width, states, device) -> BackwardPlan | None:
    """Blocks of BWD_MMA_CL_WARPS warps (one channel each), one a SM: up to MMA_CL_WHOLE_STEPS
    k-steps block k takes the whole channel groups k, k + grid, .. while they fill every block
    (the blocks at work read neighbouring channels); then one run of ``per`` items of the rest,
    shared evenly. Spans of MMA_CL_SPAN, halved down to 256 until a block fits the device's
    shared memory (None where none fits)."""
    batch, dim, seqlen = x.shape
    steps, warps = mma_steps(width), CONSTANTS["BWD_MMA_CL_WARPS"]
    span, limit = min(MMA_CL_SPAN, -(-seqlen // 256) * 256), shared_memory_limit(device)
    layout, smem = _mma_cl_layout(span, steps)
    while span > 256 and smem > limit:
        span = max(256, span // 512 * 256)
        layout, smem = _mma_cl_layout(span, steps)
    if smem > limit:
        return None
    name = _mma_name(width, channel_last=True)
    groups, group_items = -(-dim // warps), batch * -(-seqlen // span)
    resident = min(resident_blocks(device, MMA.source, name, 32 * warps, smem), MAX_GRID)
    whole = groups // resident * resident if steps <= MMA_CL_WHOLE_STEPS else 0
    rest = (groups - whole) * group_items
    per = max(1, -(-rest // resident))
    grid = min(resident, whole + -(-rest // per))
    launch = MMA.launch(
        name, grid, (32 * warps, 1), smem, x_aligned=True, dout_aligned=True, dx_aligned=True,
        span=span, per=per, whole=whole, **layout,
    )  # fmt: skip
    return _finish([launch], x, width, states, batch * -(-seqlen // span), None)


def _cl_name(width: int) -> str:
    return f"bwd_mma_cl<{C_TYPES['bfloat16']}, {_cl_steps(width)}>"


def cl_threads(ks: int) -> int:
    """bwd_mma_cl's threads a block at KS k-steps: BWD_CL_WARPS warps, twice as many from
    BWD_CL_DX_FROM (dx's own; ``bwd_cl_threads`` in its source)."""
    more = 2 if ks >= CONSTANTS["BWD_CL_DX_FROM"] else 1
    return 32 * CONSTANTS["BWD_CL_WARPS"] * more


def _cl_shared_memory(width: int) -> tuple[int, int]:
    """bwd_mma_cl's taps_at and bytes a block: its four rings (x, x one position later, dz's
    high and low halves; 32 channels of RING = 128 (LF + 1) positions and 16 bytes, LF = 1 up to
    KS 9, else 2; the dz rings' 16 bytes are the zeros dweight reads for blocks outside the
    unit), two x staging buffers and the dout buffer (128 positions of 32 channels), then each
    warp's taps (8 channels x D + 32 word pairs) and 8 biases."""
    ks = _cl_steps(width)
    d = 16 * (ks - 1)
    warps, step = CONSTANTS["BWD_CL_WARPS"], CONSTANTS["BWD_CL_STEP"]
    channels = 8 * warps
    ring = step * (2 if d <= 128 else 3)
    taps_at = 4 * channels * (2 * ring + 16) + 3 * step * 2 * channels
    return taps_at, taps_at + warps * (8 * (d + 32) + 8) * 4


def _plan_cl_tensor(x, width, states, device) -> BackwardPlan | None:
    """A persistent grid of BWD_CL_WARPS-warp blocks (twice as many warps from BWD_CL_DX_FROM
    k-steps: dx's own), each taking items (32 channels of a piece of ``span`` positions of a
    batch row, channel group fastest) in turn; one part a piece (None where a block does not fit
    the device, or below MMA_CL_FROM where the pieces are shorter than MMA_CL_LONG_SPAN)."""
    batch, dim, seqlen = x.shape
    d = 16 * (_cl_steps(width) - 1)
    warps, step = CONSTANTS["BWD_CL_WARPS"], CONSTANTS["BWD_CL_STEP"]
    spans = piece_spans(seqlen, step, MMA_CL_LONGEST, MMA_CL_SHORTEST)
    short = width < MMA_CL_FROM  # (taken on long pieces only)
    taps_at, smem = _cl_shared_memory(width)
    if smem > shared_memory_limit(device) or (short and spans[0] < MMA_CL_LONG_SPAN):
        return None
    name, groups = _cl_name(width), -(-dim // (8 * warps))
    threads = cl_threads(_cl_steps(width))
    resident = resident_blocks(device, MMA_CL.source, name, threads, smem)

    def items(span):  # (channel groups, pieces of the rows)
        return groups * batch * -(-seqlen // span)

    def time(span):  # a persistent grid's waves of items, each its steps long
        return (span + max(d, step - 1)) * waves(items(span), resident, MMA_CL_FILL)

    least = min(map(time, spans))
    span = max(s for s in spans if time(s) <= MMA_CL_SLACK * least)
    if short and span < MMA_CL_LONG_SPAN:
        return None
    pieces = -(-seqlen // span)
    launch = MMA_CL.launch(
        name, min(items(span), resident, MAX_GRID), (threads, 1), smem, span=span,
        pieces=pieces, group_divisor=fast_divisor(groups), piece_divisor=fast_divisor(pieces),
        taps_at=taps_at,
    )  # fmt: skip
    return _finish([launch], x, width, states, batch * pieces, None)


def _channels_fastest(a: Array) -> bool:
    """Whether ``a``'s channels lie closer together than its positions (rows of several)."""
    _, a_c, a_l = a.strides
    return abs(a_c) < abs(a_l) and a.shape[2] > 1


def _wide_layout(width: int, itemsize: int) -> tuple[dict, int]:
    """A bwd_wide block's shared memory (accumulation type): WIDE_CHANNELS rows of x, then of
    dz, of ``row_slots`` slots each (WIDE_TILE positions and the 8 (width // 8) + 16 a window
    read reaches past them, WIDE_BANK_PAD slots every WIDE_BANK_RUN); then the taps and the
    reversed taps, ``tap_slots`` each (the last tap block whole). Returns the plan fields and
    the bytes."""
    acc, channels = acc_bytes(itemsize), CONSTANTS["WIDE_CHANNELS"]
    reach = CONSTANTS["WIDE_TILE"] + 8 * (width // 8) + 16
    row_slots = reach + reach // CONSTANTS["WIDE_BANK_RUN"] * CONSTANTS["WIDE_BANK_PAD"]
    tap_slots = 8 * (width // 8) + 8
    dz_at = channels * row_slots * acc
    taps_at = 2 * dz_at
    rtaps_at = taps_at + channels * tap_slots * acc
    layout = dict(
        row_slots=row_slots, tap_slots=tap_slots, dz_at=dz_at, taps_at=taps_at, rtaps_at=rtaps_at
    )
    return layout, rtaps_at + channels * tap_slots * acc


def _plan_wide(x, dout, dx, width, states, device) -> BackwardPlan | None:
    """bwd_wide, where its block fits the device's shared memory (None where not): one item
    a block (a batch row's group of WIDE_CHANNELS channels and a segment of its tiles); rows
    split into segments of at least two tiles while the items would not fill the device
    twice over."""
    batch, dim, seqlen = x.shape
    layout, smem = _wide_layout(width, ITEMSIZE[x.dtype_name])
    if smem > shared_memory_limit(device):
        return None
    name = f"bwd_wide<{C_TYPES[x.dtype_name]}>"
    threads = CONSTANTS["WIDE_THREADS"]
    resident = resident_blocks(device, WIDE.source, name, threads, smem)
    tiles = -(-seqlen // CONSTANTS["WIDE_TILE"])
    rows = batch * -(-dim // CONSTANTS["WIDE_CHANNELS"])
    segments = max(1, min(tiles // 2, -(-2 * resident // rows)))
    seg_tiles = -(-tiles // segments)
    segments = -(-tiles // seg_tiles)
    launch = WIDE.launch(
        name, _grid(rows * segments, 1), (threads, 1), smem,
        x_channels_fastest=_channels_fastest(x), dout_channels_fastest=_channels_fastest(dout),
        dx_channels_fastest=_channels_fastest(dx), seg_tiles=seg_tiles, **layout,
    )  # fmt: skip
    return _finish([launch], x, width, states, batch * segments, None)


def _channel_vectors(a: Array, lane_bytes: int) -> bool:
    """Whether channel-contiguous ``a`` splits into bwd_channel's aligned lane vectors."""
    return a.shape[1] % (lane_bytes // a.itemsize) == 0 and rows_aligned(a, 1, lane_bytes)


def _channel_group_tiles(row_tiles: int, rows: int, steps: int, slots: int) -> int:
    """bwd_channel's tiles a group (a warp's work) for ``rows`` rows (batch rows x channel
    strips) of ``row_tiles`` tiles of ``steps`` steps, with ``slots`` warps resident on the
    device. A row's groups: the fewest that make CHANNEL_MIN_GROUPS groups in all, but no more
    than one wave of the slots holds; then as even as they can be, each of CHANNEL_MIN_STEPS to
    CHANNEL_STEPS steps (a warp's time is its group's length). Where that takes more than one
    wave and groups of up to CHANNEL_LONG_STEPS fit one, those."""
    wave = slots // rows  # groups a row that one wave holds
    most = max(1, CHANNEL_STEPS // steps)
    least = min(most, max(1, -(-CHANNEL_MIN_STEPS // steps)))
    per_row = max(1, min(-(-CHANNEL_MIN_GROUPS // rows), wave))
    tiles = min(most, max(least, -(-row_tiles // per_row)))
    one_wave = -(-row_tiles // max(wave, 1))  # tiles a group with a wave's groups a row
    if wave and -(-row_tiles // tiles) > wave and one_wave * steps <= CHANNEL_LONG_STEPS:
        tiles = one_wave
    return -(-row_tiles // -(-row_tiles // tiles))  # the same groups, evened out


def _plan_channel(x, dout, dx, width, has_seq, states, itemsize, device) -> BackwardPlan:
    batch, dim, seqlen = x.shape
    steps, lane_bytes, _, warps = _channel_tile(x.dtype_name, width)
    strips = -(-dim // (32 * lane_bytes // itemsize))
    row_tiles = -(-seqlen // steps)
    block_tiles = _channel_block_tiles(row_tiles, batch, steps, warps) if strips <= MAX_GRID else 0
    pairs = _channel_pairs(x, dout, dx, width, has_seq)
    block_sum, kernel = False, CHANNEL
    if block_tiles or not pairs:  # bwd_channel's groups: the block sums' test, or its plan
        name = _channel_name(x.dtype_name, width, has_seq)
        slots = resident_blocks(device, CHANNEL.source, name, 32 * warps, 0) * warps
        tiles = _channel_group_tiles(row_tiles, batch * strips, steps, slots)
        groups = -(-seqlen // (steps * tiles))
        grid = _grid(batch * groups * strips, warps)
        block_sum = block_tiles > 0 and batch * groups > 1
    if block_sum:  # one block a strip, its warps a batch row's groups each
        tiles, groups, grid = block_tiles, -(-row_tiles // block_tiles), strips
    elif pairs:  # a pair of warps a group of 128 channels
        name, kernel = _pair_name(x.dtype_name, width), CHANNEL_PAIR
        strips, warps = dim // 128, 2 * CHANNEL_PAIRS
        slots = resident_blocks(device, CHANNEL_PAIR.source, name, 32 * warps, 0) * CHANNEL_PAIRS
        tiles = _channel_group_tiles(row_tiles, batch * strips, steps, slots)
        groups = -(-seqlen // (steps * tiles))
        grid = _grid(batch * groups * strips, CHANNEL_PAIRS)
    launch = kernel.launch(
        name, grid, (32 * warps, 1), dout_aligned=_channel_vectors(dout, lane_bytes),
        dx_aligned=_channel_vectors(dx, lane_bytes),
        rows16=rows_aligned(x, 1) and rows_aligned(dout, 1),
        strip_divisor=fast_divisor(warps if block_sum else strips),
        group_divisor=fast_divisor(groups), group_tiles=tiles, block_sum=block_sum,
    )  # fmt: skip
    return _finish([launch], x, width, states, 1 if block_sum else batch * groups, None)


def _channel_block_tiles(row_tiles: int, batch: int, steps: int, warps: int) -> int:
    """bwd_channel's tiles a group with block sums (a block's ``warps`` warps take every batch
    row's groups of a strip), 0 where the batch rows do not fit a block or the groups would be
    longer than CHANNEL_BLOCK_STEPS."""
    if batch > warps:
        return 0
    tiles = -(-row_tiles // (warps // batch))
    return tiles if tiles * steps <= CHANNEL_BLOCK_STEPS else 0


def _finish(launches: list, x: Array, width: int, states: bool, n_parts: int, scratch):
    """The main kernel's launches, then bwd_states (when ``states``) and bwd_reduce (when
    there is more than one part)."""
    batch, dim, _ = x.shape
    t = C_TYPES[x.dtype_name]
    if states and width > 1 and batch > 0:
        grid = _grid(batch * dim, STATES_THREADS)
        launches.append(STATES.launch(f"bwd_states<{t}>", grid, (STATES_THREADS, 1)))
    if n_parts != 1:  # bwd_reduce: 32 of the dim (width + 1) sums a block, or 32 REDUCE_SUMS
        sums = dim * (width + 1)
        per = REDUCE_SUMS if sums > REDUCE_MANY else 1
        block = (32 * CONSTANTS["REDUCE_WARPS"], 1)
        launches.append(REDUCE.launch(f"bwd_reduce<{t}, {per}>", _grid(sums, 32 * per), block))
    return BackwardPlan(tuple(launches), n_parts, scratch)


# ---- the typed argument builder --------------------------------------------------------------

_ZEROS = {n: (0,) * n for n in (1, 2, 3)}


def _strides(a: Array | None, n: int) -> tuple[int, ...]:
    return _ZEROS[n] if a is None else a.strides


def backward_args(
    launch: Launch, plan: BackwardPlan, x, weight, bias, seq_idx, initial_states, dout,
    dfinal_states, dx, dweight, dbias, dinitial_states, partials, scratch, width, silu,
) -> ParamBlock:  # fmt: skip
    """The kernel arguments: the thirteen pointers (0 when absent), then the kernel's struct:
    FIELDS, then the plan's fields."""
    arrays = (
        x, weight, bias, seq_idx, initial_states, dout, dfinal_states, dx, dweight, dbias,
        dinitial_states, partials, scratch,
    )  # fmt: skip
    return pack((
        *(0 if a is None else a.ptr for a in arrays),
        *x.shape, width, *x.strides, *weight.strides, *_strides(bias, 1),
        *_strides(seq_idx, 2), *_strides(initial_states, 3), *dout.strides,
        *_strides(dfinal_states, 3), *dx.strides, *_strides(dinitial_states, 3),
        *dweight.strides, *_strides(dbias, 1),
        dtype_code(weight), dtype_code(bias), dtype_code(seq_idx), dtype_code(initial_states),
        dtype_code(dfinal_states), int(silu), plan.n_parts, *launch.plan_fields,
    ))  # fmt: skip
