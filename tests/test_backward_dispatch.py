"""Which kernels a backward call launches, with what arguments and scratch, for each layout and
feature (cupyconv/_backward_plan.py).

Runs without a GPU: the arrays are stand-ins exposing only ``__cuda_array_interface__`` and
``__dlpack_device__``, and the launcher records instead of launching.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from fakes import FakeCudaArray

import cupyconv
from cupyconv import _arrays, _backward_plan, _launch, backward
from cupyconv._backward_plan import CHANNEL_SMEM, all_backward_instances

KERNELS = {k.template: k for k in _backward_plan.KERNELS}
STEPS = _backward_plan._channel_tile("float16", 4)[0]  # bwd_channel's tile at width 4, 16-bit x
POINTERS = 13


def params_of(plan, args) -> dict:
    values = args.values
    fields = _backward_plan.FIELDS + KERNELS[plan.name.split("<")[0]].plan_fields
    params = dict(zip(fields, values[POINTERS:], strict=True))
    params["pointers"] = values[:POINTERS]
    return params


@pytest.fixture
def launches(monkeypatch):
    """Record (kernel template, launch, parameters, allocations) instead of launching."""
    record = {"launches": [], "allocations": []}

    def fake_empty(like, shape, strides, dtype):
        record["allocations"].append((tuple(shape), tuple(strides), np.dtype(dtype).name))
        return _arrays.describe(FakeCudaArray(shape, strides, dtype), "out")

    def fake_launch(plan, device, args, stream):
        record["launches"].append((plan.name.split("<")[0], plan, params_of(plan, args)))

    monkeypatch.setattr(backward, "empty", fake_empty)
    monkeypatch.setattr(backward, "launch", fake_launch)
    monkeypatch.setattr(backward, "stream_of", lambda a: None)
    monkeypatch.setattr(backward, "result", lambda like, arr: arr.obj)
    monkeypatch.setattr(_backward_plan, "_plans", {})
    monkeypatch.setattr(_backward_plan, "shared_memory_limit", lambda device: 232448)
    monkeypatch.setattr(_backward_plan, "resident_blocks", lambda d, s, name, t, smem: 132 * 2)
    return record


def cf(b, c, length, dtype=np.float32, **kw):
    return FakeCudaArray((b, c, length), dtype=dtype, **kw)


def cl(b, c, length, dtype=np.float32, **kw):
    return FakeCudaArray((b, c, length), (length * c, 1, c), dtype=dtype, **kw)


def call(x, width=4, dout=None, bias=True, **kw):
    b, c, length = x.__cuda_array_interface__["shape"]
    dtype = np.dtype(x.__cuda_array_interface__["typestr"])
    dout = dout if dout is not None else FakeCudaArray((b, c, length), x_strides(x), dtype)
    w = FakeCudaArray((c, width), dtype=dtype)
    bias_ = FakeCudaArray((c,), dtype=dtype) if bias else None
    return cupyconv.causal_conv1d_bwd(x, w, bias_, dout, activation="silu", **kw)


def x_strides(x):
    itemsize = np.dtype(x.__cuda_array_interface__["typestr"]).itemsize
    return tuple(s // itemsize for s in x.__cuda_array_interface__["strides"])


def names(record):
    return [name for name, _, _ in record["launches"]]


@pytest.mark.parametrize(
    "x,width,main,with_seq",
    [
        (cf(2, 64, 300), 4, "bwd_time", "bwd_time"),
        (cf(2, 64, 300), 16, "bwd_time", "bwd_time"),
        (cf(2, 64, 300), 17, "bwd_wide", "bwd_dz"),  # wider, not bfloat16
        (cl(2, 64, 300), 4, "bwd_channel", "bwd_channel"),
        (cl(2, 64, 300), 12, "bwd_channel", "bwd_channel"),
        (cl(2, 64, 300), 16, "bwd_channel", "bwd_channel"),
        (cl(2, 64, 300), 24, "bwd_channel", "bwd_channel"),
        (cl(2, 64, 300), 32, "bwd_channel", "bwd_dz"),  # seq_idx: bwd_channel up to 24
        (cl(2, 64, 300), 33, "bwd_wide", "bwd_dz"),  # bwd_wide takes no seq_idx
        (cl(2, 63, 300), 4, "bwd_wide", "bwd_dz"),  # channels do not split into lane vectors
        (cl(2, 63, 300), 10, "bwd_channel", "bwd_channel"),  # one channel a lane
        (cl(2, 64, 300, offset=1), 4, "bwd_wide", "bwd_dz"),  # misaligned
        (FakeCudaArray((2, 64, 300), (64 * 600, 600, 2)), 4, "bwd_wide", "bwd_dz"),  # step 2
    ],
)
def test_main_kernel_by_layout(launches, x, width, main, with_seq):
    """The main kernel without and with seq_idx; the general path's three kernels."""
    for seq_idx, want in ((None, main), (FakeCudaArray((2, 300), dtype=np.int32), with_seq)):
        launches["launches"].clear()
        call(x, width, seq_idx=seq_idx)
        got = names(launches)
        assert got[0] == want
        if want == "bwd_dz":
            assert got[:3] == ["bwd_dz", "bwd_dx", "bwd_weight"]
        parts = launches["launches"][0][2]["n_parts"]
        assert (got[-1] == "bwd_reduce") == (parts != 1) and "bwd_states" not in got


def test_partials_and_scratch(launches):
    """The partials hold n_parts blocks of (dim, width + 1) accumulators; only the general path
    allocates a dz scratch, laid out like x."""
    call(cf(3, 64, 5000), 4)
    (_, plan, params) = launches["launches"][0]
    parts = params["n_parts"]
    assert launches["allocations"][-1] == ((parts, 64, 5), (64 * 5, 5, 1), "float32")
    chunk = 32 * 8 * 4  # bwd_time long rows: 8 vectors of 4 float32 a lane
    assert parts == 3 * -(-5000 // chunk)
    launches["allocations"].clear()
    seq_idx = FakeCudaArray((3, 5000), dtype=np.int32)
    call(cl(3, 64, 5000), 20, seq_idx=seq_idx)  # general path, channel-last: dz [b, seqlen, dim]
    shapes = launches["allocations"]
    assert ((3, 64, 5000), (5000 * 64, 1, 64), "float32") in shapes


def test_reduce_launch(launches):
    """bwd_reduce: 32 sums (of dim (width + 1)) a block of REDUCE_WARPS warps, 32 REDUCE_SUMS
    where there are more than REDUCE_MANY."""
    warps = _backward_plan.CONSTANTS["REDUCE_WARPS"]
    per = _backward_plan.REDUCE_SUMS
    for dim, sums_a_thread in ((100, 1), (_backward_plan.REDUCE_MANY // 5 + 1, per)):
        launches["launches"].clear()
        call(cf(3, dim, 5000), 4)
        (_, plan, params) = launches["launches"][-1]
        assert plan.name == f"bwd_reduce<float, {sums_a_thread}>" and params["n_parts"] > 1
        assert plan.block == (32 * warps, 1)
        assert plan.grid == -(-dim * 5 // (32 * sums_a_thread))


@pytest.mark.parametrize(
    "shape,run",
    [((8, 5120, 2048), 2), ((1, 4096, 16384), 2), ((64, 1024, 512), 4), ((256, 4096, 64), 8),
     ((3, 64, 5000), 1), ((1, 256, 512), 1)],
)  # fmt: skip
def test_time_runs(launches, shape, run):
    """bwd_time's warps take runs of up to TIME_RUN chunks of a channel, halved while the call
    would have fewer than TIME_MIN_RUNS runs; one part of the partials a run."""
    batch, dim, seqlen = shape
    call(FakeCudaArray(shape, dtype=np.float16), 4)
    (name, plan, params) = launches["launches"][0]
    f = dict(zip(_backward_plan.TIME.plan_fields, plan.plan_fields, strict=True))
    vectors = next((c[0] for most, c in _backward_plan.TIME_CHUNKS if 2 * seqlen <= most), 8)
    chunks = batch * -(-seqlen // (32 * vectors * 8))  # a channel's (8 float16 a vector)
    assert name.startswith("bwd_time") and f["run_chunks"] == run
    assert f["runs"] == params["n_parts"] == -(-chunks // run)
    assert plan.grid == -(-dim * f["runs"] // (plan.block[0] // 32))
    assert f["dim_divisor"] == _launch.fast_divisor(dim)


@pytest.mark.parametrize(
    "dtype,seqlen,chunk",
    [(np.float16, 256, "1, 2, 1"), (np.float16, 257, "2, 2, 2"), (np.float16, 512, "2, 2, 2"),
     (np.float16, 513, "4, 2, 2"), (np.float16, 1024, "4, 2, 2"), (np.float16, 1025, "8, 1, 1"),
     (np.float32, 128, "1, 2, 1"), (np.float32, 256, "2, 2, 2"), (np.float64, 64, "1, 2, 1"),
     (np.float64, 256, "4, 2, 2"), (np.float64, 257, "8, 1, 1")],
)  # fmt: skip
def test_time_chunks_by_row_bytes(launches, dtype, seqlen, chunk):
    """bwd_time's chunk (vectors a lane, warps a block, staging areas a warp) by the row's bytes:
    one vector a lane up to 512, two with two staging areas up to 1024, four up to 2048 (a row
    in one chunk), then eight."""
    call(cf(4, 64, seqlen, dtype=dtype), 4)
    (name, plan, _) = launches["launches"][0]
    assert plan.name.endswith(f", 4, false, {chunk}>"), plan.name


@pytest.mark.parametrize(
    "x,width,main",
    [(cf(1, 64, 300), 4, "bwd_time"), (cl(1, 64, 16), 4, "bwd_channel"),
     (cl(1, 64, 300), 40, "bwd_wide")],
)  # fmt: skip
def test_single_part_has_no_partials(launches, x, width, main):
    """A call of one part writes dweight and dbias from its main kernel (write_sum): no
    partials allocated (their pointer 0), no bwd_reduce."""
    call(x, width)
    got = names(launches)
    assert got[0] == main and "bwd_reduce" not in got
    params = launches["launches"][0][2]
    assert params["n_parts"] == 1 and params["pointers"][11] == 0  # partials
    shapes = [shape for shape, _, _ in launches["allocations"]]
    assert (1, 64, width + 1) not in shapes


@pytest.mark.parametrize("dinit,dfinal", [(True, False), (False, True), (True, True)])
def test_states_kernel_when_needed(launches, dinit, dfinal):
    x = cf(2, 16, 100)
    init = FakeCudaArray((2, 16, 3))
    df = FakeCudaArray((2, 16, 3)) if dfinal else None
    call(x, 4, initial_states=init, dfinal_states=df, return_dinitial_states=dinit)
    got = names(launches)
    assert got == ["bwd_time", "bwd_states", "bwd_reduce"]
    params = launches["launches"][1][2]
    assert (params["pointers"][10] != 0) == dinit  # dinitial_states
    assert (params["pointers"][6] != 0) == dfinal  # dfinal_states


def test_no_tokens_still_writes_zero_gradients(launches):
    """seqlen 0: no main kernel; the reduction writes zeros (n_parts 0), bwd_states copies
    dfinal_states into dinitial_states."""
    x = cf(2, 16, 0)
    call(x, 4, initial_states=FakeCudaArray((2, 16, 3)), dfinal_states=FakeCudaArray((2, 16, 3)),
         return_dinitial_states=True)  # fmt: skip
    assert names(launches) == ["bwd_states", "bwd_reduce"]
    assert launches["launches"][-1][2]["n_parts"] == 0
    assert launches["launches"][0][2]["seq_dtype"] == 0


def test_vector_flags(launches):
    """dout and dx are read / written in vectors only when they are aligned like x."""
    x = cf(2, 64, 512, np.float16)
    dout = FakeCudaArray((2, 64, 512), (64 * 1024, 1024, 2), np.float16)  # strided in time
    dx = FakeCudaArray((2, 64, 512), dtype=np.float16, offset=1)  # misaligned
    call(x, 4, dout=dout, dx=dx)
    params = launches["launches"][0][2]
    assert (params["x_aligned"], params["dout_aligned"], params["dx_aligned"]) == (1, 0, 0)


@pytest.mark.parametrize(
    "dtype,seqlen,dout_offset,whole",
    [(np.float16, 256, 0, 1), (np.float16, 512, 0, 1), (np.float16, 1024, 0, 1),
     (np.float16, 2048, 0, 1), (np.float32, 1024, 0, 1), (np.float16, 500, 0, 0),
     (np.float16, 4096, 0, 0), (np.float16, 512, 1, 0)],
)  # fmt: skip
def test_whole_rows_flag(launches, dtype, seqlen, dout_offset, whole):
    """bwd_time stages a chunk as its row's vectors alone when every row is exactly one chunk
    and x and dout are aligned."""
    x = cf(2, 64, seqlen, dtype)
    dout = FakeCudaArray((2, 64, seqlen), dtype=dtype, offset=dout_offset)
    call(x, 4, dout=dout)
    name, _, params = launches["launches"][0]
    assert name == "bwd_time" and params["whole_rows"] == whole


def test_zero_stride_dout(launches):
    """An expanded dout (stride 0) is read element by element."""
    x = cl(2, 64, 100)
    dout = FakeCudaArray((2, 64, 100), (0, 0, 0))
    call(x, 4, dout=dout)
    name, _, params = launches["launches"][0]
    assert name == "bwd_channel" and params["dout_aligned"] == 0


def test_channel_tiles_fit_and_are_whole_multiples_of_the_width():
    """Every bwd_channel instance: R a multiple of K (compile-time ring slots), and its BUFS
    staged tiles per warp within the static shared-memory budget."""
    for names_ in all_backward_instances().values():
        for name in names_:
            if not name.startswith("bwd_channel<"):
                continue
            args = name[len("bwd_channel<") : -1].split(", ")
            width, steps, lane_bytes, bufs, warps = (int(a) for a in (args[1], *args[3:]))
            assert steps % width == 0, name
            assert warps * bufs * 2 * steps * 32 * lane_bytes <= CHANNEL_SMEM, name


@pytest.mark.parametrize(
    "shape,tiles",
    [
        ((8, 5120, 2048), 64),  # 640 rows (batch rows x strips of 64 channels) of 256 tiles
        ((1, 4096, 16384), 64),  # 64 rows: 32 groups a row make the 2048
        ((4, 1536, 4096), 24),  # 96 rows: 22 groups a row (2112)
        ((64, 1024, 512), 32),  # 1024 rows: 2 groups a row
        ((8, 5120, 2400), 75),  # 300 tiles a row: 4 groups of 75 (5 would be more than a wave)
        ((8, 5120, 2304), 72),  # 288 tiles a row: 4 groups of 72 (not 5 of up to 58)
        ((8, 5120, 2600), 82),  # 325 tiles: 4 groups of 82 (656 steps) in one wave, not 6 of 55
        ((8, 5120, 3200), 58),  # 400 tiles: 4 groups would pass CHANNEL_LONG_STEPS; 7 of 58
        ((24, 4000, 512), 64),  # 1512 rows: 2 groups a row would be more than a wave
        ((512, 1024, 512), 64),  # 8192 rows: more than a wave with one group a row
        ((2, 256, 512), 2),  # 8 rows: groups of CHANNEL_MIN_STEPS steps
    ],
)
def test_channel_groups(launches, monkeypatch, shape, tiles):
    """bwd_channel's groups (8-step tiles of 16-bit x, strips of 64 channels; here 132 SMs x 5
    blocks of 4 warps): the fewest a row that make CHANNEL_MIN_GROUPS in all within one wave of
    the resident warps, as even as they can be, of CHANNEL_MIN_STEPS to CHANNEL_STEPS steps, longer
    where groups that short would take more than one wave."""
    monkeypatch.setattr(_backward_plan, "resident_blocks", lambda d, s, name, t, smem: 132 * 5)
    monkeypatch.setattr(_backward_plan, "_channel_pairs", lambda *args: False)
    batch, dim, seqlen = shape
    call(cl(batch, dim, seqlen, dtype=np.float16))
    name, plan, params = launches["launches"][0]
    assert name == "bwd_channel" and params["group_tiles"] == tiles
    groups = -(-seqlen // (STEPS * tiles))
    assert params["group_divisor"] == _launch.fast_divisor(groups)
    assert plan.grid * 4 >= batch * -(-dim // 64) * groups


@pytest.mark.parametrize(
    "shape,tiles",
    [
        ((1, 256, 512), 16),  # 64 tiles a row: 4 groups of 128 steps, one a warp of the block
        ((2, 40, 50), 4),  # 7 tiles a row: 2 groups a row of 4 tiles, 2 batch rows
        ((3, 1024, 128), 16),  # one group a row
        ((2, 256, 512), 0),  # groups of 256 steps: longer than CHANNEL_BLOCK_STEPS
        ((5, 64, 64), 0),  # more batch rows than a block's 4 warps
        ((1, 64, 16), 0),  # one group: one part already
    ],
)
def test_channel_block_sums(launches, monkeypatch, shape, tiles):
    """bwd_channel's block sums: where every batch row's groups of a strip fit one block's
    warps with at most CHANNEL_BLOCK_STEPS steps each, one block a strip adds dweight and dbias
    itself (one part: no partials, no bwd_reduce); elsewhere the groups of test_channel_groups."""
    monkeypatch.setattr(_backward_plan, "resident_blocks", lambda d, s, name, t, smem: 132 * 5)
    monkeypatch.setattr(_backward_plan, "_channel_pairs", lambda *args: False)
    batch, dim, seqlen = shape
    call(cl(batch, dim, seqlen, dtype=np.float16))
    name, plan, params = launches["launches"][0]
    assert name == "bwd_channel" and params["block_sum"] == (tiles > 0)
    if tiles:
        groups = -(-seqlen // (STEPS * tiles))
        assert params["group_tiles"] == tiles and batch * groups <= 4
        assert plan.grid == -(-dim // 64) and params["n_parts"] == 1
        assert names(launches) == ["bwd_channel"] and params["pointers"][11] == 0  # partials
    else:
        assert params["group_tiles"] * STEPS <= _backward_plan.CHANNEL_STEPS


@pytest.mark.parametrize(
    "shape,tiles",
    [
        ((8, 5120, 2048), 86),  # 320 rows (batch rows x strips of 128 channels): 3 groups a row
        ((1, 4096, 16384), 63),  # 32 rows: 33 groups a row (a wave of 1056 pairs)
        ((64, 1024, 512), 32),  # 512 rows: 2 groups a row
    ],
)
def test_channel_pairs(launches, monkeypatch, shape, tiles):
    """bwd_channel_pair (16-bit x in whole strips of 128 channels): a pair of warps a group, the
    groups planned as bwd_channel's over the resident pairs (here 132 SMs x 4 blocks of 2). Its
    plan asks the occupancy of no other kernel (each one asked is compiled)."""
    asked = []

    def resident_blocks(device, source, name, threads, smem):
        asked.append(name)
        return 132 * 4

    monkeypatch.setattr(_backward_plan, "resident_blocks", resident_blocks)
    batch, dim, seqlen = shape
    call(cl(batch, dim, seqlen, dtype=np.float16))
    assert asked == ["bwd_channel_pair<__half, 4, 8, 3, 2>"]
    name, plan, params = launches["launches"][0]
    assert plan.name == "bwd_channel_pair<__half, 4, 8, 3, 2>" and plan.block == (128, 1)
    assert params["group_tiles"] == tiles and not params["block_sum"]
    groups = -(-seqlen // (STEPS * tiles))
    assert params["group_divisor"] == _launch.fast_divisor(groups)
    assert params["strip_divisor"] == _launch.fast_divisor(dim // 128)
    assert plan.grid * 2 >= batch * (dim // 128) * groups


def test_channel_pairs_where_they_apply(launches):
    """bwd_channel_pair takes 16-bit x without seq_idx at widths 1, 2 and 4, whole strips of
    128 channels in 16-byte aligned rows, dout and dx in 8-byte vectors; bwd_channel the rest."""
    seq_idx = FakeCudaArray((2, 512), dtype=np.int32)
    # 256 channels of a 264-channel projection, from channel 8 (16 bytes) or 4 (8 bytes)
    sliced = FakeCudaArray((2, 256, 512), (512 * 264, 1, 264), np.float16, offset=8)
    odd = FakeCudaArray((2, 256, 512), (512 * 264, 1, 264), np.float16, offset=4)
    cases = [
        (cl(2, 256, 512, np.float16), {}, 4, "bwd_channel_pair"),
        (cl(2, 256, 512, np.float16), {}, 2, "bwd_channel_pair"),
        (cl(2, 256, 512, np.float16), {}, 1, "bwd_channel_pair"),
        (cl(2, 256, 512, np.float16), {}, 3, "bwd_channel"),  # a 9-step tile
        (cl(2, 256, 512, np.float16), {}, 8, "bwd_channel"),  # the pair's lanes would spill
        (cl(2, 256, 512, np.float16), {"seq_idx": seq_idx}, 4, "bwd_channel"),
        (cl(2, 192, 512, np.float16), {}, 4, "bwd_channel"),  # a strip of 64 channels left
        (cl(2, 256, 512, np.float32), {}, 4, "bwd_channel"),
        (sliced, {}, 4, "bwd_channel_pair"),
        (odd, {}, 4, "bwd_channel"),
    ]
    for x, kw, width, kernel in cases:
        launches["launches"].clear()
        call(x, width, **kw)
        assert names(launches)[0] == kernel, (x.__cuda_array_interface__, width, kw)


def test_fields_match_the_structs():
    """Every kernel's parameter struct in the prelude lists FIELDS then its plan's fields."""
    text = _backward_plan.TIME.source.prelude
    for kernel in _backward_plan.KERNELS:
        fields = ", ".join(_backward_plan.FIELDS + kernel.plan_fields)
        assert f"struct {kernel.params} {{ long long {fields}; }};" in text


# ---- bwd_mma's plan (bfloat16 x and weights: arrays described directly, numpy fakes cannot
# carry bfloat16) -------------------------------------------------------------------------------


def bf16_rows(b, c, length, strides=None, ptr=1 << 40):
    import ml_dtypes

    strides = strides or (c * length, length, 1)
    return _arrays.Array(
        None, "cuda", 0, ptr, (b, c, length), strides, np.dtype(ml_dtypes.bfloat16)
    )


@pytest.mark.parametrize("limit", (232448, 166912, 101376), ids=("sm90", "sm80", "sm86"))
def test_tensor_core_plan_fits_the_device(monkeypatch, limit):
    """Every width from MMA_MIN_WIDTH (rows of at most MMA_SHORT_ROW positions: from
    MMA_SHORT_MIN_WIDTH) to 256 x short and long rows x aligned and misaligned x: bwd_mma below
    MMA_BLOCK_STEPS k-steps, bwd_mma_block from there, its shared memory within the opt-in limit
    (the layout's areas in order, 16-byte aligned), spans a multiple of 256, and runs that cover
    every item (a block's item: BWD_MMA_BLOCK_WARPS spans of a row). (bwd_mma_time, which
    takes the narrower aligned rows, has its own test.)"""
    monkeypatch.setattr(_backward_plan, "_plans", {})
    monkeypatch.setattr(_backward_plan, "MMA_TIME_MAX_STEPS", 0)
    monkeypatch.setattr(_backward_plan, "shared_memory_limit", lambda device: limit)
    monkeypatch.setattr(_backward_plan, "resident_blocks", lambda d, s, name, t, smem: 132 * 2)
    block_warps = _backward_plan.CONSTANTS["BWD_MMA_BLOCK_WARPS"]
    for seqlen in (1, 300, 700, 5000):
        for ptr in (1 << 40, (1 << 40) + 2):
            short = seqlen <= _backward_plan.MMA_SHORT_ROW
            first = _backward_plan.MMA_SHORT_MIN_WIDTH if short else _backward_plan.MMA_MIN_WIDTH
            for width in range(first, 257):
                x = bf16_rows(2, 40, seqlen, ptr=ptr)
                plan = _backward_plan.plan_backward(x, x, x, width, False, False, "bfloat16", 0)
                main, reduce_ = plan.launches
                steps = _launch.mma_steps(width)
                d = 16 * (steps - 1)
                assert d >= width - 1
                block = steps >= _backward_plan.MMA_BLOCK_STEPS
                if block:
                    assert main.name == f"bwd_mma_block<__nv_bfloat16, {steps}>"
                    kernel, areas = _backward_plan.MMA_BLOCK, ("x1_at", "dout0_at", "dout1_at")
                    areas += ("dzl0_at", "dzl1_at", "frag_at", "pad_at", "scratch_at", "flags_at")
                else:
                    assert main.name == f"bwd_mma<__nv_bfloat16, {steps}, 0>"
                    kernel, areas = _backward_plan.MMA, ("dout_at", "x1_at", "dout1_at")
                    areas += ("dzl_at", "frag_at", "pad_at")
                assert reduce_.name.startswith("bwd_reduce")
                f = dict(zip(kernel.plan_fields, main.plan_fields, strict=True))
                where = f"L={seqlen} ptr%16={ptr % 16} width {width}: {f}"
                warps = main.block[0] // 32
                if block:
                    assert warps == block_warps, where
                    layout, smem = _backward_plan._mma_block_layout(f["span"], steps)
                    assert main.smem == smem <= limit and layout["flags_at"] < smem, where
                    units, rows_per_item = main.grid, block_warps * f["span"]
                else:
                    assert 1 <= warps <= _backward_plan.CONSTANTS["BWD_MMA_WARPS"], where
                    assert main.smem == warps * f["warp_bytes"] <= limit, where
                    units, rows_per_item = main.grid * warps, f["span"]
                at = [f[k] for k in areas]
                assert at == sorted(at) and all(a % 16 == 0 for a in at), where
                assert f["span"] % 256 == 0, where
                items = 40 * 2 * -(-seqlen // rows_per_item)
                assert 1 <= main.grid and units * f["per"] >= items, where
                assert plan.n_parts == 2 * -(-seqlen // rows_per_item), where
                assert f["x_aligned"] == (ptr % 16 == 0 and seqlen % 8 == 0), where


def test_time_tensor_core_plan(monkeypatch):
    """bwd_mma_time for bwd_mma's calls of up to MMA_TIME_MAX_STEPS k-steps whose x and dout
    rows start on 8-byte boundaries: chunks of MMA_TIME_CHUNK (at 3 k-steps MMA_TIME_LONG_CHUNK
    where the rows are whole long chunks), one wave of warps, each a run of ``per`` chunks that
    together cover the call, a part of the partials a chunk; bwd_mma for the others."""
    monkeypatch.setattr(_backward_plan, "_plans", {})
    monkeypatch.setattr(_backward_plan, "shared_memory_limit", lambda device: 232448)
    resident = 132 * 3
    monkeypatch.setattr(_backward_plan, "resident_blocks", lambda d, s, name, t, smem: resident)
    bp, base = _backward_plan, 1 << 40
    assert bp.MMA_TIME_LONG_CHUNK[0] == 4 and bp.MMA_TIME_CHUNK[0] == 2
    for seqlen, ptr, dx_ptr in itertools.product(
        (300, 512, 700, 1024, 2048, 3072, 5000), (base, base + 8, base + 2), (base, base + 4)
    ):
        first = bp.MMA_SHORT_MIN_WIDTH if seqlen <= bp.MMA_SHORT_ROW else bp.MMA_MIN_WIDTH
        for width in range(first, 66):
            x, dx = bf16_rows(3, 40, seqlen, ptr=ptr), bf16_rows(3, 40, seqlen, ptr=dx_ptr)
            plan = bp.plan_backward(x, x, dx, width, False, False, "bfloat16", 0)
            main = plan.launches[0]
            steps = _launch.mma_steps(width)
            where = f"L={seqlen} ptr%16={ptr % 16} width {width}"
            if steps > bp.MMA_TIME_MAX_STEPS or ptr % 8:
                assert main.name.startswith("bwd_mma<"), where
                continue
            long = steps == 3 and seqlen % 1024 == 0
            groups, warps = bp.MMA_TIME_LONG_CHUNK if long else bp.MMA_TIME_CHUNK
            assert main.name == f"bwd_mma_time<__nv_bfloat16, {steps}, {groups}, {warps}>"
            f = dict(zip(bp.MMA_TIME.plan_fields, main.plan_fields, strict=True))
            per_row = -(-seqlen // (256 * groups))
            items, per = 40 * 3 * per_row, f["per"]
            assert main.block == (32 * warps, 1) and main.smem == 0, where
            assert per == -(-items // (resident * warps)), where
            assert (main.grid - 1) * warps * per < items <= main.grid * warps * per, where
            assert f["dx_aligned"] == (dx_ptr % 8 == 0), where
            assert plan.n_parts == 3 * per_row, where
    # dout's rows off the 8-byte boundary (x's on it): bwd_mma
    x, dout = bf16_rows(3, 40, 2048, ptr=base), bf16_rows(3, 40, 2048, ptr=base + 2)
    plan = bp.plan_backward(x, dout, x, 16, False, False, "bfloat16", 0)
    assert plan.launches[0].name.startswith("bwd_mma<")
    # 2^31 chunks or more (its indices are 32-bit): bwd_mma
    x = bf16_rows(2**20, 2**10, 256 * bp.MMA_TIME_CHUNK[0] * 2, ptr=base)
    plan = bp.plan_backward(x, x, x, 16, False, False, "bfloat16", 0)
    assert plan.launches[0].name.startswith("bwd_mma<")


@pytest.mark.parametrize("limit", (232448, 166912, 101376), ids=("sm90", "sm80", "sm86"))
def test_channel_last_tensor_core_plan_fits_the_device(monkeypatch, limit):
    """Channel-contiguous bfloat16 x, widths MMA_CL_MIN_WIDTH to 65 x row lengths: bwd_mma's
    channel-last form where a block of BWD_MMA_CL_WARPS warps and its staging area fit the
    opt-in limit (the staging area after the warps' areas, 16-byte aligned), spans a multiple of
    256, whole groups then runs covering every item of 16 channels; else bwd_channel or the
    general path."""
    monkeypatch.setattr(_backward_plan, "_plans", {})
    monkeypatch.setattr(_backward_plan, "shared_memory_limit", lambda device: limit)
    monkeypatch.setattr(_backward_plan, "resident_blocks", lambda d, s, name, t, smem: 132)
    warps = _backward_plan.CONSTANTS["BWD_MMA_CL_WARPS"]
    taken = set()
    for seqlen in (1, 300, 700, 5000):
        for width in range(_backward_plan.MMA_CL_MIN_WIDTH, 66):
            x = bf16_rows(2, 40, seqlen, strides=(40 * seqlen, 1, 40))
            plan = _backward_plan.plan_backward(x, x, x, width, False, False, "bfloat16", 0)
            main = plan.launches[0]
            if not main.name.startswith("bwd_mma"):
                narrow = width < _backward_plan.CHANNEL_WIDE_FROM["bfloat16"]
                assert main.name.startswith("bwd_channel" if narrow else "bwd_wide"), main.name
                continue
            steps = _launch.mma_steps(width)
            taken.add(steps)
            assert main.name == f"bwd_mma<__nv_bfloat16, {steps}, 1>" and main.block == (512, 1)
            f = dict(zip(_backward_plan.MMA.plan_fields, main.plan_fields, strict=True))
            where = f"L={seqlen} width {width}: {f}"
            d, tb = 16 * (steps - 1), -(-16 * (steps - 1) // 128)
            staged = 32 * ((d + f["span"] + 128 * tb) + (f["span"] + 128 * tb))
            assert f["stage_at"] == warps * f["warp_bytes"] and f["stage_at"] % 16 == 0, where
            assert main.smem == f["stage_at"] + staged <= limit, where
            assert f["span"] % 256 == 0 and f["span"] <= _backward_plan.MMA_CL_SPAN, where
            groups, group_items = -(-40 // warps), 2 * -(-seqlen // f["span"])
            rest = groups * group_items - f["whole"] * group_items  # (after the whole groups)
            assert f["whole"] % main.grid == 0 and f["whole"] <= groups, where
            assert 1 <= main.grid <= 132 and main.grid * f["per"] >= rest, where
            assert plan.n_parts == 2 * -(-seqlen // f["span"]), where
    fits = {232448: {3, 4, 5}, 166912: {3, 4}, 101376: set()}  # k-steps, by device
    assert taken == fits[limit]


@pytest.mark.parametrize(
    "shape,width,grid,whole,per",
    [
        ((8, 5120, 2048), 21, 132, 264, 14),  # 320 groups: two waves whole, 56 x 32 items left
        ((8, 5120, 2048), 31, 132, 264, 14),
        ((8, 5120, 2048), 48, 132, 264, 14),  # KS 4 (spans of 512)
        ((8, 5120, 2048), 64, 132, 0, 156),  # past MMA_CL_WHOLE_STEPS: runs of the items
        ((1, 4096, 16384), 21, 132, 132, 31),  # 256 groups of 32 spans
        ((64, 1024, 512), 21, 128, 0, 32),  # 64 groups, fewer than the blocks: runs of the items
    ],
)
def test_channel_last_tensor_core_runs(monkeypatch, shape, width, grid, whole, per):
    """bwd_mma's channel-contiguous blocks take whole channel groups while they fill every
    block (up to MMA_CL_WHOLE_STEPS k-steps), then the rest in runs of ``per`` items, at most
    one a block (bwd_mma_cl's long pieces off: it would take width 64 on rows of 2048)."""
    monkeypatch.setattr(_backward_plan, "_plans", {})
    monkeypatch.setattr(_backward_plan, "shared_memory_limit", lambda device: 232448)
    monkeypatch.setattr(_backward_plan, "resident_blocks", lambda d, s, name, t, smem: 132)
    monkeypatch.setattr(_backward_plan, "MMA_CL_LONG_FROM", _backward_plan.MMA_CL_FROM)
    batch, dim, seqlen = shape
    x = bf16_rows(batch, dim, seqlen, strides=(dim * seqlen, 1, dim))
    main = _backward_plan.plan_backward(x, x, x, width, False, False, "bfloat16", 0).launches[0]
    f = dict(zip(_backward_plan.MMA.plan_fields, main.plan_fields, strict=True))
    assert (main.grid, f["whole"], f["per"]) == (grid, whole, per), f


def test_channel_last_tensor_core_plan_needs_aligned_runs_of_8_channels(monkeypatch):
    monkeypatch.setattr(_backward_plan, "_plans", {})
    monkeypatch.setattr(_backward_plan, "shared_memory_limit", lambda device: 232448)
    monkeypatch.setattr(_backward_plan, "resident_blocks", lambda d, s, name, t, smem: 132)

    def main(x, dout=None, width=40, seq=False, weight="bfloat16"):  # (past bwd_channel's)
        d = dout or x
        return _backward_plan.plan_backward(x, d, x, width, seq, False, weight, 0).launches[0].name

    def cl(c=64, ptr=1 << 40, row=None):
        return bf16_rows(2, c, 300, strides=(c * 300, 1, row or c), ptr=ptr)

    assert main(cl()).startswith("bwd_mma") and main(cl(row=192)).startswith("bwd_mma")
    assert main(cl(), width=_backward_plan.MMA_CL_MIN_WIDTH).startswith("bwd_mma")
    assert main(cl(), width=_backward_plan.MMA_CL_MIN_WIDTH - 1).startswith("bwd_channel")
    # more k-steps than MMA_CL_STEPS: bwd_mma_cl, on the same conditions
    assert main(cl(), width=66).startswith("bwd_mma_cl<")
    for width in (40, 66, 256):
        assert main(cl(c=60), width=width).startswith("bwd_wide")  # channels not in runs of 8
        assert main(cl(ptr=(1 << 40) + 2), width=width).startswith("bwd_wide")  # runs off 16 bytes
        assert main(cl(row=68), width=width).startswith("bwd_wide")  # rows off 16 bytes
        dout = bf16_rows(2, 64, 300)  # time-contiguous
        assert main(cl(), dout=dout, width=width).startswith("bwd_wide")
        assert main(cl(), seq=True, width=width).startswith("bwd_dz")
        assert main(cl(), weight="float32", width=width).startswith("bwd_wide")


@pytest.mark.parametrize(
    "shape,width,kernel",
    [
        ((8, 5120, 2048), 49, "bwd_mma<__nv_bfloat16, 4, 1>"),  # KS 4: bwd_mma
        ((8, 5120, 2048), 50, "bwd_mma_cl<__nv_bfloat16, 5>"),  # KS 5, pieces of 2048
        ((8, 5120, 2048), 65, "bwd_mma_cl<__nv_bfloat16, 5>"),
        ((1, 4096, 16384), 64, "bwd_mma_cl<__nv_bfloat16, 5>"),  # pieces of 4096
        ((4, 4096, 2000), 64, "bwd_mma_cl<__nv_bfloat16, 5>"),  # one piece of 2048 a row
        ((16, 2048, 1024), 64, "bwd_mma<__nv_bfloat16, 5, 1>"),  # rows of 1024
        ((1, 64, 16384), 64, "bwd_mma<__nv_bfloat16, 5, 1>"),  # two groups: pieces of 512
        ((64, 1024, 512), 64, "bwd_mma<__nv_bfloat16, 5, 1>"),  # (bwd_mma_cl not compiled)
        ((8, 5120, 2048), 66, "bwd_mma_cl<__nv_bfloat16, 6>"),
        ((64, 1024, 512), 66, "bwd_mma_cl<__nv_bfloat16, 6>"),  # from MMA_CL_FROM: any pieces
    ],
)
def test_channel_last_kernel_at_ks_5_by_piece_length(monkeypatch, shape, width, kernel):
    """bwd_mma_cl from MMA_CL_LONG_FROM (KS 5) where its pieces are MMA_CL_LONG_SPAN positions
    or more, bwd_mma's channel-last form where they are shorter; bwd_mma_cl from MMA_CL_FROM
    whatever its pieces. Rows too short for such pieces do not compile it (the occupancy query)."""
    asked = []
    monkeypatch.setattr(_backward_plan, "_plans", {})
    monkeypatch.setattr(_backward_plan, "shared_memory_limit", lambda device: 232448)
    monkeypatch.setattr(
        _backward_plan, "resident_blocks", lambda d, s, name, t, smem: asked.append(name) or 264
    )
    batch, dim, seqlen = shape
    x = bf16_rows(batch, dim, seqlen, strides=(dim * seqlen, 1, dim))
    main = _backward_plan.plan_backward(x, x, x, width, False, False, "bfloat16", 0).launches[0]
    assert main.name == kernel
    if seqlen <= _backward_plan.MMA_CL_LONG_SPAN // 2 and width < _backward_plan.MMA_CL_FROM:
        assert not any(name.startswith("bwd_mma_cl") for name in asked), asked
    if kernel.startswith("bwd_mma_cl") and width < _backward_plan.MMA_CL_FROM:
        f = dict(zip(_backward_plan.MMA_CL.plan_fields, main.plan_fields, strict=True))
        assert f["span"] >= _backward_plan.MMA_CL_LONG_SPAN


@pytest.mark.parametrize("limit", (232448, 166912, 101376), ids=("sm90", "sm80", "sm86"))
def test_channel_last_tensor_core_kernel_plan(monkeypatch, limit):
    """Channel-contiguous bfloat16 x from MMA_CL_FROM to 256 x row lengths: bwd_mma_cl (KS 10
    from width 129) where its block fits the opt-in limit (four rings of 32 channels, the
    staging buffers, the warps' tap tables; 4 warps, 8 from BWD_CL_DX_FROM k-steps), else
    bwd_wide or the general path; pieces a multiple of 128 positions covering the rows, a part
    each, a grid of at most the resident blocks and the items."""
    monkeypatch.setattr(_backward_plan, "_plans", {})
    monkeypatch.setattr(_backward_plan, "shared_memory_limit", lambda device: limit)
    monkeypatch.setattr(_backward_plan, "resident_blocks", lambda d, s, name, t, smem: 264)
    bp = _backward_plan
    taken = set()
    for seqlen in (1, 300, 5000):
        for width in range(bp.MMA_CL_FROM, 257):
            x = bf16_rows(3, 80, seqlen, strides=(80 * seqlen, 1, 80))
            plan = bp.plan_backward(x, x, x, width, False, False, "bfloat16", 0)
            main = plan.launches[0]
            ks = _launch.mma_steps(width) if width <= 128 else max(_launch.mma_steps(width), 10)
            d = 16 * (ks - 1)
            ring = 128 * (2 if d <= 128 else 3)
            taps_at = 4 * 32 * (2 * ring + 16) + 3 * 128 * 64
            smem = taps_at + 4 * (8 * (d + 32) + 8) * 4
            if smem > limit:  # (bwd_wide, or the general path where that does not fit either)
                assert main.name.split("<")[0] in ("bwd_wide", "bwd_dz"), main.name
                continue
            taken.add(ks)
            where = f"L={seqlen} width {width}"
            assert main.name == f"bwd_mma_cl<__nv_bfloat16, {ks}>", where
            threads = 256 if ks >= bp.CONSTANTS["BWD_CL_DX_FROM"] else 128  # (dx's own warps)
            assert main.block == (threads, 1) and main.smem == smem, where
            f = dict(zip(bp.MMA_CL.plan_fields, main.plan_fields, strict=True))
            assert f["taps_at"] == taps_at and taps_at % 16 == 0, where
            span, pieces = f["span"], f["pieces"]
            assert span % 128 == 0 and span <= bp.MMA_CL_LONGEST, where
            assert (pieces - 1) * span < seqlen <= pieces * span, where
            items = 3 * 3 * pieces  # (channel groups, batch rows, pieces)
            assert main.grid == min(items, 264), where
            assert plan.n_parts == 3 * pieces, where
            assert [s.name.split("<")[0] for s in plan.launches[1:]] == ["bwd_reduce"], where
    fits = {232448: set(range(6, 18)), 166912: set(range(6, 18)), 101376: set()}  # (66: KS 6)
    assert taken == fits[limit]


def test_tensor_core_plan_only_for_bfloat16_time_rows(monkeypatch):
    monkeypatch.setattr(_backward_plan, "_plans", {})
    monkeypatch.setattr(_backward_plan, "shared_memory_limit", lambda device: 232448)
    monkeypatch.setattr(_backward_plan, "resident_blocks", lambda d, s, name, t, smem: 132 * 2)
    x = bf16_rows(2, 64, 300)
    cl = bf16_rows(2, 64, 300, strides=(64 * 300, 1, 64))

    def main(x, width=16, seq=False, weight="bfloat16"):
        return _backward_plan.plan_backward(x, x, x, width, seq, False, weight, 0).launches[0].name

    long = bf16_rows(2, 64, _backward_plan.MMA_SHORT_ROW + 1)
    assert main(long, width=_backward_plan.MMA_MIN_WIDTH).startswith("bwd_mma")
    assert main(long, width=_backward_plan.MMA_MIN_WIDTH - 1).startswith("bwd_time")
    # rows of at most MMA_SHORT_ROW positions: bwd_time up to MMA_SHORT_MIN_WIDTH - 1
    assert main(x, width=_backward_plan.MMA_SHORT_MIN_WIDTH).startswith("bwd_mma")
    assert main(x, width=_backward_plan.MMA_SHORT_MIN_WIDTH - 1).startswith("bwd_time")
    assert main(x, width=40, weight="float32").startswith("bwd_wide")  # weights of another dtype
    assert main(x, width=40, seq=True).startswith("bwd_dz")
    assert main(cl, width=8).startswith("bwd_channel")


@pytest.mark.parametrize("limit", (232448, 166912, 101376), ids=("sm90", "sm80", "sm86"))
@pytest.mark.parametrize("layout", ("step2", "cf", "cl"))
def test_wide_plan_fits_the_device(monkeypatch, limit, layout):
    """Every width 1 to 256 x dtype x row length x layout: bwd_time (time-contiguous) and
    bwd_channel (channel-contiguous) where they serve, else bwd_wide where its block fits the
    opt-in limit (rows of x and dz that reach every window read, 16-byte aligned areas in
    order, x's order), else the general path; segments of at least two tiles, covering the
    row, and only while the items would not fill the device twice."""
    monkeypatch.setattr(_backward_plan, "_plans", {})
    monkeypatch.setattr(_backward_plan, "shared_memory_limit", lambda device: limit)
    monkeypatch.setattr(_backward_plan, "resident_blocks", lambda d, s, name, t, smem: 132 * 2)
    c = _backward_plan.CONSTANTS
    tile, channels = c["WIDE_TILE"], c["WIDE_CHANNELS"]
    general = set()
    for dtype in (np.float16, np.float32, np.float64):
        acc = 8 if dtype is np.float64 else 4
        for batch, dim, seqlen in ((2, 40, 300), (1, 16, 5000), (1, 16, 700), (4, 8, 3)):
            strides = {
                "step2": (dim * seqlen * 2, 2 * seqlen, 2),  # every other step
                "cf": (dim * seqlen, seqlen, 1),
                "cl": (dim * seqlen, 1, dim),
            }[layout]
            x = _arrays.describe(FakeCudaArray((batch, dim, seqlen), strides, dtype), "x")
            name = np.dtype(dtype).name
            for width in range(1, 257):
                plan = _backward_plan.plan_backward(x, x, x, width, False, False, name, 0)
                main = plan.launches[0]
                where = f"{np.dtype(dtype).name} {(batch, dim, seqlen)} width {width}"
                if layout == "cf" and width <= _backward_plan.TIME_MAX_WIDTH:
                    assert main.name.startswith("bwd_time"), where
                    continue
                if layout == "cl" and width < _backward_plan.CHANNEL_WIDE_FROM[name]:
                    assert main.name.startswith("bwd_channel"), where
                    continue
                if not main.name.startswith("bwd_wide"):
                    assert main.name.startswith("bwd_dz"), where
                    general.add((np.dtype(dtype).name, width))
                    continue
                f = dict(zip(_backward_plan.WIDE.plan_fields, main.plan_fields, strict=True))
                reach = tile + 8 * (width // 8) + 16  # the furthest window read, + 1
                pads = (reach - 1) // c["WIDE_BANK_RUN"] * c["WIDE_BANK_PAD"]
                assert f["row_slots"] >= reach + pads, where
                assert f["tap_slots"] >= 8 * (width // 8) + 8 and f["tap_slots"] % 8 == 0, where
                rows = channels * f["row_slots"] * acc
                assert f["dz_at"] == rows and f["taps_at"] == 2 * rows, where
                assert f["rtaps_at"] == f["taps_at"] + channels * f["tap_slots"] * acc, where
                assert all(f[k] % 16 == 0 for k in ("dz_at", "taps_at", "rtaps_at")), where
                assert main.smem == f["rtaps_at"] + channels * f["tap_slots"] * acc <= limit, where
                cl = layout == "cl" and seqlen > 1
                assert main.block == (c["WIDE_THREADS"], 1) and f["x_channels_fastest"] == cl, where
                tiles = -(-seqlen // tile)
                segments = -(-tiles // f["seg_tiles"])
                assert f["seg_tiles"] >= min(2, tiles) and plan.n_parts == batch * segments, where
                items = batch * -(-dim // channels)
                assert segments == 1 or items * (segments - 1) < 2 * 132 * 2, where
                assert main.grid == items * segments, where
    # where a block does not fit: float64 on sm_80 from width 168, on sm_86 from 48, the others
    # on sm_86 from 232
    want = {
        232448: set(),
        166912: {("float64", w) for w in range(168, 257)},
        101376: {(d, w) for d in ("float16", "float32") for w in range(232, 257)}
        | {("float64", w) for w in range(48, 257)},
    }
    assert general == want[limit]
