"""The kernels themselves, run on the CPU (tests/emulation.py), against the float64 reference.

Each case goes through the public function as on a GPU (validation, plan, packed parameters),
and the planned kernel instances run under the emulator: every thread of every block, warp-wide
operations and tensor-core MMAs computed from all their lanes, shared memory NaN-filled before
each block. Results are compared with ``cupyconv.reference`` at the per-dtype tolerances (every
result buffer starts NaN-filled, so an element no kernel writes fails), and every array's bytes
outside its elements must be untouched.

The cases cover every kernel template of the forward, backward, update and varlen operators
(``test_the_cases_launch_every_kernel``), on an H200 (sm_90) and, for the kernels whose code or
plan differs there, an A100 (sm_80). The ``emulation`` marker's grid (``.ci/run``) adds widths,
dtypes and features.
"""

from __future__ import annotations

import itertools

import ml_dtypes
import numpy as np
import pytest
from emulation import check_guards, compiler_available, emulated_gpu, host, run_kernel
from test_forward_gpu import seq_ids

import cupyconv
from cupyconv import _backward_plan, _forward_plan, _update_plan, reference
from cupyconv.testing import GRAD_TOLERANCE, assert_close, tolerance

pytestmark = pytest.mark.skipif(
    not compiler_available(),
    reason="the kernels' CPU emulation needs a C++17 compiler with _Float16 (g++ 12 or later)",
)

NP_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}
NP_DTYPES["float64"] = np.float64


def rounded(rng, shape, dtype, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(NP_DTYPES[dtype]).astype(np.float64)


def placed(a64, dtype, layout):
    """``a64`` ([batch, dim, seqlen]) in guarded host memory: cf (time-contiguous), cl
    (channel-contiguous), cl_slice (channels 8 .. 8 + dim of a channel-last buffer of 2 dim + 8
    channels: x's view of a wider projection), cl_odd (the same from channel 5: rows that do
    not start on vector boundaries), cf_slice or cf_odd (the channel-first counterparts)."""
    b, c, length = a64.shape
    if layout == "cf":
        return host(a64, NP_DTYPES[dtype])
    if layout == "cf_slice":  # channels 3 .. 3 + dim of a channel-first buffer of dim + 5
        return host(a64, NP_DTYPES[dtype], ((c + 5) * length, length, 1), 3 * length)
    if layout == "cf_odd":  # rows of length + 1, from the buffer's second element
        return host(a64, NP_DTYPES[dtype], (c * (length + 1), length + 1, 1), 1)
    wide = c if layout == "cl" else 2 * c + 8
    offset = {"cl": 0, "cl_slice": 8, "cl_odd": 5}[layout]
    return host(a64, NP_DTYPES[dtype], (length * wide, 1, wide), offset)


def states(rng, batch, dim, width, dtype, layout):
    s64 = rounded(rng, (batch, dim, width - 1), dtype)
    strides = (dim * (width - 1), 1, dim) if layout != "cf" else None
    return s64, host(s64, NP_DTYPES[dtype], strides)


def poison(x64, g64=None, width=None):
    """inf and NaN in x (and dout): at a row's interior, a run of three, a row's last position,
    and with ``width`` where its outputs end two positions before the row's end (the two after
    them, and the tensor cores' blocks past the row, see it only through the band's zeros)."""
    length = x64.shape[2]
    x64[0, 1, length * 7 // 25] = np.inf
    x64[1, 2, length * 3 // 5 : length * 3 // 5 + 3] = np.nan
    x64[1, 4, length - 1] = -np.inf
    if width is not None and width + 2 < length:
        x64[1, x64.shape[1] - 1, length - width - 2] = np.nan
    if g64 is not None:
        g64[0, 3, min(40, length - 1)] = -np.inf
        g64[1, 5, length * 103 // 250] = np.nan


def assert_matches(got, want, dtype, poisoned=False, rtol=None, atol=None, name="out"):
    """``assert_close``, and where the reference has non-finite entries (``poisoned``: it must
    have some, and some finite ones), those entries non-finite too and the rest within
    tolerance."""
    finite = np.isfinite(want)
    if poisoned:
        assert (~finite).any() and finite.any(), name
    assert_close(got[finite], want[finite], dtype, rtol=rtol, atol=atol, name=name)
    assert not np.isfinite(got[~finite].astype(np.float64)).any(), name


def forward_case(shape, width, layout="cf", dtype="bfloat16", wdtype=None, features=(), arch=900):
    """One forward call under the emulator against the reference; returns the kernels run.
    Feature "non_finite": inf and NaN in x (``poison``); "no_act": no activation (else SiLU)."""
    rng = np.random.default_rng(width + len(layout) + 7 * len(features))
    wdtype = wdtype or dtype
    b, c, length = shape
    x64 = rounded(rng, shape, dtype)
    if "non_finite" in features:
        poison(x64, width=width)
    w64 = rounded(rng, (c, width), wdtype, width**-0.5)
    b64 = rounded(rng, (c,), wdtype)
    s = seq_ids(rng, b, length, 3, True) if "seq_idx" in features else None
    init, act = "states" in features, None if "no_act" in features else "silu"
    with emulated_gpu(arch) as run:
        x = placed(x64, dtype, layout)
        w, bias = host(w64, NP_DTYPES[wdtype]), host(b64, NP_DTYPES[wdtype])
        i64, i = states(rng, b, c, width, dtype, layout) if init else (None, None)
        si = host(s, np.int32) if s is not None else None
        got = cupyconv.causal_conv1d_fn(
            x, w, bias, si, i, return_final_states=init, activation=act
        )  # fmt: skip
    want = reference.causal_conv1d_fn(x64, w64, b64, s, i64, init, act)
    if init:
        (out, final), (want, want_final) = got, want
        assert_matches(final.data, want_final, dtype, name="final_states")
    else:
        out = got
    assert_matches(out.data, want, dtype, "non_finite" in features)
    check_guards(x, w, bias, i, si, *run["allocations"])
    return run["launches"]


def backward_case(shape, width, layout="cf", dtype="bfloat16", wdtype=None, features=(), arch=900):
    """One backward call under the emulator against the reference; returns the kernels run.
    Feature "non_finite": inf and NaN in x and dout (``poison``); "dout_cf": dout laid out
    channel-first whatever x's layout (so that bwd_channel reads it element by element);
    "no_act": no activation (else SiLU)."""
    rng = np.random.default_rng(width + 3 * len(layout) + 11 * len(features))
    wdtype = wdtype or dtype
    b, c, length = shape
    x64, g64 = rounded(rng, shape, dtype), rounded(rng, shape, dtype)
    if "non_finite" in features:
        poison(x64, g64, width)
    w64 = rounded(rng, (c, width), wdtype, width**-0.5)
    b64 = rounded(rng, (c,), wdtype)
    s = seq_ids(rng, b, length, 3, True) if "seq_idx" in features else None
    init, act = "states" in features, None if "no_act" in features else "silu"
    with emulated_gpu(arch) as run:
        x = placed(x64, dtype, layout)
        dout = placed(g64, dtype, "cf" if "dout_cf" in features else layout)
        w, bias = host(w64, NP_DTYPES[wdtype]), host(b64, NP_DTYPES[wdtype])
        i64, i = states(rng, b, c, width, dtype, layout) if init else (None, None)
        f64, f = states(rng, b, c, width, dtype, layout) if init else (None, None)
        si = host(s, np.int32) if s is not None else None
        dx, dw, db, di = cupyconv.causal_conv1d_bwd(
            x, w, bias, dout, si, i, f, return_dinitial_states=init, activation=act
        )  # fmt: skip
    rdx, rdw, rdb, rdi = reference.causal_conv1d_bwd(x64, w64, b64, g64, s, i64, f64, act)
    poisoned = "non_finite" in features
    assert_matches(dx.data, rdx, dtype, poisoned, name="dx")
    # dweight and dbias: rounded once to weight's dtype; the atol scaled by the terms summed
    rtol = max(GRAD_TOLERANCE[0], tolerance(wdtype)[0])
    atol = GRAD_TOLERANCE[1] * (b * length) ** 0.5
    assert_matches(dw.data, rdw, wdtype, poisoned, rtol, atol, name="dweight")
    assert_matches(db.data, rdb, wdtype, poisoned, rtol, atol, name="dbias")
    if init:
        assert_close(di.data, rdi, dtype, name="dinitial_states")
    check_guards(x, dout, w, bias, i, f, si, *run["allocations"])
    return run["launches"]


def update_case(
    batch, dim, seqlen, width, state_len, circular=False, pool=0, order="cf", state_dtype="float32"
):  # fmt: skip
    """One decode update (bfloat16 x) under the emulator against the reference; ``pool`` > 0
    gathers state rows from a pool of batch + pool rows, every third batch row a padding row
    (-1). Returns the kernels run."""
    rng = np.random.default_rng(width + state_len + pool)
    shape = (batch, dim) if seqlen is None else (batch, dim, seqlen)
    x64 = rounded(rng, shape, "bfloat16")
    w64 = rounded(rng, (dim, width), "bfloat16", width**-0.5)
    b64 = rounded(rng, (dim,), "bfloat16")
    rows = batch + pool
    s64 = rounded(rng, (rows, dim, state_len), state_dtype)
    idx = None
    if pool:
        idx = rng.permutation(rows)[:batch].astype(np.int32)
        idx[::3] = -1
    lens = rng.integers(0, 4 * state_len, batch).astype(np.int32) if circular else None
    with emulated_gpu() as run:
        x = host(x64, ml_dtypes.bfloat16)
        w, bias = host(w64, ml_dtypes.bfloat16), host(b64, ml_dtypes.bfloat16)
        s_strides = (dim * state_len, 1, dim) if order == "cl" else None
        state = host(s64, NP_DTYPES[state_dtype], s_strides)
        ii = host(idx, np.int32) if idx is not None else None
        ll = host(lens, np.int32) if lens is not None else None
        out = cupyconv.causal_conv1d_update(x, state, w, bias, "silu", ll, ii)
    want, want_state = reference.causal_conv1d_update(x64, s64, w64, b64, "silu", lens, idx)
    assert_close(out.data, want, "bfloat16")
    exact = want_state.astype(NP_DTYPES[state_dtype]).astype(np.float64)
    assert np.array_equal(state.data.astype(np.float64), exact), "conv_state is not the reference's"
    check_guards(x, w, bias, state, ii, ll, *run["allocations"])
    return run["launches"]


def varlen_case(lengths, dim, state_len, dtype="bfloat16"):
    """causal_conv1d_varlen_states on packed sequences of ``lengths``: exactly the reference's."""
    rng = np.random.default_rng(state_len)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    x64 = rounded(rng, (int(cu[-1]), dim), dtype)
    with emulated_gpu() as run:
        x, cs = host(x64, NP_DTYPES[dtype]), host(cu, np.int32)
        states = cupyconv.causal_conv1d_varlen_states(x, cs, state_len)
    want = reference.causal_conv1d_varlen_states(x64, cu, state_len)
    assert np.array_equal(states.data.astype(np.float64), want)
    check_guards(x, cs, *run["allocations"])
    return run["launches"]


def templates(launches):
    return {name.split("<")[0] for name in launches}


# (shape, width, layout, dtype, weight dtype, features, arch) -> the kernel template expected
SHAPE, LONG, WHOLE = (2, 40, 300), (1, 36, 700), (1, 8, 512)
SHORT = (2, 40, 50)  # bwd_channel's block sums
STRIPS = (2, 256, 300)  # whole strips of 128 channels: bwd_channel_pair
FORWARD = {
    (SHAPE, 4, "cf", "bfloat16", None, (), 900): "fwd_time",
    (SHAPE, 4, "cl", "bfloat16", None, (), 900): "fwd_channel",
    (SHAPE, 4, "cl_slice", "float32", None, ("seq_idx", "states"), 900): "fwd_channel",
    (SHAPE, 16, "cf", "bfloat16", None, (), 900): "fwd_mma",
    (WHOLE, 20, "cf", "bfloat16", None, (), 900): "fwd_mma_time",
    (SHAPE, 16, "cl", "bfloat16", None, (), 900): "fwd_mma_cl",
    (SHAPE, 31, "cl_slice", "bfloat16", None, ("states",), 900): "fwd_mma_cl",
    (SHAPE, 31, "cl_slice", "bfloat16", None, ("states",), 800): "fwd_mma_cl",
    (SHAPE, 64, "cl", "bfloat16", None, (), 900): "fwd_mma_cl",
    (SHAPE, 33, "cl", "float16", None, ("non_finite",), 900): "fwd_mma_cl",
    (SHAPE, 97, "cl", "bfloat16", None, ("states",), 900): "fwd_mma_cl",
    (SHAPE, 16, "cl", "bfloat16", None, ("no_act",), 900): "fwd_mma_cl",
    (SHAPE, 100, "cl", "bfloat16", None, (), 900): "fwd_mma",
    (SHAPE, 100, "cf", "float16", "float32", (), 900): "fwd_mma",
    (SHAPE, 256, "cf", "bfloat16", None, ("states",), 900): "fwd_mma",
    (SHAPE, 64, "cf", "float64", None, (), 900): "fwd_time_wide",
    (SHAPE, 64, "cl", "float32", None, (), 900): "fwd_split_cl",
    (SHAPE, 39, "cl_slice", "float32", "bfloat16", ("states", "non_finite"), 900): "fwd_split_cl",
    (SHAPE, 29, "cl", "float32", None, ("states",), 900): "fwd_split_cl",
    (SHAPE, 17, "cl_slice", "float32", None, ("non_finite",), 800): "fwd_split_cl",
    (SHAPE, 29, "cl", "float64", None, ("states",), 900): "fwd_channel_wide",
    (SHAPE, 256, "cl", "float32", None, ("states",), 800): "fwd_split_cl",
    (SHAPE, 9, "cl_odd", "bfloat16", None, ("seq_idx",), 900): "fwd_general",
}
BACKWARD = {
    (SHAPE, 4, "cf", "bfloat16", None, (), 900): "bwd_time",
    (SHAPE, 4, "cl", "bfloat16", None, ("seq_idx", "states"), 900): "bwd_channel",
    (SHAPE, 16, "cl_slice", "float32", None, (), 900): "bwd_channel",
    (SHORT, 4, "cl", "bfloat16", None, ("seq_idx", "states"), 900): "bwd_channel",
    (SHORT, 12, "cl_odd", "float32", None, (), 900): "bwd_channel",
    (SHAPE, 3, "cl", "float16", None, ("dout_cf",), 900): "bwd_channel",
    (STRIPS, 4, "cl", "bfloat16", None, ("states",), 900): "bwd_channel_pair",
    (STRIPS, 2, "cl_slice", "float16", None, (), 900): "bwd_channel_pair",
    (STRIPS, 1, "cl", "bfloat16", None, ("non_finite",), 900): "bwd_channel_pair",
    (STRIPS, 4, "cl", "float16", None, (), 800): "bwd_channel_pair",
    (LONG, 16, "cf", "bfloat16", None, (), 900): "bwd_mma_time",
    (SHAPE, 33, "cf", "bfloat16", None, ("states",), 900): "bwd_mma_time",
    (SHAPE, 40, "cf", "bfloat16", None, ("states",), 900): "bwd_mma",
    (SHAPE, 40, "cl", "bfloat16", None, (), 900): "bwd_mma",
    (SHAPE, 129, "cf", "bfloat16", None, (), 900): "bwd_mma_block",
    (SHAPE, 66, "cl_slice", "bfloat16", None, ("states",), 900): "bwd_mma_cl",
    (SHAPE, 66, "cl", "bfloat16", None, (), 800): "bwd_mma_cl",
    (SHAPE, 200, "cl", "bfloat16", None, (), 900): "bwd_mma_cl",
    (SHAPE, 100, "cl", "bfloat16", None, ("no_act",), 900): "bwd_mma_cl",
    (SHAPE, 130, "cl", "bfloat16", None, ("no_act",), 900): "bwd_mma_cl",
    (LONG, 16, "cf", "bfloat16", None, ("no_act",), 900): "bwd_mma_time",
    (SHAPE, 64, "cl", "float32", None, ("states",), 900): "bwd_wide",
    (SHAPE, 20, "cf", "float16", "float32", ("seq_idx", "states"), 900): "bwd_dz",
}


def _id(case):
    shape, width, layout, dtype, wdtype, features, arch = case
    parts = [f"{shape[0]}x{shape[1]}x{shape[2]}", f"w{width}", layout, dtype]
    parts += ([f"w{wdtype}"] if wdtype else []) + list(features) + [f"sm{arch // 10}"]
    return "-".join(parts)


@pytest.mark.parametrize("case", FORWARD, ids=_id)
def test_forward(case):
    shape, width, layout, dtype, wdtype, features, arch = case
    ran = forward_case(shape, width, layout, dtype, wdtype, features, arch)
    assert FORWARD[case] in templates(ran), ran


def test_reads_outside_every_array_fail():
    """The emulator's cp.async reads only inside the live arrays: x left out of them, the
    channel-last backward's staging of x fails the launch."""
    import emulation

    rng = np.random.default_rng(0)
    x64, g64 = rounded(rng, (2, 64, 40), "bfloat16"), rounded(rng, (2, 64, 40), "bfloat16")
    w64 = rounded(rng, (64, 4), "bfloat16")
    with emulated_gpu():
        x, dout = placed(x64, "bfloat16", "cl"), placed(g64, "bfloat16", "cl")
        w = host(w64, NP_DTYPES["bfloat16"])
        emulation._live.discard(x)
        with pytest.raises(emulation.EmulationError, match="cp.async: a read outside every array"):
            cupyconv.causal_conv1d_bwd(x, w, None, dout)


# One thread of warp 0 copies 16 bytes into shared memory by cp.async and waits for them after
# two barriers; between those, a thread of warp 1 stores into the destination if `store`.
IN_FLIGHT = """
#include "ptx.cuh"
__global__ void store_in_flight(const float* src, float* out, long long store) {
    __shared__ __align__(16) float dst[4];
    if (threadIdx.x == 0) {
        cp_async<16>(dst, src, 16);
        cp_async_commit();
    }
    __syncthreads();
    if (threadIdx.x == 32 && store) dst[1] = 2.f;
    __syncthreads();
    if (threadIdx.x == 0) {
        cp_async_wait<0>();
        for (int i = 0; i < 4; ++i) out[i] = dst[i];
    }
}
"""


@pytest.mark.parametrize("store", (0, 1))
def test_stores_into_a_copy_in_flight_fail(store):
    """A cp.async may land any time before its wait: another warp's store into its destination
    meanwhile fails the launch, and without it the copy lands at the wait."""
    import emulation

    src, out = host(np.arange(1.0, 5.0), np.float32), host(np.zeros(4), np.float32)
    args = [src, out, np.int64(store)]
    if store:
        with pytest.raises(emulation.EmulationError, match="written while the copy was in flight"):
            run_kernel(IN_FLIGHT, "store_in_flight", args, 1, (64, 1), 0)
    else:
        run_kernel(IN_FLIGHT, "store_in_flight", args, 1, (64, 1), 0)
        assert out.data.tolist() == [1.0, 2.0, 3.0, 4.0]


@pytest.mark.parametrize("case", BACKWARD, ids=_id)
def test_backward(case):
    shape, width, layout, dtype, wdtype, features, arch = case
    ran = backward_case(shape, width, layout, dtype, wdtype, features, arch)
    assert BACKWARD[case] in templates(ran), ran


@pytest.mark.parametrize("features", ((), ("states",)))
def test_backward_long_pieces_at_ks_5(features):
    """The plan's own route at KS 5 on rows of 6000 (the emulated device's two resident blocks):
    bwd_mma_cl in pieces of 2048, the last cut by the row's end."""
    ran = backward_case((2, 40, 6000), 64, "cl", features=features)
    assert "bwd_mma_cl<__nv_bfloat16, 5>" in ran, ran


UPDATE = {  # (batch, dim, seqlen, width, state_len, circular, pool, order, state dtype)
    (3, 40, None, 4, 3, False, 0, "cf", "bfloat16"): "conv_update_lean",
    (16, 40, None, 3, 2, True, 0, "cf", "bfloat16"): "conv_update_lean",
    (3, 40, 5, 4, 6, True, 2, "cl"): "conv_update",
    (2, 40, 3, 33, 40, False, 4, "cf"): "conv_update",
    (2, 40, None, 256, 255, True, 0, "cl"): "conv_update",
}


@pytest.mark.parametrize("case", UPDATE, ids=lambda c: "-".join(map(str, c)))
def test_update(case):
    ran = update_case(*case)
    assert UPDATE[case] in templates(ran), ran


def test_varlen_states():
    assert templates(varlen_case([5, 0, 1, 3, 12, 8, 2], 37, 3)) == {"varlen_states"}
    assert templates(varlen_case([300], 40, 8, "float32")) == {"varlen_states"}


def fwd_mma_plan(monkeypatch, shape, width):
    """(plan fields, grid) of the fwd_mma launch of the channel-last forward case ``shape``,
    ``width`` (with initial states), which must launch fwd_mma."""
    from cupyconv import _forward_plan

    made = []
    plan_mma = _forward_plan._plan_mma
    monkeypatch.setattr(
        _forward_plan, "_plan_mma", lambda *a: made.append(plan_mma(*a)) or made[-1]
    )
    assert "fwd_mma" in templates(forward_case(shape, width, "cl", features=("states",)))
    return dict(zip(_forward_plan.MMA.plan_fields, made[0].plan_fields, strict=True)), made[0].grid


@pytest.mark.parametrize("buffers", (2, 1))
def test_channel_last_rows_buffers(monkeypatch, buffers):
    """fwd_mma's channel-contiguous form with its rows in two buffers and in one (where two do
    not fit), each of its two blocks taking several items (spans of a row, strips of channels,
    the last one cut by dim)."""
    from cupyconv import _forward_plan

    monkeypatch.setattr(_forward_plan, "MMA_CL_ROW_BUFFERS", (buffers,))
    fields, grid = fwd_mma_plan(monkeypatch, (2, 40, 1100), 100)
    assert fields["two_rows"] == (buffers == 2) and grid == 2
    items = 3 * 2 * -(-1100 // fields["span"])  # (channel strips x batch rows x spans)
    assert items >= 3 * grid


@pytest.mark.parametrize("width,buffers", ((100, 2), (177, 1)))
def test_channel_last_spans_of_2048(monkeypatch, width, buffers):
    """fwd_mma's channel-contiguous form at its longest spans (MMA_CL_SPAN), in two buffers
    (KS 8) and in one (KS 12), each of its two blocks taking several items."""
    from cupyconv import _forward_plan

    fields, grid = fwd_mma_plan(monkeypatch, (1, 72, 2200), width)
    assert fields["span"] == _forward_plan.CONSTANTS["MMA_CL_SPAN"] == 2048
    assert fields["two_rows"] == (buffers == 2) and grid == 2


def test_the_cases_launch_every_kernel():
    """Every kernel template of the forward and backward is the expected kernel of a case (and
    the cases check that they launch it), or is launched beside one (the final states, the
    backward's general steps and its reduction)."""
    beside = {"fwd_final_states", "bwd_dx", "bwd_weight", "bwd_states", "bwd_reduce"}
    expected = set(FORWARD.values()) | set(BACKWARD.values()) | beside
    every = {k.template for k in _forward_plan.KERNELS + _backward_plan.KERNELS}
    assert every == expected
    assert set(UPDATE.values()) == {_update_plan.UPDATE.template, _update_plan.LEAN.template}


# ---- the wider grid (.ci/run) -----------------------------------------------------------------

GRID_WIDTHS = (1, 2, 3, 5, 8, 9, 17, 18, 33, 34, 65, 129, 256)
LAYOUTS = ("cf", "cl", "cl_slice")
FEATURES = ((), ("seq_idx", "states"))
PAIRS = (
    ("float32", None), ("float16", None), ("float64", None), ("float16", "float32"),
    ("bfloat16", "float32"),
)  # fmt: skip


@pytest.mark.emulation
@pytest.mark.parametrize("width,layout,features", itertools.product(GRID_WIDTHS, LAYOUTS, FEATURES))
def test_grid(width, layout, features):
    forward_case(SHAPE, width, layout, "bfloat16", None, features)
    backward_case(SHAPE, width, layout, "bfloat16", None, features)


@pytest.mark.emulation
@pytest.mark.parametrize(
    "pair,width,layout,features", itertools.product(PAIRS, (4, 16, 64, 256), ("cf", "cl"), FEATURES)
)
def test_grid_dtypes(pair, width, layout, features):
    forward_case(SHAPE, width, layout, *pair, features)
    backward_case(SHAPE, width, layout, *pair, features)


@pytest.mark.emulation
@pytest.mark.parametrize(
    "width,layout,dtype,features",
    itertools.product((1, 2, 4), ("cl", "cl_slice"), ("bfloat16", "float16"), ((), ("states",))),
)
def test_grid_channel_pairs(width, layout, dtype, features):
    """bwd_channel_pair (whole strips of 128 channels) at every width it takes, and rows whose
    last tile the row's end cuts (301 steps)."""
    ran = backward_case((2, 256, 301), width, layout, dtype, None, features)
    assert "bwd_channel_pair" in templates(ran), ran


@pytest.mark.parametrize(
    "width,layout", [(4, "cf"), (4, "cl"), (16, "cl"), (33, "cf"), (40, "cl"), (66, "cl")]
)
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_non_finite(width, layout):
    """inf and NaN reach exactly the outputs, dx, dweight and dbias the reference has
    non-finite (the tensor-core kernels' exact paths), the rest as always."""
    forward_case(SHAPE, width, layout, features=("non_finite",))
    backward_case(SHAPE, width, layout, features=("non_finite",))


@pytest.mark.parametrize("width,layout", [(4, "cf"), (4, "cl"), (16, "cl"), (40, "cf")])
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_non_finite_with_seq_idx(width, layout):
    """The same with seq_idx: an inf at a padding position and terms of masked taps are selected
    out, not multiplied by 0 (bwd_time, bwd_channel, the general kernels)."""
    forward_case(SHAPE, width, layout, features=("non_finite", "seq_idx"))
    backward_case(SHAPE, width, layout, features=("non_finite", "seq_idx"))


@pytest.mark.emulation
@pytest.mark.parametrize(
    "width,layout", itertools.product((9, 16, 17, 20, 33, 64, 129, 200, 256), ("cf", "cl"))
)
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_grid_non_finite(width, layout):
    forward_case(SHAPE, width, layout, features=("non_finite",))
    backward_case(SHAPE, width, layout, features=("non_finite",))
    forward_case((2, 8, 1024), width, "cf", features=("non_finite",))
    backward_case((2, 8, 1024), width, "cf", features=("non_finite",))


@pytest.mark.emulation
@pytest.mark.parametrize("width,layout", itertools.product((10, 16, 64, 129, 256), ("cf", "cl")))
def test_grid_sm80(width, layout):
    forward_case(SHAPE, width, layout, "bfloat16", None, ("states",), 800)
    backward_case(SHAPE, width, layout, "bfloat16", None, ("states",), 800)


@pytest.mark.emulation
@pytest.mark.parametrize(
    "width,seqlen,circular",
    itertools.product((1, 2, 3, 5, 8, 9, 33, 256), (None, 4), (False, True)),
)
def test_grid_update(width, seqlen, circular):
    update_case(3, 40, seqlen, width, width + 2, circular, 2, "cl")
    update_case(2, 40, seqlen, width, max(width - 1, 1), circular, 0, "cf", "bfloat16")


# ---- randomised (.ci/run) ------------------------------------------------------------------------

R_WIDTHS = (*range(1, 10), 15, 16, 17, 18, 31, 32, 33, 34, 48, 63, 64, 65, 66, 100, 127, 128, 129)
R_WIDTHS += (130, 200, 255, 256)
R_LENGTHS = (1, 2, 3, 7, 8, 15, 16, 17, 63, 64, 65, 127, 128, 129, 200, 255, 256, 257, 300, 511)
R_LENGTHS += (513, 700, 1024, 1100)
R_PAIRS = (("bfloat16", "bfloat16"),) * 4 + (
    ("float16", "float16"), ("float32", "float32"), ("float64", "float64"),
    ("float16", "float32"), ("bfloat16", "float32"), ("float32", "bfloat16"),
    ("float16", "bfloat16"),
)  # fmt: skip
R_LAYOUTS = ("cf", "cl", "cl", "cl_slice", "cl_odd", "cf_slice", "cf_odd")


def random_case(seed):
    """A forward and a backward call of random shape, width, dtypes, layout and features (bias,
    activation, seq_idx with padding, initial states, final states, dfinal states, non-finite
    inputs) on sm_90 or sm_80, against the reference. Returns the case's description."""
    rng = np.random.default_rng(seed)
    width, length = int(rng.choice(R_WIDTHS)), int(rng.choice(R_LENGTHS))
    batch, dim = int(rng.integers(1, 4)), int(rng.choice([1, 3, 7, 8, 16, 33, 40, 64]))
    if width > 33:
        length = min(length, max(1, 12000 // dim))
    dtype, wdtype = R_PAIRS[rng.integers(len(R_PAIRS))]
    layout = R_LAYOUTS[rng.integers(len(R_LAYOUTS))]
    act = "silu" if rng.random() < 0.8 else None
    has_bias, has_seq = rng.random() < 0.8, rng.random() < 0.25 and length > 1
    init, dfinal = rng.random() < 0.35 and width > 1, rng.random() < 0.3 and width > 1
    want_final = rng.random() < 0.3 and width > 1
    non_finite = rng.random() < 0.15 and batch >= 2 and dim >= 7 and length >= 10
    arch = int(rng.choice([900, 900, 800]))
    what = (
        f"seed {seed}: {batch}x{dim}x{length} width {width} {dtype}/{wdtype} {layout}"
        f" sm_{arch // 10} act={act} bias={has_bias} seq={has_seq} init={init} dfinal={dfinal}"
        f" final={want_final} non_finite={non_finite}"
    )
    x64, g64 = rounded(rng, (batch, dim, length), dtype), rounded(rng, (batch, dim, length), dtype)
    if non_finite:
        poison(x64, g64, width)
    w64 = rounded(rng, (dim, width), wdtype, width**-0.5)
    b64 = rounded(rng, (dim,), wdtype) if has_bias else None
    s = seq_ids(rng, batch, length, 3, True) if has_seq else None
    state_layout = "cl" if layout.startswith("cl") else "cf"
    i64, i = states(rng, batch, dim, width, dtype, state_layout) if init else (None, None)
    f64, f = states(rng, batch, dim, width, dtype, state_layout) if dfinal else (None, None)
    with emulated_gpu(arch) as run:
        x, g = placed(x64, dtype, layout), placed(g64, dtype, layout)
        w = host(w64, NP_DTYPES[wdtype])
        bias = host(b64, NP_DTYPES[wdtype]) if has_bias else None
        si = host(s, np.int32) if has_seq else None
        got = cupyconv.causal_conv1d_fn(
            x, w, bias, si, i, return_final_states=want_final, activation=act
        )  # fmt: skip
        dx, dw, db, di = cupyconv.causal_conv1d_bwd(
            x, w, bias, g, si, i, f, return_dinitial_states=init, activation=act
        )  # fmt: skip

    want = reference.causal_conv1d_fn(x64, w64, b64, s, i64, want_final, act)
    if want_final:
        (got, final), (want, want_final_states) = got, want
        assert_matches(final.data, want_final_states, dtype, name=f"final_states ({what})")
    assert_matches(got.data, want, dtype, name=f"out ({what})")
    rdx, rdw, rdb, rdi = reference.causal_conv1d_bwd(x64, w64, b64, g64, s, i64, f64, act)
    assert_matches(dx.data, rdx, dtype, name=f"dx ({what})")
    rtol = max(GRAD_TOLERANCE[0], tolerance(wdtype)[0])
    atol = GRAD_TOLERANCE[1] * (batch * length) ** 0.5
    assert_matches(dw.data, rdw, wdtype, rtol=rtol, atol=atol, name=f"dweight ({what})")
    if has_bias:
        assert_matches(db.data, rdb, wdtype, rtol=rtol, atol=atol, name=f"dbias ({what})")
    if init:
        assert_matches(di.data, rdi, dtype, name=f"dinitial_states ({what})")
    check_guards(x, g, w, bias, si, i, f, *run["allocations"])
    return what


@pytest.mark.emulation
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("seed", range(80))
def test_randomised(seed):
    random_case(seed)


# benchmarks/tf32_cl.py's channel-last prototypes: (dtype, width, kernel, config).
PROTOTYPES = (
    ("float32", 64, "psplit", (256, 8, 0, 1, 1)),
    ("float32", 31, "psplit", (128, 8, 1, 0, 0)),
)


@pytest.mark.parametrize(
    "dtype,width,kernel,config",
    PROTOTYPES,
    ids=lambda v: "-".join(map(str, v)) if isinstance(v, tuple) else str(v),
)
def test_channel_last_prototypes(dtype, width, kernel, config):
    """benchmarks/tf32_cl.py's channel-last tensor-core prototype psplit_cl on the CPU against
    the reference (float32 x split once a step in the staging buffer, with the outputs in the
    window's own words or an output tile): channels not a multiple of the block's, rows not a
    multiple of the step, pieces of 256 positions, bias and SiLU."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import tf32_cl

    rng = np.random.default_rng(width)
    batch, seqlen, dim, span = 2, 600, 40, 256
    x64 = rounded(rng, (batch, dim, seqlen), dtype)
    w64 = rounded(rng, (dim, width), dtype, width**-0.5)
    b64 = rounded(rng, (dim,), dtype)
    np_dtype = NP_DTYPES[dtype]
    x = host(x64.transpose(0, 2, 1), np_dtype)  # [batch, seqlen, dim], as the prototypes take
    w, bias = host(w64, np_dtype), host(b64, np_dtype)
    out = host(np.full((batch, seqlen, dim), np.nan), np_dtype)
    itemsize = np.dtype(np_dtype).itemsize
    items = batch * -(-dim // (64 // itemsize)) * -(-seqlen // span)
    scalars = [np.int32(v) for v in (seqlen, dim, span, 1)]
    run_kernel(
        tf32_cl.source(emulated=True), tf32_cl.instance_name(dtype, width, kernel, config),
        [x, w, bias, out, *scalars], items, (32 * config[1], 1),
        tf32_cl.smem_bytes(kernel, width, config, itemsize),
    )  # fmt: skip
    want = reference.causal_conv1d_fn(x64, w64, b64, activation="silu")
    assert_close(out.data.transpose(0, 2, 1), want, dtype)
    check_guards(x, w, bias, out)
