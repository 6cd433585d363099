"""The forward pass on the GPU against the float64 reference.

Every case builds its inputs in numpy, moves them to the GPU in the layout under test, runs
``causal_conv1d_fn`` into NaN-prefilled output buffers (so an element a kernel forgets to
write fails) and compares with ``cupyconv.reference`` on the same rounded inputs.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import cupyconv
from cupyconv import reference
from cupyconv.testing import assert_close, tolerance

pytestmark = pytest.mark.gpu

DTYPES = ("float32", "float16", "bfloat16", "float64")


def torch_dtype(name):
    import torch

    return getattr(torch, name)


def rounded(rng, shape, dtype, scale=1.0):
    """Random float64 values (standard normal times ``scale``) already rounded to ``dtype``, so
    the reference sees exactly what the GPU sees."""
    import ml_dtypes

    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype
    return (scale * rng.standard_normal(shape)).astype(np_dtype).astype(np.float64)


def to_gpu(a64, dtype, layout="cf"):
    """A torch CUDA tensor of logical shape a64.shape (3-D: [B, C, L]) in ``layout``:
    cf (time-contiguous), cl (channel-contiguous), cl_slice (channel slice of a wider
    channel-last projection), cf_slice (channel slice of a wider channel-first buffer),
    time_stride2 (every other time step), misaligned (base pointer one element off),
    time_padded (time-contiguous rows on 16-byte boundaries, each in a row of a multiple of 8)."""
    import torch

    t = torch.from_numpy(a64).to(device="cuda", dtype=torch_dtype(dtype))
    if a64.ndim != 3 or layout == "cf":
        return t.contiguous()
    b, c, length = a64.shape
    if layout == "cl":
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "cl_slice":
        buf = torch.full((b, length, 3 * c), float("nan"), device="cuda", dtype=t.dtype)
        view = buf[:, :, c : 2 * c].transpose(1, 2)
    elif layout == "cf_slice":
        buf = torch.full((b, c + 5, length), float("nan"), device="cuda", dtype=t.dtype)
        view = buf[:, 3 : 3 + c]
    elif layout == "time_stride2":
        buf = torch.full((b, c, 2 * length), float("nan"), device="cuda", dtype=t.dtype)
        view = buf[:, :, ::2]
    elif layout == "time_padded":
        padded = length + 8 - length % 8
        buf = torch.full((b, c, padded), float("nan"), device="cuda", dtype=t.dtype)
        view = buf[:, :, :length]
    elif layout == "misaligned":
        buf = torch.full((b * c * length + 1,), float("nan"), device="cuda", dtype=t.dtype)
        view = buf[1:].view(b, c, length)
    elif layout == "misaligned_cl":
        buf = torch.full((b * c * length + 1,), float("nan"), device="cuda", dtype=t.dtype)
        view = buf[1:].view(b, length, c).transpose(1, 2)
    else:
        raise ValueError(layout)
    view.copy_(t)
    return view


def seq_ids(rng, batch, seqlen, segments, padding):
    """seq_idx rows with ``segments`` nondecreasing segments, and -1 padding at the end (and a
    padded run in the middle) when ``padding``."""
    ids = np.zeros((batch, seqlen), np.int32)
    for b in range(batch):
        cuts = (
            np.sort(
                rng.choice(
                    np.arange(1, max(seqlen, 2)),
                    size=min(segments - 1, max(seqlen - 1, 0)),
                    replace=False,
                )
            )
            if seqlen > 1
            else []
        )
        ids[b] = np.searchsorted(cuts, np.arange(seqlen), side="right")
        if padding and seqlen > 2:
            ids[b, -max(1, seqlen // 5) :] = -1
            mid = seqlen // 2
            ids[b, mid : mid + max(1, seqlen // 10)] = -1
    return ids


def run_case(
    batch,
    dim,
    seqlen,
    width,
    dtype="float32",
    wdtype=None,
    layout="cf",
    bias=True,
    silu=True,
    segments=0,
    padding=False,
    init=False,
    final=False,
    final_buffer=False,
    seed=0,
):
    import torch

    rng = np.random.default_rng(seed)
    wdtype = wdtype or dtype
    x64 = rounded(rng, (batch, dim, seqlen), dtype)
    w64 = rounded(rng, (dim, width), wdtype, scale=width**-0.5)
    b64 = rounded(rng, (dim,), wdtype) if bias else None
    s = seq_ids(rng, batch, seqlen, segments, padding) if segments else None
    i64 = rounded(rng, (batch, dim, width - 1), dtype) if init else None
    act = "silu" if silu else None

    x = to_gpu(x64, dtype, layout)
    w = to_gpu(w64, wdtype)
    b = to_gpu(b64, wdtype) if bias else None
    si = torch.from_numpy(s).cuda() if s is not None else None
    ii = to_gpu(i64, dtype, "cl" if layout.startswith("cl") else "cf") if init else None
    out = torch.full(
        (batch, seqlen, dim) if layout.startswith("cl") else (batch, dim, seqlen),
        float("nan"),
        device="cuda",
        dtype=x.dtype,
    )
    if layout.startswith("cl"):
        out = out.transpose(1, 2)
    fbuf = None
    if final and final_buffer:
        fbuf = torch.full((batch, dim, width - 1), float("nan"), device="cuda", dtype=x.dtype)
    res = cupyconv.causal_conv1d_fn(
        x,
        w,
        b,
        seq_idx=si,
        initial_states=ii,
        return_final_states=final,
        final_states_out=fbuf,
        activation=act,
        out=out,
    )
    want = reference.causal_conv1d_fn(
        x64, w64, b64, seq_idx=s, initial_states=i64, return_final_states=final, activation=act
    )
    if final:
        got_out, got_final = res
        want_out, want_final = want
        assert got_out is out
        if fbuf is not None:
            assert got_final is fbuf
        elif width > 1:
            assert got_final.stride() == (dim * (width - 1), 1, dim)
        assert_close(got_final, want_final, dtype, name="final_states")
    else:
        got_out, want_out = res, want
        assert got_out is out
    assert_close(got_out, want_out, dtype, name="out")
    return got_out


# ---- curated cases ---------------------------------------------------------------------------

LAYOUTS = ("cf", "cl", "cl_slice", "cf_slice", "time_stride2", "misaligned", "misaligned_cl")
WIDTHS = (1, 2, 3, 4, 5, 8, 9, 16, 17, 18, 31, 64, 256)
SHAPES = (
    (1, 1, 1),
    (2, 7, 3),
    (3, 64, 63),
    (2, 64, 129),
    (1, 7, 372),
    (2, 130, 784),
    (1, 4128, 65),
    (3, 20, 2048),
    (1, 9, 4096),
)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("width", WIDTHS, ids=lambda k: f"width{k}")
def test_widths_and_layouts(layout, width):
    for i, (b, c, length) in enumerate(SHAPES[::2] if width > 31 else SHAPES):
        run_case(b, c, length, width, "float32", layout=layout, seed=i)


@pytest.mark.parametrize("layout", ("cf", "cl", "cl_slice", "misaligned"))
@pytest.mark.parametrize(
    "segments,padding,init,final",
    [
        pytest.param(
            s,
            p,
            i,
            f,
            id=f"seq{s}{'-pad' if p else ''}{'-init' if i else ''}{'-final' if f else ''}",
        )
        for s, p, i, f in itertools.product((0, 1, 5), (False, True), (False, True), (False, True))
        if not (s == 0 and p)
    ],
)
@pytest.mark.parametrize("width", (2, 4, 7, 33), ids=lambda k: f"width{k}")
def test_features(layout, segments, padding, init, final, width):
    for i, (b, c, length) in enumerate(((2, 64, 151), (3, 7, 2), (1, 24, 1134))):
        run_case(
            b,
            c,
            length,
            width,
            "float32",
            layout=layout,
            segments=segments,
            padding=padding,
            init=init,
            final=final,
            final_buffer=i == 0,
            seed=i,
        )


@pytest.mark.parametrize(
    "dtype,wdtype",
    list(itertools.product(DTYPES[:3], DTYPES[:3]))
    + [("float64", "float64"), ("bfloat16", "float64"), ("float64", "float16")],
)
@pytest.mark.parametrize("layout", ("cf", "cl", "misaligned"))
def test_dtype_pairs(dtype, wdtype, layout):
    for width in (1, 4, 8, 20):
        run_case(
            3,
            72,
            300,
            width,
            dtype,
            wdtype,
            layout=layout,
            segments=2,
            init=True,
            final=True,
            seed=width,
        )


@pytest.mark.parametrize(
    "dtype,wdtype",
    [
        ("bfloat16", "bfloat16"),
        ("bfloat16", "float32"),
        ("bfloat16", "float16"),
        ("float16", "float16"),
    ],
)
@pytest.mark.parametrize(
    "layout", ("cf", "cf_slice", "misaligned", "cl", "cl_slice", "misaligned_cl")
)
def test_tensor_core_widths(dtype, wdtype, layout):
    """Widths 9 to 256 of 16-bit x (on tensor cores, fwd_mma, from 14 time-contiguous and 9
    channel-contiguous; fwd_time below): weights split
    in two parts when wider than x, row starts with and without states, partial and one-step
    tiles, a row of several tiles, channel-last tiles past the last channel."""
    widths = (9, 16, 17, 18, 33, 64, 65, 100, 129, 130, 200, 256)
    shapes = ((2, 5, 300), (1, 3, 2600), (2, 2, 1), (1, 37, 1100))
    for i, (width, (b, c, length)) in enumerate(itertools.product(widths, shapes)):
        run_case(
            b, c, length, width, dtype, wdtype, layout=layout, init=i % 2 == 0, final=i % 3 == 0,
            silu=i % 4 != 3, seed=i,
        )  # fmt: skip


@pytest.mark.parametrize("layout", ("cl", "cf"))
def test_tensor_core_runs_of_spans(layout):
    """Rows long enough to be split into several spans, handed out in runs that end past a
    row's last span (channel-contiguous x) or mid-row (time-contiguous x)."""
    run_case(8, 320, 7000, 17, "bfloat16", layout=layout, init=True, final=True, seed=5)


@pytest.mark.parametrize("buffers", (2, 1))
@pytest.mark.parametrize("blocks", (1, 3))
@pytest.mark.parametrize("width", (100, 129, 161))
def test_channel_last_rows_buffers(monkeypatch, buffers, blocks, width):
    """fwd_mma's channel-contiguous form (bfloat16 x and taps, KS 8, 9 and 11) with its rows in two
    buffers (an item's outputs sent out after the next item's barrier, the last after the loop)
    and in one (where two do not fit), on grids of one and three blocks: runs of several items
    a block, rows of several spans ending inside one, states before each row, final states; a
    strip of channels cut by dim (37)."""
    from cupyconv import _fast, _forward_plan

    resident = _forward_plan.resident_blocks  # (which also opts into the shared memory)
    monkeypatch.setattr(_forward_plan, "resident_blocks", lambda *a: min(blocks, resident(*a)))
    monkeypatch.setattr(_forward_plan, "MMA_CL_ROW_BUFFERS", (buffers,))
    monkeypatch.setattr(_forward_plan, "_plans", {})
    monkeypatch.setattr(_fast, "_calls", {})
    run_case(2, 37, 2600, width, "bfloat16", layout="cl", init=True, final=True, seed=width)
    plans = [p for p in _forward_plan._plans.values() if p.name.startswith("fwd_mma<")]
    for plan in plans:
        fields = dict(zip(_forward_plan.MMA.plan_fields, plan.plan_fields, strict=True))
        assert fields["two_rows"] == (buffers == 2) and -(-2600 // fields["span"]) >= 2
    assert plans


@pytest.mark.parametrize("sweep", (True, False))
@pytest.mark.parametrize("blocks", (1, 3))
@pytest.mark.parametrize(
    "dtype,wdtype,width",
    [
        ("bfloat16", "bfloat16", 16), ("bfloat16", "float32", 31), ("float32", "float32", 33),
        ("float16", "float16", 64),
    ],
)  # fmt: skip
def test_tensor_core_item_orders(monkeypatch, sweep, blocks, dtype, wdtype, width):
    """Time-contiguous fwd_mma with its items swept over the grid (a warp's next item
    n_warps on: every carry of its (channel, batch row, span) step) and in runs, on grids of
    one and three main blocks: rows of two spans, states before each row, final states."""
    from cupyconv import _fast, _forward_plan

    resident = _forward_plan.resident_blocks  # (which also opts into the shared memory)
    monkeypatch.setattr(_forward_plan, "resident_blocks", lambda *a: min(blocks, resident(*a)))
    monkeypatch.setattr(_forward_plan, "MMA_SWEEP_SPAN", 0 if sweep else 1 << 40)
    monkeypatch.setattr(_forward_plan, "MMA_TIME_MAX_STEPS", 0)  # (fwd_mma_time otherwise)
    monkeypatch.setattr(_forward_plan, "_plans", {})
    monkeypatch.setattr(_fast, "_calls", {})
    run_case(3, 37, 2600, width, dtype, wdtype, init=True, final=True, seed=width)
    plans = [p for p in _forward_plan._plans.values() if p.name.startswith("fwd_mma<")]
    for plan in plans:
        fields = dict(zip(_forward_plan.MMA.plan_fields, plan.plan_fields, strict=True))
        assert fields["sweep"] == sweep and -(-2600 // fields["span"]) >= 2
    assert plans


@pytest.mark.parametrize("dtype", ("bfloat16", "float16"))
@pytest.mark.parametrize("width", (14, 17, 33), ids=lambda k: f"width{k}")
def test_tensor_core_time_rows_on_8_byte_boundaries(monkeypatch, dtype, width):
    """fwd_mma_time (time-contiguous 16-bit x whose rows start on 8-byte boundaries): rows four
    elements past a 16-byte boundary, rows of each chunk shape, rows of several chunks ending
    inside one (mid-group too), states before the rows, final states, an inf and NaNs that must
    reach only the outputs of their taps, and outputs of the library's own (aligned: the
    whole-chunk stores), one element off a 4-byte boundary and every other step (element
    stores)."""
    import torch

    from cupyconv import _fast, _forward_plan

    monkeypatch.setattr(_forward_plan, "_plans", {})
    monkeypatch.setattr(_fast, "_calls", {})
    rng = np.random.default_rng(width)
    rtol, atol = tolerance(dtype)
    shapes = ((2, 3, 8200), (1, 1, 8195), (3, 5, 512), (1, 2, 4096), (2, 2, 1024))
    for i, (b, c, length) in enumerate(shapes):
        x64 = rounded(rng, (b, c, length), dtype)
        if i == 0:
            x64[0, 1, 5000] = np.inf
            x64[1, 2, 300:303] = np.nan
        w64 = rounded(rng, (c, width), dtype, scale=width**-0.5)
        b64 = rounded(rng, (c,), dtype)
        i64 = rounded(rng, (b, c, width - 1), dtype) if i % 2 == 0 else None
        act, final = "silu" if i != 1 else None, i % 2 == 1
        want = reference.causal_conv1d_fn(
            x64, w64, b64, initial_states=i64, return_final_states=final, activation=act
        )
        want_out, want_final = want if final else (want, None)
        finite = np.isfinite(want_out)
        n = b * c * length
        xbuf = torch.full((n + 4,), float("nan"), device="cuda", dtype=torch_dtype(dtype))
        x = xbuf[4:].view(b, c, length)
        x.copy_(torch.from_numpy(x64))
        obuf = torch.full((2 * n + 1,), float("nan"), device="cuda", dtype=x.dtype)
        outs = (
            None, obuf[1 : n + 1].view(b, c, length), obuf[: 2 * n].view(b, c, 2 * length)[..., ::2]
        )  # fmt: skip
        for out in outs:
            res = cupyconv.causal_conv1d_fn(
                x, to_gpu(w64, dtype), to_gpu(b64, dtype),
                initial_states=None if i64 is None else to_gpu(i64, dtype),
                return_final_states=final, activation=act, out=out,
            )  # fmt: skip
            got, got_final = res if final else (res, None)
            assert out is None or got is out
            if final:
                assert_close(got_final, want_final, dtype, name="final_states")
            g = got.double().cpu().numpy()
            np.testing.assert_allclose(g[finite], want_out[finite], rtol=rtol, atol=atol)
            assert not np.isfinite(g[~finite]).any()
    names = {p.name for p in _forward_plan._plans.values()}
    assert any(name.startswith("fwd_mma_time<") for name in names), names


@pytest.mark.parametrize(
    "dtype,wdtype",
    [
        ("bfloat16", "bfloat16"),
        ("bfloat16", "float32"),
        ("float16", "float32"),
        ("float32", "float32"),
        ("float32", "bfloat16"),
        ("float64", "float64"),
    ],
)
@pytest.mark.parametrize("layout", ("cl", "cl_slice", "misaligned_cl"))
def test_channel_last_wide_filters(dtype, wdtype, layout):
    """Channel-last widths above 8 without seq_idx (fwd_channel up to 16 where the rows split
    into its lane vectors; for 16-bit x fwd_mma_cl from 10 with weights of x's dtype (fwd_mma
    from 98), bfloat16 x with float32 weights fwd_mma's split form from 16; fwd_split_cl from 17
    for float32 x; fwd_channel_wide for the others): tiles past the last channel and time step,
    states before the row, with and without bias and activation."""
    widths = (9, 16, 17, 29, 33, 64, 100, 256)
    cases = itertools.product(widths, ((2, 33, 300), (1, 70, 1), (1, 5, 600)))
    for i, (width, (b, c, length)) in enumerate(cases):
        run_case(
            b, c, length, width, dtype, wdtype, layout=layout, bias=i % 2 == 0,
            silu=i % 3 != 0, init=i % 2 == 1, final=i % 4 == 0, seed=i,
        )  # fmt: skip


@pytest.mark.parametrize("dtype", ("bfloat16", "float16"))
@pytest.mark.parametrize("layout", ("cl", "cl_slice"))
@pytest.mark.parametrize("dim", (392, 300, 4), ids=lambda c: f"dim{c}")
def test_channel_last_lane_vectors(dtype, layout, dim):
    """16-bit channel-last x in fwd_channel (lane vectors of 4 channels): a last tile of 8 channels
    (dim 392), rows aligned to 8 bytes only (dim 300; the slices of a 3 dim wide projection),
    a single lane (dim 4)."""
    for i, width in enumerate((2, 4, 7)):
        run_case(
            2, dim, 151, width, dtype, layout=layout, segments=i, padding=i == 2, init=i != 1,
            final=True, final_buffer=i == 0, seed=i,
        )  # fmt: skip


@pytest.mark.parametrize("dtype", ("bfloat16", "float16", "float32", "float64"))
@pytest.mark.parametrize("layout", ("cl", "cl_slice"))
@pytest.mark.parametrize("dim", (392, 300, 2), ids=lambda c: f"dim{c}")
def test_channel_last_wide_lane_vectors(dtype, layout, dim):
    """Channel-last x at widths 9 to 16 in fwd_channel's wide tiles (32 time steps, lane vectors
    of 2 channels, 1 for float64): a last strip of 8 channels (dim 392), rows aligned to 8 bytes
    only (dim 300), a single lane (dim 2), a last tile of 23 steps (151), states before the
    row."""
    for i, width in enumerate((9, 12, 15, 16)):
        run_case(
            2, dim, 151, width, dtype, layout=layout, bias=i != 2, silu=i != 1, init=i % 2 == 0,
            final=True, final_buffer=i == 0, seed=i,
        )  # fmt: skip


@pytest.mark.parametrize(
    "dtype,wdtype",
    [
        ("float32", "float32"), ("float32", "bfloat16"), ("float32", "float64"),
        ("float16", "float32"), ("float16", "bfloat16"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("layout", ("cf", "cf_slice", "misaligned"))
def test_split_window_on_tensor_cores(dtype, wdtype, layout):
    """Time-contiguous float32 x, and float16 x with other weights, from width 18 in fwd_mma
    with the window and the taps split into bfloat16 parts: every KS, rows
    shorter and longer than a span, states before the row, final states, with and without
    bias and activation, within x's dtype's tolerance."""
    for i, width in enumerate((18, 31, 33, 64, 100, 129, 256)):
        run_case(
            2, 24, (300, 2500)[i % 2], width, dtype, wdtype, layout=layout, bias=i % 3 != 1,
            silu=i % 2 == 0, init=i % 3 != 2, final=i % 2 == 1, seed=i,
        )  # fmt: skip


@pytest.mark.parametrize(
    "layout,dtype,wdtype,width,segments,kernel",
    [
        ("cl", "float32", "float32", 17, 0, "fwd_split_cl"),  # KS 2
        ("cl", "float64", "float64", 17, 0, "fwd_channel_wide"),
        ("cl", "float32", "float32", 40, 0, "fwd_split_cl"),
        ("cl", "float64", "float64", 100, 0, "fwd_channel_wide"),
        ("cl", "float16", "float32", 64, 0, "fwd_channel_wide"),  # x through registers
        ("cl", "float32", "bfloat16", 200, 0, "fwd_split_cl"),  # taps converted
        ("cf", "float32", "float32", 33, 2, "fwd_time_wide"),  # seq_idx
        ("cf", "float32", "float32", 33, 0, "fwd_mma"),  # the window split
        ("cf", "float16", "float32", 64, 0, "fwd_mma"),
        ("cf", "bfloat16", "bfloat16", 20, 3, "fwd_time_wide"),  # seq_idx
        ("cf", "float64", "float64", 256, 0, "fwd_time_wide"),
        ("cl", "bfloat16", "bfloat16", 17, 0, "fwd_mma_cl"),  # many items a block
        ("cl", "float16", "float16", 33, 0, "fwd_mma_cl"),
        ("cl", "bfloat16", "bfloat16", 64, 0, "fwd_mma_cl"),  # KS 5
        ("cl", "bfloat16", "bfloat16", 97, 0, "fwd_mma_cl"),  # KS 7
    ],
)  # fmt: skip
def test_wide_kernels_in_a_grid_of_one_block(
    monkeypatch, layout, dtype, wdtype, width, segments, kernel
):
    """The wide kernels (fwd_channel_wide, fwd_time_wide, fwd_mma on a split window,
    fwd_mma_cl, fwd_split_cl) with a grid of one main block: its warps take every tile (row,
    item) in turn, so the copies of the next tile (span) into the other buffer, the taps staged
    again for each tile (row), a last strip of 8 channels and last tiles cut by the row's end
    all run many times in one launch; the blocks after it write the final states (the main
    warps step by the main blocks alone)."""
    from cupyconv import _fast, _forward_plan

    resident = _forward_plan.resident_blocks  # (which also opts into the shared memory)
    monkeypatch.setattr(_forward_plan, "resident_blocks", lambda *args: min(1, resident(*args)))
    monkeypatch.setattr(_forward_plan, "MAX_GRID", 1)  # (fwd_split_cl: a block an item)
    monkeypatch.setattr(_forward_plan, "_plans", {})
    monkeypatch.setattr(_fast, "_calls", {})
    run_case(
        3, 200, 1300, width, dtype, wdtype, layout=layout, segments=segments, padding=segments > 0,
        init=True, final=True,
    )  # fmt: skip
    launched = [plan.name for plan in _forward_plan._plans.values()]
    assert any(name.startswith(kernel + "<") for name in launched), launched


@pytest.mark.parametrize("layout", ("cf", "cl"))
def test_short_rows_with_states(layout):
    for seqlen, width in ((1, 4), (2, 4), (3, 8), (1, 33)):
        run_case(2, 16, seqlen, width, "float32", layout=layout, init=True, final=True, segments=2)


def test_no_bias_no_activation():
    run_case(2, 40, 500, 4, "bfloat16", bias=False, silu=False)
    run_case(2, 40, 500, 4, "bfloat16", layout="cl", bias=False, silu=False)


def param_on_gpu(a64, dtype, form):
    """Weight (C, K) or bias (C,) as a torch CUDA tensor: ``contiguous``, ``strided``
    (weight strides (1, C); every other element of a bias) or ``misaligned`` (contiguous, one
    element off an aligned address)."""
    import torch

    t = torch.from_numpy(a64).to(device="cuda", dtype=torch_dtype(dtype))
    if form == "contiguous":
        return t.contiguous()
    if form == "strided" and t.ndim == 2:
        return t.t().contiguous().t()
    buf = torch.full((2 * t.numel() + 1,), float("nan"), device="cuda", dtype=t.dtype)
    if form == "strided":  # a bias
        view = buf[: 2 * t.numel() : 2]
    else:
        view = buf[1 : 1 + t.numel()].view(t.shape)
    view.copy_(t)
    return view


@pytest.mark.parametrize("layout", ("cf", "cl"))
@pytest.mark.parametrize("form", ("contiguous", "strided", "misaligned"))
@pytest.mark.parametrize("wdtype", ("bfloat16", "float32"))
def test_weight_and_bias_layouts(layout, form, wdtype):
    """fwd_channel reads a lane's taps (and biases) in wide loads when they are consecutive and
    aligned, else one by one; fwd_time one per lane: every form gives the same result."""
    rng = np.random.default_rng(3)
    for width in (3, 4, 12):
        x64 = rounded(rng, (2, 264, 99), "bfloat16")
        w64, b64 = rounded(rng, (264, width), wdtype), rounded(rng, (264,), wdtype)
        x = to_gpu(x64, "bfloat16", layout)
        w, b = param_on_gpu(w64, wdtype, form), param_on_gpu(b64, wdtype, form)
        out = cupyconv.causal_conv1d_fn(x, w, b, activation="silu")
        want = reference.causal_conv1d_fn(x64, w64, b64, activation="silu")
        assert_close(out, want, "bfloat16", name=f"out (width {width})")


@pytest.mark.parametrize("layout", ("cf", "cl", "cl_slice"))
def test_default_out_follows_x(layout):
    import torch

    rng = np.random.default_rng(1)
    x = to_gpu(rounded(rng, (2, 16, 40), "float16"), "float16", layout)
    w = torch.randn(16, 4, device="cuda", dtype=torch.float16)
    out = cupyconv.causal_conv1d_fn(x, w)
    want = (16 * 40, 40, 1) if layout == "cf" else (40 * 16, 1, 16)
    assert out.stride() == want and out.dtype == torch.float16


def test_bitwise_reproducible():
    import torch

    for layout, width in (("cf", 4), ("cl", 4), ("cf", 64), ("time_stride2", 3)):
        rng = np.random.default_rng(width)
        x = to_gpu(rounded(rng, (2, 96, 1000), "bfloat16"), "bfloat16", layout)
        w = torch.randn(96, width, device="cuda", dtype=torch.bfloat16)
        first = cupyconv.causal_conv1d_fn(x, w, activation="silu")
        for _ in range(3):
            again = cupyconv.causal_conv1d_fn(x, w, activation="silu")
            assert torch.equal(first.view(torch.int16), again.view(torch.int16))


def test_empty_inputs_return_empty():
    import torch

    w = torch.randn(4, 3, device="cuda")
    out = cupyconv.causal_conv1d_fn(torch.empty(2, 4, 0, device="cuda"), w)
    assert out.shape == (2, 4, 0)
    out = cupyconv.causal_conv1d_fn(
        torch.empty(2, 0, 5, device="cuda"), torch.empty(0, 3, device="cuda")
    )
    assert out.shape == (2, 0, 5)


# ---- frameworks, streams, devices ------------------------------------------------------------


@pytest.mark.parametrize("dtype", ("float32", "float16", "bfloat16"))
@pytest.mark.parametrize("layout", ("cf", "cl", "cl_slice"))
def test_torch(dtype, layout):
    run_case(2, 96, 777, 4, dtype, layout=layout, segments=3, init=True, final=True)


@pytest.mark.parametrize("dtype", ("float32", "float16", "bfloat16"))
@pytest.mark.parametrize("layout", ("cf", "cl", "slice"))
def test_cupy(dtype, layout):
    import cupy
    import ml_dtypes

    rng = np.random.default_rng(5)
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    x64 = rounded(rng, (2, 48, 300), dtype)
    w64 = rounded(rng, (48, 4), dtype)
    if layout == "cf":
        x = cupy.asarray(x64.astype(np_dtype))
    elif layout == "cl":
        x = cupy.asarray(np.ascontiguousarray(x64.transpose(0, 2, 1)).astype(np_dtype)).transpose(
            0, 2, 1
        )
    else:
        buf = cupy.asarray(
            np.concatenate([x64, x64, x64], axis=1).transpose(0, 2, 1).astype(np_dtype)
        )
        x = buf[:, :, 48:96].transpose(0, 2, 1)
    w = cupy.asarray(w64.astype(np_dtype))
    out, final = cupyconv.causal_conv1d_fn(x, w, return_final_states=True, activation="silu")
    assert isinstance(out, cupy.ndarray) and isinstance(final, cupy.ndarray)
    assert out.dtype == np_dtype
    want, want_final = reference.causal_conv1d_fn(
        x64, w64, return_final_states=True, activation="silu"
    )
    assert_close(out, want, dtype)
    assert_close(final, want_final, dtype, name="final_states")


@pytest.mark.parametrize("dtype", ("float32", "float16", "bfloat16"))
def test_jax(dtype):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    if jax.default_backend() != "gpu":
        pytest.skip("JAX has no GPU backend here")
    rng = np.random.default_rng(7)
    x64 = rounded(rng, (2, 40, 257), dtype)
    w64 = rounded(rng, (40, 3), dtype)
    b64 = rounded(rng, (40,), dtype)
    x = jnp.asarray(x64, dtype=dtype)
    out, final = cupyconv.causal_conv1d_fn(
        x,
        jnp.asarray(w64, dtype=dtype),
        jnp.asarray(b64, dtype=dtype),
        activation="silu",
        return_final_states=True,
    )
    assert isinstance(out, jax.Array) and out.dtype == x.dtype
    want, want_final = reference.causal_conv1d_fn(
        x64, w64, b64, activation="silu", return_final_states=True
    )
    assert_close(np.asarray(out.astype(jnp.float32)), want, dtype)
    assert_close(np.asarray(final.astype(jnp.float32)), want_final, dtype, name="final_states")


def test_torch_nondefault_stream():
    """The kernel runs on torch's current stream: it sees work queued before it there."""
    import torch

    rng = np.random.default_rng(11)
    x64 = rounded(rng, (4, 256, 4096), "float32")
    src = torch.from_numpy(x64).float().cuda()
    w64 = rounded(rng, (256, 4), "float32")
    w = torch.from_numpy(w64).float().cuda()
    x = torch.zeros_like(src)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(20_000_000)  # keep the stream busy so a wrong-stream launch reads zeros
        x.copy_(src)
        out = cupyconv.causal_conv1d_fn(x, w)
    side.synchronize()
    assert_close(out, reference.causal_conv1d_fn(x64, w64), "float32")


def test_thread_without_cuda_context():
    """A thread that has not used CUDA yet (no current context) launches correctly."""
    import threading

    import torch

    rng = np.random.default_rng(12)
    x64 = rounded(rng, (2, 64, 300), "bfloat16")
    w64 = rounded(rng, (64, 4), "bfloat16")
    x, w = to_gpu(x64, "bfloat16"), to_gpu(w64, "bfloat16")
    out = torch.full_like(x, float("nan"))
    errors = []

    def call():
        try:
            cupyconv.causal_conv1d_fn(x, w, activation="silu", out=out)
            torch.cuda.synchronize()
        except Exception as e:  # reported below, in the test's thread
            errors.append(e)

    thread = threading.Thread(target=call)
    thread.start()
    thread.join()
    assert errors == []
    assert_close(out, reference.causal_conv1d_fn(x64, w64, activation="silu"), "bfloat16")


def test_second_device():
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    rng = np.random.default_rng(2)
    x64 = rounded(rng, (2, 8, 50), "float32")
    w64 = rounded(rng, (8, 4), "float32")
    x = torch.from_numpy(x64).float().to("cuda:1")
    out = cupyconv.causal_conv1d_fn(x, torch.from_numpy(w64).float().to("cuda:1"))
    assert out.device == x.device
    assert_close(out, reference.causal_conv1d_fn(x64, w64), "float32")


def test_warmup_then_cuda_graph():
    import torch

    rng = np.random.default_rng(4)
    x64 = rounded(rng, (2, 64, 512), "bfloat16")
    w64 = rounded(rng, (64, 4), "bfloat16")
    x = torch.from_numpy(x64).to("cuda", torch.bfloat16)
    w = torch.from_numpy(w64).to("cuda", torch.bfloat16)
    cupyconv.warmup(x, w, activation="silu", return_final_states=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # torch's recommended warm-up before capture
        cupyconv.causal_conv1d_fn(x, w, activation="silu", return_final_states=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, final = cupyconv.causal_conv1d_fn(x, w, activation="silu", return_final_states=True)
    x64b = rounded(rng, (2, 64, 512), "bfloat16")
    x.copy_(torch.from_numpy(x64b))
    graph.replay()
    torch.cuda.synchronize()
    want, want_final = reference.causal_conv1d_fn(
        x64b, w64, activation="silu", return_final_states=True
    )
    assert_close(out, want, "bfloat16")
    assert_close(final, want_final, "bfloat16", name="final_states")


# ---- sizes that overflow 32-bit offsets or grid dimensions -----------------------------------


def _check_tail(out, x64_rows, w64, b64, t0, dtype, act="silu"):
    """Compare out[..., t0:] with the reference run on the tail plus its K-1 halo."""
    k = w64.shape[1]
    lo = max(0, t0 - (k - 1))
    want = reference.causal_conv1d_fn(x64_rows[..., lo:], w64, b64, activation=act)
    assert_close(out, want[..., t0 - lo :], dtype)


def test_many_channels():
    run_case(1, 70_000, 9, 4, "bfloat16", layout="cf")
    run_case(1, 70_000, 9, 4, "bfloat16", layout="cl")


def test_long_rows():
    run_case(1, 3, 70_000, 4, "float32", layout="cf", segments=3, init=True, final=True)
    run_case(1, 3, 70_000, 4, "float32", layout="cl", segments=3, init=True, final=True)
    run_case(1, 2, 4_200_000, 4, "bfloat16", layout="cf")


@pytest.mark.parametrize("layout", ("cf", "cl"))
def test_more_than_2_pow_31_elements(layout):
    import torch

    width = 4
    if layout == "cf":
        batch, dim, seqlen = 2, 16, 2**26 + 5  # 2.1e9 elements
    else:
        batch, dim, seqlen = 1, 520, 2**22 + 3
    assert batch * dim * seqlen > 2**31
    g = torch.Generator(device="cuda").manual_seed(0)
    if layout == "cf":
        x = torch.randn(batch, dim, seqlen, device="cuda", dtype=torch.bfloat16, generator=g)
    else:
        x = torch.randn(
            batch, seqlen, dim, device="cuda", dtype=torch.bfloat16, generator=g
        ).transpose(1, 2)
    w = torch.randn(dim, width, device="cuda", dtype=torch.bfloat16, generator=g)
    b = torch.randn(dim, device="cuda", dtype=torch.bfloat16, generator=g)
    out = cupyconv.causal_conv1d_fn(x, w, b, activation="silu")
    w64 = w.double().cpu().numpy()
    b64 = b.double().cpu().numpy()
    t0 = seqlen - 3000
    lo = t0 - (width - 1)
    rows = x[-1:, :, lo:].double().cpu().numpy()
    _check_tail(out[-1:, :, t0:], rows, w64, b64, width - 1, "bfloat16")
    del x, out
    torch.cuda.empty_cache()


# ---- the full grid (slow) --------------------------------------------------------------------

GRID_WIDTHS = (1, 2, 3, 4, 5, 8, 16, 31, 64, 256)
GRID_C = (1, 7, 64, 4128)
GRID_L = (1, 2, 3, 8, 63, 64, 65, 127, 128, 129, 151, 372, 784, 1134, 2048, 4096)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ("cf", "cl", "cl_slice", "misaligned"))
@pytest.mark.parametrize("width", GRID_WIDTHS, ids=lambda k: f"width{k}")
@pytest.mark.parametrize("dim", GRID_C, ids=lambda c: f"dim{c}")
def test_grid(layout, width, dim):
    for i, seqlen in enumerate(GRID_L):
        batch = 1 + i % 3
        if dim * seqlen * batch > 4_000_000:
            continue
        run_case(
            batch,
            dim,
            seqlen,
            width,
            ("float32", "bfloat16", "float16")[i % 3],
            layout=layout,
            segments=i % 4,
            padding=i % 2 == 1,
            init=i % 3 == 0,
            final=i % 2 == 0,
            seed=i,
        )


# ---- every valid input launches ---------------------------------------------------------------


def test_wide_channel_last_short_rows_launch():
    """x (2, 264, 3) float32, the channel-last view [:, :, 267:531].transpose(1, 2) of a
    contiguous (2, 3, 799) buffer, weight (264, 256), no bias, SiLU: the wide channel-last tile
    asks for 96 KiB of shared memory, which the kernel must be allowed before it launches."""
    import torch

    rng = np.random.default_rng(16)
    x64, w64 = rounded(rng, (2, 264, 3), "float32"), rounded(rng, (264, 256), "float32", 1 / 16)
    buf = torch.full((2, 3, 799), float("nan"), device="cuda")
    x = buf[:, :, 267:531].transpose(1, 2)
    x.copy_(torch.from_numpy(x64))
    out = cupyconv.causal_conv1d_fn(x, torch.from_numpy(w64).cuda(), activation="silu")
    want = reference.causal_conv1d_fn(x64, w64, activation="silu")
    assert_close(out, want, "float32")


def _random_launch_cases(n=48, seed=2026):
    rng = np.random.default_rng(seed)
    dtypes = ("float32", "bfloat16", "float16", "float64")
    for i in range(n):
        width = int(rng.choice([rng.integers(1, 9), rng.integers(9, 65), rng.integers(65, 257)]))
        seqlen = int(rng.choice([1, 2, 3, rng.integers(4, 64), rng.integers(64, 900)]))
        yield pytest.param(
            dict(
                batch=int(rng.integers(1, 4)), dim=int(rng.integers(1, 300)), seqlen=seqlen,
                width=width, dtype=dtypes[i % 4], layout=LAYOUTS[int(rng.integers(len(LAYOUTS)))],
                bias=bool(rng.integers(2)), silu=bool(rng.integers(2)),
                segments=int(rng.integers(0, 4)), padding=bool(rng.integers(2)),
                init=bool(rng.integers(2)), final=bool(rng.integers(2)), seed=i,
            ),
            id=f"case{i}",
        )  # fmt: skip


@pytest.mark.parametrize("case", list(_random_launch_cases()))
def test_random_launches(case):
    """A seeded random sample of widths 1..256 x layouts x dtypes x row lengths x features:
    every plan's launch fits the device and matches the reference."""
    run_case(**case)


# ---- overlap and non-finite values on the GPU path -------------------------------------------


def test_overlapping_buffers_are_refused_before_any_launch():
    import torch

    buf = torch.zeros(1, 2, 16, device="cuda")
    x, w = torch.ones(1, 2, 2, device="cuda"), torch.ones(2, 9, device="cuda")
    with pytest.raises(ValueError, match="^out must not share memory with initial_states"):
        cupyconv.causal_conv1d_fn(x, w, initial_states=buf[:, :, 0:8], out=buf[:, :, 5:7])
    base = torch.zeros(1, 2, 12, device="cuda")
    with pytest.raises(ValueError, match="^final_states_out must not share memory with out"):
        cupyconv.causal_conv1d_fn(
            torch.ones(1, 2, 10, device="cuda"), torch.ones(2, 3, device="cuda"),
            out=base[:, :, 0:10], return_final_states=True, final_states_out=base[:, :, 6:8],
        )  # fmt: skip
    out = torch.zeros(1, 2, 2, device="cuda", requires_grad=True)
    with pytest.raises(ValueError, match="^out must not require grad"):
        cupyconv.causal_conv1d_fn(x, w[:, :3], out=out)
    torch.cuda.synchronize()
    assert not buf.any() and not base.any() and not out.detach().any()


def test_disjoint_views_of_one_gpu_buffer():
    import torch

    rng = np.random.default_rng(21)
    x64, w64 = rng.standard_normal((1, 2, 10)), rng.standard_normal((2, 3))
    buf = torch.full((1, 2, 16), float("nan"), device="cuda", dtype=torch.float64)
    buf[:, :, 0:2] = torch.from_numpy(rng.standard_normal((1, 2, 2)))
    i64 = buf[:, :, 0:2].cpu().numpy()
    x, w = torch.from_numpy(x64).cuda(), torch.from_numpy(w64).cuda()
    out = cupyconv.causal_conv1d_fn(x, w, initial_states=buf[:, :, 0:2], out=buf[:, :, 5:15])
    want = reference.causal_conv1d_fn(x64, w64, initial_states=i64)
    assert_close(out, want, "float64")


@pytest.mark.parametrize("layout", ("cf", "cl"))
@pytest.mark.parametrize("width", (2, 4, 7, 20), ids=lambda k: f"width{k}")
@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
def test_non_finite_values_stay_in_their_segment(layout, width, dtype):
    """inf and NaN in one segment and at padding: every output outside that segment (and the
    padding outputs, 0) is finite and matches the reference, which masks by selection."""
    import torch

    rng = np.random.default_rng(width)
    batch, dim, seqlen = 2, 16, 300
    x64 = rounded(rng, (batch, dim, seqlen), dtype)
    s = np.zeros((batch, seqlen), np.int32)
    s[:, 100:200], s[:, 200:] = 1, 2
    s[:, 250:260] = -1  # padding, holding NaN
    x64[:, :, 120] = np.inf
    x64[:, 3, 150] = np.nan
    x64[:, :, 250:260] = np.nan
    w64 = rounded(rng, (dim, width), dtype, scale=width**-0.5)
    x = to_gpu(x64, dtype, layout)
    w = to_gpu(w64, dtype)
    si = torch.from_numpy(s).cuda()
    out, final = cupyconv.causal_conv1d_fn(
        x, w, seq_idx=si, activation="silu", return_final_states=True
    )
    want, want_final = reference.causal_conv1d_fn(
        x64, w64, seq_idx=s, activation="silu", return_final_states=True
    )
    got = out.double().cpu().numpy()
    finite = np.isfinite(want)
    assert finite[:, :, :100].all() and finite[:, :, 200:].all()  # the other segments
    rtol, atol = tolerance(dtype)
    np.testing.assert_allclose(got[finite], want[finite], rtol=rtol, atol=atol)
    assert not np.isfinite(got[~finite]).any()
    assert_close(final, want_final, dtype, name="final_states")


@pytest.mark.parametrize("layout", ("cf", "cl"))
@pytest.mark.parametrize("dtype", ("bfloat16", "float16", "float32"))
@pytest.mark.parametrize("width", (9, 20, 33, 64, 129, 200, 256), ids=lambda k: f"width{k}")
def test_non_finite_inputs_reach_only_their_taps(width, dtype, layout):
    """Without seq_idx too: the wide kernels (tensor cores, zero-padded taps) must not let an inf
    or NaN reach an output whose width taps do not include it."""
    rng = np.random.default_rng(width)
    x64 = rounded(rng, (2, 5, 3000), dtype)
    x64[0, 1, 700] = np.inf
    x64[1, 2, 1500:1503] = np.nan
    x64[1, 4, 2999] = -np.inf
    w64 = rounded(rng, (5, width), dtype, scale=width**-0.5)
    b64 = rounded(rng, (5,), dtype)
    x = to_gpu(x64, dtype, layout)
    out = cupyconv.causal_conv1d_fn(x, to_gpu(w64, dtype), to_gpu(b64, dtype))
    want = reference.causal_conv1d_fn(x64, w64, b64)
    got = out.double().cpu().numpy()
    finite = np.isfinite(want)
    rtol, atol = tolerance(dtype)
    np.testing.assert_allclose(got[finite], want[finite], rtol=rtol, atol=atol)
    assert not np.isfinite(got[~finite]).any()


def test_channel_last_wide_filters_in_any_order_of_widths():
    """fwd_channel_wide's shared memory grows with the width; a kernel planned with more and
    launched after a plan with less must still launch (its limit only ever grows)."""
    import torch

    rng = np.random.default_rng(3)
    buf64 = rng.standard_normal((2, 3, 799))
    for width in (256, 100, 9, 256):
        x64 = buf64[:, :, 267:531].transpose(0, 2, 1)  # (2, 264, 3), channel-contiguous
        w64 = rng.standard_normal((264, width)) * width**-0.5
        buf = torch.from_numpy(buf64).float().cuda()
        x = buf[:, :, 267:531].transpose(1, 2)
        w = torch.from_numpy(w64).float().cuda()
        out = cupyconv.causal_conv1d_fn(x, w, activation="silu")
        want = reference.causal_conv1d_fn(
            x64.astype(np.float32), w64.astype(np.float32), activation="silu"
        )
        assert_close(out, want, "float32", name=f"out (width {width})")
