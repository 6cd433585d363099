"""The public operators on CPU arrays: numpy, CPU torch tensors and CPU JAX arrays.

On the CPU, cupyconv runs the float64 reference and rounds once to the caller's dtype, so every
result is compared (``cupyconv.testing.assert_close``) with ``cupyconv.reference`` run on the
same inputs after their rounding to the test dtype. Beyond the values, these tests pin what the
caller gets back: the framework and dtype of x, the caller's own ``out``/``final_states_out``/
``dx`` objects, the memory order of new outputs, and in-place updates of ``conv_state``.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

import cupyconv
from cupyconv import reference
from cupyconv.testing import GRAD_TOLERANCE, assert_close, to_numpy, tolerance

BATCH, DIM, SEQLEN, WIDTH = 2, 5, 9, 4
DTYPES = ["float32", "float16", "bfloat16", "float64"]
FRAMEWORKS = ["numpy", "torch", "jax"]


# ---- one small adapter per framework ----------------------------------------------------------


class Numpy:
    name = "numpy"

    @staticmethod
    def dtype(name):
        return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)

    def array(self, values, dtype="float32", layout="channel-first"):
        """``values`` (float64 numpy) rounded to ``dtype``; ``layout`` "channel-last" stores a
        3-D array as [batch, seqlen, dim] viewed as [batch, dim, seqlen]."""
        if layout == "channel-last":
            return (
                np.ascontiguousarray(values.transpose(0, 2, 1))
                .astype(self.dtype(dtype))
                .transpose(0, 2, 1)
            )
        return np.asarray(values).astype(self.dtype(dtype))

    def index(self, values, dtype="int32"):
        return np.asarray(values, dtype=dtype)

    def is_native(self, a):
        return isinstance(a, np.ndarray)

    def dtype_name(self, a):
        return str(a.dtype)

    def strides(self, a):
        """Strides in elements."""
        return tuple(s // a.itemsize for s in a.strides)

    def ptr(self, a):
        return a.ctypes.data

    def full(self, shape, value, dtype, layout="channel-first"):
        return self.array(np.full(shape, value), dtype, layout)


class Torch:
    name = "torch"

    def __init__(self):
        import torch

        self.torch = torch

    def dtype(self, name):
        return getattr(self.torch, name)

    def array(self, values, dtype="float32", layout="channel-first"):
        t = self.torch.from_numpy(np.array(values, dtype=np.float64)).to(self.dtype(dtype))
        if layout == "channel-last":
            return t.transpose(1, 2).contiguous().transpose(1, 2)
        return t

    def index(self, values, dtype="int32"):
        return self.torch.tensor(np.asarray(values), dtype=self.dtype(dtype))

    def is_native(self, a):
        return isinstance(a, self.torch.Tensor) and a.device.type == "cpu"

    def dtype_name(self, a):
        return str(a.dtype).removeprefix("torch.")

    def strides(self, a):
        return tuple(a.stride())

    def ptr(self, a):
        return a.data_ptr()

    def full(self, shape, value, dtype, layout="channel-first"):
        return self.array(np.full(shape, value), dtype, layout)


class Jax:
    name = "jax"

    def __init__(self):
        import jax
        import jax.numpy as jnp

        self.jax, self.jnp = jax, jnp

    def array(self, values, dtype="float32", layout="channel-first"):
        return self.jnp.asarray(np.asarray(values), dtype=getattr(self.jnp, dtype))

    def index(self, values, dtype="int32"):
        return self.jnp.asarray(np.asarray(values), dtype=getattr(self.jnp, dtype))

    def is_native(self, a):
        return isinstance(a, self.jax.Array)

    def dtype_name(self, a):
        return str(a.dtype)


@pytest.fixture(params=FRAMEWORKS)
def fw(request):
    """The framework adapter; JAX runs with 64-bit types enabled (for float64 inputs)."""
    if request.param == "numpy":
        yield Numpy()
        return
    pytest.importorskip(request.param)
    if request.param == "torch":
        yield Torch()
        return
    import jax

    # CPU JAX arrays, also where JAX has a GPU backend
    with jax.enable_x64(True), jax.default_device(jax.devices("cpu")[0]):
        yield Jax()


@pytest.fixture(params=["numpy", "torch"])
def mutable_fw(request):
    """Frameworks whose arrays can be written in place (out=, conv_state)."""
    if request.param == "numpy":
        return Numpy()
    pytest.importorskip("torch")
    return Torch()


def rand(*shape, seed=0):
    return np.random.default_rng(seed + 7 * len(shape) + sum(shape)).standard_normal(shape)


SEQ_IDX = [[0, 0, 0, 0, 1, 1, 1, 2, 2], [-1, 0, 0, 0, 0, 1, 1, 1, -1]]  # -1: padding


def dense_strides(shape, order):
    """Strides (elements) of a dense array whose dims, outermost first, are ``order``."""
    strides, step = [0] * len(shape), 1
    for d in reversed(order):
        strides[d] = step
        step *= shape[d]
    return tuple(strides)


def check_result(fw, got, want, dtype, name="out"):
    assert fw.is_native(got), f"{name}: got {type(got).__name__}, not a {fw.name} array"
    assert fw.dtype_name(got) == dtype, f"{name}: dtype {fw.dtype_name(got)}, expected {dtype}"
    assert_close(got, want, dtype, name=name)


# ---- forward ---------------------------------------------------------------------------------

FEATURES = ["plain", "bias-silu", "seq_idx-states-swish"]


@pytest.mark.parametrize("features", FEATURES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward(fw, dtype, features):
    x = fw.array(rand(BATCH, DIM, SEQLEN), dtype)
    weight = fw.array(rand(DIM, WIDTH), dtype)
    kwargs = {}
    if features != "plain":
        kwargs = dict(bias=fw.array(rand(DIM), dtype), activation="silu")
    if features == "seq_idx-states-swish":
        kwargs.update(
            seq_idx=fw.index(SEQ_IDX),
            initial_states=fw.array(rand(BATCH, DIM, WIDTH - 1), dtype),
            return_final_states=True,
            activation="swish",
        )
    got = cupyconv.causal_conv1d_fn(x, weight, **kwargs)
    want = reference.causal_conv1d_fn(
        to_numpy(x),
        to_numpy(weight),
        **{k: to_numpy(v) if hasattr(v, "shape") else v for k, v in kwargs.items()},
    )
    if features == "seq_idx-states-swish":
        check_result(fw, got[0], want[0], dtype)
        check_result(fw, got[1], want[1], dtype, name="final_states")
        assert tuple(got[1].shape) == (BATCH, DIM, WIDTH - 1)
    else:
        check_result(fw, got, want, dtype)


@pytest.mark.parametrize(
    ("x_dtype", "weight_dtype", "bias_dtype"),
    [
        ("float16", "float32", "bfloat16"),
        ("bfloat16", "float16", "float32"),
        ("float32", "bfloat16", "float64"),
        ("float64", "float32", "float16"),
    ],
    ids=lambda d: d,
)
def test_forward_mixed_dtypes_return_x_dtype(fw, x_dtype, weight_dtype, bias_dtype):
    x = fw.array(rand(BATCH, DIM, SEQLEN), x_dtype)
    weight, bias = fw.array(rand(DIM, WIDTH), weight_dtype), fw.array(rand(DIM), bias_dtype)
    got = cupyconv.causal_conv1d_fn(x, weight, bias, activation="silu")
    want = reference.causal_conv1d_fn(
        to_numpy(x), to_numpy(weight), to_numpy(bias), activation="silu"
    )
    check_result(fw, got, want, x_dtype)


LAYOUTS = ["channel-first", "channel-last"]


@pytest.mark.parametrize("out_layout", LAYOUTS)
@pytest.mark.parametrize("x_layout", LAYOUTS)
def test_out_and_final_states_out_are_written_and_returned(mutable_fw, x_layout, out_layout):
    fw = mutable_fw
    x = fw.array(rand(BATCH, DIM, SEQLEN), "float16", x_layout)
    weight, bias = fw.array(rand(DIM, WIDTH)), fw.array(rand(DIM))
    init = fw.array(rand(BATCH, DIM, WIDTH - 1), "float16")
    out = fw.full((BATCH, DIM, SEQLEN), np.nan, "float16", out_layout)
    # final_states_out with its own strides: a [dim, batch, width - 1] buffer, permuted
    final_buffer = fw.full((DIM, BATCH, WIDTH - 1), np.nan, "float16")
    final = final_buffer.transpose(1, 0, 2) if fw.name == "numpy" else final_buffer.permute(1, 0, 2)
    out_strides, final_strides = fw.strides(out), fw.strides(final)

    got, got_final = cupyconv.causal_conv1d_fn(
        x,
        weight,
        bias,
        initial_states=init,
        return_final_states=True,
        final_states_out=final,
        activation="silu",
        out=out,
    )
    assert got is out and got_final is final
    assert fw.strides(out) == out_strides and fw.strides(final) == final_strides
    want, want_final = reference.causal_conv1d_fn(
        to_numpy(x),
        to_numpy(weight),
        to_numpy(bias),
        initial_states=to_numpy(init),
        return_final_states=True,
        activation="silu",
    )
    assert_close(out, want, name="out")
    assert_close(final, want_final, name="final_states_out")


def test_final_states_out_is_ignored_without_return_final_states(mutable_fw):
    fw = mutable_fw
    final = fw.full((BATCH, DIM, WIDTH - 1), 7.0, "float32")
    got = cupyconv.causal_conv1d_fn(
        fw.array(rand(BATCH, DIM, SEQLEN)), fw.array(rand(DIM, WIDTH)), final_states_out=final
    )
    assert fw.is_native(got) and tuple(got.shape) == (BATCH, DIM, SEQLEN)
    assert (to_numpy(final) == 7.0).all()


def _x_in_layout(fw, layout, dtype="float32"):
    """x [batch, dim, seqlen] in ``layout`` and its expected default-out order."""
    values = rand(BATCH, DIM, SEQLEN)
    if layout in LAYOUTS:
        x = fw.array(values, dtype, layout)
    elif layout == "channel-slice-of-projection":  # x = proj[..., :dim] of [batch, seqlen, 3*dim]
        proj = fw.array(rand(BATCH, SEQLEN, 3 * DIM), dtype)
        x = (
            proj[:, :, DIM : 2 * DIM].transpose(1, 2)
            if fw.name == "torch"
            else (proj[:, :, DIM : 2 * DIM].transpose(0, 2, 1))
        )
    else:  # "time-slice": a window of a longer channel-first buffer
        x = fw.array(rand(BATCH, DIM, 2 * SEQLEN), dtype)[:, :, 3 : 3 + SEQLEN]
    order = (0, 1, 2) if layout in ("channel-first", "time-slice") else (0, 2, 1)
    return x, order


@pytest.mark.parametrize(
    "layout", ["channel-first", "channel-last", "channel-slice-of-projection", "time-slice"]
)
def test_default_out_follows_x_stride_order(mutable_fw, layout):
    fw = mutable_fw
    x, order = _x_in_layout(fw, layout)
    weight = fw.array(rand(DIM, WIDTH))
    out = cupyconv.causal_conv1d_fn(x, weight)
    assert fw.strides(out) == dense_strides((BATCH, DIM, SEQLEN), order), fw.strides(x)
    assert_close(out, reference.causal_conv1d_fn(to_numpy(x), to_numpy(weight)))
    dx = cupyconv.causal_conv1d_bwd(x, weight, None, x)[0]  # dx follows x's order too
    assert fw.strides(dx) == dense_strides((BATCH, DIM, SEQLEN), order)


@pytest.mark.parametrize("width", [1, 2, WIDTH, 9], ids=lambda k: f"width{k}")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_final_states_are_laid_out_batch_width_dim(mutable_fw, layout, width):
    """New final_states are a dense [batch, width - 1, dim] array viewed as [batch, dim,
    width - 1], whatever x's layout (seqlen < width - 1 reaches into initial_states)."""
    fw = mutable_fw
    seqlen = 3
    x = fw.array(rand(BATCH, DIM, seqlen), "bfloat16", layout)
    weight = fw.array(rand(DIM, width), "bfloat16")
    init = fw.array(rand(BATCH, DIM, width - 1), "bfloat16")
    _, final = cupyconv.causal_conv1d_fn(x, weight, initial_states=init, return_final_states=True)
    assert tuple(final.shape) == (BATCH, DIM, width - 1)
    if width > 1:  # an empty array's strides mean nothing
        assert fw.strides(final) == dense_strides((BATCH, DIM, width - 1), (0, 2, 1))
    want = reference.causal_conv1d_fn(
        to_numpy(x), to_numpy(weight), initial_states=to_numpy(init), return_final_states=True
    )[1]
    np.testing.assert_array_equal(to_numpy(final), want)  # final states are copies: exact


def test_inputs_are_not_modified(mutable_fw):
    fw = mutable_fw
    args = dict(
        x=fw.array(rand(BATCH, DIM, SEQLEN)),
        weight=fw.array(rand(DIM, WIDTH)),
        bias=fw.array(rand(DIM)),
        seq_idx=fw.index(SEQ_IDX),
        initial_states=fw.array(rand(BATCH, DIM, WIDTH - 1)),
    )
    before = {k: to_numpy(v) for k, v in args.items()}
    cupyconv.causal_conv1d_fn(**args, return_final_states=True, activation="silu")
    cupyconv.causal_conv1d_bwd(
        args["x"],
        args["weight"],
        args["bias"],
        args["x"],
        args["seq_idx"],
        args["initial_states"],
        args["initial_states"],
        return_dinitial_states=True,
    )
    for k, v in args.items():
        np.testing.assert_array_equal(to_numpy(v), before[k], err_msg=k)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("width", [1, 4, 7], ids=lambda k: f"width{k}")
def test_torch_matches_torch_conv1d(layout, width, dtype):
    """``F.conv1d(x, weight.unsqueeze(1), bias, padding=width-1, groups=dim)[..., :seqlen]``
    then SiLU, computed by torch itself."""
    torch = pytest.importorskip("torch")
    fw = Torch()
    x = fw.array(rand(BATCH, DIM, SEQLEN), dtype, layout)
    weight, bias = fw.array(rand(DIM, width), dtype), fw.array(rand(DIM), dtype)
    got = cupyconv.causal_conv1d_fn(x, weight, bias, activation="silu")
    conv = torch.nn.functional.conv1d(
        x.double(), weight.double().unsqueeze(1), bias.double(), padding=width - 1, groups=DIM
    )[..., :SEQLEN]
    want = torch.nn.functional.silu(conv)
    assert got.dtype == getattr(torch, dtype)
    assert_close(got, want.numpy())


# ---- backward --------------------------------------------------------------------------------


def grad_tolerance(dtype, reduction_terms):
    """dweight/dbias: the GRAD_TOLERANCE of docs/semantics.md with the atol scaled by
    sqrt(terms summed); a half-precision weight/bias also carries its own rounding, so its rtol
    is at least the dtype's output rtol."""
    rtol, atol = GRAD_TOLERANCE
    return max(rtol, tolerance(dtype)[0]), atol * math.sqrt(reduction_terms)


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward(fw, dtype):
    x = fw.array(rand(BATCH, DIM, SEQLEN), dtype)
    weight, bias = fw.array(rand(DIM, WIDTH), dtype), fw.array(rand(DIM), dtype)
    dout = fw.array(rand(BATCH, DIM, SEQLEN, seed=1), dtype)
    init = fw.array(rand(BATCH, DIM, WIDTH - 1), dtype)
    dfinal = fw.array(rand(BATCH, DIM, WIDTH - 1, seed=2), dtype)
    seq_idx = fw.index(SEQ_IDX, "int64")
    dx, dweight, dbias, dinit = cupyconv.causal_conv1d_bwd(
        x,
        weight,
        bias,
        dout,
        seq_idx,
        init,
        dfinal,
        return_dinitial_states=True,
        activation="silu",
    )
    want = reference.causal_conv1d_bwd(
        *(to_numpy(a) for a in (x, weight, bias, dout, seq_idx, init, dfinal)), activation="silu"
    )
    check_result(fw, dx, want[0], dtype, name="dx")
    check_result(fw, dinit, want[3], dtype, name="dinitial_states")
    rtol, atol = grad_tolerance(dtype, BATCH * SEQLEN)
    assert fw.is_native(dweight) and fw.dtype_name(dweight) == dtype
    assert fw.is_native(dbias) and fw.dtype_name(dbias) == dtype
    assert_close(dweight, want[1], rtol=rtol, atol=atol, name="dweight")
    assert_close(dbias, want[2], rtol=rtol, atol=atol, name="dbias")


@pytest.mark.parametrize(
    ("x_dtype", "weight_dtype", "bias_dtype"),
    [
        ("bfloat16", "float32", "float16"),
        ("float16", "bfloat16", "float64"),
        ("float64", "float16", "float32"),
    ],
    ids=lambda d: d,
)
def test_backward_returns_dweight_and_dbias_in_their_dtypes(fw, x_dtype, weight_dtype, bias_dtype):
    x = fw.array(rand(BATCH, DIM, SEQLEN), x_dtype)
    weight, bias = fw.array(rand(DIM, WIDTH), weight_dtype), fw.array(rand(DIM), bias_dtype)
    dout = fw.array(rand(BATCH, DIM, SEQLEN, seed=1), x_dtype)
    dx, dweight, dbias, dinit = cupyconv.causal_conv1d_bwd(x, weight, bias, dout)
    want = reference.causal_conv1d_bwd(*(to_numpy(a) for a in (x, weight, bias, dout)))
    check_result(fw, dx, want[0], x_dtype, name="dx")
    assert fw.dtype_name(dweight) == weight_dtype and fw.dtype_name(dbias) == bias_dtype
    for got, expected, dtype, name in [
        (dweight, want[1], weight_dtype, "dweight"),
        (dbias, want[2], bias_dtype, "dbias"),
    ]:
        rtol, atol = grad_tolerance(dtype, BATCH * SEQLEN)
        assert_close(got, expected, rtol=rtol, atol=atol, name=name)
    assert dinit is None


def test_backward_dinitial_states_only_when_asked(fw):
    x, weight = fw.array(rand(BATCH, DIM, SEQLEN)), fw.array(rand(DIM, WIDTH))
    init = fw.array(rand(BATCH, DIM, WIDTH - 1))
    assert cupyconv.causal_conv1d_bwd(x, weight, None, x, initial_states=init)[3] is None
    assert cupyconv.causal_conv1d_bwd(x, weight, None, x, return_dinitial_states=True)[3] is None
    dx, dweight, dbias, dinit = cupyconv.causal_conv1d_bwd(
        x, weight, None, x, initial_states=init, return_dinitial_states=True
    )
    assert dbias is None  # no bias, no dbias
    want = reference.causal_conv1d_bwd(
        to_numpy(x), to_numpy(weight), None, to_numpy(x), initial_states=to_numpy(init)
    )
    check_result(fw, dinit, want[3], "float32", name="dinitial_states")


def test_backward_dinitial_states_have_the_dtype_of_x(fw):
    x = fw.array(rand(BATCH, DIM, SEQLEN), "float16")
    init = fw.array(rand(BATCH, DIM, WIDTH - 1), "float32")
    dinit = cupyconv.causal_conv1d_bwd(
        x, fw.array(rand(DIM, WIDTH)), None, x, initial_states=init, return_dinitial_states=True
    )[3]
    assert fw.dtype_name(dinit) == "float16", fw.dtype_name(dinit)


@pytest.mark.parametrize("dx_layout", LAYOUTS)
def test_backward_dx_buffer_is_written_and_returned(mutable_fw, dx_layout):
    fw = mutable_fw
    x = fw.array(rand(BATCH, DIM, SEQLEN), "bfloat16")
    weight = fw.array(rand(DIM, WIDTH))
    dout = fw.array(rand(BATCH, DIM, SEQLEN, seed=3), "bfloat16")
    dx = fw.full((BATCH, DIM, SEQLEN), np.nan, "bfloat16", dx_layout)
    got = cupyconv.causal_conv1d_bwd(x, weight, None, dout, dx=dx, activation="silu")[0]
    assert got is dx
    want = reference.causal_conv1d_bwd(
        to_numpy(x), to_numpy(weight), None, to_numpy(dout), activation="silu"
    )[0]
    assert_close(dx, want, name="dx")


# ---- decode update ---------------------------------------------------------------------------

STATE_LEN = WIDTH + 2
POOL = 5
INDICES = [3, -1, 0]  # three batch rows: pool rows 3 and 0, and a padding row


@pytest.mark.parametrize("state_layout", ["state-dense", "state-channel-last"])
@pytest.mark.parametrize("tokens", [0, 1, 3, 8], ids=["x2d", "tokens1", "tokens3", "tokens8"])
@pytest.mark.parametrize("mode", ["sliding", "circular"])
@pytest.mark.parametrize("pool", [False, True], ids=["rows", "pool"])
def test_update_mutates_conv_state_in_place(mutable_fw, pool, mode, tokens, state_layout):
    """tokens 0 means a 2-D x (one token); 8 > STATE_LEN wraps around in circular mode."""
    fw = mutable_fw
    batch = len(INDICES) if pool else BATCH
    x_shape = (batch, DIM) if tokens == 0 else (batch, DIM, tokens)
    x = fw.array(rand(*x_shape), "float16")
    weight, bias = fw.array(rand(DIM, WIDTH), "float16"), fw.array(rand(DIM))
    n_rows = POOL if pool else batch
    # conv_state is float32 while x is float16 (allowed: docs/semantics.md lifts that restriction)
    layout = "channel-last" if state_layout == "state-channel-last" else "channel-first"
    state = fw.array(rand(n_rows, DIM, STATE_LEN, seed=4), "float32", layout)
    strides, ptr = fw.strides(state), fw.ptr(state)
    lens = fw.index([5, 11, 2][:batch]) if mode == "circular" else None
    indices = fw.index(INDICES) if pool else None
    before = to_numpy(state)

    out = cupyconv.causal_conv1d_update(x, state, weight, bias, "silu", lens, indices)

    want_out, want_state = reference.causal_conv1d_update(
        to_numpy(x),
        before,
        to_numpy(weight),
        to_numpy(bias),
        "silu",
        None if lens is None else to_numpy(lens),
        None if indices is None else INDICES,
    )
    check_result(fw, out, want_out, "float16")
    assert fw.ptr(state) == ptr and fw.strides(state) == strides  # the caller's buffer
    np.testing.assert_array_equal(to_numpy(state), want_state)  # updated states are copies
    if pool:
        np.testing.assert_array_equal(to_numpy(out)[1], 0.0)  # the padding row
        for row in (1, 2, 4):  # rows no batch row points at are untouched
            np.testing.assert_array_equal(to_numpy(state)[row], before[row])
    if tokens > 0 and not pool:
        assert not np.array_equal(to_numpy(state), before)


def test_update_jax_x_returns_jax_with_a_numpy_state():
    """Results come back in x's framework; the (mutable) state may be numpy."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    x = jax.device_put(jnp.asarray(rand(BATCH, DIM, 2), dtype=jnp.bfloat16), jax.devices("cpu")[0])
    state = rand(BATCH, DIM, WIDTH - 1).astype(np.float32)
    weight = rand(DIM, WIDTH).astype(np.float32)
    want_out, want_state = reference.causal_conv1d_update(to_numpy(x), state, weight)
    out = cupyconv.causal_conv1d_update(x, state, weight)
    fw = Jax()
    check_result(fw, out, want_out, "bfloat16")
    np.testing.assert_array_equal(state, want_state)


def test_update_continues_the_forward(mutable_fw):
    """Prefill with return_final_states, then decode token by token: equal to one forward."""
    fw = mutable_fw
    prefill, decode = 5, 4
    values = rand(BATCH, DIM, prefill + decode)
    x = fw.array(values, "float64")
    weight, bias = fw.array(rand(DIM, WIDTH), "float64"), fw.array(rand(DIM), "float64")
    full = cupyconv.causal_conv1d_fn(x, weight, bias, activation="silu")
    _, state = cupyconv.causal_conv1d_fn(
        x[:, :, :prefill], weight, bias, activation="silu", return_final_states=True
    )
    for t in range(prefill, prefill + decode):
        token = cupyconv.causal_conv1d_update(x[:, :, t], state, weight, bias, "silu")
        assert_close(token, to_numpy(full)[:, :, t], name=f"token {t}")


# ---- packed-sequence states ------------------------------------------------------------------


@pytest.mark.parametrize("state_len", [0, 1, 3, 6], ids=lambda s: f"state_len{s}")
@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_states(fw, dtype, state_len):
    cu_seqlens = [0, 2, 7, 7, 11]  # lengths 2, 5, 0, 4
    x = fw.array(rand(cu_seqlens[-1], DIM), dtype)
    states = cupyconv.causal_conv1d_varlen_states(x, fw.index(cu_seqlens, "int64"), state_len)
    want = reference.causal_conv1d_varlen_states(to_numpy(x), cu_seqlens, state_len)
    assert fw.is_native(states) and fw.dtype_name(states) == dtype
    assert tuple(states.shape) == (len(cu_seqlens) - 1, DIM, state_len)
    np.testing.assert_array_equal(to_numpy(states), want)  # copies: exact
    if fw.name != "jax" and state_len > 0:  # laid out [N, state_len, dim]
        shape = (len(cu_seqlens) - 1, DIM, state_len)
        assert fw.strides(states) == dense_strides(shape, (0, 2, 1))
