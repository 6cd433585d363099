"""The float64 oracle (``cupyconv.reference``) tested on its own, on the CPU.

It is checked against independent definitions: scalar loops written straight from docs/semantics.md
text, ``numpy.convolve`` per channel, central finite differences for the backward, the update
and varlen-state definitions in terms of the forward on a concatenated history, and (where torch
is importable) ``torch.nn.functional.conv1d`` and torch autograd.
"""

from __future__ import annotations

import itertools
import math

import ml_dtypes
import numpy as np
import pytest

from cupyconv import reference as ref
from cupyconv.testing import assert_close

# --------------------------------------------------------------------------------------------
# Scalar-loop definitions, straight from docs/semantics.md
# --------------------------------------------------------------------------------------------


def h_loop(x, seq_idx, initial_states, width, b, c, t, s):
    """h(b, c, t, s): the input the output at t may see at position s (docs/semantics.md)."""
    if seq_idx is not None and seq_idx[b, t] < 0:
        return 0.0  # padding sees nothing
    if s >= 0:
        if seq_idx is not None and seq_idx[b, s] != seq_idx[b, t]:
            return 0.0  # another packed sequence (or padding)
        return x[b, c, s]
    if initial_states is None:
        return 0.0
    if seq_idx is not None and seq_idx[b, t] != seq_idx[b, 0]:
        return 0.0  # the initial state belongs to the first segment only
    return initial_states[b, c, width - 1 + s]


def forward_loop(x, weight, bias, seq_idx, initial_states, silu):
    """(out, final_states) by quadruple loops over batch, dim, seqlen and width."""
    batch, dim, seqlen = x.shape
    width = weight.shape[1]
    out = np.zeros((batch, dim, seqlen))
    final_states = np.zeros((batch, dim, width - 1))
    for b, c, t in itertools.product(range(batch), range(dim), range(seqlen)):
        if seq_idx is not None and seq_idx[b, t] < 0:
            continue  # padding output is 0
        z = 0.0 if bias is None else bias[c]
        for k in range(width):
            s = t - (width - 1) + k
            z += weight[c, k] * h_loop(x, seq_idx, initial_states, width, b, c, t, s)
        out[b, c, t] = z / (1.0 + math.exp(-z)) if silu else z
    for b, c, j in itertools.product(range(batch), range(dim), range(width - 1)):
        s = seqlen - (width - 1) + j
        final_states[b, c, j] = h_loop(x, seq_idx, initial_states, width, b, c, seqlen - 1, s)
    return out, final_states


def make_seq_idx(rng, batch, seqlen):
    """Segment ids with 1-4 increasing segments per row and padding.

    Row 0 ends in padding (its final states are 0), row 1 starts with padding (its initial
    state is never visible), row 2 has a padding run in the middle, with one id -2.
    """
    seq_idx = np.zeros((batch, seqlen), dtype=np.int32)
    for b in range(batch):
        cuts = rng.choice(np.arange(1, seqlen), size=min(3, seqlen - 1), replace=False)
        for cut in cuts:
            seq_idx[b, cut:] += 1
        pad = max(1, seqlen // 5)
        if b % 3 == 0:
            seq_idx[b, seqlen - pad :] = -1
        elif b % 3 == 1:
            seq_idx[b, :pad] = -1
        elif seqlen >= 4:
            middle = seqlen // 2
            seq_idx[b, middle - 1 : middle + 1] = (-1, -2)
    return seq_idx


def make_case(seed, batch, dim, seqlen, width, bias, seq_idx, initial_states):
    """Random float64 arrays for one problem; None for the features that are off."""
    rng = np.random.default_rng(seed)
    return {
        "x": rng.standard_normal((batch, dim, seqlen)),
        "weight": rng.standard_normal((dim, width)),
        "bias": rng.standard_normal(dim) if bias else None,
        "seq_idx": make_seq_idx(rng, batch, seqlen) if seq_idx else None,
        "initial_states": (
            rng.standard_normal((batch, dim, width - 1)) if initial_states else None
        ),
    }


SHAPES = [
    pytest.param((3, 3, 12, 4), id="batch3-dim3-seqlen12-width4"),
    pytest.param((3, 2, 9, 3), id="batch3-dim2-seqlen9-width3"),
    pytest.param((3, 2, 2, 5), id="batch3-dim2-seqlen2-width5-seqlen-lt-width-1"),
    pytest.param((3, 2, 7, 1), id="batch3-dim2-seqlen7-width1"),
    pytest.param((2, 2, 1, 4), id="batch2-dim2-seqlen1-width4"),
]

FEATURE_NAMES = ("bias", "silu", "seq_idx", "initial_states", "final_states")
FEATURES = [
    pytest.param(
        flags, id="-".join(n for n, f in zip(FEATURE_NAMES, flags, strict=True) if f) or "plain"
    )
    for flags in itertools.product((False, True), repeat=len(FEATURE_NAMES))
]


# --------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("features", FEATURES)
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_matches_scalar_loops(shape, features):
    bias, silu, seq_idx, initial_states, final_states = features
    case = make_case(0, *shape, bias, seq_idx, initial_states)
    want_out, want_final = forward_loop(**case, silu=silu)
    got = ref.causal_conv1d_fn(
        **case, return_final_states=final_states, activation="silu" if silu else None
    )
    if final_states:
        got_out, got_final = got
        assert_close(got_final, want_final, name="final_states")
    else:
        got_out = got
    assert got_out.dtype == np.float64
    assert_close(got_out, want_out, name="out")


@pytest.mark.parametrize(
    ("batch", "dim", "seqlen", "width"),
    [
        pytest.param(2, 4, 16, 4, id="batch2-dim4-seqlen16-width4"),
        pytest.param(1, 3, 5, 8, id="batch1-dim3-seqlen5-width8"),
        pytest.param(2, 2, 33, 1, id="batch2-dim2-seqlen33-width1"),
    ],
)
def test_forward_matches_numpy_convolve(batch, dim, seqlen, width):
    case = make_case(1, batch, dim, seqlen, width, True, False, False)
    x, weight, bias = case["x"], case["weight"], case["bias"]
    want = np.empty_like(x)
    for b, c in itertools.product(range(batch), range(dim)):
        # convolve flips its kernel; weight is ordered oldest tap first, so flip it back.
        want[b, c] = np.convolve(x[b, c], weight[c, ::-1])[:seqlen] + bias[c]
    assert_close(ref.causal_conv1d_fn(x, weight, bias), want)


def test_swish_is_silu():
    case = make_case(2, 2, 3, 10, 4, True, True, True)
    silu = ref.causal_conv1d_fn(**case, activation="silu")
    swish = ref.causal_conv1d_fn(**case, activation="swish")
    plain = ref.causal_conv1d_fn(**case)
    np.testing.assert_array_equal(silu, swish)
    assert_close(silu, ref.silu(plain))


def test_silu_is_stable_for_large_inputs():
    z = np.array([-1000.0, -30.0, 0.0, 30.0, 1000.0])
    with np.errstate(over="raise", invalid="raise", divide="raise"):  # underflow is fine
        got = ref.silu(z)
    np.testing.assert_allclose(got, [0.0, -30.0 / (1.0 + math.exp(30.0)), 0.0, 30.0, 1000.0])


def test_single_segment_seq_idx_equals_no_seq_idx():
    case = make_case(3, 2, 3, 11, 4, True, False, True)
    plain = ref.causal_conv1d_fn(**case, return_final_states=True)
    with_ids = ref.causal_conv1d_fn(
        **case | {"seq_idx": np.full((2, 11), 7)}, return_final_states=True
    )
    for got, want in zip(with_ids, plain, strict=True):
        np.testing.assert_array_equal(got, want)


def test_segments_do_not_leak():
    case = make_case(4, 1, 2, 10, 4, True, False, True)
    seq_idx = np.array([[0, 0, 0, 0, 1, 1, 1, 1, 1, 1]])
    before = ref.causal_conv1d_fn(**case | {"seq_idx": seq_idx})
    case["x"][..., :4] += 100.0  # the first segment only
    case["initial_states"] += 100.0
    after = ref.causal_conv1d_fn(**case | {"seq_idx": seq_idx})
    np.testing.assert_array_equal(after[..., 4:], before[..., 4:])
    assert np.all(after[..., :4] != before[..., :4])


def test_padding_outputs_and_final_states_are_zero():
    case = make_case(5, 2, 3, 8, 4, True, False, True)
    seq_idx = np.array([[0, 0, 0, -1, 1, 1, -1, -1], [-1, -1, 0, 0, 0, 0, 0, 0]])
    out, final_states = ref.causal_conv1d_fn(
        **case | {"seq_idx": seq_idx}, return_final_states=True, activation="silu"
    )
    np.testing.assert_array_equal(out[0, :, [3, 6, 7]], 0.0)
    np.testing.assert_array_equal(out[1, :, :2], 0.0)
    assert np.all(out[0, :, :3] != 0.0)
    assert np.all(out[1, :, 2:] != 0.0)
    np.testing.assert_array_equal(final_states[0], 0.0)  # the last token is padding
    np.testing.assert_array_equal(final_states[1], case["x"][1, :, -3:])


def test_final_states_reach_into_initial_states_when_short():
    case = make_case(6, 2, 3, 2, 5, False, False, True)  # seqlen 2 < width-1 = 4
    _, final_states = ref.causal_conv1d_fn(**case, return_final_states=True)
    want = np.concatenate([case["initial_states"][..., 2:], case["x"]], axis=2)
    np.testing.assert_array_equal(final_states, want)


def test_empty_seqlen():
    case = make_case(7, 2, 3, 0, 4, True, False, True)
    out, final_states = ref.causal_conv1d_fn(**case, return_final_states=True)
    assert out.shape == (2, 3, 0)
    np.testing.assert_array_equal(final_states, case["initial_states"])


@pytest.mark.parametrize(
    "dtype", [np.float16, np.float32, ml_dtypes.bfloat16], ids=["float16", "float32", "bfloat16"]
)
def test_low_precision_inputs_are_upcast(dtype):
    case = make_case(8, 2, 3, 9, 4, True, True, True)
    low = {k: v if k == "seq_idx" else v.astype(dtype) for k, v in case.items()}
    up = {k: v if k == "seq_idx" else v.astype(np.float64) for k, v in low.items()}
    got = ref.causal_conv1d_fn(**low, return_final_states=True, activation="silu")
    want = ref.causal_conv1d_fn(**up, return_final_states=True, activation="silu")
    for g, w in zip(got, want, strict=True):
        assert g.dtype == np.float64
        np.testing.assert_array_equal(g, w)


def test_inputs_are_not_modified_and_outputs_are_new():
    case = make_case(9, 2, 3, 9, 4, True, True, True)
    dout = np.ones((2, 3, 9))
    dfinal = np.ones((2, 3, 3))
    conv_state = np.ones((2, 3, 5))
    saved = {k: v.copy() for k, v in case.items()} | {"conv_state": conv_state.copy()}
    out, final_states = ref.causal_conv1d_fn(**case, return_final_states=True)
    grads = ref.causal_conv1d_bwd(
        case["x"], case["weight"], case["bias"], dout, case["seq_idx"],
        case["initial_states"], dfinal,
    )  # fmt: skip
    _, new_state = ref.causal_conv1d_update(case["x"][..., :2], conv_state, case["weight"])
    for name, value in saved.items():
        current = conv_state if name == "conv_state" else case[name]
        np.testing.assert_array_equal(current, value, err_msg=name)
    inputs = [*case.values(), dout, dfinal, conv_state]
    for result in (out, final_states, *grads, new_state):
        assert not any(np.shares_memory(result, a) for a in inputs)


def test_unknown_activation_is_refused():
    case = make_case(10, 1, 2, 4, 3, False, False, False)
    with pytest.raises(ValueError, match="activation"):
        ref.causal_conv1d_fn(**case, activation="relu")


# --------------------------------------------------------------------------------------------
# Backward, against central finite differences
# --------------------------------------------------------------------------------------------


def numeric_grad(f, a, eps=1e-6):
    """Central differences of the scalar function f at every element of a."""
    grad = np.zeros_like(a)
    for i in np.ndindex(a.shape):
        plus, minus = a.copy(), a.copy()
        plus[i] += eps
        minus[i] -= eps
        grad[i] = (f(plus) - f(minus)) / (2 * eps)
    return grad


def backward_case(name, shape, *, bias=True, seq_idx, initial=True, dfinal, silu):
    cfg = {"shape": shape, "bias": bias, "seq_idx": seq_idx, "initial": initial}
    return pytest.param(cfg | {"dfinal": dfinal, "silu": silu}, id=name)


BACKWARD_CASES = [
    backward_case(
        "-".join(
            ["batch3-dim2-seqlen9-width4"]
            + ["seq_idx"] * seq_idx
            + ["silu"] * silu
            + ["dfinal_states"] * dfinal
        ),
        (3, 2, 9, 4),
        seq_idx=seq_idx,
        dfinal=dfinal,
        silu=silu,
    )
    for seq_idx, silu, dfinal in itertools.product((False, True), repeat=3)
] + [
    backward_case(
        "no-bias-no-initial_states-seq_idx-silu-dfinal_states",
        (2, 3, 8, 3),
        bias=False,
        seq_idx=True,
        initial=False,
        dfinal=True,
        silu=True,
    ),
    backward_case(
        "seqlen2-lt-width-1-seq_idx-silu-dfinal_states",
        (3, 2, 2, 5),
        seq_idx=True,
        dfinal=True,
        silu=True,
    ),
    backward_case(
        "seqlen2-lt-width-1-dfinal_states", (2, 2, 2, 5), seq_idx=False, dfinal=True, silu=False
    ),
    backward_case("width1-seq_idx-silu", (3, 2, 6, 1), seq_idx=True, dfinal=True, silu=True),
]


@pytest.mark.parametrize("cfg", BACKWARD_CASES)
def test_backward_matches_finite_differences(cfg):
    case = make_case(11, *cfg["shape"], cfg["bias"], cfg["seq_idx"], cfg["initial"])
    batch, dim, seqlen, width = cfg["shape"]
    rng = np.random.default_rng(12)
    dout = rng.standard_normal((batch, dim, seqlen))
    dfinal = rng.standard_normal((batch, dim, width - 1)) if cfg["dfinal"] else None
    activation = "silu" if cfg["silu"] else None

    def loss(**change):
        args = case | change
        if dfinal is None:
            return np.sum(ref.causal_conv1d_fn(**args, activation=activation) * dout)
        out, final_states = ref.causal_conv1d_fn(
            **args, return_final_states=True, activation=activation
        )
        return np.sum(out * dout) + np.sum(final_states * dfinal)

    dx, dweight, dbias, dinitial = ref.causal_conv1d_bwd(
        case["x"], case["weight"], case["bias"], dout, case["seq_idx"],
        case["initial_states"], dfinal, activation,
    )  # fmt: skip
    tol = {"rtol": 1e-6, "atol": 1e-7}
    assert_close(dx, numeric_grad(lambda a: loss(x=a), case["x"]), **tol, name="dx")
    assert_close(
        dweight, numeric_grad(lambda a: loss(weight=a), case["weight"]), **tol, name="dweight"
    )
    if cfg["bias"]:
        assert_close(dbias, numeric_grad(lambda a: loss(bias=a), case["bias"]), **tol, name="dbias")
    else:
        assert dbias is None
    if cfg["initial"]:
        want = numeric_grad(lambda a: loss(initial_states=a), case["initial_states"])
        assert_close(dinitial, want, **tol, name="dinitial_states")
    else:
        assert dinitial is None
    assert np.abs(dx).max() > 1e-3  # the check above compared something


def test_backward_masked_taps_contribute_nothing_to_dweight():
    """A non-finite dz meets masked taps (inputs of another segment) and reaches only the
    dweight terms of its visible taps: the masked ones are selected out, not inf * 0 = NaN."""
    x = np.array([[[0.5, -1.0, 2.0, 1.5, -0.25, 0.75]]])
    weight = np.array([[0.3, -0.2, 0.6]])
    seq_idx = np.array([[0, 0, 0, 1, 1, 1]])
    dout = np.array([[[1.0, 2.0, -1.0, np.inf, 0.5, -2.0]]])
    _, dweight, dbias, _ = ref.causal_conv1d_bwd(x, weight, np.zeros(1), dout, seq_idx)
    # dweight[k] = sum over t of dout[t] x[t - 2 + k], where t - 2 + k is in t's segment
    want = [
        sum(dout[0, 0, t] * x[0, 0, s] for t in range(6) for s in [t - 2 + k]
            if s >= 0 and seq_idx[0, s] == seq_idx[0, t])
        for k in range(3)
    ]  # fmt: skip
    assert np.isfinite(want[:2]).all() and want[2] == np.inf
    assert_close(dweight[0, :2], np.array(want[:2]), rtol=1e-12, atol=0, name="dweight")
    assert dweight[0, 2] == np.inf
    assert dbias[0] == np.inf


# --------------------------------------------------------------------------------------------
# Update, against the forward on the concatenated history
# --------------------------------------------------------------------------------------------


def update_row_expected(state_row, x_row, weight, bias, activation, cache_seqlen=None):
    """(out_row [dim, seqlen], new_state_row [dim, state_len]) for one batch row.

    The state row is unrolled into a time-ordered history (oldest first), the forward runs on
    concat(history, x) with no initial states, and the new state is the last state_len entries
    of that concatenation, rolled back into the circular buffer in circular mode.
    """
    state_len = state_row.shape[1]
    seqlen = x_row.shape[1]
    if cache_seqlen is None:
        history = state_row
    else:
        p = cache_seqlen % state_len if state_len else 0  # the oldest entry: the next write
        history = state_row[:, (p + np.arange(state_len)) % state_len]
    both = np.concatenate([history, x_row], axis=1)
    out = ref.causal_conv1d_fn(both[None], weight, bias, activation=activation)[0, :, state_len:]
    new_linear = both[:, seqlen:]
    if cache_seqlen is None:
        return out, new_linear
    new_state = np.empty_like(state_row)
    new_state[:, (p + seqlen + np.arange(state_len)) % state_len] = new_linear
    return out, new_state


UPDATE_SHAPES = [  # (width, state_len, seqlen)
    pytest.param(4, 3, 1, id="width4-state_len3-seqlen1"),
    pytest.param(4, 3, 5, id="width4-state_len3-seqlen5-seqlen-gt-state_len"),
    pytest.param(4, 7, 4, id="width4-state_len7-seqlen4"),
    pytest.param(3, 12, 5, id="width3-state_len12-seqlen5"),
    pytest.param(2, 4, 9, id="width2-state_len4-seqlen9-seqlen-gt-state_len"),
    pytest.param(1, 0, 3, id="width1-state_len0-seqlen3"),
    pytest.param(1, 2, 3, id="width1-state_len2-seqlen3"),
]
MODES = [pytest.param(False, id="sliding"), pytest.param(True, id="circular")]
ACTIVATIONS = [pytest.param(None, id="identity"), pytest.param("silu", id="silu")]


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("circular", MODES)
@pytest.mark.parametrize(("width", "state_len", "seqlen"), UPDATE_SHAPES)
def test_update_matches_forward_on_history(width, state_len, seqlen, circular, activation):
    batch, dim = 3, 4
    rng = np.random.default_rng(13)
    x = rng.standard_normal((batch, dim, seqlen))
    conv_state = rng.standard_normal((batch, dim, state_len))
    weight = rng.standard_normal((dim, width))
    bias = rng.standard_normal(dim)
    cache_seqlens = np.array([0, 5, 17], dtype=np.int32) if circular else None
    out, new_state = ref.causal_conv1d_update(
        x, conv_state, weight, bias, activation, cache_seqlens=cache_seqlens
    )
    assert out.shape == x.shape
    assert new_state.shape == conv_state.shape
    for b in range(batch):
        want_out, want_state = update_row_expected(
            conv_state[b], x[b], weight, bias, activation,
            None if cache_seqlens is None else int(cache_seqlens[b]),
        )  # fmt: skip
        assert_close(out[b], want_out, name=f"out[{b}]")
        np.testing.assert_array_equal(new_state[b], want_state, err_msg=f"conv_state[{b}]")


@pytest.mark.parametrize("circular", MODES)
def test_update_pool_rows_with_padding(circular):
    pool, dim, width, state_len, seqlen = 5, 3, 4, 6, 2
    rng = np.random.default_rng(14)
    x = rng.standard_normal((3, dim, seqlen))
    conv_state = rng.standard_normal((pool, dim, state_len))
    weight = rng.standard_normal((dim, width))
    indices = np.array([3, -1, 0], dtype=np.int32)
    cache_seqlens = np.array([4, 9, 11], dtype=np.int32) if circular else None
    out, new_state = ref.causal_conv1d_update(
        x, conv_state, weight, None, "silu", cache_seqlens, indices
    )
    np.testing.assert_array_equal(out[1], 0.0)  # padding row
    for row in (1, 2, 4):  # no index refers to these rows
        np.testing.assert_array_equal(new_state[row], conv_state[row])
    for b, row in ((0, 3), (2, 0)):
        want_out, want_state = update_row_expected(
            conv_state[row], x[b], weight, None, "silu",
            None if cache_seqlens is None else int(cache_seqlens[b]),
        )  # fmt: skip
        assert_close(out[b], want_out, name=f"out[{b}]")
        np.testing.assert_array_equal(new_state[row], want_state)
        assert not np.array_equal(new_state[row], conv_state[row])


@pytest.mark.parametrize("circular", MODES)
def test_update_two_dimensional_x_is_one_token(circular):
    batch, dim, width, state_len = 2, 3, 4, 5
    rng = np.random.default_rng(15)
    x = rng.standard_normal((batch, dim))
    conv_state = rng.standard_normal((batch, dim, state_len))
    weight = rng.standard_normal((dim, width))
    cache_seqlens = np.array([2, 8]) if circular else None
    out2, state2 = ref.causal_conv1d_update(x, conv_state, weight, cache_seqlens=cache_seqlens)
    out3, state3 = ref.causal_conv1d_update(
        x[..., None], conv_state, weight, cache_seqlens=cache_seqlens
    )
    assert out2.shape == (batch, dim)
    np.testing.assert_array_equal(out2, out3[..., 0])
    np.testing.assert_array_equal(state2, state3)
    want_out, want_state = update_row_expected(
        conv_state[1], x[1][:, None], weight, None, None, None if not circular else 8
    )
    assert_close(out2[1], want_out[:, 0])
    np.testing.assert_array_equal(state2[1], want_state)


@pytest.mark.parametrize("circular", MODES)
@pytest.mark.parametrize(
    "state_len", [pytest.param(3, id="state_len3"), pytest.param(6, id="state_len6")]
)
def test_update_token_by_token_equals_one_call(state_len, circular):
    batch, dim, width, seqlen = 2, 3, 4, 8  # seqlen > state_len
    rng = np.random.default_rng(16)
    x = rng.standard_normal((batch, dim, seqlen))
    conv_state = rng.standard_normal((batch, dim, state_len))
    weight = rng.standard_normal((dim, width))
    bias = rng.standard_normal(dim)
    cache_seqlens = np.array([1, 10]) if circular else None
    out_all, state_all = ref.causal_conv1d_update(
        x, conv_state, weight, bias, "silu", cache_seqlens
    )
    state = conv_state
    outs = []
    for i in range(seqlen):
        step_seqlens = None if cache_seqlens is None else cache_seqlens + i
        out_i, state = ref.causal_conv1d_update(
            x[..., i], state, weight, bias, "silu", step_seqlens
        )
        outs.append(out_i)
    assert_close(np.stack(outs, axis=-1), out_all)
    np.testing.assert_array_equal(state, state_all)


def test_update_continues_forward_final_states():
    batch, dim, width, seqlen, split = 2, 3, 4, 10, 6
    case = make_case(17, batch, dim, seqlen, width, True, False, True)
    full_out, full_final = ref.causal_conv1d_fn(**case, return_final_states=True)
    head = case | {"x": case["x"][..., :split]}
    _, head_final = ref.causal_conv1d_fn(**head, return_final_states=True)
    tail_out, tail_state = ref.causal_conv1d_update(
        case["x"][..., split:], head_final, case["weight"], case["bias"]
    )
    assert_close(tail_out, full_out[..., split:])
    np.testing.assert_array_equal(tail_state, full_final)


# --------------------------------------------------------------------------------------------
# Varlen states
# --------------------------------------------------------------------------------------------

VARLEN_CU_SEQLENS = [0, 5, 5, 7, 19, 20]  # lengths 5, 0, 2, 12, 1


@pytest.mark.parametrize("state_len", [0, 1, 3, 4, 8], ids=lambda n: f"state_len{n}")
def test_varlen_states_match_slice_definition(state_len):
    rng = np.random.default_rng(18)
    dim = 3
    x = rng.standard_normal((VARLEN_CU_SEQLENS[-1], dim))
    cu_seqlens = np.array(VARLEN_CU_SEQLENS, dtype=np.int32)
    states = ref.causal_conv1d_varlen_states(x, cu_seqlens, state_len)
    count = len(cu_seqlens) - 1
    want = np.zeros((count, dim, state_len))
    for n in range(count):
        end, length = cu_seqlens[n + 1], cu_seqlens[n + 1] - cu_seqlens[n]
        for i in range(min(length, state_len)):  # i-th token from the end, right-aligned
            want[n, :, state_len - 1 - i] = x[end - 1 - i, :]
    np.testing.assert_array_equal(states, want)


def test_varlen_states_are_per_sequence_final_states():
    rng = np.random.default_rng(19)
    dim, width = 3, 5
    x = rng.standard_normal((VARLEN_CU_SEQLENS[-1], dim))
    weight = rng.standard_normal((dim, width))
    states = ref.causal_conv1d_varlen_states(x, VARLEN_CU_SEQLENS, width - 1)
    for n, (start, end) in enumerate(itertools.pairwise(VARLEN_CU_SEQLENS)):
        sequence = x[start:end].T[None]  # [1, dim, len_n]
        _, final_states = ref.causal_conv1d_fn(sequence, weight, return_final_states=True)
        np.testing.assert_array_equal(states[n], final_states[0], err_msg=f"sequence {n}")


# --------------------------------------------------------------------------------------------
# torch, where importable
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("batch", "dim", "seqlen", "width"),
    [
        pytest.param(2, 5, 37, 4, id="batch2-dim5-seqlen37-width4"),
        pytest.param(1, 3, 3, 7, id="batch1-dim3-seqlen3-width7"),
        pytest.param(2, 4, 20, 1, id="batch2-dim4-seqlen20-width1"),
    ],
)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_forward_matches_torch_conv1d(batch, dim, seqlen, width, activation, bias):
    torch = pytest.importorskip("torch")
    functional = torch.nn.functional
    case = make_case(20, batch, dim, seqlen, width, bias, False, False)
    x, weight = torch.from_numpy(case["x"]), torch.from_numpy(case["weight"])
    b = None if case["bias"] is None else torch.from_numpy(case["bias"])
    want = functional.conv1d(x, weight.unsqueeze(1), b, padding=width - 1, groups=dim)
    want = want[..., :seqlen]
    if activation:
        want = functional.silu(want)
    assert_close(ref.causal_conv1d_fn(**case, activation=activation), want.numpy())


def torch_forward_with_states(torch, x, weight, bias, initial_states, activation):
    """torch conv1d on concat(initial_states, x) with no padding, and its last width-1 inputs."""
    functional = torch.nn.functional
    width = weight.shape[1]
    history = torch.cat([initial_states, x], dim=2)
    out = functional.conv1d(history, weight.unsqueeze(1), bias, groups=x.shape[1])
    if activation:
        out = functional.silu(out)
    return out, history[..., history.shape[2] - (width - 1) :]


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize(
    "seqlen", [pytest.param(2, id="seqlen2-lt-width-1"), pytest.param(19, id="seqlen19")]
)
def test_forward_and_backward_with_states_match_torch_autograd(seqlen, activation):
    torch = pytest.importorskip("torch")
    batch, dim, width = 2, 3, 5
    case = make_case(21, batch, dim, seqlen, width, True, False, True)
    rng = np.random.default_rng(22)
    dout = rng.standard_normal((batch, dim, seqlen))
    dfinal = rng.standard_normal((batch, dim, width - 1))

    leaves = {
        k: torch.from_numpy(case[k]).requires_grad_()
        for k in ("x", "weight", "bias", "initial_states")
    }
    want_out, want_final = torch_forward_with_states(
        torch, leaves["x"], leaves["weight"], leaves["bias"], leaves["initial_states"], activation
    )
    loss = (want_out * torch.from_numpy(dout)).sum() + (want_final * torch.from_numpy(dfinal)).sum()
    loss.backward()

    out, final_states = ref.causal_conv1d_fn(
        **case, return_final_states=True, activation=activation
    )
    assert_close(out, want_out.detach().numpy(), name="out")
    assert_close(final_states, want_final.detach().numpy(), name="final_states")
    grads = ref.causal_conv1d_bwd(
        case["x"], case["weight"], case["bias"], dout, None, case["initial_states"], dfinal,
        activation,
    )  # fmt: skip
    for name, got in zip(("x", "weight", "bias", "initial_states"), grads, strict=True):
        assert_close(got, leaves[name].grad.numpy(), name=f"d{name}")
