"""The backward pass on the GPU against the float64 reference.

Every case builds its inputs in numpy (already rounded to the dtype under test), moves them to
the GPU in the layout under test, runs ``causal_conv1d_bwd`` into NaN-prefilled buffers (dx of
the layout under test, dweight / dbias / dinitial_states buffers where the case asks for them),
and compares dx and dinitial_states with the reference at the dtype's tolerance, dweight and
dbias at ``GRAD_TOLERANCE`` with the atol scaled by sqrt(batch * seqlen), the number of terms
of each reduction (docs/semantics.md, "Tolerances").
"""

from __future__ import annotations

import numpy as np
import pytest
from test_forward_gpu import rounded, seq_ids, to_gpu

import cupyconv
from cupyconv import reference
from cupyconv.testing import GRAD_TOLERANCE, assert_close, tolerance

pytestmark = pytest.mark.gpu


def channel_last(layout: str) -> bool:
    return layout.startswith("cl") or layout.endswith("_cl")


def nan_like_layout(shape, dtype, layout):
    import torch

    b, c, length = shape
    if channel_last(layout):
        return torch.full((b, length, c), float("nan"), device="cuda", dtype=dtype).transpose(1, 2)
    return torch.full(shape, float("nan"), device="cuda", dtype=dtype)


def run_bwd(
    batch, dim, seqlen, width, dtype="float32", wdtype=None, layout="cf", bias=True, silu=True,
    segments=0, padding=False, init=False, dinit=True, dfinal=False, buffers=False, seed=0,
):  # fmt: skip
    """One backward case against the reference; returns the results (for repeat checks)."""
    import torch

    rng = np.random.default_rng(seed)
    wdtype = wdtype or dtype
    x64 = rounded(rng, (batch, dim, seqlen), dtype)
    g64 = rounded(rng, (batch, dim, seqlen), dtype)
    w64 = rounded(rng, (dim, width), wdtype, scale=width**-0.5)
    b64 = rounded(rng, (dim,), wdtype) if bias else None
    s = seq_ids(rng, batch, seqlen, segments, padding) if segments else None
    i64 = rounded(rng, (batch, dim, width - 1), dtype) if init else None
    f64 = rounded(rng, (batch, dim, width - 1), dtype) if dfinal else None
    act = "silu" if silu else None
    state_layout = "cl" if channel_last(layout) else "cf"

    x, dout = to_gpu(x64, dtype, layout), to_gpu(g64, dtype, layout)
    w = to_gpu(w64, wdtype)
    b = to_gpu(b64, wdtype) if bias else None
    si = torch.from_numpy(s).cuda() if s is not None else None
    ii = to_gpu(i64, dtype, state_layout) if init else None
    ff = to_gpu(f64, dtype, state_layout) if dfinal else None
    kwargs = {}
    dx_buf = None
    if buffers:
        dx_buf = nan_like_layout((batch, dim, seqlen), x.dtype, layout)
        kwargs["dweight_out"] = torch.full((width, dim), float("nan"), device="cuda",
                                           dtype=w.dtype).t()  # fmt: skip
        if bias:
            kwargs["dbias_out"] = torch.full((dim,), float("nan"), device="cuda", dtype=w.dtype)
        if init and dinit:
            kwargs["dinitial_states_out"] = nan_like_layout((batch, dim, width - 1), x.dtype, "cl")
    dx, dw, db, di = cupyconv.causal_conv1d_bwd(
        x, w, b, dout, si, ii, ff, dx=dx_buf, return_dinitial_states=dinit, activation=act,
        **kwargs,
    )  # fmt: skip
    torch.cuda.synchronize()
    rdx, rdw, rdb, rdi = reference.causal_conv1d_bwd(x64, w64, b64, g64, s, i64, f64, act)

    if buffers:
        assert dx is dx_buf and dw is kwargs["dweight_out"]
    assert dx.dtype == x.dtype and dx.stride() == (dx_buf.stride() if buffers else dx.stride())
    if not buffers and seqlen > 1 and dim > 1:  # dx in x's memory order
        assert (dx.stride(1) == 1) == channel_last(layout)
    assert dw.dtype == w.dtype and dw.shape == (dim, width)
    reduction = max(batch * seqlen, 1) ** 0.5
    # dweight and dbias are rounded once to weight's dtype: never tighter than that dtype's rtol.
    rtol, atol = max(GRAD_TOLERANCE[0], tolerance(wdtype)[0]), GRAD_TOLERANCE[1]
    assert_close(dx, rdx, dtype, name="dx")
    assert_close(dw, rdw, rtol=rtol, atol=atol * reduction, name="dweight")
    if bias:
        assert db.dtype == w.dtype
        assert_close(db, rdb, rtol=rtol, atol=atol * reduction, name="dbias")
    else:
        assert db is None
    if init and dinit:
        assert_close(di, rdi, dtype, name="dinitial_states")
    else:
        assert di is None
    return dx, dw, db, di


def features_of(features: str, segments: int = 4) -> dict:
    """run_bwd's keyword arguments for a dash-separated list of features: nobias, nosilu, seq
    (``segments`` segments), padding, init, dfinal, buffers (output buffers, with init and
    dfinal), all (seq, padding, init and dfinal)."""
    f = set(features.split("-"))
    every = "all" in f
    return dict(
        bias="nobias" not in f, silu="nosilu" not in f,
        segments=segments if every or "seq" in f else 0, padding=every or "padding" in f,
        init=every or bool(f & {"init", "buffers"}),
        dfinal=every or bool(f & {"dfinal", "buffers"}), buffers="buffers" in f,
    )  # fmt: skip


WIDTHS = (1, 2, 3, 4, 5, 8, 16, 17, 31, 64, 256)
LAYOUTS = ("cf", "cl", "cl_slice", "cf_slice", "time_stride2", "misaligned", "misaligned_cl")


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_widths_layouts(width, layout):
    run_bwd(2, 40, 300, width, "float32", layout=layout)


@pytest.mark.parametrize("dtype", ("float32", "float16", "bfloat16", "float64"))
@pytest.mark.parametrize("layout", ("cf", "cl"))
@pytest.mark.parametrize("width", (4, 16))
def test_dtypes(dtype, layout, width):
    run_bwd(2, 64, 500, width, dtype, layout=layout)


@pytest.mark.parametrize(
    "dtype,wdtype",
    [("bfloat16", "float32"), ("float16", "bfloat16"), ("float32", "bfloat16"),
     ("float64", "float32")],
)  # fmt: skip
def test_dtype_pairs(dtype, wdtype):
    run_bwd(2, 24, 130, 4, dtype, wdtype, layout="cl")


@pytest.mark.parametrize("layout", ("cf", "cl", "cl_slice"))
@pytest.mark.parametrize("width", (1, 2, 4, 7, 16, 40))
@pytest.mark.parametrize(
    "features",
    ["bias", "nobias-nosilu", "seq", "seq-padding", "init", "dfinal", "seq-init-dfinal", "all"],
)
def test_features(layout, width, features):
    run_bwd(3, 33, 257, width, "float32", layout=layout, seed=width, **features_of(features))


@pytest.mark.parametrize("layout", ("cf", "cl"))
@pytest.mark.parametrize("seqlen", (1, 2, 3, 5))
@pytest.mark.parametrize("width", (4, 8, 31))
def test_short_rows_with_states(layout, seqlen, width):
    """L < K - 1: the final states reach into the initial states, and so do their gradients."""
    run_bwd(
        2, 16, seqlen, width, "float32", layout=layout, segments=2, padding=False, init=True,
        dfinal=True, seed=seqlen,
    )  # fmt: skip


@pytest.mark.parametrize("layout", ("cf", "cl", "misaligned"))
def test_buffers(layout):
    """dx, dweight_out, dbias_out and dinitial_states_out written in place, any strides."""
    run_bwd(2, 48, 200, 4, "bfloat16", layout=layout, init=True, dfinal=True, buffers=True)


@pytest.mark.parametrize("layout", ("cf", "cl"))
@pytest.mark.parametrize("features", ["buffers", "buffers-nobias", "buffers-seq"])
@pytest.mark.parametrize("shape", [(2, 48, 200), (3, 64, 5000)], ids=["one-part", "partials"])
def test_buffers_lean_path(monkeypatch, layout, features, shape):
    """A call with output buffers like an earlier one's replays its launches (no argument
    checks, plan or packing again) into the new buffers, with the new values; a dx that
    shares memory with dout sends the call the full way, which refuses it."""
    import torch

    from cupyconv import _fast, backward

    kwargs = dict(layout=layout, **features_of(features))
    run_bwd(*shape, 4, "bfloat16", seed=1, **kwargs)
    calls = len(_fast._calls)

    def full_path(*args):
        raise AssertionError("the call took the full path")

    with monkeypatch.context() as m:
        m.setattr(backward, "_BackwardCall", full_path)
        run_bwd(*shape, 4, "bfloat16", seed=2, **kwargs)
    assert len(_fast._calls) == calls
    x, dout, dx = (nan_like_layout(shape, torch.bfloat16, layout).normal_() for _ in range(3))
    w = torch.randn(shape[1], 4, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(shape[1], device="cuda", dtype=torch.bfloat16)
    grads = dict(dweight_out=torch.empty_like(w), dbias_out=torch.empty_like(b), activation="silu")
    cupyconv.causal_conv1d_bwd(x, w, b, dout, dx=dx, **grads)  # leaves a FastCall
    with pytest.raises(ValueError, match="^dx must not share memory with dout$"):
        cupyconv.causal_conv1d_bwd(x, w, b, dout, dx=dout, **grads)


@pytest.mark.parametrize("layout,width", [("cf", 4), ("cl", 4), ("misaligned", 4), ("cl", 20)])
@pytest.mark.parametrize("bias", (True, False))
def test_single_part(layout, width, bias):
    """One row short enough for one part: the main kernel (bwd_time, bwd_channel, the general
    path) writes dweight and dbias itself, here into NaN-filled buffers of other strides."""
    run_bwd(1, 64, 16, width, "bfloat16", layout=layout, bias=bias, buffers=True, seed=width)


@pytest.mark.parametrize("dinit", (False, True))
def test_no_dinitial_without_request(dinit):
    run_bwd(1, 8, 50, 4, init=True, dinit=dinit)


@pytest.mark.parametrize("shape", [(2, 8, 0), (0, 8, 16), (2, 0, 16)])
def test_empty(shape):
    """No tokens: dweight and dbias are zero and dinitial_states is dfinal_states."""
    batch, dim, seqlen = shape
    run_bwd(batch, dim, seqlen, 4, init=True, dfinal=True, segments=2 if seqlen else 0)


# ---- the tensor-core backward (bwd_mma: bfloat16 x and weights, time-contiguous x) ----------

MMA_WIDTHS = (2, 4, 5, 8, 9, 16, 17, 18, 31, 33, 64, 65, 129, 200, 256)


def forced_route(monkeypatch, kernel: str, **limits):
    """The plan's dispatch limits set to ``limits`` (fresh plan and call caches) for the test;
    after it, the test must have launched ``kernel``."""
    from cupyconv import _backward_plan, _fast

    for name, value in limits.items():
        monkeypatch.setattr(_backward_plan, name, value)
    monkeypatch.setattr(_backward_plan, "_plans", {})
    monkeypatch.setattr(_fast, "_calls", {})
    yield
    launched = [s.name for plan in _backward_plan._plans.values() for s in plan.launches]
    assert any(name.startswith(kernel) for name in launched), launched


@pytest.fixture
def tensor_cores(monkeypatch):
    """bwd_mma for every width it takes, whatever the dispatch threshold (bwd_mma_time's
    widths too; bwd_mma_cl from MMA_CL_FROM only)."""
    from cupyconv._backward_plan import MMA_CL_FROM

    yield from forced_route(
        monkeypatch, "bwd_mma", MMA_MIN_WIDTH=2, MMA_SHORT_MIN_WIDTH=2, MMA_CL_MIN_WIDTH=2,
        MMA_TIME_MAX_STEPS=0, MMA_CL_LONG_FROM=MMA_CL_FROM,
    )  # fmt: skip


@pytest.mark.parametrize("width", MMA_WIDTHS)
@pytest.mark.parametrize("layout", ("cf", "cf_slice", "misaligned"))
def test_tensor_core_widths(tensor_cores, width, layout):
    """Spans of 1024 positions and a partial one; rows staged by cp.async or element by element."""
    run_bwd(2, 37, 1500, width, "bfloat16", layout=layout, seed=width)


CL_MMA_WIDTHS = (2, 4, 5, 8, 9, 16, 17, 18, 31, 33, 49, 64, 65)


@pytest.mark.parametrize("width", CL_MMA_WIDTHS)
@pytest.mark.parametrize("layout", ("cl", "cl_slice"))
def test_tensor_core_channel_last_widths(tensor_cores, width, layout):
    """Channel-contiguous x: groups of 16 channels (the last one of 8), spans of 512 and a
    partial one, runs starting inside a row."""
    run_bwd(2, 40, 1300, width, "bfloat16", layout=layout, seed=width)


@pytest.mark.parametrize("width", (16, 33, 48, 64))
def test_tensor_core_channel_last_runs(tensor_cores, monkeypatch, width):
    """Channel-contiguous x on two blocks: up to MMA_CL_WHOLE_STEPS k-steps each takes a whole
    group of channels (its batch rows' spans, staged one after another), then half the third
    group's items (the second half starting inside a row); beyond, each half of all items."""
    from cupyconv import _backward_plan

    resident = _backward_plan.resident_blocks  # (which also opts the kernel into its shared memory)
    monkeypatch.setattr(_backward_plan, "resident_blocks", lambda *args: min(2, resident(*args)))
    run_bwd(3, 40, 1300, width, "bfloat16", layout="cl", init=True, dfinal=True, seed=width)
    (plan,) = _backward_plan._plans.values()
    main = plan.launches[0]
    f = dict(zip(_backward_plan.MMA.plan_fields, main.plan_fields, strict=True))
    group_items = 3 * -(-1300 // f["span"])
    if _backward_plan.mma_steps(width) <= _backward_plan.MMA_CL_WHOLE_STEPS:
        assert (main.grid, f["whole"], f["per"]) == (2, 2, -(-group_items // 2))
    else:
        assert (main.grid, f["whole"], f["per"]) == (2, 0, -(-3 * group_items // 2))


@pytest.mark.parametrize("features", ["nobias-nosilu", "init", "dfinal", "init-dfinal", "buffers"])
@pytest.mark.parametrize(
    "layout,width",
    [("cf", 2), ("cf", 5), ("cf", 16), ("cf", 64), ("cf", 256), ("cl", 5), ("cl", 33), ("cl", 64)],
)
def test_tensor_core_features(tensor_cores, features, layout, width):
    dim = 24 if layout == "cl" else 20
    run_bwd(3, dim, 700, width, "bfloat16", layout=layout, seed=width, **features_of(features))


@pytest.mark.parametrize("seqlen", (1, 3, 255, 256, 257, 700, 1024, 1025, 2100))
@pytest.mark.parametrize("layout,width", [("cf", 8), ("cf", 40), ("cl", 40)])
def test_tensor_core_row_lengths(tensor_cores, seqlen, layout, width):
    """Rows shorter than the width, spans cut by the row's end, L < K - 1 with states."""
    dim = 16 if layout == "cl" else 9
    run_bwd(2, dim, seqlen, width, "bfloat16", layout=layout, init=True, dfinal=True, seed=seqlen)


@pytest.mark.parametrize(
    "layout,width,seqlen", [("cf", 4, 700), ("cf", 64, 700), ("cl", 17, 500), ("cl", 64, 250)]
)
def test_tensor_core_single_part(tensor_cores, layout, width, seqlen):
    """One row of one batch: dweight and dbias written by bwd_mma itself where the row is one
    span (channel-last: spans of 512, or 256 from width 50); time-contiguous spans shrink to
    give the device work, into several parts."""
    from cupyconv import _backward_plan

    dim = 24 if layout == "cl" else 20
    run_bwd(1, dim, seqlen, width, "bfloat16", layout=layout, buffers=True, init=True, seed=width)
    (plan,) = _backward_plan._plans.values()
    if layout == "cl":
        assert plan.n_parts == 1 and [s.name.split("<")[0] for s in plan.launches] == [
            "bwd_mma", "bwd_states",
        ]  # fmt: skip


@pytest.mark.parametrize("layout,width", [("cf", 16), ("cf", 64), ("cf", 200), ("cl", 64)])
def test_tensor_core_repeatable(tensor_cores, layout, width):
    check_repeatable(layout, width)


def check_repeatable(layout, width):
    """Every output bitwise the same over repeated runs: runs of spans and channels of many
    warps (the dweight products summed in a fixed order)."""
    import torch

    rng = np.random.default_rng(width)
    shape = (3, 304, 2100)
    x = to_gpu(rounded(rng, shape, "bfloat16"), "bfloat16", layout)
    g = to_gpu(rounded(rng, shape, "bfloat16"), "bfloat16", layout)
    w = to_gpu(rounded(rng, (304, width), "bfloat16", scale=width**-0.5), "bfloat16")
    b = to_gpu(rounded(rng, (304,), "bfloat16"), "bfloat16")
    init = to_gpu(rounded(rng, (3, 304, width - 1), "bfloat16"), "bfloat16")

    def run():
        return cupyconv.causal_conv1d_bwd(
            x, w, b, g, initial_states=init, return_dinitial_states=True, activation="silu"
        )

    first = run()
    for _ in range(3):
        assert all(torch.equal(p, q) for p, q in zip(first, run()))


@pytest.fixture
def block_cores(monkeypatch):
    """bwd_mma_block for every time-contiguous width bwd_mma takes, narrow ones included."""
    yield from forced_route(
        monkeypatch, "bwd_mma_block", MMA_MIN_WIDTH=2, MMA_SHORT_MIN_WIDTH=2, MMA_BLOCK_STEPS=2,
        MMA_TIME_MAX_STEPS=0,
    )  # fmt: skip


@pytest.mark.parametrize("width", MMA_WIDTHS)
@pytest.mark.parametrize("layout", ("cf", "cf_slice", "misaligned"))
@pytest.mark.parametrize("seqlen", (1500, 5000))
def test_block_tensor_core_widths(block_cores, width, layout, seqlen):
    """A block's spans of a row (the last ones past its end), rows of one and of several block
    spans, runs starting inside a row; rows staged by cp.async or element by element."""
    run_bwd(2, 37, seqlen, width, "bfloat16", layout=layout, seed=width)


@pytest.mark.parametrize("features", ["nobias-nosilu", "init", "dfinal", "init-dfinal", "buffers"])
@pytest.mark.parametrize("width", (5, 64, 100, 256))
def test_block_tensor_core_features(block_cores, features, width):
    run_bwd(3, 20, 2600, width, "bfloat16", seed=width, **features_of(features))


@pytest.mark.parametrize("seqlen", (1, 3, 255, 256, 257, 700, 1024, 1025, 2100, 4500))
@pytest.mark.parametrize("width", (40, 200))
def test_block_tensor_core_row_lengths(block_cores, seqlen, width):
    """Rows shorter than the width, spans cut by the row's end, L < K - 1 with states, one
    part (a channel an item) and several."""
    run_bwd(2, 9, seqlen, width, "bfloat16", init=True, dfinal=True, seed=seqlen)
    run_bwd(1, 7, seqlen, width, "bfloat16", init=True, seed=seqlen + 1)


@pytest.mark.parametrize("silu", (True, False), ids=("silu", "none"))
@pytest.mark.parametrize("width", (8, 100, 256))
def test_block_tensor_core_non_finite_values_reach_only_their_taps(block_cores, width, silu):
    check_non_finite((2, 6, 5000), "bfloat16", "cf", width, silu)


@pytest.mark.parametrize("silu", (True, False), ids=("silu", "none"))
@pytest.mark.parametrize("layout,width", [("cf", 8), ("cf", 33), ("cf", 256), ("cl", 33)])
def test_tensor_core_non_finite_values_reach_only_their_taps(tensor_cores, layout, width, silu):
    """inf and NaN in x and dout: the tensor cores' zero band entries must not carry them to a
    dx or a dweight whose own terms do not include them."""
    check_non_finite((2, 8 if layout == "cl" else 6, 2500), "bfloat16", layout, width, silu)


@pytest.mark.parametrize("layout,width", [("cf", 4), ("cl", 4), ("cl", 16), ("cf", 40)])
def test_non_finite_values_with_seq_idx(layout, width):
    """Padding positions' inf and a non-finite dz next to a segment's start: the terms of masked
    taps and padding are selected out (bwd_time, bwd_channel, the general kernels)."""
    check_non_finite((2, 8, 600), "bfloat16", layout, width, True, segments=5)


def check_non_finite(shape, dtype, layout, width, silu, segments=0):
    """inf and NaN in x and dout reach exactly the dx, dweight and dbias entries the reference
    has non-finite; the others match it (dweight and dbias as run_bwd checks them). With
    ``segments``, seq_idx with padding: masked taps and padding select their terms out."""
    rng = np.random.default_rng(width)
    length = shape[2]
    x64, g64 = rounded(rng, shape, dtype), rounded(rng, shape, dtype)
    x64[0, 1, length * 7 // 25] = np.inf
    x64[1, 2, length * 3 // 5 : length * 3 // 5 + 3] = np.nan
    x64[1, 4, length - 1] = -np.inf  # the row's last position: reaches no dz
    # the outputs it reaches end two positions before the row's end: those two see it only
    # through the tensor cores' band zeros (z of the blocks past the row)
    x64[1, shape[1] - 1, length - width - 2] = np.nan
    g64[0, 3, 40] = -np.inf
    g64[1, 5, length * 103 // 250] = np.nan
    w64 = rounded(rng, (shape[1], width), dtype, scale=width**-0.5)
    b64 = rounded(rng, (shape[1],), dtype)
    act = "silu" if silu else None
    s = seq_ids(rng, shape[0], length, segments, True) if segments else None
    x, g = to_gpu(x64, dtype, layout), to_gpu(g64, dtype, layout)
    w, b = to_gpu(w64, dtype), to_gpu(b64, dtype)
    si = None if s is None else to_gpu(s, "int32")
    got = cupyconv.causal_conv1d_bwd(x, w, b, g, si, activation=act)[:3]
    want = reference.causal_conv1d_bwd(x64, w64, b64, g64, s, activation=act)[:3]
    terms = shape[0] * length
    grads = (max(GRAD_TOLERANCE[0], tolerance(dtype)[0]), GRAD_TOLERANCE[1] * terms**0.5)
    tolerances = {"dx": tolerance(dtype), "dweight": grads, "dbias": grads}
    for (name, (rtol, atol)), a, e in zip(tolerances.items(), got, want, strict=True):
        a = a.double().cpu().numpy()
        finite = np.isfinite(e)
        assert (~finite).any() and finite.any(), name
        np.testing.assert_allclose(a[finite], e[finite], rtol=rtol, atol=atol)
        assert not np.isfinite(a[~finite]).any(), name


# ---- bwd_mma_cl: channel-contiguous x in steps of 128 positions, dweight's lags in place -----


@pytest.fixture
def cl_cores(monkeypatch):
    """bwd_mma_cl for every channel-contiguous width from 2 (bwd_mma's channel-last form off)."""
    yield from forced_route(
        monkeypatch, "bwd_mma_cl", MMA_CL_FROM=2, MMA_CL_LONG_FROM=2, MMA_CL_MIN_WIDTH=1000
    )


CL_KERNEL_WIDTHS = (2, 4, 5, 16, 17, 18, 31, 33, 34, 64, 65, 66, 100, 113, 128, 129, 130, 200, 256)


@pytest.mark.parametrize("width", CL_KERNEL_WIDTHS)
@pytest.mark.parametrize("layout", ("cl", "cl_slice"))
def test_cl_kernel_widths(cl_cores, width, layout):
    """Every KS (KS 10 from width 129, two lag fragments), a partial channel group (40 of 64),
    pieces of the rows and their ends."""
    run_bwd(2, 40, 1300, width, "bfloat16", layout=layout, seed=width)


@pytest.mark.parametrize("features", ["nobias-nosilu", "init", "dfinal", "init-dfinal", "buffers"])
@pytest.mark.parametrize("width", (5, 33, 100, 256))
def test_cl_kernel_features(cl_cores, features, width):
    run_bwd(3, 24, 700, width, "bfloat16", layout="cl", seed=width, **features_of(features))


@pytest.mark.parametrize("seqlen", (2, 3, 127, 128, 129, 255, 256, 257, 700, 1025, 9000))
@pytest.mark.parametrize("width", (40, 200))
def test_cl_kernel_row_lengths(cl_cores, seqlen, width):
    """Rows shorter than the width (L < K - 1 with states), within one step, cut inside a step,
    and long rows of many pieces."""
    run_bwd(2, 16, seqlen, width, "bfloat16", layout="cl", init=True, dfinal=True, seed=seqlen)


@pytest.mark.parametrize("width", (50, 64, 65))
def test_cl_kernel_long_pieces_at_ks_5(monkeypatch, width):
    """The plan's own route at KS 5: bwd_mma_cl where its pieces are MMA_CL_LONG_SPAN positions
    or more (two resident blocks: three pieces of 2048 a row, the last cut by the row's end)."""
    from cupyconv import _backward_plan, _fast

    resident = _backward_plan.resident_blocks  # (which also opts the kernel into its shared memory)
    monkeypatch.setattr(_backward_plan, "resident_blocks", lambda *args: min(2, resident(*args)))
    monkeypatch.setattr(_backward_plan, "_plans", {})
    monkeypatch.setattr(_fast, "_calls", {})
    run_bwd(2, 40, 6000, width, "bfloat16", layout="cl", init=True, dfinal=True, seed=width)
    (plan,) = _backward_plan._plans.values()
    main = plan.launches[0]
    f = dict(zip(_backward_plan.MMA_CL.plan_fields, main.plan_fields, strict=True))
    assert main.name == "bwd_mma_cl<__nv_bfloat16, 5>", main.name
    assert (f["span"], f["pieces"]) == (2048, 3), f


@pytest.mark.parametrize("width,seqlen", [(17, 500), (64, 250), (256, 500)])
def test_cl_kernel_single_part(cl_cores, width, seqlen):
    """One row of one piece: dweight and dbias written by bwd_mma_cl itself."""
    from cupyconv import _backward_plan

    run_bwd(1, 24, seqlen, width, "bfloat16", layout="cl", buffers=True, init=True, seed=width)
    (plan,) = _backward_plan._plans.values()
    assert plan.n_parts == 1
    assert [s.name.split("<")[0] for s in plan.launches] == ["bwd_mma_cl", "bwd_states"]


@pytest.mark.parametrize("width", (40, 200))
def test_cl_kernel_repeatable(cl_cores, width):
    check_repeatable("cl", width)


@pytest.mark.parametrize("silu", (True, False), ids=("silu", "none"))
@pytest.mark.parametrize("width", (33, 100))
def test_cl_kernel_non_finite_values_reach_only_their_taps(cl_cores, width, silu):
    check_non_finite((2, 8, 2500), "bfloat16", "cl", width, silu)


# ---- bwd_mma_time: time-contiguous rows on 8-byte boundaries, in registers ------------------


@pytest.fixture
def time_cores(monkeypatch):
    """bwd_mma_time for every width up to its k-steps, whatever the dispatch threshold."""
    yield from forced_route(monkeypatch, "bwd_mma_time", MMA_MIN_WIDTH=2, MMA_SHORT_MIN_WIDTH=2)


TIME_MMA_WIDTHS = (2, 4, 5, 8, 12, 16, 17, 18, 24, 31, 33)


@pytest.mark.parametrize("width", TIME_MMA_WIDTHS)
@pytest.mark.parametrize("layout", ("cf", "cf_slice", "time_padded"))
def test_time_tensor_core_widths(time_cores, width, layout):
    """Chunks of 512 positions, whole and cut by the row's end (time_padded: rows of 1499, the
    last 4 positions part in the row; dx written position by position)."""
    seqlen = 1499 if layout == "time_padded" else 1500
    run_bwd(2, 37, seqlen, width, "bfloat16", layout=layout, seed=width)


@pytest.mark.parametrize("layout", ("cf", "cf_slice"))
@pytest.mark.parametrize("seqlen", (1024, 2048))
@pytest.mark.parametrize("width", (18, 24, 33))
def test_time_tensor_core_long_chunks(time_cores, monkeypatch, width, seqlen, layout):
    """At 3 k-steps, rows made of whole MMA_TIME_LONG_CHUNK chunks take them: a run of chunks a
    warp, then (two blocks in all) runs of many chunks over channels and batch rows, the first
    of a row with initial states."""
    from cupyconv import _backward_plan

    run_bwd(2, 37, seqlen, width, "bfloat16", layout=layout, seed=width)
    monkeypatch.setattr(_backward_plan, "resident_blocks", lambda *args: 1)
    _backward_plan._plans.clear()
    run_bwd(3, 9, seqlen, width, "bfloat16", layout=layout, init=True, dfinal=True, seed=seqlen)
    (plan,) = _backward_plan._plans.values()
    groups, warps = _backward_plan.MMA_TIME_LONG_CHUNK
    assert plan.launches[0].name == f"bwd_mma_time<__nv_bfloat16, 3, {groups}, {warps}>"
    assert plan.n_parts == 3 * (seqlen // (256 * groups))


@pytest.mark.parametrize(
    "features", ["nobias-nosilu", "nosilu", "init", "dfinal", "init-dfinal", "buffers"]
)
@pytest.mark.parametrize("width", (5, 16, 33))
def test_time_tensor_core_features(time_cores, features, width):
    run_bwd(3, 20, 700, width, "bfloat16", seed=width, **features_of(features))


@pytest.mark.parametrize("seqlen", (1, 3, 5, 255, 256, 257, 511, 512, 513, 1024, 1027, 2100))
@pytest.mark.parametrize("width", (8, 33))
def test_time_tensor_core_row_lengths(time_cores, seqlen, width):
    """Rows shorter than the width, chunks cut by the row's end inside a group of 4, L < K - 1
    with states, one part (one chunk a channel: dweight and dbias written directly) and
    several."""
    kw = dict(layout="time_padded", init=True)
    run_bwd(2, 9, seqlen, width, "bfloat16", dfinal=True, seed=seqlen, **kw)
    run_bwd(1, 7, seqlen, width, "bfloat16", seed=seqlen + 1, **kw)


@pytest.mark.parametrize("width", (16, 33))
def test_time_tensor_core_runs(time_cores, monkeypatch, width):
    """Eight warps in all: each takes a run of many chunks (several channels, batch rows, runs
    starting inside a row), the C_d carried over a channel's chunks and summed at its last."""
    from cupyconv import _backward_plan

    monkeypatch.setattr(_backward_plan, "resident_blocks", lambda *args: 2)
    run_bwd(3, 20, 1300, width, "bfloat16", init=True, dfinal=True, seed=width)
    (plan,) = _backward_plan._plans.values()
    main = plan.launches[0]
    f = dict(zip(_backward_plan.MMA_TIME.plan_fields, main.plan_fields, strict=True))
    groups, warps = _backward_plan.MMA_TIME_CHUNK  # (rows of 1300: not whole long chunks)
    per_row = -(-1300 // (256 * groups))
    assert main.name.startswith("bwd_mma_time<") and plan.n_parts == 3 * per_row
    assert f["per"] == -(-20 * 3 * per_row // (2 * warps)) and main.grid <= 2


@pytest.mark.parametrize("width", (16, 31))
def test_time_tensor_core_repeatable(time_cores, width):
    check_repeatable("cf", width)


@pytest.mark.parametrize("runs", (False, True), ids=("chunks", "runs"))
@pytest.mark.parametrize("silu", (True, False), ids=("silu", "none"))
@pytest.mark.parametrize("width", (8, 16, 33))
def test_time_tensor_core_non_finite_values_reach_only_their_taps(
    time_cores, monkeypatch, width, silu, runs
):
    """(runs: eight warps in all, each a run of many chunks, the dz of a chunk's last group
    carried to the next one.)"""
    from cupyconv import _backward_plan

    if runs:
        monkeypatch.setattr(_backward_plan, "resident_blocks", lambda *args: 2)
    check_non_finite((2, 6, 2500), "bfloat16", "cf", width, silu)


# ---- bwd_wide: CUDA cores, any layout, width and dtype pair without seq_idx ----------------


@pytest.fixture
def wide_path(monkeypatch):
    """bwd_wide for every call without seq_idx, whatever the faster kernels would take."""
    yield from forced_route(
        monkeypatch, "bwd_wide", TIME_MAX_WIDTH=0, CHANNEL_MAX_WIDTH=0, MMA_MIN_WIDTH=1000,
        MMA_CL_MIN_WIDTH=1000, MMA_CL_FROM=1000, MMA_CL_LONG_FROM=1000,
    )  # fmt: skip


WIDE_WIDTHS = (1, 2, 4, 7, 8, 9, 16, 17, 31, 33, 64, 100, 129, 255, 256)


@pytest.mark.parametrize("width", WIDE_WIDTHS)
@pytest.mark.parametrize("layout", ("cf", "cl", "cl_slice", "time_stride2", "misaligned_cl"))
def test_wide_widths_layouts(wide_path, width, layout):
    """Three tiles, the last cut by the row; three channel groups, the last of 8 channels."""
    run_bwd(2, 40, 700, width, "float32", layout=layout, seed=width)


@pytest.mark.parametrize(
    "dtype,wdtype",
    [("bfloat16", "bfloat16"), ("bfloat16", "float32"), ("float16", "float16"),
     ("float16", "float32"), ("float32", "bfloat16"), ("float64", "float64")],
)  # fmt: skip
@pytest.mark.parametrize("layout", ("cf", "cl"))
@pytest.mark.parametrize("width", (5, 64, 256))
def test_wide_dtypes(wide_path, dtype, wdtype, layout, width):
    run_bwd(2, 24, 600, width, dtype, wdtype, layout=layout, seed=width)


@pytest.mark.parametrize("features", ["nobias-nosilu", "init", "dfinal", "init-dfinal", "buffers"])
@pytest.mark.parametrize("layout", ("cf", "cl"))
@pytest.mark.parametrize("width", (3, 40, 256))
def test_wide_features(wide_path, features, layout, width):
    run_bwd(3, 20, 600, width, "float32", layout=layout, seed=width, **features_of(features))


@pytest.mark.parametrize("seqlen", (1, 3, 255, 256, 257, 513, 1000, 5000))
@pytest.mark.parametrize("layout", ("cf", "cl"))
@pytest.mark.parametrize("batch,width", [(2, 17), (1, 17), (1, 256)])
def test_wide_row_lengths(wide_path, seqlen, layout, batch, width):
    """Rows shorter than the width, tiles cut by the row's end, L < K - 1 with states; one
    batch row of one channel group splits into segments of two tiles (the dz after each
    computed first)."""
    run_bwd(batch, 16, seqlen, width, "float32", layout=layout, init=True, dfinal=True, seed=seqlen)
    if batch == 1 and seqlen == 5000:
        from cupyconv import _backward_plan

        (plan,) = _backward_plan._plans.values()
        f = dict(zip(_backward_plan.WIDE.plan_fields, plan.launches[0].plan_fields, strict=True))
        assert f["seg_tiles"] == 2 and plan.n_parts == 10


@pytest.mark.parametrize("silu", (True, False), ids=("silu", "none"))
@pytest.mark.parametrize("layout,width", [("cf", 9), ("cf", 33), ("cl", 33), ("cl", 256)])
def test_wide_non_finite_values_reach_only_their_taps(wide_path, layout, width, silu):
    """No product of a tap past the width (the last tap block runs only its taps) nor of a
    zero dz past the row's end."""
    check_non_finite((2, 6, 1200), "float32", layout, width, silu)


@pytest.mark.parametrize("layout,width", [("cf", 64), ("cl", 64), ("cl", 256)])
def test_wide_repeatable(wide_path, layout, width):
    """Every output bitwise the same over repeated runs: segments of rows and channel groups
    added in a fixed order."""
    import torch

    case = dict(layout=layout, init=True, dfinal=True, seed=width)
    first = run_bwd(1, 48, 6000, width, "float32", **case)
    for _ in range(3):
        again = run_bwd(1, 48, 6000, width, "float32", **case)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


# ---- bwd_time: runs of a channel's chunks, one warp each -------------------------------------


@pytest.fixture
def time_runs(monkeypatch):
    """bwd_time's runs of TIME_RUN chunks for every call, however few runs it then has (and
    bwd_time for bfloat16 x of any width)."""
    yield from forced_route(monkeypatch, "bwd_time", TIME_MIN_RUNS=1, MMA_MIN_WIDTH=1000)


@pytest.mark.parametrize("layout", ("cf", "cf_slice", "misaligned"))
@pytest.mark.parametrize("width", (1, 4, 8, 16))
@pytest.mark.parametrize(
    "dtype,seqlen",
    [("float32", 100), ("float32", 250), ("float32", 2100), ("bfloat16", 500), ("bfloat16", 600)],
)  # fmt: skip
def test_time_runs(time_runs, layout, width, dtype, seqlen):
    """Runs of 8 chunks across batch rows (5 rows of 1 or 3 chunks: runs end inside a row and
    at the call's end), chunks cut by the row's end, one-chunk rows of each chunk shape (one
    staging area a warp, and two: the next chunk, in the next row, copied ahead)."""
    run_bwd(5, 7, seqlen, width, dtype, layout=layout, init=True, dfinal=True, seed=width)
    from cupyconv import _backward_plan

    (plan,) = _backward_plan._plans.values()
    f = dict(zip(_backward_plan.TIME.plan_fields, plan.launches[0].plan_fields, strict=True))
    chunks = 5 * (3 if seqlen == 2100 else 1)
    assert f["run_chunks"] == 8 and f["runs"] == plan.n_parts == -(-chunks // 8)


@pytest.mark.parametrize("features", ["seq-padding", "seq-init-dfinal", "nobias-nosilu", "buffers"])
@pytest.mark.parametrize("width", (3, 16))
@pytest.mark.parametrize("seqlen", (100, 230, 1300))
def test_time_runs_features(time_runs, features, width, seqlen):
    run_bwd(6, 9, seqlen, width, "float32", seed=width, **features_of(features))


@pytest.mark.parametrize("layout", ("cf", "cf_slice", "misaligned"))
@pytest.mark.parametrize("width", (1, 4, 16))
@pytest.mark.parametrize("features", ["seq-padding-init-dfinal", "nobias-nosilu"])
@pytest.mark.parametrize(
    "dtype,seqlen",
    [("bfloat16", 256), ("bfloat16", 512), ("bfloat16", 1024), ("bfloat16", 2048),
     ("float32", 128), ("float32", 1024)],
)  # fmt: skip
def test_time_whole_rows(time_runs, layout, width, features, dtype, seqlen):
    """Rows of exactly one chunk of each chunk shape, staged as their vectors alone (x's halo
    before the row zero for the whole launch, or initial_states), runs across batch rows;
    misaligned rows take the checked staging."""
    run_bwd(5, 7, seqlen, width, dtype, layout=layout, seed=width, **features_of(features))
    from cupyconv import _backward_plan

    (plan,) = _backward_plan._plans.values()
    f = dict(zip(_backward_plan.TIME.plan_fields, plan.launches[0].plan_fields, strict=True))
    assert f["whole_rows"] == (layout != "misaligned")


def test_time_runs_repeatable(time_runs):
    import torch

    case = dict(segments=3, init=True, dfinal=True)
    first = run_bwd(9, 64, 2500, 4, "bfloat16", **case)
    for _ in range(3):
        again = run_bwd(9, 64, 2500, 4, "bfloat16", **case)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


# ---- bwd_channel: groups of CHANNEL_STEPS steps, one warp each --------------------------------


@pytest.fixture
def channel_groups(monkeypatch):
    """bwd_channel's groups of up to CHANNEL_STEPS steps (evened out) for every call, however
    few groups it then has (as on a device whose warps the rows alone fill), and bwd_channel
    for bfloat16 x from width 12 on."""
    from cupyconv import _backward_plan

    tiles = _backward_plan._channel_group_tiles
    most = lambda row_tiles, rows, steps, slots: tiles(row_tiles, rows, steps, 0)  # noqa: E731
    yield from forced_route(
        monkeypatch, "bwd_channel", _channel_group_tiles=most, MMA_CL_MIN_WIDTH=1000
    )


@pytest.mark.parametrize("layout", ("cl", "cl_slice"))
@pytest.mark.parametrize("width", (1, 4, 8, 12))
@pytest.mark.parametrize("dtype,seqlen", [("float32", 1100), ("bfloat16", 513), ("float64", 300)])
def test_channel_groups(channel_groups, layout, width, dtype, seqlen):
    """Groups of many tiles: a batch row in one or several groups, the last cut by the row's
    end (65 tiles of 8 steps in two groups, 33 and 32); one part of the partials a group."""
    run_bwd(3, 70, seqlen, width, dtype, layout=layout, init=True, dfinal=True, seed=width)
    from cupyconv import _backward_plan

    (plan,) = _backward_plan._plans.values()
    main = plan.launches[0]
    f = dict(zip(_backward_plan.CHANNEL.plan_fields, main.plan_fields, strict=True))
    steps = int(main.name.split(",")[3])  # the tile's time steps
    row_tiles, most = -(-seqlen // steps), _backward_plan.CHANNEL_STEPS // steps
    groups = -(-row_tiles // most)  # groups of CHANNEL_STEPS steps, evened out
    assert f["group_tiles"] == -(-row_tiles // groups)
    assert plan.n_parts == 3 * groups


@pytest.mark.parametrize("width", (1, 4, 9))
@pytest.mark.parametrize("seqlen", (5, 70, 600))
def test_channel_groups_in_turn(channel_groups, monkeypatch, width, seqlen):
    """Two blocks of warps, each warp a group after another (the staged tiles of its groups in
    turn, short groups with fewer tiles than staging buffers)."""
    from cupyconv import _backward_plan

    monkeypatch.setattr(_backward_plan, "MAX_GRID", 2)
    run_bwd(3, 300, seqlen, width, "bfloat16", layout="cl", init=True, dfinal=True, seed=seqlen)
    (plan,) = _backward_plan._plans.values()
    assert plan.launches[0].grid == 2


@pytest.mark.parametrize(
    "batch,dim,seqlen,width,dtype",
    [
        (1, 256, 512, 4, "bfloat16"),  # the (1, 256, 512) training step's backward
        (2, 70, 100, 4, "bfloat16"),  # a strip cut by dim: lanes without channels
        (2, 40, 40, 3, "float32"),
        (3, 45, 90, 12, "float16"),  # one channel a lane
        (2, 34, 60, 9, "float64"),
    ],
)
@pytest.mark.parametrize("features", ["seq-padding-init-dfinal", "nobias-nosilu", "buffers"])
def test_channel_block_sums(monkeypatch, batch, dim, seqlen, width, dtype, features):
    """bwd_channel's block sums (a block a strip, its warps every batch row's groups): dweight
    and dbias added in the block, one part, no bwd_reduce; bitwise the same when repeated."""
    from cupyconv import _backward_plan, _fast

    monkeypatch.setattr(_backward_plan, "_plans", {})
    monkeypatch.setattr(_fast, "_calls", {})
    case = dict(layout="cl", seed=seqlen, **features_of(features, 3))
    first = run_bwd(batch, dim, seqlen, width, dtype, **case)
    (plan,) = _backward_plan._plans.values()
    main = plan.launches[0]
    f = dict(zip(_backward_plan.CHANNEL.plan_fields, main.plan_fields, strict=True))
    assert main.name.startswith("bwd_channel<") and f["block_sum"] == 1 and plan.n_parts == 1
    assert "bwd_reduce" not in "".join(launch.name for launch in plan.launches)
    import torch

    again = run_bwd(batch, dim, seqlen, width, dtype, **case)
    assert all(a is b is None or torch.equal(a, b) for a, b in zip(first, again))


@pytest.mark.parametrize("layout", ("cl", "cl_slice"))
@pytest.mark.parametrize("width", (1, 2, 4))
@pytest.mark.parametrize("dtype", ("bfloat16", "float16"))
@pytest.mark.parametrize("features", ("init-dfinal", "nobias-nosilu", "buffers"))
def test_channel_pairs(monkeypatch, layout, width, dtype, features):
    """bwd_channel_pair (warps in pairs on strips of 128 channels) against the oracle, on rows of
    three groups of 368 steps (groups of up to CHANNEL_STEPS, evened out), the row's end inside
    a tile; and bitwise bwd_channel's results where both take those groups."""
    import torch

    from cupyconv import _backward_plan, _fast

    tiles = _backward_plan._channel_group_tiles
    most = lambda row_tiles, rows, steps, slots: tiles(row_tiles, rows, steps, 0)  # noqa: E731
    monkeypatch.setattr(_backward_plan, "_channel_group_tiles", most)
    case = dict(layout=layout, seed=width, **features_of(features))
    results = []
    for pairs in (True, False):
        if not pairs:
            monkeypatch.setattr(_backward_plan, "_channel_pairs", lambda *args: False)
        monkeypatch.setattr(_backward_plan, "_plans", {})
        monkeypatch.setattr(_fast, "_calls", {})
        results.append(run_bwd(2, 256, 1100, width, dtype, **case))
        (plan,) = _backward_plan._plans.values()
        want = "bwd_channel_pair<" if pairs else "bwd_channel<"
        assert plan.launches[0].name.startswith(want), plan.launches[0].name
    assert all(a is b is None or torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.parametrize("features", ["seq-padding", "seq-init-dfinal", "nobias-nosilu", "buffers"])
@pytest.mark.parametrize("width", (3, 12))
def test_channel_groups_features(channel_groups, features, width):
    run_bwd(4, 40, 1200, width, "bfloat16", layout="cl", seed=width, **features_of(features, 5))


@pytest.mark.parametrize("width", (10, 17, 24, 32))
@pytest.mark.parametrize("dtype", ("bfloat16", "float16", "float32", "float64"))
@pytest.mark.parametrize("features", ("", "seq-padding-init-dfinal"))
def test_channel_one_lane(monkeypatch, width, dtype, features):
    """bwd_channel with one channel a lane (from CHANNEL_LANE_FROM; 12 warps an SM past width
    16) against the oracle: strips cut by dim (45 channels: bwd_mma's channel-last form does not
    take them), rows of several groups, with and without seq_idx (the general path past
    CHANNEL_SEQ_MAX_WIDTH)."""
    from cupyconv import _backward_plan, _fast

    monkeypatch.setattr(_backward_plan, "_plans", {})
    monkeypatch.setattr(_fast, "_calls", {})
    kwargs = features_of(features, 3)
    run_bwd(2, 45, 700, width, dtype, layout="cl", seed=width, **kwargs)
    (plan,) = _backward_plan._plans.values()
    taken = _backward_plan._channel_takes(dtype, width, bool(kwargs["segments"]))
    other = "bwd_dz<" if kwargs["segments"] else "bwd_wide<"  # (the general path with seq_idx)
    assert plan.launches[0].name.startswith("bwd_channel<" if taken else other)


@pytest.mark.parametrize("width", (9, 10, 16, 17, 32, 33))
@pytest.mark.parametrize("dim", (70, 71))
def test_channel_last_float16_crossover(monkeypatch, width, dim):
    """float16 channel-contiguous x without seq_idx: bwd_channel below its CHANNEL_WIDE_FROM
    (33), two channels a lane below CHANNEL_LANE_FROM (10), one from it (any dim, channels
    staged one by one where strips are cut by dim; 12 warps an SM past 16), bwd_wide from 33."""
    from cupyconv import _backward_plan, _fast

    monkeypatch.setattr(_backward_plan, "_plans", {})
    monkeypatch.setattr(_fast, "_calls", {})
    run_bwd(2, dim, 600, width, "float16", layout="cl", init=True, dfinal=True, seed=width)
    (plan,) = _backward_plan._plans.values()
    name = plan.launches[0].name
    if width >= _backward_plan.CHANNEL_WIDE_FROM["float16"]:
        assert name.startswith("bwd_wide<__half"), name
    elif width >= _backward_plan.CHANNEL_LANE_FROM:
        assert name.startswith("bwd_channel<__half") and name.split(", ")[4] == "2", name
    else:
        assert name.startswith("bwd_channel<__half" if dim % 2 == 0 else "bwd_wide<__half"), name


@pytest.mark.parametrize("layout", ("cf", "cl"))
def test_repeatable(layout):
    """Every output the same over repeated runs (no floating-point atomics)."""
    import torch

    case = dict(layout=layout, segments=3, init=True, dfinal=True)
    first = run_bwd(2, 256, 2048, 4, "bfloat16", **case)
    for _ in range(3):
        again = run_bwd(2, 256, 2048, 4, "bfloat16", **case)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_cupy_inputs():
    """CuPy arrays in, CuPy arrays out, on CuPy's current stream."""
    import cupy

    rng = np.random.default_rng(1)
    x64 = rng.standard_normal((2, 16, 100))
    g64 = rng.standard_normal((2, 16, 100))
    w64 = rng.standard_normal((16, 4))
    dx, dw, db, di = cupyconv.causal_conv1d_bwd(
        cupy.asarray(x64), cupy.asarray(w64), None, cupy.asarray(g64), activation="silu"
    )
    rdx, rdw, _, _ = reference.causal_conv1d_bwd(x64, w64, None, g64, activation="silu")
    assert isinstance(dx, cupy.ndarray) and isinstance(dw, cupy.ndarray) and db is None
    assert_close(dx, rdx, "float64", name="dx")
    assert_close(dw, rdw, "float64", name="dweight")


@pytest.mark.slow
@pytest.mark.parametrize("layout", ("cf", "cl"))
def test_bitwise_repeatable_over_100_runs(layout):
    """out, dx, dweight, dbias and dinitial_states bitwise identical over 100 runs on
    (2, 4128, 2048) with seq_idx (the training issue's acceptance case)."""
    import torch

    rng = np.random.default_rng(7)
    batch, dim, seqlen, width = 2, 4128, 2048, 4
    x = to_gpu(rounded(rng, (batch, dim, seqlen), "bfloat16"), "bfloat16", layout)
    g = to_gpu(rounded(rng, (batch, dim, seqlen), "bfloat16"), "bfloat16", layout)
    w = to_gpu(rounded(rng, (dim, width), "bfloat16", scale=0.5), "bfloat16")
    b = to_gpu(rounded(rng, (dim,), "bfloat16"), "bfloat16")
    s = torch.from_numpy(seq_ids(rng, batch, seqlen, 4, True)).cuda()
    init = to_gpu(rounded(rng, (batch, dim, width - 1), "bfloat16"), "bfloat16", layout)

    def run():
        out = cupyconv.causal_conv1d_fn(x, w, b, s, init, activation="silu")
        grads = cupyconv.causal_conv1d_bwd(
            x, w, b, g, s, init, return_dinitial_states=True, activation="silu"
        )
        return [t.view(torch.int16).clone() for t in (out, *grads)]

    first = run()
    for _ in range(99):
        assert all(torch.equal(p, q) for p, q in zip(first, run()))


@pytest.mark.parametrize("layout", ("cf", "cl"))
def test_back_to_back_calls_read_what_the_kernels_before_wrote(layout):
    """Backward kernels are programmatic dependent launches (on sm_90 scheduled while the kernel
    before them finishes). Calls in a row, nothing synchronised between them: each reads x
    right after a torch copy wrote it, and dout = the call before's dx (no kernel between);
    each call's results match the reference on the values its inputs held."""
    import torch

    rng = np.random.default_rng(11)
    shape, width = (2, 512, 4096), 4
    w64 = rounded(rng, (shape[1], width), "bfloat16", scale=0.5)
    b64 = rounded(rng, (shape[1],), "bfloat16")
    w, b = to_gpu(w64, "bfloat16"), to_gpu(b64, "bfloat16")
    sources = [to_gpu(rounded(rng, shape, "bfloat16"), "bfloat16", layout) for _ in range(4)]
    x = to_gpu(np.zeros(shape), "bfloat16", layout)
    dout = to_gpu(rounded(rng, shape, "bfloat16"), "bfloat16", layout)
    runs = []
    for src in sources:
        x.copy_(src)
        dx, dw, db, _ = cupyconv.causal_conv1d_bwd(x, w, b, dout, activation="silu")
        runs.append((src, dout, dx, dw, db))
        dout = dx
    torch.cuda.synchronize()
    rtol, atol = max(GRAD_TOLERANCE[0], tolerance("bfloat16")[0]), GRAD_TOLERANCE[1]
    atol *= (shape[0] * shape[2]) ** 0.5
    for src, g, dx, dw, db in runs:
        x64, g64 = (t.double().cpu().numpy() for t in (src, g))
        rdx, rdw, rdb, _ = reference.causal_conv1d_bwd(x64, w64, b64, g64, activation="silu")
        assert_close(dx, rdx, "bfloat16", name="dx")
        assert_close(dw, rdw, rtol=rtol, atol=atol, name="dweight")
        assert_close(db, rdb, rtol=rtol, atol=atol, name="dbias")
