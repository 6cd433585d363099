"""The decode update and the packed-sequence states on the GPU against the float64 reference.

Each update case builds x, the state pool, weight and bias in numpy (already rounded to the
dtypes under test), runs ``causal_conv1d_update`` on torch CUDA tensors, and compares out with
the reference at x's tolerance and the updated conv_state exactly (its entries are copies of
earlier entries or of x, rounded once to the state's dtype). Padding rows (negative
conv_state_indices) must give out 0 and leave their state rows alone; rows of the pool no batch
row uses must stay as they were. The varlen states are copies too: compared exactly.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from test_forward_gpu import rounded, to_gpu, torch_dtype

import cupyconv
from cupyconv import reference
from cupyconv.testing import GRAD_TOLERANCE, assert_close, to_numpy, tolerance

pytestmark = pytest.mark.gpu

WIDTHS = (1, 2, 3, 4, 5, 8, 16, 64, 256)
SEQLENS = (None, 1, 2, 4, 5, 9)  # None: 2-D x (one token)


def state_tensor(s64, dtype, order):
    """conv_state [N, dim, state_len] in memory order "cf" ([N, dim, state_len] dense) or "cl"
    (a [N, state_len, dim] buffer viewed as [N, dim, state_len])."""
    return to_gpu(s64, dtype, "cl" if order == "cl" else "cf")


def run_update(
    batch, dim, seqlen, width, state_len, dtype="bfloat16", state_dtype=None, wdtype=None,
    circular=False, pool=0, order="cf", bias=True, silu=True, index_dtype="int32", seed=0,
    lens_scale=1,
):  # fmt: skip
    """One update case; ``pool`` > 0 gathers rows from a pool of batch + pool rows, with every
    third batch row a padding row (-1)."""
    import torch

    rng = np.random.default_rng(seed)
    state_dtype = state_dtype or dtype
    wdtype = wdtype or dtype
    shape = (batch, dim) if seqlen is None else (batch, dim, seqlen)
    x64 = rounded(rng, shape, dtype)
    w64 = rounded(rng, (dim, width), wdtype, scale=width**-0.5)
    b64 = rounded(rng, (dim,), wdtype) if bias else None
    n_rows = batch + pool if pool else batch
    s64 = rounded(rng, (n_rows, dim, state_len), state_dtype)
    idx = None
    if pool:
        idx = rng.permutation(n_rows)[:batch].astype(index_dtype)
        idx[::3] = -1
    lens = None
    if circular:
        lens = (rng.integers(0, 4 * max(state_len, 1), batch) * lens_scale).astype(index_dtype)
    act = "silu" if silu else None

    x = to_gpu(x64, dtype)
    w = to_gpu(w64, wdtype)
    b = to_gpu(b64, wdtype) if bias else None
    state = state_tensor(s64, state_dtype, order)
    ii = torch.from_numpy(idx).cuda() if idx is not None else None
    ll = torch.from_numpy(lens).cuda() if lens is not None else None
    out = cupyconv.causal_conv1d_update(x, state, w, b, act, ll, ii)
    torch.cuda.synchronize()
    want, want_state = reference.causal_conv1d_update(x64, s64, w64, b64, act, lens, idx)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert_close(out, want, dtype)
    exact = want_state.astype(np_dtype(state_dtype)).astype(np.float64)
    got = to_numpy(state)
    if not np.array_equal(got, exact):
        bad = np.argwhere(got != exact)[0]
        raise AssertionError(
            f"conv_state: {int((got != exact).sum())} entries differ; first at {tuple(bad)}: "
            f"got {got[tuple(bad)]!r}, expected {exact[tuple(bad)]!r}"
        )
    return out, state


def np_dtype(name):
    import ml_dtypes

    return ml_dtypes.bfloat16 if name == "bfloat16" else np.dtype(name)


def _cases():
    """widths x seqlens x modes, with state_len, memory order and pool cycling through their
    values so that each appears with every width."""
    extra = itertools.cycle([(0, "cf", 0), (1, "cl", 3), (3, "cf", 4), (9, "cl", 0)])
    for width, seqlen, circular in itertools.product(WIDTHS, SEQLENS, (False, True)):
        more, order, pool = next(extra)
        yield width, seqlen, circular, width - 1 + more, order, pool


@pytest.mark.parametrize(
    "width, seqlen, circular, state_len, order, pool",
    list(_cases()),
    ids=lambda v: str(v),
)
def test_update_matrix(width, seqlen, circular, state_len, order, pool):
    run_update(5, 70, seqlen, width, state_len, circular=circular, order=order, pool=pool)


@pytest.mark.slow
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("seqlen", SEQLENS)
@pytest.mark.parametrize("more", range(10))
@pytest.mark.parametrize("circular", (False, True))
@pytest.mark.parametrize("order", ("cf", "cl"))
@pytest.mark.parametrize("pool", (0, 4))
def test_update_grid(width, seqlen, more, circular, order, pool):
    run_update(4, 33, seqlen, width, width - 1 + more, circular=circular, order=order, pool=pool)


def update_kernel(batch, dim, seqlen, width, state_len, dtype, circular, pool):
    """The kernel instance the plan picks for an update with run_update's layout."""
    import torch

    from cupyconv.update import _UpdateCall

    shape = (batch, dim) if seqlen is None else (batch, dim, seqlen)
    x = torch.zeros(shape, dtype=torch_dtype(dtype), device="cuda")
    state = torch.zeros(batch + pool, dim, state_len, dtype=x.dtype, device="cuda")
    w, b = torch.zeros(dim, width, dtype=x.dtype, device="cuda"), torch.zeros(dim, dtype=x.dtype)
    idx = torch.zeros(batch, dtype=torch.int32, device="cuda") if pool else None
    lens = torch.zeros(batch, dtype=torch.int32, device="cuda") if circular else None
    call = _UpdateCall(x, state, w, b.cuda(), "silu", lens, idx)
    return call.plan().name


@pytest.mark.parametrize("width", range(2, 9))
@pytest.mark.parametrize("seqlen", (None, 1))
@pytest.mark.parametrize("mode", ("sliding", "circular", "circular-long"))
@pytest.mark.parametrize("dtype", ("bfloat16", "float16", "float32"))
def test_update_lean(width, seqlen, mode, dtype):
    """The layout of a decode step takes conv_update_lean: 19 and 5 batch rows (groups of R
    rows and a partial one), 130 channels (a partial channel tile), a pool with padding rows;
    circular states of width - 1 entries (read and written whole) and two entries longer."""
    circular = mode != "sliding"
    state_len = width - 1 + (2 if mode == "circular-long" else 0)
    args = (19, 130, seqlen, width, state_len)
    assert update_kernel(*args, dtype, circular, 5).startswith("conv_update_lean<")
    run_update(*args, dtype, circular=circular, pool=5, seed=width)
    run_update(5, *args[1:], dtype, circular=circular, seed=width + 1)  # two rows a thread


DTYPES = ("float32", "float16", "bfloat16")


@pytest.mark.parametrize("dtype", DTYPES + ("float64",))
@pytest.mark.parametrize("state_dtype", DTYPES + ("float64",))
def test_update_state_dtypes(dtype, state_dtype):
    """Every state dtype with every x dtype (a float32 state with bfloat16 x: computed in
    float32, stored in float32), both modes."""
    for circular in (False, True):
        run_update(3, 40, 5, 4, 6, dtype, state_dtype, circular=circular, pool=2, seed=1)


@pytest.mark.parametrize("dtype, wdtype", list(itertools.product(DTYPES, DTYPES)))
def test_update_weight_dtypes(dtype, wdtype):
    run_update(3, 40, 3, 4, 3, dtype, wdtype=wdtype, order="cl", seed=2)


@pytest.mark.parametrize("bias, silu", [(False, False), (False, True), (True, False)])
def test_update_bias_activation(bias, silu):
    run_update(2, 64, 4, 4, 3, bias=bias, silu=silu, circular=True, seed=3)


def test_update_circular_wraps_many_times():
    """seqlen > state_len: later tokens overwrite earlier ones in order; large cache_seqlens
    (int64, past 2**31)."""
    run_update(3, 16, 9, 4, 3, circular=True, index_dtype="int64", lens_scale=2**31 + 7)
    run_update(3, 16, 9, 2, 1, "float32", circular=True, seed=5)


def test_update_width_one_without_state():
    """width 1 with state_len 0: out = act(w x + b), nothing to store."""
    run_update(2, 8, 3, 1, 0, circular=False)
    run_update(2, 8, 3, 1, 0, circular=True)


def test_update_index_dtypes_and_large_dim():
    run_update(2, 5000, 2, 4, 4, pool=3, index_dtype="int64", circular=True, seed=6)


def test_update_strided_x_and_weight():
    """x as a channel slice of a wider buffer and a transposed weight."""
    import torch

    rng = np.random.default_rng(7)
    x64 = rounded(rng, (3, 24, 2), "float32")
    w64 = rounded(rng, (24, 4), "float32")
    s64 = rounded(rng, (3, 24, 5), "float32")
    x = to_gpu(x64, "float32", "cl_slice")
    w = torch.from_numpy(w64.T.copy()).float().cuda().t()
    state = to_gpu(s64, "float32")
    out = cupyconv.causal_conv1d_update(x, state, w, None, "silu")
    want, want_state = reference.causal_conv1d_update(x64, s64, w64, None, "silu")
    assert_close(out, want, "float32")
    assert np.array_equal(to_numpy(state), want_state)


def test_update_decode_loop_matches_forward():
    """Token by token through the update equals the forward over the whole sequence, and the
    state ends as the forward's last inputs."""
    import torch

    rng = np.random.default_rng(8)
    batch, dim, seqlen, width = 2, 48, 12, 4
    x64 = rounded(rng, (batch, dim, seqlen), "float32")
    w64 = rounded(rng, (dim, width), "float32")
    x = to_gpu(x64, "float32")
    w = to_gpu(w64, "float32")
    state = torch.zeros(batch, dim, width - 1, device="cuda")
    outs = [
        cupyconv.causal_conv1d_update(x[:, :, t], state, w, None, "silu") for t in range(seqlen)
    ]
    want = reference.causal_conv1d_fn(x64, w64, activation="silu")
    assert_close(torch.stack(outs, dim=2), want, "float32")
    assert np.array_equal(to_numpy(state), x64[:, :, -(width - 1) :])


def test_update_lean_path_from_threads():
    """Threads decoding at once, each on its own stream, all on the lean path (one launch
    layout, one parameter buffer per thread): each gets its own outputs and states."""
    import threading

    import torch

    rng = np.random.default_rng(21)
    batch, dim, seqlen, width, n = 2, 64, 40, 4, 6
    w64 = rounded(rng, (dim, width), "float32")
    w = to_gpu(w64, "float32")
    xs64 = [rounded(rng, (batch, dim, seqlen), "float32") for _ in range(n)]
    results, errors = [None] * n, []

    def decode(i):
        try:
            with torch.cuda.stream(torch.cuda.Stream()):
                x = to_gpu(xs64[i], "float32")
                state = torch.zeros(batch, dim, width - 1, device="cuda")
                outs = [
                    cupyconv.causal_conv1d_update(x[:, :, t].contiguous(), state, w, None, "silu")
                    for t in range(seqlen)
                ]
                results[i] = (torch.stack(outs, dim=2), state)
                torch.cuda.current_stream().synchronize()
        except Exception as e:  # reported below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=decode, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    for x64, (out, state) in zip(xs64, results):
        assert_close(out, reference.causal_conv1d_fn(x64, w64, activation="silu"), "float32")
        assert np.array_equal(to_numpy(state), x64[:, :, -(width - 1) :])


def test_update_repeated_layout_takes_new_arrays():
    """The second call with the same layout (the lean path) reads the new arrays."""
    for seed in (10, 11, 12):
        run_update(4, 32, 2, 4, 4, circular=True, pool=2, seed=seed)


def test_update_overlap_refused_after_lean_calls():
    """A conv_state that shares memory with x is refused, also once the layout is cached."""
    import torch

    buf = torch.zeros(2, 16, 8, device="cuda")
    w = torch.randn(16, 4, device="cuda")
    for _ in range(2):
        cupyconv.causal_conv1d_update(torch.randn(2, 16, 1, device="cuda"), buf[:, :, 2:], w)
    with pytest.raises(ValueError, match="^conv_state must not share memory with x"):
        cupyconv.causal_conv1d_update(buf[:, :, 2:3], buf[:, :, 2:], w)


def test_update_cupy_inputs():
    import cupy

    rng = np.random.default_rng(13)
    x64 = rounded(rng, (2, 16), "float32")
    w64 = rounded(rng, (16, 3), "float32")
    s64 = rounded(rng, (2, 16, 4), "float32")
    state = cupy.asarray(s64.astype(np.float32))
    for _ in range(2):  # the second call takes the lean path
        st = state.copy()
        out = cupyconv.causal_conv1d_update(
            cupy.asarray(x64, np.float32), st, cupy.asarray(w64, np.float32)
        )
        assert isinstance(out, cupy.ndarray)
        want, want_state = reference.causal_conv1d_update(x64, s64, w64)
        assert_close(out, want, "float32")
        assert np.array_equal(to_numpy(st), want_state)


def test_update_empty():
    import torch

    w = torch.randn(8, 4, device="cuda")
    state = torch.randn(0, 8, 3, device="cuda")
    out = cupyconv.causal_conv1d_update(torch.randn(0, 8, device="cuda"), state, w)
    assert out.shape == (0, 8)
    state = torch.randn(2, 8, 3, device="cuda")
    before = state.clone()
    out = cupyconv.causal_conv1d_update(torch.randn(2, 8, 0, device="cuda"), state, w)
    assert out.shape == (2, 8, 0) and torch.equal(state, before)


# ---- packed-sequence states --------------------------------------------------------------------


def _varlen_case(lengths, dim, state_len, dtype, layout, index_dtype="int32", seed=0):
    import torch

    rng = np.random.default_rng(seed)
    total = int(sum(lengths)) + 3  # tokens past the last sequence are not read
    x64 = rounded(rng, (total, dim), dtype)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(index_dtype)
    t = torch.from_numpy(x64).to("cuda", torch_dtype(dtype))
    if layout == "slice":  # a channel slice of a wider [T, 3 dim] buffer
        buf = torch.full((total, 3 * dim), float("nan"), device="cuda", dtype=t.dtype)
        buf[:, dim : 2 * dim] = t
        t = buf[:, dim : 2 * dim]
    elif layout == "time_contiguous":
        t = t.t().contiguous().t()
    states = cupyconv.causal_conv1d_varlen_states(t, torch.from_numpy(cu).cuda(), state_len)
    torch.cuda.synchronize()
    want = reference.causal_conv1d_varlen_states(x64, cu, state_len)
    assert states.shape == (len(lengths), dim, state_len) and states.dtype == t.dtype
    if state_len > 1 and dim > 1:
        assert states.stride() == (state_len * dim, 1, dim)  # laid out [N, state_len, dim]
    assert np.array_equal(to_numpy(states), want)


@pytest.mark.parametrize("state_len", (0, 1, 3, 8))
@pytest.mark.parametrize("layout", ("dense", "slice", "time_contiguous"))
@pytest.mark.parametrize("dtype", DTYPES + ("float64",))
def test_varlen_states(state_len, layout, dtype):
    _varlen_case([5, 0, 1, 3, 12, 8, 2], 37, state_len, dtype, layout)


def test_varlen_states_one_sequence_and_int64():
    _varlen_case([300], 130, 4, "bfloat16", "dense", "int64")
    _varlen_case([0], 4, 3, "float32", "dense")


# ---- CUDA graphs -------------------------------------------------------------------------------


def _capture(fn):
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # torch's recommended warm-up before capture
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = fn()
    return graph, result


@pytest.mark.parametrize("mode", ("sliding", "circular", "gathered"))
def test_update_cuda_graph(mode):
    """Captured after warmup, replayed with new x, state and cache_seqlens values: the eager
    results, step after step."""
    import torch

    rng = np.random.default_rng(20)
    batch, dim, width, state_len, pool = 6, 64, 4, 5, 3
    w64 = rounded(rng, (dim, width), "bfloat16")
    b64 = rounded(rng, (dim,), "bfloat16")
    w, b = to_gpu(w64, "bfloat16"), to_gpu(b64, "bfloat16")
    n_rows = batch + pool if mode == "gathered" else batch
    s64 = rounded(rng, (n_rows, dim, state_len), "bfloat16")
    state = state_tensor(s64, "bfloat16", "cl")
    x = torch.zeros(batch, dim, device="cuda", dtype=torch.bfloat16)
    lens = idx = None
    lens64 = idx64 = None
    if mode == "circular":
        lens = torch.zeros(batch, device="cuda", dtype=torch.int32)
    if mode == "gathered":
        idx64 = rng.permutation(n_rows)[:batch].astype(np.int32)
        idx64[1] = -1
        idx = torch.from_numpy(idx64).cuda()
    args = (x, state, w, b, "silu", lens, idx)
    cupyconv.warmup(cupyconv.causal_conv1d_update, *args)
    graph, out = _capture(lambda: cupyconv.causal_conv1d_update(*args))
    state.copy_(state_tensor(s64, "bfloat16", "cl"))  # the warm-up calls moved it
    for step in range(3):
        x64 = rounded(rng, (batch, dim), "bfloat16")
        x.copy_(torch.from_numpy(x64))
        if lens is not None:
            lens64 = rng.integers(0, 50, batch).astype(np.int32)
            lens.copy_(torch.from_numpy(lens64))
        graph.replay()
        torch.cuda.synchronize()
        want, s64 = reference.causal_conv1d_update(x64, s64, w64, b64, "silu", lens64, idx64)
        assert_close(out, want, "bfloat16", name=f"out step {step}")
        assert np.array_equal(to_numpy(state), s64), f"state step {step}"


@pytest.mark.parametrize("layout,shape", [("cl", (2, 64, 300)), ("cf", (4, 64, 2048))])
def test_backward_cuda_graph(layout, shape):
    """Captured and replayed with new inputs: bwd_channel (channel-last) and bwd_time's runs of
    whole rows (channel-first), each with bwd_reduce."""
    import torch

    rng = np.random.default_rng(21)
    width = 4
    x64, g64 = rounded(rng, shape, "bfloat16"), rounded(rng, shape, "bfloat16")
    w64 = rounded(rng, (64, width), "bfloat16")
    b64 = rounded(rng, (64,), "bfloat16")
    x, dout = to_gpu(x64, "bfloat16", layout), to_gpu(g64, "bfloat16", layout)
    w, b = to_gpu(w64, "bfloat16"), to_gpu(b64, "bfloat16")
    cupyconv.warmup(cupyconv.causal_conv1d_bwd, x, w, b, dout, activation="silu")
    graph, (dx, dw, db, _) = _capture(
        lambda: cupyconv.causal_conv1d_bwd(x, w, b, dout, activation="silu")
    )
    x64, g64 = rounded(rng, shape, "bfloat16"), rounded(rng, shape, "bfloat16")
    x.copy_(to_gpu(x64, "bfloat16", layout))
    dout.copy_(to_gpu(g64, "bfloat16", layout))
    graph.replay()
    torch.cuda.synchronize()
    rdx, rdw, rdb, _ = reference.causal_conv1d_bwd(x64, w64, b64, g64, activation="silu")
    assert_close(dx, rdx, "bfloat16", name="dx")
    # dweight and dbias: GRAD_TOLERANCE's atol scaled by sqrt(batch * seqlen), rounded once to
    # bfloat16 (never tighter than its rtol), as in test_backward_gpu.py.
    rtol, atol = max(GRAD_TOLERANCE[0], tolerance("bfloat16")[0]), GRAD_TOLERANCE[1]
    atol *= np.sqrt(shape[0] * shape[2])
    assert_close(dw, rdw, rtol=rtol, atol=atol, name="dweight")
    assert_close(db, rdb, rtol=rtol, atol=atol, name="dbias")


def test_capture_without_warmup_is_refused():
    """A kernel that is not compiled yet cannot be compiled during a capture: a clear error."""
    import torch

    x = torch.zeros(3, 40, device="cuda", dtype=torch.float16)
    state = torch.zeros(3, 40, 12, device="cuda", dtype=torch.float16)  # an unused width
    w = torch.zeros(40, 13, device="cuda", dtype=torch.float16)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="not compiled yet and the stream is capturing"):
        with torch.cuda.graph(graph):
            cupyconv.causal_conv1d_update(x, state, w)
