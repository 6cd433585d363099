"""The bad-input table of docs/semantics.md ("Inputs and their checks"), row by row, for the
four public functions, on CPU arrays (no GPU needed).

Every refused call must raise the documented exception type with a message that names the
offending argument (and, for a mismatch, the argument it disagrees with), before anything is
written. Devices are checked with a small fake CUDA array (``FakeCudaArray``) that exposes only
metadata, so "CPU mixed with GPU" and "two GPUs" are tested on any machine.

Each case is one call: the valid arguments of ``valid_args(op)`` with a few replaced.
"""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest
from fakes import FakeCudaArray

import cupyconv
from cupyconv import reference
from cupyconv.testing import assert_close

BATCH, DIM, SEQLEN, WIDTH = 2, 4, 6, 3
STATE_LEN = WIDTH + 1  # conv_state's state_len in the update cases (>= width - 1)
CU_SEQLENS = [0, 2, 5]  # two packed sequences of a 5-token varlen x

OPS = {
    "fn": cupyconv.causal_conv1d_fn,
    "bwd": cupyconv.causal_conv1d_bwd,
    "update": cupyconv.causal_conv1d_update,
    "varlen": cupyconv.causal_conv1d_varlen_states,
}


def _rand(*shape, dtype=np.float32):
    rng = np.random.default_rng(sum(shape) + len(shape))
    return rng.standard_normal(shape).astype(dtype)


def valid_args(op: str) -> dict:
    """Arguments every check applies to (all optional arrays present) that ``op`` accepts."""
    x = _rand(BATCH, DIM, SEQLEN)
    weight = _rand(DIM, WIDTH)
    bias = _rand(DIM)
    seq_idx = np.array([[0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 2, 2]], np.int32)
    states = _rand(BATCH, DIM, WIDTH - 1)
    if op == "fn":
        return dict(
            x=x,
            weight=weight,
            bias=bias,
            seq_idx=seq_idx,
            initial_states=states,
            return_final_states=True,
            final_states_out=np.full_like(states, np.nan),
            activation="silu",
            out=np.full_like(x, np.nan),
        )
    if op == "bwd":
        return dict(
            x=x,
            weight=weight,
            bias=bias,
            dout=_rand(BATCH, DIM, SEQLEN, dtype=np.float32) + 1,
            seq_idx=seq_idx,
            initial_states=states,
            dfinal_states=states + 1,
            dx=np.full_like(x, np.nan),
            return_dinitial_states=True,
            activation="silu",
        )
    if op == "update":
        return dict(
            x=x,
            conv_state=_rand(BATCH, DIM, STATE_LEN),
            weight=weight,
            bias=bias,
            activation="silu",
            cache_seqlens=np.array([3, 7], np.int32),
            conv_state_indices=np.array([1, 0], np.int32),
        )
    return dict(
        x=_rand(CU_SEQLENS[-1], DIM), cu_seqlens=np.array(CU_SEQLENS, np.int32), state_len=3
    )


def case(op, case_id, exc, patterns, marks=(), **replace):
    """One refused call: ``op`` with ``replace`` applied to its valid arguments must raise
    ``exc`` whose message matches every regex in ``patterns``."""
    return pytest.param(op, replace, exc, patterns, id=f"{op}-{case_id}", marks=marks)


def check_refused(op, replace, exc, patterns):
    args = valid_args(op)
    args.update(replace)
    with pytest.raises(exc, match=patterns[0]) as info:
        OPS[op](**args)
    message = str(info.value)
    for pattern in patterns[1:]:
        assert re.search(pattern, message), f"{pattern!r} not in message {message!r}"
    assert type(info.value) is exc, f"expected exactly {exc.__name__}; got {info.type.__name__}"
    return info.value


@pytest.mark.parametrize("op", OPS)
def test_valid_arguments_are_accepted(op):
    """The base of every case below is a valid call, so each refusal is due to its one change."""
    OPS[op](**valid_args(op))


# ---- wrong number of dimensions ------------------------------------------------------------

# op -> {argument: its number of dimensions}
NDIMS = {
    "fn": dict(x=3, weight=2, bias=1, seq_idx=2, initial_states=3, final_states_out=3, out=3),
    "bwd": dict(x=3, weight=2, bias=1, dout=3, seq_idx=2, initial_states=3, dfinal_states=3, dx=3),
    "update": dict(x=3, conv_state=3, weight=2, bias=1, cache_seqlens=1, conv_state_indices=1),
    "varlen": dict(x=2, cu_seqlens=1),
}


def _ndim_cases():
    for op, ndims in NDIMS.items():
        for name in ndims:
            good = valid_args(op)[name]
            for label, bad in (("extra-dim", good[None]), ("missing-dim", good[0, ...])):
                if bad.ndim == 2 and op == "update" and name == "x":
                    continue  # a 2-D x is one token: valid
                want = "2 or 3" if op == "update" and name == "x" else str(good.ndim)
                yield case(
                    op,
                    f"{name}-{label}",
                    ValueError,
                    [rf"^{name} must have {want} dimensions", re.escape(str(bad.shape))],
                    **{name: bad},
                )


NDIM_CASES = list(_ndim_cases()) + [
    case(
        "update", "x-1d", ValueError, [r"^x must have 2 or 3 dimensions", r"\(4,\)"], x=_rand(DIM)
    ),
]


@pytest.mark.parametrize(("op", "replace", "exc", "patterns"), NDIM_CASES)
def test_wrong_number_of_dimensions(op, replace, exc, patterns):
    check_refused(op, replace, exc, patterns)


# ---- sizes that disagree between arguments: the message names both --------------------------

X = r"\bx\b"  # the message names x (the other argument of most mismatches)
BAD_STATES = _rand(BATCH, DIM, WIDTH)  # width instead of width - 1

MISMATCH_CASES = [
    # forward
    case(
        "fn",
        "weight-dim",
        ValueError,
        [r"^weight", X, r"x\.shape\[1\]", r"\(5, 3\)"],
        weight=_rand(DIM + 1, WIDTH),
    ),
    case(
        "fn", "bias-dim", ValueError, [r"^bias", r"x\.shape\[1\]", r"\(5,\)"], bias=_rand(DIM + 1)
    ),
    case(
        "fn",
        "seq_idx-batch",
        ValueError,
        [r"^seq_idx", X, r"\(3, 6\)"],
        seq_idx=np.zeros((BATCH + 1, SEQLEN), np.int32),
    ),
    case(
        "fn",
        "seq_idx-seqlen",
        ValueError,
        [r"^seq_idx", X, r"\(2, 5\)"],
        seq_idx=np.zeros((BATCH, SEQLEN - 1), np.int32),
    ),
    case(
        "fn",
        "initial_states-width",
        ValueError,
        [r"^initial_states", X, r"weight"],
        initial_states=BAD_STATES,
    ),
    case(
        "fn",
        "initial_states-batch",
        ValueError,
        [r"^initial_states", X, r"weight"],
        initial_states=_rand(1, DIM, WIDTH - 1),
    ),
    case(
        "fn",
        "initial_states-dim",
        ValueError,
        [r"^initial_states", X, r"weight"],
        initial_states=_rand(BATCH, DIM - 1, WIDTH - 1),
    ),
    case(
        "fn",
        "final_states_out-width",
        ValueError,
        [r"^final_states_out", X, r"weight"],
        final_states_out=BAD_STATES.copy(),
    ),
    case(
        "fn",
        "out-seqlen",
        ValueError,
        [r"^out", X, r"\(2, 4, 7\)"],
        out=_rand(BATCH, DIM, SEQLEN + 1),
    ),
    case("fn", "out-dim", ValueError, [r"^out", X], out=_rand(BATCH, DIM + 1, SEQLEN)),
    # backward
    case(
        "bwd",
        "weight-dim",
        ValueError,
        [r"^weight", r"x\.shape\[1\]"],
        weight=_rand(DIM + 1, WIDTH),
    ),
    case("bwd", "bias-dim", ValueError, [r"^bias", r"x\.shape\[1\]"], bias=_rand(DIM - 1)),
    case(
        "bwd",
        "dout-seqlen",
        ValueError,
        [r"^dout", X, r"\(2, 4, 5\)"],
        dout=_rand(BATCH, DIM, SEQLEN - 1),
    ),
    case("bwd", "dout-batch", ValueError, [r"^dout", X], dout=_rand(1, DIM, SEQLEN)),
    case(
        "bwd",
        "seq_idx-seqlen",
        ValueError,
        [r"^seq_idx", X],
        seq_idx=np.zeros((BATCH, SEQLEN + 1), np.int64),
    ),
    case(
        "bwd",
        "initial_states-width",
        ValueError,
        [r"^initial_states", X, r"weight"],
        initial_states=BAD_STATES,
    ),
    case(
        "bwd",
        "dfinal_states-width",
        ValueError,
        [r"^dfinal_states", X, r"weight"],
        dfinal_states=BAD_STATES,
    ),
    case(
        "bwd",
        "dfinal_states-dim",
        ValueError,
        [r"^dfinal_states", X, r"weight"],
        dfinal_states=_rand(BATCH, DIM + 1, WIDTH - 1),
    ),
    case("bwd", "dx-seqlen", ValueError, [r"^dx", X], dx=_rand(BATCH, DIM, SEQLEN + 1)),
    # update
    case(
        "update",
        "weight-dim",
        ValueError,
        [r"^weight", r"x\.shape\[1\]"],
        weight=_rand(DIM + 1, WIDTH),
    ),
    case("update", "bias-dim", ValueError, [r"^bias", r"x\.shape\[1\]"], bias=_rand(DIM + 1)),
    case(
        "update",
        "cache_seqlens-batch",
        ValueError,
        [r"^cache_seqlens", X, r"\(3,\)"],
        cache_seqlens=np.zeros(BATCH + 1, np.int32),
    ),
    case(
        "update",
        "conv_state_indices-batch",
        ValueError,
        [r"^conv_state_indices", X],
        conv_state_indices=np.zeros(BATCH - 1, np.int32),
    ),
    case(
        "update",
        "conv_state-dim",
        ValueError,
        [r"^conv_state", r"\(2, 5, 4\)"],
        conv_state=_rand(BATCH, DIM + 1, STATE_LEN),
    ),
    case(
        "update",
        "conv_state-batch",
        ValueError,
        [r"^conv_state", r"\(3, 4, 4\)"],
        conv_state=_rand(BATCH + 1, DIM, STATE_LEN),
        conv_state_indices=None,
    ),
    case(
        "update",
        "conv_state-dim-names-x",
        ValueError,
        [r"^conv_state", X],
        conv_state=_rand(BATCH, DIM + 1, STATE_LEN),
    ),
    case(
        "update",
        "conv_state-batch-names-x",
        ValueError,
        [r"^conv_state", X],
        conv_state=_rand(BATCH + 1, DIM, STATE_LEN),
        conv_state_indices=None,
    ),
    # conv_state shorter than width - 1 (width 5 needs state_len >= 4; it has 3)
    case(
        "update",
        "conv_state-shorter-than-width",
        ValueError,
        [r"^conv_state", r"width - 1 = 4", r"got 3\b"],
        conv_state=_rand(BATCH, DIM, 3),
        weight=_rand(DIM, 5),
    ),
]


@pytest.mark.parametrize(("op", "replace", "exc", "patterns"), MISMATCH_CASES)
def test_mismatched_sizes(op, replace, exc, patterns):
    check_refused(op, replace, exc, patterns)


def test_pool_may_have_more_rows_than_batch():
    """With conv_state_indices, conv_state's first size is the pool size, not batch."""
    args = valid_args("update")
    args["conv_state"] = _rand(7, DIM, STATE_LEN)
    args["conv_state_indices"] = np.array([6, -1], np.int32)
    cupyconv.causal_conv1d_update(**args)


# ---- dtypes --------------------------------------------------------------------------------

FLOATS = r"float32, float16, bfloat16, float64"
INTS = r"int32, int64"

DTYPE_CASES = [
    case(
        "fn",
        "x-int32",
        TypeError,
        [r"^x must have dtype", FLOATS, r"got int32"],
        x=np.ones((BATCH, DIM, SEQLEN), np.int32),
    ),
    case(
        "fn",
        "x-complex64",
        TypeError,
        [r"^x must have dtype", r"got complex64"],
        x=np.ones((BATCH, DIM, SEQLEN), np.complex64),
    ),
    case(
        "fn",
        "x-bool",
        TypeError,
        [r"^x must have dtype", r"got bool"],
        x=np.ones((BATCH, DIM, SEQLEN), bool),
    ),
    case(
        "fn",
        "weight-int64",
        TypeError,
        [r"^weight must have dtype", r"got int64"],
        weight=np.ones((DIM, WIDTH), np.int64),
    ),
    case(
        "fn",
        "bias-int32",
        TypeError,
        [r"^bias must have dtype", r"got int32"],
        bias=np.ones(DIM, np.int32),
    ),
    case(
        "fn",
        "initial_states-uint8",
        TypeError,
        [r"^initial_states must have dtype"],
        initial_states=np.ones((BATCH, DIM, WIDTH - 1), np.uint8),
    ),
    case(
        "fn",
        "seq_idx-float32",
        TypeError,
        [r"^seq_idx must have dtype", INTS, r"float32"],
        seq_idx=np.zeros((BATCH, SEQLEN), np.float32),
    ),
    case(
        "fn",
        "seq_idx-int16",
        TypeError,
        [r"^seq_idx must have dtype", INTS, r"int16"],
        seq_idx=np.zeros((BATCH, SEQLEN), np.int16),
    ),
    case(
        "fn",
        "seq_idx-uint32",
        TypeError,
        [r"^seq_idx must have dtype", r"uint32"],
        seq_idx=np.zeros((BATCH, SEQLEN), np.uint32),
    ),
    case(
        "bwd",
        "x-int32",
        TypeError,
        [r"^x must have dtype", r"got int32"],
        x=np.ones((BATCH, DIM, SEQLEN), np.int32),
    ),
    case(
        "bwd",
        "weight-int32",
        TypeError,
        [r"^weight must have dtype"],
        weight=np.ones((DIM, WIDTH), np.int32),
    ),
    case(
        "bwd",
        "dout-int64",
        TypeError,
        [r"^dout must have dtype"],
        dout=np.ones((BATCH, DIM, SEQLEN), np.int64),
    ),
    case(
        "bwd",
        "dout-complex128",
        TypeError,
        [r"^dout must have dtype"],
        dout=np.ones((BATCH, DIM, SEQLEN), np.complex128),
    ),
    case(
        "bwd",
        "seq_idx-float64",
        TypeError,
        [r"^seq_idx must have dtype", INTS],
        seq_idx=np.zeros((BATCH, SEQLEN)),
    ),
    case(
        "update",
        "x-int32",
        TypeError,
        [r"^x must have dtype", r"got int32"],
        x=np.ones((BATCH, DIM, SEQLEN), np.int32),
    ),
    case(
        "update",
        "weight-int32",
        TypeError,
        [r"^weight must have dtype"],
        weight=np.ones((DIM, WIDTH), np.int32),
    ),
    case(
        "update",
        "conv_state-int32",
        TypeError,
        [r"^conv_state must have dtype"],
        conv_state=np.ones((BATCH, DIM, STATE_LEN), np.int32),
    ),
    case(
        "update",
        "cache_seqlens-float32",
        TypeError,
        [r"^cache_seqlens must have dtype", INTS],
        cache_seqlens=np.zeros(BATCH, np.float32),
    ),
    case(
        "update",
        "cache_seqlens-uint64",
        TypeError,
        [r"^cache_seqlens must have dtype"],
        cache_seqlens=np.zeros(BATCH, np.uint64),
    ),
    case(
        "update",
        "conv_state_indices-float64",
        TypeError,
        [r"^conv_state_indices must have dtype", INTS],
        conv_state_indices=np.zeros(BATCH),
    ),
    case(
        "update",
        "conv_state_indices-int8",
        TypeError,
        [r"^conv_state_indices must have dtype", r"int8"],
        conv_state_indices=np.zeros(BATCH, np.int8),
    ),
    case(
        "varlen",
        "x-int64",
        TypeError,
        [r"^x must have dtype"],
        x=np.ones((CU_SEQLENS[-1], DIM), np.int64),
    ),
    case(
        "varlen",
        "cu_seqlens-float32",
        TypeError,
        [r"^cu_seqlens must have dtype", INTS],
        cu_seqlens=np.array(CU_SEQLENS, np.float32),
    ),
    case(
        "varlen",
        "cu_seqlens-uint32",
        TypeError,
        [r"^cu_seqlens must have dtype"],
        cu_seqlens=np.array(CU_SEQLENS, np.uint32),
    ),
    # output buffers of a float dtype other than x's: ValueError (wrong buffer, not a bad dtype)
    case(
        "fn",
        "out-float16-for-float32-x",
        ValueError,
        [r"^out must have the dtype of x \(float32\)", r"float16"],
        out=np.zeros((BATCH, DIM, SEQLEN), np.float16),
    ),
    case(
        "fn",
        "out-float64-for-float32-x",
        ValueError,
        [r"^out must have the dtype of x"],
        out=np.zeros((BATCH, DIM, SEQLEN), np.float64),
    ),
    case(
        "fn",
        "final_states_out-bfloat16",
        ValueError,
        [r"^final_states_out must have the dtype of x", r"bfloat16"],
        final_states_out=np.zeros((BATCH, DIM, WIDTH - 1), ml_dtypes.bfloat16),
    ),
    case(
        "bwd",
        "dx-float64-for-float32-x",
        ValueError,
        [r"^dx must have the dtype of x"],
        dx=np.zeros((BATCH, DIM, SEQLEN), np.float64),
    ),
]


@pytest.mark.parametrize(("op", "replace", "exc", "patterns"), DTYPE_CASES)
def test_dtypes(op, replace, exc, patterns):
    check_refused(op, replace, exc, patterns)


@pytest.mark.parametrize(
    ("x_dtype", "weight_dtype", "bias_dtype"),
    [
        (np.float32, np.float16, ml_dtypes.bfloat16),
        (ml_dtypes.bfloat16, np.float32, np.float64),
        (np.float64, np.float32, np.float16),
        (np.float16, ml_dtypes.bfloat16, np.float32),
    ],
    ids=["x-f32-w-f16-b-bf16", "x-bf16-w-f32-b-f64", "x-f64-w-f32-b-f16", "x-f16-w-bf16-b-f32"],
)
def test_the_four_float_dtypes_mix_freely(x_dtype, weight_dtype, bias_dtype):
    out = cupyconv.causal_conv1d_fn(
        _rand(BATCH, DIM, SEQLEN).astype(x_dtype),
        _rand(DIM, WIDTH).astype(weight_dtype),
        _rand(DIM).astype(bias_dtype),
        seq_idx=np.zeros((BATCH, SEQLEN), np.int64),
    )
    assert out.dtype == np.dtype(x_dtype)


def test_torch_dtypes_are_checked():
    torch = pytest.importorskip("torch")
    x = torch.ones(BATCH, DIM, SEQLEN, dtype=torch.int32)
    with pytest.raises(TypeError, match=r"^x must have dtype.*got int32"):
        cupyconv.causal_conv1d_fn(x, torch.ones(DIM, WIDTH))
    with pytest.raises(TypeError, match=r"^weight must have dtype.*got complex64"):
        cupyconv.causal_conv1d_fn(x.float(), torch.ones(DIM, WIDTH, dtype=torch.complex64))
    with pytest.raises(TypeError, match=r"^seq_idx must have dtype.*int32, int64.*got int16"):
        cupyconv.causal_conv1d_fn(
            x.float(),
            torch.ones(DIM, WIDTH),
            seq_idx=torch.zeros(BATCH, SEQLEN, dtype=torch.int16),
        )
    with pytest.raises(TypeError, match=r"^conv_state_indices must have dtype.*got float32"):
        cupyconv.causal_conv1d_update(
            x.float(),
            torch.zeros(BATCH, DIM, WIDTH - 1),
            torch.ones(DIM, WIDTH),
            conv_state_indices=torch.zeros(BATCH),
        )


# ---- activation and flags ------------------------------------------------------------------

ACCEPTED = r"None, 'silu', 'swish'"


@pytest.mark.parametrize("op", ["fn", "bwd", "update"])
@pytest.mark.parametrize(
    "activation", ["relu", "SiLU", "", True, 1], ids=["relu", "SiLU", "empty", "True", "one"]
)
def test_unknown_activation(op, activation):
    check_refused(
        op,
        dict(activation=activation),
        ValueError,
        [r"^activation must be one of", ACCEPTED, re.escape(repr(activation))],
    )


@pytest.mark.parametrize(
    ("op", "flag"), [("fn", "return_final_states"), ("bwd", "return_dinitial_states")]
)
def test_flags_must_be_bools(op, flag):
    check_refused(op, {flag: "yes"}, TypeError, [rf"^{flag} must be a bool", r"str"])


# ---- width ---------------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["fn", "bwd", "update"])
@pytest.mark.parametrize("width", [0, 257, 1000], ids=lambda k: f"width{k}")
def test_width_outside_1_to_256(op, width):
    replace = dict(weight=_rand(DIM, width))
    # The states would have to be [.., width - 1]; leave them out so only the width is wrong.
    replace.update(
        dict(
            fn=dict(initial_states=None, final_states_out=None, return_final_states=False),
            bwd=dict(initial_states=None, dfinal_states=None),
            update=dict(conv_state=_rand(BATCH, DIM, max(width, 1))),
        )[op]
    )
    check_refused(
        op,
        replace,
        ValueError,
        [r"^weight\.shape\[1\] \(the width\) must be between 1 and 256", rf"got {width}"],
    )


@pytest.mark.parametrize("width", [1, 2, 256], ids=lambda k: f"width{k}")
def test_widths_at_the_bounds_are_accepted(width):
    x, weight = _rand(1, DIM, SEQLEN), _rand(DIM, width)
    out, final = cupyconv.causal_conv1d_fn(x, weight, return_final_states=True)
    want, want_final = reference.causal_conv1d_fn(x, weight, return_final_states=True)
    assert_close(out, want)
    assert final.shape == (1, DIM, width - 1)
    assert_close(final, want_final)


# ---- empty arrays: empty results of the right shape ----------------------------------------


def test_empty_forward():
    for batch, dim, seqlen in [(BATCH, 0, SEQLEN), (BATCH, DIM, 0), (0, DIM, SEQLEN)]:
        x = np.zeros((batch, dim, seqlen), np.float16)
        weight = _rand(dim, WIDTH)
        out, final = cupyconv.causal_conv1d_fn(
            x,
            weight,
            _rand(dim),
            seq_idx=np.zeros((batch, seqlen), np.int32),
            return_final_states=True,
            activation="silu",
        )
        assert out.shape == (batch, dim, seqlen) and out.dtype == np.float16
        assert final.shape == (batch, dim, WIDTH - 1) and final.dtype == np.float16
        assert not final.any()  # zeros: no input and no initial states


def test_empty_seqlen_final_states_come_from_initial_states():
    init = _rand(BATCH, DIM, WIDTH - 1)
    out, final = cupyconv.causal_conv1d_fn(
        np.zeros((BATCH, DIM, 0), np.float32),
        _rand(DIM, WIDTH),
        initial_states=init,
        return_final_states=True,
    )
    assert out.shape == (BATCH, DIM, 0)
    np.testing.assert_array_equal(final, init)


def test_empty_backward():
    x = np.zeros((BATCH, 0, SEQLEN), np.float32)
    dx, dweight, dbias, dinit = cupyconv.causal_conv1d_bwd(
        x,
        _rand(0, WIDTH),
        _rand(0),
        x,
        initial_states=np.zeros((BATCH, 0, WIDTH - 1), np.float32),
        return_dinitial_states=True,
    )
    assert (dx.shape, dweight.shape, dbias.shape, dinit.shape) == (
        (BATCH, 0, SEQLEN),
        (0, WIDTH),
        (0,),
        (BATCH, 0, WIDTH - 1),
    )
    x = np.zeros((BATCH, DIM, 0), np.float32)
    dx, dweight, dbias, _ = cupyconv.causal_conv1d_bwd(x, _rand(DIM, WIDTH), _rand(DIM), x)
    assert dx.shape == (BATCH, DIM, 0)
    assert not dweight.any() and not dbias.any()  # an empty reduction is 0


def test_empty_update():
    state = _rand(BATCH, DIM, STATE_LEN)
    before = state.copy()
    out = cupyconv.causal_conv1d_update(
        np.zeros((BATCH, DIM, 0), np.float32), state, _rand(DIM, WIDTH)
    )
    assert out.shape == (BATCH, DIM, 0)
    np.testing.assert_array_equal(state, before)  # no token, no change


def test_empty_varlen_states():
    states = cupyconv.causal_conv1d_varlen_states(
        np.zeros((0, DIM), np.float32), np.zeros(1, np.int32), 3
    )
    assert states.shape == (0, DIM, 3)
    states = cupyconv.causal_conv1d_varlen_states(
        np.zeros((5, 0), np.float32), np.array([0, 5], np.int32), 3
    )
    assert states.shape == (1, 0, 3)


def _empty_buffer_cases():
    """Calls whose output buffer (out, dx, final_states_out, conv_state) has no element; each
    maker returns the call and the buffer (or shape) its first result must be."""

    def fn_out(xp):
        x, out = xp.zeros((BATCH, DIM, 0)), xp.zeros((BATCH, DIM, 0))
        return lambda: cupyconv.causal_conv1d_fn(x, xp.ones((DIM, WIDTH)), out=out), out

    def fn_out_dim0(xp):
        x, out = xp.zeros((BATCH, 0, SEQLEN)), xp.zeros((BATCH, 0, SEQLEN))
        return lambda: cupyconv.causal_conv1d_fn(x, xp.ones((0, WIDTH)), out=out), out

    def fn_final_width1(xp):  # width 1: final states are [batch, dim, 0]
        x, final = xp.ones((BATCH, DIM, SEQLEN)), xp.zeros((BATCH, DIM, 0))
        return lambda: cupyconv.causal_conv1d_fn(
            x,
            xp.ones((DIM, 1)),
            return_final_states=True,
            final_states_out=final,
        )[1], final

    def bwd_dx(xp):
        x, dx = xp.zeros((BATCH, DIM, 0)), xp.zeros((BATCH, DIM, 0))
        return lambda: cupyconv.causal_conv1d_bwd(x, xp.ones((DIM, WIDTH)), None, x, dx=dx)[0], dx

    def update_dim0(xp):
        return lambda: cupyconv.causal_conv1d_update(
            xp.zeros((BATCH, 0)), xp.zeros((BATCH, 0, WIDTH - 1)), xp.ones((0, WIDTH))
        ), (BATCH, 0)

    def update_width1(xp):  # width 1 needs no history: state_len 0 is valid
        return lambda: cupyconv.causal_conv1d_update(
            xp.ones((BATCH, DIM)), xp.zeros((BATCH, DIM, 0)), xp.ones((DIM, 1))
        ), (BATCH, DIM)

    calls = [fn_out, fn_out_dim0, fn_final_width1, bwd_dx, update_dim0, update_width1]
    for make in calls:
        yield pytest.param("numpy", make, id=f"numpy-{make.__name__}")
        yield pytest.param("torch", make, id=f"torch-{make.__name__}")


@pytest.mark.parametrize(("framework", "make"), list(_empty_buffer_cases()))
def test_empty_output_buffers_are_accepted(framework, make):
    xp = pytest.importorskip("torch") if framework == "torch" else np
    call, expected = make(xp)
    result = call()
    if isinstance(expected, tuple):
        assert tuple(result.shape) == expected
    else:
        assert result is expected


# ---- objects that are not arrays -----------------------------------------------------------

NOT_ARRAY_CASES = [
    case(
        "fn",
        "x-list",
        TypeError,
        [r"^x must be an array", r"got list"],
        x=np.zeros((BATCH, DIM, SEQLEN)).tolist(),
    ),
    case("fn", "x-None", TypeError, [r"^x must be an array", r"None"], x=None),
    case("fn", "x-str", TypeError, [r"^x must be an array", r"got str"], x="x"),
    case("fn", "x-float", TypeError, [r"^x must be an array", r"got float"], x=1.0),
    case("fn", "weight-None", TypeError, [r"^weight must be an array", r"None"], weight=None),
    case(
        "fn",
        "weight-tuple",
        TypeError,
        [r"^weight must be an array", r"got tuple"],
        weight=((1.0, 2.0, 3.0),) * DIM,
    ),
    case("fn", "bias-list", TypeError, [r"^bias must be an array", r"got list"], bias=[0.0] * DIM),
    case(
        "fn",
        "seq_idx-list",
        TypeError,
        [r"^seq_idx must be an array"],
        seq_idx=[[0] * SEQLEN] * BATCH,
    ),
    case(
        "fn",
        "initial_states-str",
        TypeError,
        [r"^initial_states must be an array"],
        initial_states="zeros",
    ),
    case(
        "fn",
        "out-list",
        TypeError,
        [r"^out must be an array"],
        out=np.zeros((BATCH, DIM, SEQLEN)).tolist(),
    ),
    case(
        "fn",
        "final_states_out-list",
        TypeError,
        [r"^final_states_out must be an array"],
        final_states_out=[0.0],
    ),
    case("bwd", "dout-None", TypeError, [r"^dout must be an array", r"None"], dout=None),
    case("bwd", "x-list", TypeError, [r"^x must be an array"], x=[1.0, 2.0]),
    case("bwd", "dx-str", TypeError, [r"^dx must be an array"], dx="dx"),
    case(
        "bwd",
        "dfinal_states-list",
        TypeError,
        [r"^dfinal_states must be an array"],
        dfinal_states=[0.0],
    ),
    case(
        "update",
        "conv_state-None",
        TypeError,
        [r"^conv_state must be an array", r"None"],
        conv_state=None,
    ),
    case(
        "update",
        "conv_state-list",
        TypeError,
        [r"^conv_state must be an array"],
        conv_state=[[[0.0] * STATE_LEN] * DIM] * BATCH,
    ),
    case("update", "x-str", TypeError, [r"^x must be an array"], x="x"),
    case(
        "update",
        "cache_seqlens-list",
        TypeError,
        [r"^cache_seqlens must be an array"],
        cache_seqlens=[0, 0],
    ),
    case(
        "update",
        "conv_state_indices-int",
        TypeError,
        [r"^conv_state_indices must be an array"],
        conv_state_indices=0,
    ),
    case("varlen", "x-None", TypeError, [r"^x must be an array", r"None"], x=None),
    case(
        "varlen",
        "cu_seqlens-list",
        TypeError,
        [r"^cu_seqlens must be an array", r"list"],
        cu_seqlens=CU_SEQLENS,
    ),
    case(
        "varlen", "cu_seqlens-None", TypeError, [r"^cu_seqlens must be an array"], cu_seqlens=None
    ),
    case(
        "varlen", "state_len-str", TypeError, [r"^state_len must be an int", r"str"], state_len="3"
    ),
    case(
        "varlen",
        "state_len-float",
        TypeError,
        [r"^state_len must be an int", r"float"],
        state_len=3.0,
    ),
    case(
        "varlen",
        "state_len-negative",
        ValueError,
        [r"^state_len must be between 0 and 2147483647", r"-1"],
        state_len=-1,
    ),
    case(
        "varlen",
        "cu_seqlens-empty",
        ValueError,
        [r"^cu_seqlens must have shape"],
        cu_seqlens=np.zeros(0, np.int32),
    ),
]


@pytest.mark.parametrize(("op", "replace", "exc", "patterns"), NOT_ARRAY_CASES)
def test_objects_that_are_not_arrays(op, replace, exc, patterns):
    check_refused(op, replace, exc, patterns)


# ---- output buffers: read-only, immutable (JAX), overlapping, same memory as an input --------


def _readonly(a):
    a = a.copy()
    a.flags.writeable = False
    return a


def _buffer_views():
    """One [batch, 2 * dim, seqlen] buffer: x is its first half, outputs are views of it."""
    buf = np.full((BATCH, 2 * DIM, SEQLEN), np.nan, np.float32)
    buf[:, :DIM] = _rand(BATCH, DIM, SEQLEN)
    return buf


_BUF = _buffer_views()
_X_IN_BUF = _BUF[:, :DIM]
_SHIFT_BUF = _rand(BATCH, DIM, SEQLEN + 1)
_STATES = valid_args("fn")["initial_states"]

BUFFER_CASES = [
    case(
        "fn",
        "out-read-only",
        ValueError,
        [r"^out must be writable", r"read-only"],
        out=_readonly(np.zeros((BATCH, DIM, SEQLEN), np.float32)),
    ),
    case(
        "fn",
        "final_states_out-read-only",
        ValueError,
        [r"^final_states_out must be writable"],
        final_states_out=_readonly(np.zeros((BATCH, DIM, WIDTH - 1), np.float32)),
    ),
    case(
        "bwd",
        "dx-read-only",
        ValueError,
        [r"^dx must be writable"],
        dx=_readonly(np.zeros((BATCH, DIM, SEQLEN), np.float32)),
    ),
    case(
        "update",
        "conv_state-read-only",
        ValueError,
        [r"^conv_state must be writable"],
        conv_state=_readonly(np.zeros((BATCH, DIM, STATE_LEN), np.float32)),
    ),
    # same memory as an input
    case(
        "fn",
        "out-is-x",
        ValueError,
        [r"^out must not share memory with x"],
        x=_X_IN_BUF,
        out=_X_IN_BUF,
    ),
    case(
        "fn",
        "out-overlaps-x-by-one-channel",
        ValueError,
        [r"^out must not share memory with x"],
        x=_X_IN_BUF,
        out=_BUF[:, 1 : DIM + 1],
    ),
    case(
        "fn",
        "out-overlaps-x-by-one-step",
        ValueError,
        [r"^out must not share memory with x"],
        x=_SHIFT_BUF[..., 1:],
        out=_SHIFT_BUF[..., :-1],
    ),
    case(
        "fn",
        "out-is-x-reversed",
        ValueError,
        [r"^out must not share memory with x"],
        x=_X_IN_BUF,
        out=_X_IN_BUF[..., ::-1],
    ),
    case(
        "fn",
        "final_states_out-is-initial_states",
        ValueError,
        [r"^final_states_out must not share memory with initial_states"],
        initial_states=_STATES,
        final_states_out=_STATES,
    ),
    case(
        "fn",
        "final_states_out-inside-out",
        ValueError,
        [r"^final_states_out must not share memory with out"],
        out=_BUF[:, DIM:],
        final_states_out=_BUF[:, DIM:, : WIDTH - 1],
    ),
    case(
        "fn",
        "final_states_out-inside-x",
        ValueError,
        [r"^final_states_out must not share memory with x"],
        x=_X_IN_BUF,
        final_states_out=_X_IN_BUF[..., : WIDTH - 1],
    ),
    case(
        "bwd",
        "dx-is-x",
        ValueError,
        [r"^dx must not share memory with x"],
        x=_X_IN_BUF,
        dx=_X_IN_BUF,
    ),
    case(
        "bwd",
        "dx-is-dout",
        ValueError,
        [r"^dx must not share memory with dout"],
        dout=_X_IN_BUF,
        dx=_X_IN_BUF,
    ),
    case(
        "bwd",
        "dx-overlaps-dout",
        ValueError,
        [r"^dx must not share memory with dout"],
        dout=_X_IN_BUF,
        dx=_BUF[:, DIM - 1 : 2 * DIM - 1],
    ),
    case(
        "update",
        "conv_state-overlaps-x",
        ValueError,
        [r"^conv_state must not share memory with x"],
        x=_X_IN_BUF,
        conv_state=_X_IN_BUF[..., SEQLEN - STATE_LEN :],
    ),
    # an output buffer in which two indices reach one element
    case(
        "fn",
        "out-with-zero-stride",
        ValueError,
        [r"^out must not have overlapping elements", r"strides"],
        out=np.lib.stride_tricks.as_strided(
            np.zeros(DIM * SEQLEN, np.float32), (BATCH, DIM, SEQLEN), (0, 4 * SEQLEN, 4)
        ),
    ),
]


@pytest.mark.parametrize(("op", "replace", "exc", "patterns"), BUFFER_CASES)
def test_output_buffers(op, replace, exc, patterns):
    check_refused(op, replace, exc, patterns)


def test_conv_state_sharing_memory_with_weight():
    buf = _rand(DIM, STATE_LEN)  # weight [dim, width] and conv_state [1, dim, state_len] over it
    args = dict(
        x=_rand(1, DIM),
        conv_state=buf[None],
        weight=buf[:, :WIDTH],
        bias=None,
        cache_seqlens=None,
        conv_state_indices=None,
    )
    check_refused("update", args, ValueError, [r"^conv_state must not share memory with weight"])


def _disjoint_slices():
    """x and the output buffer as disjoint slices of one buffer (accepted, written correctly)."""
    # channel-first: buf[:, :dim] and buf[:, dim:]
    buf = np.full((BATCH, 2 * DIM, SEQLEN), np.nan, np.float32)
    buf[:, :DIM] = _rand(BATCH, DIM, SEQLEN)
    yield "channel-first", buf[:, :DIM], buf[:, DIM:]
    # channel-last projection [batch, seqlen, 2 * dim], each half viewed as [batch, dim, seqlen]
    buf = np.full((BATCH, SEQLEN, 2 * DIM), np.nan, np.float32)
    buf[..., :DIM] = _rand(BATCH, SEQLEN, DIM)
    yield "channel-last", buf[..., :DIM].transpose(0, 2, 1), buf[..., DIM:].transpose(0, 2, 1)
    # interleaved channels: x the even channels, out the odd ones
    buf = np.full((BATCH, 2 * DIM, SEQLEN), np.nan, np.float32)
    buf[:, 0::2] = _rand(BATCH, DIM, SEQLEN)
    yield "interleaved-channels", buf[:, 0::2], buf[:, 1::2]
    # time halves
    buf = np.full((BATCH, DIM, 2 * SEQLEN), np.nan, np.float32)
    buf[..., :SEQLEN] = _rand(BATCH, DIM, SEQLEN)
    yield "time-halves", buf[..., :SEQLEN], buf[..., SEQLEN:]


@pytest.mark.parametrize(("x", "out"), [pytest.param(x, o, id=n) for n, x, o in _disjoint_slices()])
def test_disjoint_slices_of_one_buffer_are_accepted(x, out):
    weight, bias = _rand(DIM, WIDTH), _rand(DIM)
    x_before = x.copy()
    got = cupyconv.causal_conv1d_fn(x, weight, bias, activation="silu", out=out)
    assert got is out
    np.testing.assert_array_equal(x, x_before)
    assert_close(out, reference.causal_conv1d_fn(x, weight, bias, activation="silu"))
    # dx and x (also dout here) as disjoint slices, too
    got_dx = cupyconv.causal_conv1d_bwd(x, weight, bias, x, dx=out)[0]
    assert got_dx is out


def test_update_x_and_conv_state_in_one_buffer_without_overlap_are_accepted():
    buf = _rand(BATCH, DIM, SEQLEN + STATE_LEN)
    x, state = buf[..., :SEQLEN], buf[..., SEQLEN:]
    weight = _rand(DIM, WIDTH)
    want_out, want_state = reference.causal_conv1d_update(x, state, weight)
    out = cupyconv.causal_conv1d_update(x, state, weight)
    assert_close(out, want_out)
    np.testing.assert_array_equal(state, want_state)


def test_torch_output_buffers():
    torch = pytest.importorskip("torch")
    x, weight = torch.randn(BATCH, DIM, SEQLEN), torch.randn(DIM, WIDTH)
    with pytest.raises(ValueError, match=r"^out must not share memory with x"):
        cupyconv.causal_conv1d_fn(x, weight, out=x)
    shifted = torch.randn(BATCH, DIM, SEQLEN + 1)
    with pytest.raises(ValueError, match=r"^out must not share memory with x"):
        cupyconv.causal_conv1d_fn(shifted[..., 1:], weight, out=shifted[..., :-1])
    with pytest.raises(ValueError, match=r"^out must not have overlapping elements"):
        cupyconv.causal_conv1d_fn(x, weight, out=torch.empty(1, DIM, SEQLEN).expand(x.shape))
    with pytest.raises(ValueError, match=r"^out must have the dtype of x \(float32\); got float16"):
        cupyconv.causal_conv1d_fn(x, weight, out=torch.empty(x.shape, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"^conv_state must not share memory with x"):
        cupyconv.causal_conv1d_update(x[..., : WIDTH - 1], x[..., : WIDTH - 1], weight)
    buf = torch.randn(BATCH, 2 * DIM, SEQLEN)
    out = cupyconv.causal_conv1d_fn(buf[:, :DIM], weight, out=buf[:, DIM:])
    assert out.data_ptr() == buf[:, DIM:].data_ptr()
    assert_close(out, reference.causal_conv1d_fn(buf[:, :DIM].numpy(), weight.numpy()))


@pytest.mark.parametrize(
    ("op", "name"),
    [("fn", "out"), ("fn", "final_states_out"), ("bwd", "dx"), ("update", "conv_state")],
)
def test_jax_output_buffers_are_refused(op, name):
    jax = pytest.importorskip("jax")
    good = valid_args(op)[name]
    check_refused(
        op,
        {name: jax.device_put(good, jax.devices("cpu")[0])},
        TypeError,
        [rf"^{name} must be a mutable array", r"JAX", r"immutable"],
    )


# ---- devices: a fake CUDA array (metadata only) ----------------------------------------------


def _fake(op, name, device):
    good = valid_args(op)[name]
    return FakeCudaArray(good.shape, dtype=good.dtype, device=device)


def _device_cases():
    cpu_gpu = [r"^all arrays must be on one device", r"cpu", r"cuda:0"]
    two_gpus = [r"^all arrays must be on one device", r"cuda:0", r"cuda:1"]
    for op, name in [
        ("fn", "x"),
        ("fn", "weight"),
        ("fn", "seq_idx"),
        ("fn", "out"),
        ("fn", "final_states_out"),
        ("bwd", "dout"),
        ("bwd", "dx"),
        ("update", "x"),
        ("update", "conv_state"),
        ("update", "conv_state_indices"),
        ("varlen", "x"),
        ("varlen", "cu_seqlens"),
    ]:
        yield pytest.param(
            op, {name: (name, 0)}, cpu_gpu + [rf"\b{name}\b"], id=f"{op}-{name}-cuda0-with-cpu"
        )
    for op, names in [
        ("fn", ("x", "weight", "bias", "seq_idx", "initial_states", "final_states_out", "out")),
        (
            "bwd",
            ("x", "weight", "bias", "dout", "seq_idx", "initial_states", "dfinal_states", "dx"),
        ),
        ("update", ("x", "conv_state", "weight", "bias", "cache_seqlens", "conv_state_indices")),
        ("varlen", ("x", "cu_seqlens")),
    ]:
        # everything on cuda:0 but the last array, which is on cuda:1
        fakes = {n: (n, 0) for n in names}
        fakes[names[-1]] = (names[-1], 1)
        yield pytest.param(
            op, fakes, two_gpus + [rf"\b{names[-1]}\b"], id=f"{op}-{names[-1]}-cuda1-with-cuda0"
        )


@pytest.mark.parametrize(("op", "fakes", "patterns"), list(_device_cases()))
def test_arrays_on_different_devices(op, fakes, patterns):
    replace = {n: _fake(op, n, device) for n, (_, device) in fakes.items()}
    args = valid_args(op)
    owned = {n: a.copy() for n, a in args.items() if isinstance(a, np.ndarray)}
    args.update(replace)
    with pytest.raises(ValueError, match=patterns[0]) as info:
        OPS[op](**args)
    for pattern in patterns[1:]:
        assert re.search(pattern, str(info.value)), (pattern, str(info.value))
    for n, before in owned.items():  # nothing the caller owns was written
        if n not in replace:
            np.testing.assert_array_equal(args[n], before, err_msg=n)


def test_torch_cpu_tensor_with_a_cuda_array():
    torch = pytest.importorskip("torch")
    x = torch.randn(BATCH, DIM, SEQLEN)
    with pytest.raises(ValueError, match=r"x on cpu and weight on cuda:0"):
        cupyconv.causal_conv1d_fn(x, FakeCudaArray((DIM, WIDTH)))
    with pytest.raises(ValueError, match=r"x on cuda:1 and conv_state on cpu"):
        cupyconv.causal_conv1d_update(
            FakeCudaArray((BATCH, DIM), device=1),
            torch.zeros(BATCH, DIM, WIDTH - 1),
            torch.ones(DIM, WIDTH),
        )


# ---- a refused call leaves everything the caller owns as it was -------------------------------

REFUSED_CALLS = [
    ("fn", dict(activation="gelu")),
    ("fn", dict(final_states_out=np.zeros((BATCH, DIM, WIDTH - 1), np.float16))),
    ("fn", dict(initial_states=BAD_STATES)),
    ("fn", dict(seq_idx=np.zeros((BATCH, SEQLEN), np.float32))),
    ("fn", dict(weight=_rand(DIM, 300))),
    ("bwd", dict(dfinal_states=BAD_STATES)),
    ("bwd", dict(return_dinitial_states=1)),
    ("update", dict(activation="relu")),
    ("update", dict(bias=_rand(DIM + 1))),
    ("update", dict(cache_seqlens=np.zeros(BATCH, np.float32))),
    ("update", dict(conv_state_indices=np.zeros(BATCH + 1, np.int32))),
    ("update", dict(weight=_rand(DIM, STATE_LEN + 2))),  # state_len < width - 1
]
REFUSED_IDS = [
    "fn-activation",
    "fn-final_states_out-dtype",
    "fn-initial_states-width",
    "fn-seq_idx-dtype",
    "fn-width-300",
    "bwd-dfinal_states-width",
    "bwd-flag-not-bool",
    "update-activation",
    "update-bias-dim",
    "update-cache_seqlens-dtype",
    "update-conv_state_indices-batch",
    "update-conv_state-too-short",
]


@pytest.mark.parametrize(("op", "replace"), REFUSED_CALLS, ids=REFUSED_IDS)
def test_refused_call_modifies_nothing(op, replace):
    args = valid_args(op)
    args.update(replace)
    before = {n: a.copy() for n, a in args.items() if isinstance(a, np.ndarray)}
    with pytest.raises((ValueError, TypeError)):
        OPS[op](**args)
    for n, a in before.items():
        np.testing.assert_array_equal(args[n], a, err_msg=f"{n} was modified")
