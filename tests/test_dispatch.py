"""Which kernel a forward call launches, and with what arguments, for each layout and feature
(cupyconv/_forward_plan.py).

Runs without a GPU: the arrays are stand-ins exposing only ``__cuda_array_interface__`` and
``__dlpack_device__``, and the launcher records instead of launching.
"""

from __future__ import annotations

import numpy as np
import pytest
from fakes import FakeCudaArray

import cupyconv
from cupyconv import _arrays, _forward_plan, _launch, forward


def channel_last(b, c, length, **kw):
    return FakeCudaArray((b, c, length), (length * c, 1, c), **kw)


KERNELS = {k.template: k for k in _forward_plan.KERNELS}


def params_of(plan, args) -> dict:
    """The packed arguments of a launch by name: ``pointers``, then the kernel's struct fields
    (the call's FIELDS and the plan's own, as the prelude declares them)."""
    values = args.values
    n = _forward_plan.POINTERS
    fields = _forward_plan.FIELDS + KERNELS[plan.name.split("<")[0]].plan_fields
    params = dict(zip(fields, values[n:], strict=True))
    params["pointers"] = values[:n]
    return params


@pytest.fixture
def launches(monkeypatch):
    """Record (kernel name, launch, its parameters as a dict) instead of launching."""
    record = []

    def fake_empty(like, shape, strides, dtype):
        return _arrays.describe(FakeCudaArray(shape, strides, dtype), "out")

    def fake_launch(plan, device, args, stream):
        record.append((plan.name, plan, params_of(plan, args)))

    monkeypatch.setattr(forward, "empty", fake_empty)
    monkeypatch.setattr(forward, "launch", fake_launch)
    monkeypatch.setattr(forward, "stream_of", lambda a: None)
    monkeypatch.setattr(forward, "result", lambda like, arr: arr.obj)
    fake_resident = lambda device, source, name, threads, smem: 132 * 8
    monkeypatch.setattr(_forward_plan, "resident_blocks", fake_resident)
    fake_device(monkeypatch, SM90_SMEM)
    monkeypatch.setattr(_forward_plan, "_plans", {})
    return record


def fake_device(monkeypatch, limit):
    """A device of 132 SMs whose blocks may have ``limit`` bytes of dynamic shared memory, and
    whose SMs hold that and a reserved kilobyte a block (sm_80 to sm_90)."""
    monkeypatch.setattr(_forward_plan, "multiprocessors", lambda device: 132)
    monkeypatch.setattr(_forward_plan, "shared_memory_limit", lambda device: limit)
    fit = lambda device, smem, blocks: blocks * (smem + 1024) <= limit + 1024  # noqa: E731
    monkeypatch.setattr(_forward_plan, "blocks_fit", fit)


SM90_SMEM, SM80_SMEM, SM86_SMEM = 232448, 166912, 101376  # opt-in shared memory per block
F16, F32 = np.float16, np.float32


def weight(c, k):
    return FakeCudaArray((c, k))


def CF():  # noqa: N802 - names a layout
    return FakeCudaArray((2, 64, 300))


def CL():  # noqa: N802 - names a layout
    return channel_last(2, 64, 300)


@pytest.mark.parametrize(
    "make_x,width,name",
    [
        pytest.param(CF, 4, "fwd_time<float, 4, false, 8, 1>", id="cf-width4"),
        pytest.param(CF, 17, "fwd_time<float, 17, false, 8, 1>", id="cf-width17"),
        pytest.param(CF, 18, "fwd_mma<float, 3, true, 0>", id="cf-width18"),
        pytest.param(CL, 8, "fwd_channel<float, 8, false, 16, 16>", id="cl-width8"),
        pytest.param(CL, 9, "fwd_channel<float, 9, false, 32, 8>", id="cl-width9"),
        pytest.param(CL, 16, "fwd_channel<float, 16, false, 32, 8>", id="cl-width16"),
        pytest.param(CL, 17, "fwd_split_cl<float, 2>", id="cl-width17"),
        pytest.param(CL, 33, "fwd_split_cl<float, 3>", id="cl-width33"),
        pytest.param(CL, 34, "fwd_split_cl<float, 4>", id="cl-width34"),
        pytest.param(CL, 256, "fwd_split_cl<float, 17>", id="cl-width256"),
        pytest.param(
            lambda: FakeCudaArray((2, 64, 300), (64 * 600, 600, 2)), 4, "fwd_general<float>",
            id="time-stride2",
        ),
        pytest.param(
            lambda: FakeCudaArray((2, 64, 300), dtype=np.float16),
            4,
            "fwd_time<__half, 4, false, 2, 4>",
            id="cf-float16",
        ),
    ],
)  # fmt: skip
def test_kernel_follows_layout_and_width(launches, make_x, width, name):
    x = make_x()
    cupyconv.causal_conv1d_fn(x, weight(64, width), activation="silu")
    ((launched, plan, params),) = launches
    assert launched == name
    assert params["width"] == width and params["silu_act"] == 1
    assert (params["batch"], params["dim"], params["seqlen"]) == (2, 64, 300)
    assert plan.grid >= 1 and plan.grid <= 2**31 - 1


def test_default_out_follows_x(launches):
    x = channel_last(2, 64, 300)
    out = cupyconv.causal_conv1d_fn(x, weight(64, 4))
    ((_, _, params),) = launches
    strides = tuple(s // 4 for s in out.__cuda_array_interface__["strides"])
    assert strides == (300 * 64, 1, 64)
    assert (params["out_batch_stride"], params["out_c_stride"], params["out_l_stride"]) == strides


def test_vector_flags_follow_alignment(launches):
    cupyconv.causal_conv1d_fn(FakeCudaArray((2, 64, 300), offset=0), weight(64, 4))
    cupyconv.causal_conv1d_fn(FakeCudaArray((2, 64, 300), offset=1), weight(64, 4))
    cupyconv.causal_conv1d_fn(FakeCudaArray((2, 64, 301)), weight(64, 4))  # odd row stride
    assert [p["x_aligned"] for _, _, p in launches] == [1, 0, 0]


def test_seq_idx_and_states_select_and_fill(launches):
    x = FakeCudaArray((2, 64, 300))
    seq = FakeCudaArray((2, 300), dtype=np.int32)
    init = FakeCudaArray((2, 64, 3))
    bias = FakeCudaArray((64,), dtype=np.float16)
    out, final = cupyconv.causal_conv1d_fn(
        x, weight(64, 4), bias, seq_idx=seq, initial_states=init, return_final_states=True
    )
    ((main, plan, p),) = launches  # one launch: its blocks past main_blocks write final
    assert main == "fwd_time<float, 4, true, 8, 1>"
    assert (p["seq_dtype"], p["bias_dtype"], p["init_dtype"]) == (4, 1, 0)
    assert p["pointers"][6] != 0
    final_threads = (plan.grid - p["main_blocks"]) * plan.block[0] * plan.block[1]
    assert 0 < plan.grid - p["main_blocks"] and final_threads >= 2 * 64 * 3
    strides = tuple(s // 4 for s in final.__cuda_array_interface__["strides"])
    assert strides == (3 * 64, 1, 64)  # [batch, width - 1, dim] viewed as [batch, dim, width - 1]


def test_empty_rows_launch_only_the_final_states(launches):
    x = FakeCudaArray((2, 64, 0))
    init = FakeCudaArray((2, 64, 3))
    out, final = cupyconv.causal_conv1d_fn(
        x, weight(64, 4), initial_states=init, return_final_states=True
    )
    assert [name for name, _, _ in launches] == ["fwd_final_states<float>"]
    assert launches[0][2]["seq_dtype"] == 0  # no seq_idx read when there is no token


def test_width1_has_no_final_states_launch(launches):
    cupyconv.causal_conv1d_fn(FakeCudaArray((2, 8, 5)), weight(8, 1), return_final_states=True)
    assert [name for name, _, _ in launches] == ["fwd_time<float, 1, false, 2, 4>"]


def test_resident_blocks_takes_the_tightest_limit(monkeypatch):
    """Blocks per SM = min over registers, shared memory, threads and the block limit; a plan's
    blocks an SM fit its shared memory with the driver's reserve a block (``blocks_fit``); a
    kernel with shared memory asks for the least carveout that holds its blocks, never less than
    it asked for before."""
    import sys
    import types

    attrs = {"count": 132, "smem": 233472, "regs": 65536, "threads": 2048, "blocks": 32}
    attrs["res"], attrs["optin"] = 1024, 232448
    runtime = types.SimpleNamespace(
        cudaDevAttrMaxSharedMemoryPerBlockOptin="optin",
        cudaDevAttrMultiProcessorCount="count",
        cudaDevAttrMaxSharedMemoryPerMultiprocessor="smem",
        cudaDevAttrMaxRegistersPerMultiprocessor="regs",
        cudaDevAttrMaxThreadsPerMultiProcessor="threads",
        cudaDevAttrMaxBlocksPerMultiprocessor="blocks",
        cudaDevAttrReservedSharedMemoryPerBlock="res",
        deviceGetAttribute=lambda attr, device: attrs[attr],
    )
    cuda = types.SimpleNamespace(runtime=runtime)
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=cuda))
    monkeypatch.setitem(sys.modules, "cupy.cuda", cuda)
    monkeypatch.setattr(_launch, "_resident", {})
    monkeypatch.setattr(_launch, "_sm_smem", {})
    monkeypatch.setattr(_launch, "_smem_limit", {})
    # three blocks of 76800 bytes and their reserves fill 233472 exactly; one block may not
    # exceed the opt-in limit however many fit
    assert _launch.blocks_fit(0, 76800, 3) and not _launch.blocks_fit(0, 76801, 3)
    assert _launch.blocks_fit(0, 232448, 1) and not _launch.blocks_fit(0, 232449, 1)
    kernel = types.SimpleNamespace(num_regs=64, shared_size_bytes=0)
    monkeypatch.setattr(_launch, "get_raw_kernel", lambda source, name, device: kernel)
    source = _forward_plan.SOURCES["fwd_mma.cu"]

    monkeypatch.setattr(_launch, "_carveout", {})
    # 64 registers x 128 threads: 8 blocks; 16 KB of shared memory would allow 13. The 8 blocks'
    # 8 x 17408 bytes are 59.6 % of the SM's 233472.
    assert _launch.resident_blocks(0, source, "k", 128, 16 * 1024) == 8 * 132
    assert kernel.preferred_shared_memory_carveout == 60
    # 40 KB of shared memory per block: 233472 // (40960 + 1024) = 5 blocks, 89.9 % of it.
    assert _launch.resident_blocks(0, source, "k", 128, 40 * 1024) == 5 * 132
    assert kernel.preferred_shared_memory_carveout == 90
    # 8 blocks of 8 KB need 32 %; the kernel keeps the 90 % a plan made before needs.
    del kernel.preferred_shared_memory_carveout
    assert _launch.resident_blocks(0, source, "k", 128, 8 * 1024) == 8 * 132
    assert not hasattr(kernel, "preferred_shared_memory_carveout")
    # 72 registers round up to 2304 per warp: 28 warps, 7 blocks of 4 warps.
    kernel.num_regs = 72
    assert _launch.resident_blocks(0, source, "k2", 128, 0) == 7 * 132
    # Above 48 KB the kernel is allowed the dynamic shared memory it is launched with, and keeps
    # the largest it was allowed: a plan made earlier with more is still launched later.
    monkeypatch.setattr(_launch, "_dynamic_smem", {})
    assert _launch.resident_blocks(0, source, "k3", 128, 96 * 1024) == 2 * 132
    assert kernel.max_dynamic_shared_size_bytes == 96 * 1024
    assert _launch.resident_blocks(0, source, "k3", 128, 60 * 1024) == 3 * 132
    assert kernel.max_dynamic_shared_size_bytes == 96 * 1024


def test_one_chunk_or_tile_per_warp(launches):
    """fwd_time: a chunk of 32 x 8 vectors of a row per warp, one warp a block (32 x 2 on rows
    up to 1 KB, 4 warps a block); fwd_channel: a tile of 16 time steps (16-bit x) x 32 lanes x 4
    channels per warp, 4 warps a block."""
    half = dict(dtype=np.float16)
    cupyconv.causal_conv1d_fn(FakeCudaArray((8, 5120, 2048), **half), weight(5120, 4))
    cupyconv.causal_conv1d_fn(FakeCudaArray((64, 1024, 512), **half), weight(1024, 4))
    cupyconv.causal_conv1d_fn(channel_last(8, 5120, 2048, **half), weight(5120, 4))
    cupyconv.causal_conv1d_fn(channel_last(8, 5124, 2048, **half), weight(5124, 4))
    names = [name for name, _, _ in launches]
    assert names == [
        "fwd_time<__half, 4, false, 8, 1>", "fwd_time<__half, 4, false, 2, 4>",
        "fwd_channel<__half, 4, false, 16, 8>", "fwd_channel<__half, 4, false, 16, 8>",
    ]  # fmt: skip
    grids = [plan.grid for _, plan, _ in launches]
    cl_tiles = (8 * (2048 // 16) * (5120 // 128), 8 * (2048 // 16) * -(-5124 // 128))
    assert grids == [8 * 5120, 64 * 1024 // 4, cl_tiles[0] // 4, cl_tiles[1] // 4]
    blocks = [plan.block for _, plan, _ in launches]
    assert blocks == [(32, 1), (128, 1), (128, 1), (128, 1)]
    # fwd_time divides its chunk index by the chunks a row (of 2048 elements; 512 on short rows),
    # then by dim; fwd_channel its tile index by the strips of 128 channels, then the 16-step
    # tiles a row
    divisors = [
        (p["chunk_divisor"], p["dim_divisor"]) if "chunk_divisor" in p
        else (p["strip_divisor"], p["step_divisor"])
        for _, _, p in launches
    ]  # fmt: skip
    fast = _launch.fast_divisor
    assert divisors == [
        (fast(1), fast(5120)), (fast(1), fast(1024)),
        (fast(5120 // 128), fast(2048 // 16)), (fast(-(-5124 // 128)), fast(128)),
    ]  # fmt: skip


@pytest.mark.parametrize(
    "x",
    [
        pytest.param(lambda: channel_last(2, 66, 300), id="dim-not-a-multiple-of-4"),
        pytest.param(lambda: channel_last(2, 64, 300, offset=1), id="misaligned-base"),
    ],
)
def test_channel_last_without_lane_vectors_takes_the_general_kernel(launches, x):
    x = x()
    cupyconv.causal_conv1d_fn(x, weight(x.__cuda_array_interface__["shape"][1], 4))
    ((launched, plan, params),) = launches
    assert launched == "fwd_general<float>" and params["channels_fastest"] == 1


def test_channel_last_wide_filters_with_seq_idx_take_the_general_kernel(launches):
    x = CL()
    seq = FakeCudaArray((2, 300), dtype=np.int32)
    cupyconv.causal_conv1d_fn(x, weight(64, 9), seq_idx=seq)
    ((launched, plan, params),) = launches
    assert launched == "fwd_general<float>"


H, B = "__half", "__nv_bfloat16"
WIDE_CHANNEL = "fwd_channel<__half, {}, false, 32, 4>"  # fwd_channel's tiles above width 8


@pytest.mark.parametrize(
    "xdtype,wdtype,init,width,cf_name,cl_name",
    [
        (F16, F16, None, 64, f"fwd_mma<{H}, 5, false, 0>", f"fwd_mma_cl<{H}, 5>"),
        # float16 x: with other weights time-contiguous only (split into bfloat16 parts);
        # states of x's dtype
        (F16, F32, None, 64, f"fwd_mma<{H}, 5, true, 0>", f"fwd_channel_wide<{H}>"),
        (F16, F16, F32, 64, f"fwd_time_wide<{H}, false>", f"fwd_channel_wide<{H}>"),
        (F16, F16, F16, 18, f"fwd_mma<{H}, 3, false, 0>", f"fwd_mma_cl<{H}, 3>"),
        # time-contiguous x: fwd_time up to width 13; channel-contiguous: fwd_channel up to 9
        (F16, F16, None, 16, f"fwd_mma<{H}, 2, false, 0>", f"fwd_mma_cl<{H}, 2>"),
        # fwd_mma_cl up to KS = MMA_CL_MAX_STEPS, fwd_mma's channel-contiguous form beyond;
        # (time-contiguous rows of 300 end inside fwd_mma_time's only chunk: fwd_mma)
        (F16, F16, None, 33, f"fwd_mma<{H}, 3, false, 0>", f"fwd_mma_cl<{H}, 3>"),
        (F16, F16, None, 65, f"fwd_mma<{H}, 5, false, 0>", f"fwd_mma_cl<{H}, 5>"),
        (F16, F16, None, 66, f"fwd_mma<{H}, 6, false, 0>", f"fwd_mma_cl<{H}, 6>"),
        (F16, F16, None, 97, f"fwd_mma<{H}, 7, false, 0>", f"fwd_mma_cl<{H}, 7>"),
        (F16, F16, None, 98, f"fwd_mma<{H}, 8, false, 0>", f"fwd_mma<{H}, 8, false, 16>"),
        (F16, F16, None, 15, f"fwd_mma<{H}, 2, false, 0>", f"fwd_mma_cl<{H}, 2>"),
        (F16, F16, None, 14, f"fwd_mma<{H}, 2, false, 0>", f"fwd_mma_cl<{H}, 2>"),
        (F16, F16, None, 13, f"fwd_time<{H}, 13, false, 2, 4>", f"fwd_mma_cl<{H}, 2>"),
        (F16, F16, None, 10, f"fwd_time<{H}, 10, false, 2, 4>", f"fwd_mma_cl<{H}, 2>"),
        (F16, F16, None, 9, f"fwd_time<{H}, 9, false, 2, 4>", WIDE_CHANNEL.format(9)),
        (F16, F16, None, 8, f"fwd_time<{H}, 8, false, 2, 4>", f"fwd_channel<{H}, 8, false, 16, 8>"),
        (F16, F16, None, 256, f"fwd_mma<{H}, 17, false, 0>", f"fwd_mma<{H}, 17, false, 16>"),
        # float32 x on tensor cores (x and taps split): time-contiguous from
        # MMA_XSPLIT_MIN_WIDTH, channel-contiguous from SPLIT_CL_MIN_WIDTH (fwd_split_cl)
        (F32, F32, None, 64, "fwd_mma<float, 5, true, 0>", "fwd_split_cl<float, 5>"),
        (F32, F16, None, 40, "fwd_mma<float, 4, true, 0>", "fwd_split_cl<float, 4>"),
        (F32, F16, None, 18, "fwd_mma<float, 3, true, 0>", "fwd_split_cl<float, 3>"),
        (F32, F32, None, 17, "fwd_time<float, 17, false, 8, 1>", "fwd_split_cl<float, 2>"),
        (F32, F32, None, 16, "fwd_time<float, 16, false, 8, 1>",
         "fwd_channel<float, 16, false, 32, 8>"),
        # float32 x with states of another dtype: the CUDA-core kernels
        (F32, F32, F16, 64, "fwd_time_wide<float, false>", "fwd_channel_wide<float>"),
        (F16, F32, None, 17, f"fwd_time<{H}, 17, false, 2, 4>", f"fwd_channel_wide<{H}>"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("layout", ("cf", "cl"))
def test_tensor_cores_where_exact(launches, xdtype, wdtype, init, width, cf_name, cl_name, layout):
    """x takes fwd_mma where it is exact (states of x's dtype; float16 x with other weights and
    float32 x time-contiguous only, the window split): 16-bit time-contiguous x from
    MMA_MIN_WIDTH on, channel-contiguous x from MMA_CL_MIN_WIDTH on, a split window from
    MMA_XSPLIT_MIN_WIDTH on, with the tile layout the plan describes; channel-contiguous float32
    x takes fwd_split_cl from SPLIT_CL_MIN_WIDTH on."""
    x = FakeCudaArray((2, 8, 300), dtype=xdtype)
    name = cf_name
    if layout == "cl":
        x, name = channel_last(2, 8, 300, dtype=xdtype), cl_name
    states = None if init is None else FakeCudaArray((2, 8, width - 1), dtype=init)
    cupyconv.causal_conv1d_fn(x, FakeCudaArray((8, width), dtype=wdtype), initial_states=states)
    ((launched, plan, params),) = launches
    assert launched == name
    if launched.startswith("fwd_mma_cl<"):
        fields = dict(zip(_forward_plan.MMA_CL.plan_fields, plan.plan_fields))
        ks = _launch.mma_steps(width)
        step = _forward_plan.CONSTANTS["MMA_CL_STEP"]
        assert 16 * (ks - 1) >= width - 1 and fields["span"] % step == 0
        assert fields["pieces"] == -(-300 // fields["span"])
        more = _forward_plan.mma_cl_one_barrier(ks)
        warps = _forward_plan.CONSTANTS["MMA_CL_WARPS" if more else "MMA_CL_FEW_WARPS"]
        assert plan.block == (32 * warps, 1)
        # the ring (32 channels x 16 RB + 1 rows of 16 bytes, RB = KS + one barrier a step), 2 +
        # one staging buffers, the taps and biases (32 channels x D + 32 word pairs and one)
        assert fields["taps_at"] == 32 * (16 * (ks + more) + 1) * 16 + (2 + more) * step * 8 * 64
        assert plan.smem == fields["taps_at"] + 32 * (16 * ks + 16 + 1) * 4
        assert plan.smem + 1024 <= SM90_SMEM + 1024
    elif launched.startswith("fwd_mma<"):
        fields = dict(zip(_forward_plan.MMA.plan_fields, plan.plan_fields))
        ks = _launch.mma_steps(width)
        cl = layout == "cl"
        warps = (
            _forward_plan.mma_cl_warps(ks, False) if cl else _forward_plan.CONSTANTS["MMA_WARPS"]
        )
        assert launched.endswith(f", {warps if cl else 0}>")
        assert plan.block == (32 * warps, 1)
        itemsize = np.dtype(xdtype).itemsize
        rows = _forward_plan.CONSTANTS["MMA_CL_CHANNELS"] if cl else 2 * warps
        d = 16 * (ks - 1)
        assert d >= width - 1 and fields["span"] % _forward_plan.CONSTANTS["MMA_SPAN_STEP"] == 0
        if cl:  # rows of 8 mod 16 elements: the transposes are free of bank conflicts
            assert d + fields["span"] <= fields["row_len"] < d + fields["span"] + 16
            assert fields["row_len"] % 16 == 8
        else:
            assert fields["row_len"] == d + fields["span"]
        # the staging area; a split window (float32 x, float16 x with other weights): each
        # warp's high and low bfloat16 rows
        xsplit = not cl and (itemsize == 4 or xdtype != wdtype)  # (16-bit x here: float16)
        staging = (d + fields["span"]) * rows * 2 if cl else warps * fields["row_len"] * 4 * xsplit
        # channel-contiguous x with taps of its dtype up to MMA_CL_TWO_ROWS_STEPS: two buffers
        # of rows (on sm_90 they fit at every such width)
        two = cl and xdtype == wdtype and ks <= _forward_plan.CONSTANTS["MMA_CL_TWO_ROWS_STEPS"]
        assert fields["two_rows"] == two
        assert fields["staging_at"] >= rows * fields["row_len"] * itemsize * (2 if two else 1)
        assert fields["weights_at"] == fields["staging_at"] + staging
        assert fields["out_at"] == fields["weights_at"] + (rows if cl else warps) * (2 * d + 32) * 4
        assert plan.smem == fields["out_at"] + (warps * 512 if cl else 0)
        if cl:  # the blocks an SM is compiled for fit its shared memory
            per_sm = _forward_plan.CONSTANTS["MMA_CL_SM_WARPS"] // warps
            assert per_sm * (plan.smem + 1024) <= SM90_SMEM + 1024


def mma_plan(monkeypatch, shape, layout, xdtype, wdtype, width, resident, limit=SM90_SMEM):
    """The forward plan for dense x of ``shape`` ("cf" or "cl") and dtype names ``xdtype`` /
    ``wdtype`` (bfloat16 included, which no array interface carries) on a device of
    ``resident`` blocks and ``limit`` bytes of shared memory a block, and its fwd_mma plan
    fields by name."""
    import ml_dtypes

    monkeypatch.setattr(_forward_plan, "resident_blocks", lambda *args: resident)
    fake_device(monkeypatch, limit)
    monkeypatch.setattr(_forward_plan, "_plans", {})
    xd, wd = (np.dtype(ml_dtypes.bfloat16 if d == "bfloat16" else d) for d in (xdtype, wdtype))
    b, c, length = shape
    strides = (c * length, 1, c) if layout == "cl" else (c * length, length, 1)
    x = _arrays.Array(None, "fake", 0, 1 << 32, shape, strides, xd)
    w = _arrays.Array(None, "fake", 0, 2 << 32, (c, width), (width, 1), wd)
    plan = _forward_plan.plan_forward(x, x, w, None, width, False, 0)
    return plan, dict(zip(_forward_plan.MMA.plan_fields, plan.plan_fields))


@pytest.mark.parametrize(
    "wdtype,width,kernel",
    [
        ("bfloat16", 9, "fwd_channel<"),
        ("bfloat16", 10, "fwd_mma_cl<__nv_bfloat16, 2>"),
        ("bfloat16", 15, "fwd_mma_cl<__nv_bfloat16, 2>"),
        ("float32", 15, "fwd_channel<"),  # other weights: fwd_mma with the taps split, from 16
        ("float32", 16, "fwd_mma<__nv_bfloat16, 2, true, 8>"),
    ],
)
def test_channel_last_tensor_core_widths(monkeypatch, wdtype, width, kernel):
    """Channel-contiguous bfloat16 x takes fwd_mma_cl from MMA_CL_MIN_WIDTH on with weights of
    its dtype, fwd_mma (the taps split) from MMA_CL_SPLIT_MIN_WIDTH on with others."""
    plan, _ = mma_plan(monkeypatch, (8, 5120, 2048), "cl", "bfloat16", wdtype, width, 132 * 6)
    assert plan.name.startswith(kernel), plan.name


@pytest.mark.parametrize(
    "limit,width,kernel",
    [
        (SM90_SMEM, 97, "fwd_mma_cl<__nv_bfloat16, 7>"),
        (SM80_SMEM, 97, "fwd_mma_cl<__nv_bfloat16, 7>"),
        (SM86_SMEM, 81, "fwd_mma_cl<__nv_bfloat16, 6>"),
        (SM86_SMEM, 82, "fwd_mma<__nv_bfloat16, 7, false, 16>"),  # KS 7's block: 107 KB
        (SM86_SMEM, 97, "fwd_mma<__nv_bfloat16, 7, false, 16>"),
    ],
)
def test_channel_last_tensor_cores_where_their_block_fits(monkeypatch, limit, width, kernel):
    """fwd_mma_cl takes channel-contiguous x up to MMA_CL_MAX_STEPS k-steps where its block's
    shared memory fits the device; fwd_mma's channel-contiguous form where it does not."""
    shape = (8, 5120, 2048)
    plan, _ = mma_plan(monkeypatch, shape, "cl", "bfloat16", "bfloat16", width, 132, limit)
    assert plan.name == kernel
    assert plan.smem <= limit


@pytest.mark.parametrize(
    "limit,width,wdtype,span,two",
    [
        (SM90_SMEM, 100, "bfloat16", 2048, True),  # KS 8: 232,448 bytes, the whole limit
        (SM90_SMEM, 129, "bfloat16", 1024, True),  # KS 9: 137,728 (236,032 at 2048)
        (SM80_SMEM, 100, "bfloat16", 1024, True),  # KS 8: 134,144 (limit 166,912)
        (SM86_SMEM, 100, "bfloat16", 512, True),  # 84,992 (101,376)
        (SM90_SMEM, 161, "bfloat16", 1024, True),  # KS 11: 144,896
        (SM86_SMEM, 161, "bfloat16", 512, True),  # 95,744
        (70_000, 129, "bfloat16", 512, False),  # two buffers fit at no span; one 67,840
        (SM90_SMEM, 177, "bfloat16", 2048, False),  # KS 12: one buffer (175,360)
        (SM90_SMEM, 256, "bfloat16", 2048, False),  # KS 17: 190,720
        (SM80_SMEM, 177, "bfloat16", 1024, False),  # 109,824
        (SM90_SMEM, 64, "float32", 2048, False),  # split taps: 153,856
        (SM90_SMEM, 129, "float32", 2048, False),  # 166,144
    ],
)
def test_channel_last_rows_in_two_buffers_where_they_fit(
    monkeypatch, limit, width, wdtype, span, two
):
    """fwd_mma's channel-contiguous form with taps of x's dtype up to MMA_CL_TWO_ROWS_STEPS
    keeps its rows in two buffers (an item's window, the item before's outputs) at the longest
    span where they fit, else in one; wider filters and split taps in one."""
    plan, fields = mma_plan(
        monkeypatch, (8, 5120, 2048), "cl", "bfloat16", wdtype, width, 132, limit
    )
    assert plan.name.startswith("fwd_mma<") and plan.smem <= limit
    assert (fields["span"], fields["two_rows"]) == (span, two)
    rows = _forward_plan.CONSTANTS["MMA_CL_CHANNELS"] * fields["row_len"] * 2
    assert fields["staging_at"] == (2 if two else 1) * rows


@pytest.mark.parametrize(
    "shape,offset,xdtype,width,name",
    [
        ((8, 5120, 2048), 0, "bfloat16", 16, "fwd_mma_time<{B}, 2, 16, 1>"),
        ((8, 5120, 2048), 4, "bfloat16", 33, "fwd_mma_time<{B}, 3, 16, 1>"),  # 8-byte rows
        ((8, 5120, 2048), 2, "bfloat16", 16, "fwd_mma<{B}, 2, false, 0>"),  # 4-byte rows
        ((8, 5120, 2048), 0, "bfloat16", 34, "fwd_mma<{B}, 4, false, 0>"),  # KS 4
        ((8, 5120, 2048), 0, "bfloat16", 13, "fwd_time<{B}, 13, false, 8, 1>"),
        ((64, 1024, 512), 0, "float16", 14, "fwd_mma_time<{H}, 2, 4, 4>"),
        ((16, 2048, 1024), 0, "bfloat16", 31, "fwd_mma_time<{B}, 3, 8, 2>"),
        ((8, 5120, 2000), 0, "bfloat16", 16, "fwd_mma<{B}, 2, false, 0>"),  # ends in its chunk
        ((2, 64, 8200), 0, "bfloat16", 16, "fwd_mma_time<{B}, 2, 16, 1>"),  # 5 chunks
        ((2, 64, 8190), 0, "bfloat16", 16, "fwd_mma<{B}, 2, false, 0>"),  # (2-byte rows)
        ((2, 64, 300), 0, "bfloat16", 16, "fwd_mma<{B}, 2, false, 0>"),
    ],
)  # fmt: skip
def test_time_rows_take_fwd_mma_time(monkeypatch, shape, offset, xdtype, width, name):
    """Time-contiguous 16-bit x with weights of its dtype, rows on 8-byte boundaries: fwd_mma_time
    up to MMA_TIME_MAX_STEPS k-steps, one chunk a warp (MMA_TIME_CHUNKS by the row's bytes), on
    rows of whole chunks or of at least MMA_TIME_MIN_CHUNKS; fwd_mma for the others."""
    import ml_dtypes

    monkeypatch.setattr(_forward_plan, "resident_blocks", lambda *args: 132 * 6)
    fake_device(monkeypatch, SM90_SMEM)
    monkeypatch.setattr(_forward_plan, "_plans", {})
    dt = np.dtype(ml_dtypes.bfloat16 if xdtype == "bfloat16" else xdtype)
    b, c, length = shape
    x = _arrays.Array(None, "fake", 0, (1 << 32) + 2 * offset, shape, (c * length, length, 1), dt)
    w = _arrays.Array(None, "fake", 0, 2 << 32, (c, width), (width, 1), dt)
    plan = _forward_plan.plan_forward(x, x, w, None, width, False, 0)
    assert plan.name == name.format(B="__nv_bfloat16", H="__half")
    if plan.name.startswith("fwd_mma_time<"):
        groups, warps = next(
            (chunk for most, chunk in _forward_plan.MMA_TIME_CHUNKS if length * 2 <= most),
            _forward_plan.MMA_TIME_LONG_CHUNK,
        )
        per_row = -(-length // (128 * groups))
        assert plan.block == (32 * warps, 1) and plan.smem == 0
        assert plan.grid == -(-b * c * per_row // warps)
        fields = dict(zip(_forward_plan.MMA_TIME.plan_fields, plan.plan_fields, strict=True))
        assert fields["chunk_divisor"] == _launch.fast_divisor(per_row)
        assert fields["out_aligned"] == (offset % 2 == 0)


@pytest.mark.parametrize(
    "shape,xdtype,wdtype,width,layout,sweep",
    [
        ((8, 5120, 2048), "bfloat16", "bfloat16", 16, "cf", True),
        ((8, 5120, 2048), "bfloat16", "bfloat16", 64, "cf", True),  # KS 5
        ((8, 5120, 2048), "bfloat16", "bfloat16", 100, "cf", False),  # KS 7
        ((8, 5120, 2048), "bfloat16", "float32", 31, "cf", True),  # split taps, KS 2
        ((8, 5120, 2048), "bfloat16", "float32", 64, "cf", False),  # split taps, KS 5
        ((8, 5120, 2048), "float32", "float32", 33, "cf", True),  # split window, KS 3
        ((8, 5120, 2048), "float32", "float32", 64, "cf", False),
        ((1, 4096, 16384), "bfloat16", "bfloat16", 31, "cf", True),
        ((64, 1024, 512), "bfloat16", "bfloat16", 16, "cf", False),  # spans of 512
        ((8, 5120, 2048), "bfloat16", "bfloat16", 100, "cl", False),  # KS 7: fwd_mma
    ],
)  # fmt: skip
def test_tensor_core_item_order(monkeypatch, shape, xdtype, wdtype, width, layout, sweep):
    """Time-contiguous fwd_mma sweeps its items over the grid where spans are at least
    MMA_SWEEP_SPAN long and a row's A fragments at most MMA_SWEEP_FRAGMENTS; elsewhere (and
    on channel-contiguous x) each warp (block) takes a run of consecutive items. (fwd_mma_time
    left out: it serves the narrower of these time-contiguous rows.)"""
    monkeypatch.setattr(_forward_plan, "MMA_TIME_MAX_STEPS", 0)
    plan, fields = mma_plan(monkeypatch, shape, layout, xdtype, wdtype, width, 132 * 6)
    assert plan.name.startswith("fwd_mma<")
    assert fields["sweep"] == sweep
    assert fields["span"] >= _forward_plan.MMA_SWEEP_SPAN or not sweep


@pytest.mark.parametrize("layout", ("cf", "cl"))
@pytest.mark.parametrize(
    "wdtype,width,name,cl_name",
    [
        ("float32", 256, f"fwd_mma<{B}, 17, true, 0>", f"fwd_mma<{B}, 17, true, 16>"),
        ("float16", 33, f"fwd_mma<{B}, 3, true, 0>", f"fwd_mma<{B}, 3, true, 16>"),
        ("float16", 17, f"fwd_mma<{B}, 2, true, 0>", f"fwd_mma<{B}, 2, true, 8>"),
        ("bfloat16", 33, f"fwd_mma_time<{B}, 3, 16, 1>", f"fwd_mma_cl<{B}, 3>"),
        ("bfloat16", 129, f"fwd_mma<{B}, 9, false, 0>", f"fwd_mma<{B}, 9, false, 16>"),
        ("bfloat16", 130, f"fwd_mma<{B}, 10, false, 0>", f"fwd_mma<{B}, 10, false, 16>"),
    ],
)  # fmt: skip
def test_bfloat16_tensor_core_plans(monkeypatch, wdtype, width, name, cl_name, layout):
    """bfloat16 x takes the tensor cores with any weights: split in two parts when they are
    wider; channel-contiguous x fwd_mma_cl with weights of its dtype up to KS =
    MMA_CL_MAX_STEPS, else fwd_mma in blocks of 8 warps where the split fragments leave the
    registers for three blocks an SM, else 16."""
    plan, fields = mma_plan(monkeypatch, (2, 64, 4096), layout, "bfloat16", wdtype, width, 132 * 8)
    assert plan.name == (cl_name if layout == "cl" else name)
    assert plan.name.startswith("fwd_mma_time<") or fields["x_aligned"] == 1


@pytest.mark.parametrize(
    "shape,resident,span",
    [
        # one round of at least 1.9 blocks an SM (132 SMs): the fewest items
        ((8, 5120, 2048), 132 * 5, 1024),  # 320 items of 1024 steps: 2.4 blocks an SM
        ((1, 4096, 16384), 132 * 5, 1024),  # 256 items: 1.94 blocks an SM
        # 512 items of 1024 steps (half of each item's 8 columns empty) or of 512: the shorter
        ((2, 16384, 2048), 132 * 5, 512),
        # no span runs in one round of 1.9 blocks an SM or more: the least rounds x (span + 16)
        ((8, 5120, 2048), 132, 512),  # 5 rounds of 528 (688: 4 of 704; 256: 10 of 272)
        ((8, 5120, 2048), 132 * 2, 256),  # 5 rounds of 272 (688: 2 of 704; 1024: 2 of 1040)
        ((1, 4096, 16384), 132 * 3 // 2, 688),  # a row in 24 pieces: 384 items in 2 rounds
        ((2, 64, 40), 132 * 5, 48),  # rows shorter than a piece: one piece a row
        ((64, 1024, 512), 64, 512),  # 4 rounds of 528 (256: 8 of 272)
    ],
)  # fmt: skip
def test_channel_last_tensor_core_pieces(monkeypatch, shape, resident, span):
    """fwd_mma_cl cuts rows into 1, 2, 3 .. pieces of about equal length, MMA_CL_LONGEST steps
    down to MMA_CL_SHORTEST: of those whose items (32 channels, 8 pieces) run in one round of at
    least MMA_CL_ROUND blocks an SM (132 SMs), the one of the fewest items (the shortest of
    those), else the least rounds of items times their steps and D (the shorter on a tie); a
    persistent grid of at most the resident blocks."""
    plan, _ = mma_plan(monkeypatch, shape, "cl", "bfloat16", "bfloat16", 16, resident)
    fields = dict(zip(_forward_plan.MMA_CL.plan_fields, plan.plan_fields))
    b, c, length = shape
    assert plan.name == "fwd_mma_cl<__nv_bfloat16, 2>"
    assert fields["span"] == span and fields["pieces"] == -(-length // span)
    items = -(-c // 32) * -(-(b * fields["pieces"]) // 8)
    assert plan.grid == min(items, resident)
    assert fields["group_divisor"] == _launch.fast_divisor(-(-c // 32))
    assert fields["piece_divisor"] == _launch.fast_divisor(fields["pieces"])


@pytest.mark.parametrize(
    "seqlen,spans",
    [
        (2048, [1024, 688, 512, 416, 352, 304, 256]),
        (5000, [1008, 848, 720, 640, 560, 512, 464, 432, 400, 368, 336, 320, 304, 288, 272, 256]),
        (1000, [1008, 512, 336, 256]),  # 1000 in one piece: 1008 steps
        (512, [512, 256]),
        (300, [304]),  # 150 in each of two pieces: shorter than 256
        (40, [48]),
        (2**31 - 1, list(range(1024, 255, -16))),  # every span, found without 2**23 divisions
    ],
)  # fmt: skip
def test_even_spans(seqlen, spans):
    """A row in 1, 2, 3 .. pieces: ceil(seqlen / n) rounded up to 16 steps, from 1024 down to
    256 (each span once), one span for rows shorter than that."""
    assert _launch.even_spans(seqlen, 16, 1024, 256) == spans


def test_fast_divisor_is_exact():
    """divmod_fast (kernels/common.cuh) computes a // d as (a * m) >> k from fast_divisor(d) for
    every 0 <= a < 2**31: checked at the edges and on random values."""
    rng = np.random.default_rng(0)
    divisors = {1, 2, 3, 5, 7, 40, 128, 641, 2**31 - 1, 2**31, 2**40}
    divisors |= {2**e + o for e in range(1, 31) for o in (-1, 0, 1)}
    divisors |= {int(d) for d in rng.integers(1, 2**31, 200)}
    for d in sorted(divisors):
        magic = _launch.fast_divisor(d)
        m, k = magic & 0xFFFFFFFF, magic >> 32
        assert m < 2**32 and k <= 62
        values = {0, 1, d - 1, d, d + 1, 2 * d - 1, 2**31 - 1, (2**31 - 1) // d * d}
        values |= {int(a) for a in rng.integers(0, 2**31, 50)}
        for a in (a for a in values if 0 <= a < 2**31):
            assert (a * m) >> k == a // d, (a, d)


LAYOUTS = {
    "cf": lambda b, c, n, dt: FakeCudaArray((b, c, n), dtype=dt),
    "cl": lambda b, c, n, dt: channel_last(b, c, n, dtype=dt),
    "cl_slice": lambda b, c, n, dt: FakeCudaArray((b, c, n), (n * 3 * c, 1, 3 * c), dt, offset=c),
    "misaligned": lambda b, c, n, dt: FakeCudaArray((b, c, n), dtype=dt, offset=1),
    "time_stride2": lambda b, c, n, dt: FakeCudaArray((b, c, n), (2 * c * n, 2 * n, 2), dt),
}


@pytest.mark.parametrize(
    "limit,dtype,seq,width,warps",
    [
        (SM90_SMEM, np.float64, False, 18, 4), (SM90_SMEM, np.float32, True, 256, 4),
        (SM90_SMEM, np.float64, True, 256, 4),
        (SM86_SMEM, np.float64, True, 256, 2),  # four warps' parts do not fit
    ],
)  # fmt: skip
def test_time_wide_layout(launches, monkeypatch, limit, dtype, seq, width, warps):
    """fwd_time_wide's warp parts: two buffers of width - 1 + 32 R inputs in R columns of
    ``cols`` slots (odd), the taps rounded up to 4, with seq_idx two buffers
    of int64 ids; as many warps a block (up to TIME_WIDE_WARPS) as fit the device."""
    fake_device(monkeypatch, limit)
    x = FakeCudaArray((2, 40, 3000), dtype=dtype)
    ids = FakeCudaArray((2, 3000), dtype=np.int32) if seq else None
    cupyconv.causal_conv1d_fn(x, FakeCudaArray((40, width), dtype=dtype), seq_idx=ids)
    ((name, plan, params),) = launches
    t = "float" if dtype == np.float32 else "double"
    assert name == f"fwd_time_wide<{t}, {str(seq).lower()}>"
    run, acc = _forward_plan.CONSTANTS["TIME_WIDE_RUN"], np.dtype(dtype).itemsize
    cols = params["cols"]
    assert cols % 2 == 1 and cols * run >= width - 1 + 32 * run > (cols - 2) * run
    assert params["tap_slots"] == -(-width // 4) * 4
    assert params["ids_at"] % 16 == 0
    assert params["ids_at"] >= (2 * cols * run + params["tap_slots"]) * acc
    assert params["warp_bytes"] == params["ids_at"] + (2 * cols * run * 8 if seq else 0)
    assert plan.block == (32 * warps, 1) and plan.smem == warps * params["warp_bytes"] <= limit


@pytest.mark.parametrize(
    "limit,width,steps,buffers",
    [
        (SM90_SMEM, 17, 256, 2), (SM90_SMEM, 64, 256, 2),
        (SM90_SMEM, 128, 128, 2),  # shorter tiles, so that two buffers fit
        (SM90_SMEM, 256, 256, 1),  # two buffers do not fit at any length: one
        (SM86_SMEM, 134, 128, 1), (SM86_SMEM, 135, None, 0),  # the shortest tiles do not fit
    ],
)  # fmt: skip
def test_channel_wide_tiles(launches, monkeypatch, limit, width, steps, buffers):
    """fwd_channel_wide's tiles (float16 x, float32 weights: 8-byte slots of two float32
    sums): two buffers of CHANNEL_WIDE_STEPS steps, halved where two buffers would not fit a
    block, else one buffer; the general kernel where one buffer of the shortest tiles does not
    fit."""
    fake_device(monkeypatch, limit)
    cupyconv.causal_conv1d_fn(channel_last(2, 40, 3000, dtype=F16), weight(40, width))
    ((name, plan, params),) = launches
    if steps is None:
        assert name == "fwd_general<__half>"
        return
    assert name == "fwd_channel_wide<__half>"
    assert (params["steps"], params["buffers"]) == (steps, buffers)
    assert params["weights_at"] == (steps + width - 1) * 32 * 8  # rows of 32 8-byte slots
    assert params["buffer_bytes"] == params["weights_at"] + width * 32 * 8
    assert plan.smem == buffers * params["buffer_bytes"] <= limit
    assert plan.block == (32 * _forward_plan.CONSTANTS["CHANNEL_WIDE_WARPS"], 1)


@pytest.mark.parametrize(
    "limit,width,shape,span",
    [
        (SM90_SMEM, 64, (8, 5120, 2048), 2048),  # 2560 items fill 1056 resident blocks twice
        (SM90_SMEM, 38, (1, 64, 16384), 256),  # 4 channel groups: halved down to one step
        (SM90_SMEM, 40, (8, 1024, 4096), 512),  # the first span whose items reach 2 x 132 x 8
        (SM90_SMEM, 256, (2, 40, 3000), 256),
        (SM86_SMEM, 193, (2, 40, 3000), 256),  # KS 13, the last whose block fits
        (SM86_SMEM, 194, (2, 40, 3000), None),  # (fwd_channel_wide's does not either)
    ],
)  # fmt: skip
def test_split_cl_plan(launches, monkeypatch, limit, width, shape, span):
    """fwd_split_cl (float32 channel-contiguous x from SPLIT_CL_MIN_WIDTH on): blocks of
    SPLIT_CL_WARPS warps, one an item of SPLIT_CL_CHANNELS channels and ``span`` positions
    (SPLIT_CL_SPAN halved, down to the step's TT outputs, while the items would not fill the
    resident blocks twice), its shared memory as split_cl_shared_memory lays it out; where that
    does not fit the device, the next kernel (fwd_channel_wide, here the general one)."""
    fake_device(monkeypatch, limit)
    batch, dim, seqlen = shape
    cupyconv.causal_conv1d_fn(channel_last(batch, dim, seqlen), weight(dim, width))
    ((name, plan, params),) = launches
    ks = _launch.mma_steps(width)
    if span is None:
        assert name == "fwd_general<float>"
        assert _forward_plan.split_cl_shared_memory(ks)[2] > limit
        return
    tt = _forward_plan.CONSTANTS["SPLIT_CL_STEP"]
    assert name == f"fwd_split_cl<float, {ks}>"
    tap_row, stage_at, smem = _forward_plan.split_cl_shared_memory(ks)
    assert (params["span"], params["tap_row"]) == (span, 16 * (ks - 1) + 48)
    assert params["stage_at"] == stage_at
    assert stage_at == 2 * 16 * tap_row * 4  # two tables of tap pairs a channel
    stage_words = (ks - 1 + tt // 16) * _forward_plan.CONSTANTS["SPLIT_CL_STAGE_BLOCK"]
    assert smem - stage_at == 2 * stage_words * 4  # two staging buffers, no output tile
    assert plan.smem == smem <= limit
    assert plan.block == (32 * _forward_plan.CONSTANTS["SPLIT_CL_WARPS"], 1)
    assert plan.grid == batch * -(-dim // 16) * -(-seqlen // span)


@pytest.mark.parametrize("limit", (SM90_SMEM, SM80_SMEM, SM86_SMEM), ids=("sm90", "sm80", "sm86"))
def test_every_launch_fits_the_device(launches, monkeypatch, limit):
    """Every width 1..256 x layout x dtype (bfloat16 plans as float16; weights of x's dtype, so
    16-bit x takes fwd_mma from MMA_MIN_WIDTH / MMA_CL_MIN_WIDTH on) x short and long rows:
    the block's dynamic shared memory within the device's opt-in limit, at most 1024 threads,
    1 <= grid < 2**31; where the channel-last wide tile would not fit, the general kernel."""
    fake_device(monkeypatch, limit)
    fallbacks = 0
    for dtype in (np.float32, np.float16, np.float64):
        for layout, make in LAYOUTS.items():
            for seqlen in (3, 3000):
                for width in range(1, 257):
                    launches.clear()
                    x = make(2, 40, seqlen, dtype)
                    w = FakeCudaArray((40, width), dtype=dtype)
                    cupyconv.causal_conv1d_fn(x, w, activation="silu")
                    ((name, plan, _),) = launches
                    where = f"{layout} {np.dtype(dtype)} L={seqlen} width {width}: {name}"
                    assert plan.smem <= limit, where
                    assert plan.block[0] * plan.block[1] <= 1024, where
                    assert 1 <= plan.grid <= 2**31 - 1, where
                    wide = layout in ("cl", "cl_slice") and width > 8
                    fallbacks += wide and name.startswith("fwd_general")
    # Channel-last on sm_86, 2 layouts x 2 lengths: float64 from width 135 (122 widths), float32
    # where fwd_split_cl's block does not fit either, from width 194 (63; 16-bit x takes fwd_mma).
    assert fallbacks == {SM90_SMEM: 0, SM80_SMEM: 0, SM86_SMEM: 4 * 122 + 4 * 63}[limit]
