"""Nothing lost, nothing leaked: exact overlap detection, masking by selection, every check before
the first write, a named ValueError or TypeError for every bad input (CPU arrays; the GPU path's
share of these is in test_forward_gpu.py).

Each reproducer is one test; two hypothesis properties cover the rest: the overlap test against
``np.shares_memory`` on random views of one buffer, and random invalid calls of every operator,
which must raise a ValueError or TypeError naming an argument and leave every caller buffer
byte for byte as it was.
"""

from __future__ import annotations

import re
import sys
import types

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_validation import OPS, valid_args

import cupyconv as cc
from cupyconv import _arrays, reference
from cupyconv._overlap import views_overlap
from cupyconv.testing import assert_close

# ---- 1. overlapping buffers: found exactly, disjoint ones accepted ----------------------------


def test_init_covering_out_is_refused_and_left_alone():
    buf = np.zeros((1, 2, 16))
    init, out = buf[:, :, 0:8], buf[:, :, 5:7]
    with pytest.raises(ValueError, match="^out must not share memory with initial_states"):
        cc.causal_conv1d_fn(np.ones((1, 2, 2)), np.ones((2, 9)), initial_states=init, out=out)
    assert not buf.any()


def test_final_states_out_inside_out_is_refused():
    base = np.zeros((1, 2, 12))
    out, fin = base[:, :, 0:10], base[:, :, 6:8]
    with pytest.raises(ValueError, match="^final_states_out must not share memory with out"):
        cc.causal_conv1d_fn(
            np.ones((1, 2, 10)), np.ones((2, 3)), out=out, return_final_states=True,
            final_states_out=fin,
        )  # fmt: skip
    assert not base.any()


def test_disjoint_views_of_one_buffer_are_accepted():
    buf = np.zeros((1, 2, 16))
    init, out = buf[:, :, 0:2], buf[:, :, 5:15]
    x, w = np.ones((1, 2, 10)), np.ones((2, 3))
    got = cc.causal_conv1d_fn(x, w, initial_states=init, out=out)
    assert got is out
    assert_close(out, reference.causal_conv1d_fn(x, w, initial_states=np.zeros((1, 2, 2))))


def test_final_states_out_inside_x_is_refused():
    x = np.ones((1, 2, 10))
    with pytest.raises(ValueError, match="^final_states_out must not share memory with x"):
        cc.causal_conv1d_fn(
            x, np.ones((2, 3)), return_final_states=True, final_states_out=x[:, :, 3:5]
        )
    assert (x == 1).all()


@pytest.mark.parametrize("inside", ["initial_states", "dfinal_states"])
def test_dx_inside_a_state_is_refused(inside):
    states = np.ones((1, 2, 12))
    args = dict(x=np.ones((1, 2, 4)), weight=np.ones((2, 9)), bias=None, dout=np.ones((1, 2, 4)))
    args[inside] = states[:, :, :8]
    with pytest.raises(ValueError, match=f"^dx must not share memory with {inside}"):
        cc.causal_conv1d_bwd(**args, dx=states[:, :, 5:9])
    assert (states == 1).all()


def test_conv_state_inside_x_is_refused():
    x = np.ones((2, 4, 8))
    with pytest.raises(ValueError, match="^conv_state must not share memory with x"):
        cc.causal_conv1d_update(x, x[:, :, 1:4], np.ones((4, 3)))
    assert (x == 1).all()


def test_views_whose_strides_are_not_whole_elements():
    """A float64 view with a 12-byte stride overlaps its neighbours' bytes: found exactly."""
    buf = np.zeros(64)
    x = np.ndarray((1, 2, 3), np.float64, buf, 0, (144, 144, 12))
    out = np.ndarray((1, 2, 3), np.float64, buf, 8, (144, 144, 16))
    assert np.shares_memory(x, out)
    with pytest.raises(ValueError, match="^out must not share memory with x"):
        cc.causal_conv1d_fn(x, np.ones((2, 2)), out=out)
    assert not buf.any()


def test_gpu_strides_must_be_whole_elements():
    from fakes import FakeCudaArray

    x = FakeCudaArray((1, 2, 3), (12, 12, 1), np.float64)
    x.__cuda_array_interface__["strides"] = (144, 144, 12)
    with pytest.raises(ValueError, match="^x must have strides that are whole elements"):
        cc.causal_conv1d_fn(x, FakeCudaArray((2, 2), dtype=np.float64))


def _view(rng, buf):
    """A random strided view of ``buf`` (uint8) as some dtype, inside its bounds; the byte strides
    need not be whole elements."""
    itemsize = int(rng.choice([1, 2, 4, 8]))
    ndim = int(rng.integers(1, 4))
    shape = tuple(int(n) for n in rng.integers(0, 6, ndim))
    strides = tuple(int(s) for s in rng.integers(-24, 25, ndim))
    lo = sum(s * (n - 1) for s, n in zip(strides, shape) if s < 0 and n > 0)
    hi = sum(s * (n - 1) for s, n in zip(strides, shape) if s > 0 and n > 0) + itemsize
    offset = int(rng.integers(-lo, max(-lo, buf.size - hi) + 1))
    dtype = {1: np.uint8, 2: np.float16, 4: np.float32, 8: np.float64}[itemsize]
    return np.ndarray(shape, dtype, buf, offset, strides)


_BUFFER = np.zeros(512, np.uint8)


@settings(max_examples=10_000, deadline=None, derandomize=True)
@given(st.integers(0, 2**63))
def test_overlap_is_exact(seed):
    """Two random views of one buffer: views_overlap agrees with numpy's exact answer."""
    rng = np.random.default_rng(seed)
    a, b = _view(rng, _BUFFER), _view(rng, _BUFFER)
    want = np.shares_memory(a, b, max_work=None)
    assert views_overlap(_arrays.describe(a, "a"), _arrays.describe(b, "b")) == want


# ---- 2. masking selects: non-finite values stay in their segment -----------------------------


def test_inf_stays_in_its_segment():
    s = np.array([[0, 0, 1, 1]], np.int32)
    got = cc.causal_conv1d_fn(np.array([[[1.0, np.inf, 1, 1]]]), np.ones((1, 2)), seq_idx=s)
    np.testing.assert_array_equal(got, [[[1, np.inf, 1, 2]]])


def test_nan_at_padding_reaches_nobody():
    s = np.array([[0, -1, 1, 1]], np.int32)
    got = cc.causal_conv1d_fn(np.array([[[1.0, np.nan, 1, 1]]]), np.ones((1, 2)), seq_idx=s)
    np.testing.assert_array_equal(got, [[[1, 0, 1, 2]]])


def test_final_states_after_padding_are_zero_despite_nan():
    s = np.array([[0, 0, 1, -1]], np.int32)
    x = np.array([[[1.0, np.nan, 2, np.nan]]])
    _, final = cc.causal_conv1d_fn(x, np.ones((1, 3)), seq_idx=s, return_final_states=True)
    np.testing.assert_array_equal(final, [[[0, 0]]])


def test_backward_keeps_non_finite_padding_out_of_the_reductions():
    s = np.array([[-1, -1, 1, 1, 1]], np.int32)
    x = np.array([[[np.nan, np.inf, 1.0, 2.0, 3.0]]])
    dout = np.array([[[np.nan, 5.0, 1.0, 1.0, 1.0]]])
    dx, dweight, dbias, _ = cc.causal_conv1d_bwd(x, np.ones((1, 2)), np.zeros(1), dout, seq_idx=s)
    np.testing.assert_array_equal(dweight, [[3.0, 6.0]])  # taps of x[2..4] within segment 1
    np.testing.assert_array_equal(dbias, [3.0])
    np.testing.assert_array_equal(dx, [[[0.0, 0.0, 2.0, 2.0, 1.0]]])


# ---- 3. no write before a refusal --------------------------------------------------------------


def _torch():
    return pytest.importorskip("torch")


@pytest.mark.parametrize("buffer", ["out", "final_states_out"])
def test_torch_output_requiring_grad_is_refused_before_any_write(buffer):
    torch = _torch()
    x, w = torch.ones(1, 2, 5), torch.ones(2, 3)
    out, fin = torch.zeros(1, 2, 5), torch.zeros(1, 2, 2)
    {"out": out, "final_states_out": fin}[buffer].requires_grad_(True)
    with pytest.raises(ValueError, match=f"^{buffer} must not require grad"):
        cc.causal_conv1d_fn(x, w, return_final_states=True, final_states_out=fin, out=out)
    assert not out.detach().any() and not fin.detach().any()


def test_torch_dx_and_conv_state_requiring_grad_are_refused():
    torch = _torch()
    x, w = torch.ones(1, 2, 5), torch.ones(2, 3)
    dx = torch.zeros(1, 2, 5, requires_grad=True)
    with pytest.raises(ValueError, match="^dx must not require grad"):
        cc.causal_conv1d_bwd(x, w, None, torch.ones(1, 2, 5), dx=dx)
    state = torch.zeros(1, 2, 4, requires_grad=True)
    with pytest.raises(ValueError, match="^conv_state must not require grad"):
        cc.causal_conv1d_update(x, state, w)
    assert not dx.detach().any() and not state.detach().any()


def test_inference_conv_state_is_refused_outside_inference_mode_and_not_advanced():
    torch = _torch()
    with torch.inference_mode():
        state = torch.arange(8.0).reshape(1, 2, 4)
    before = state.clone()
    with pytest.raises(ValueError, match="^conv_state is an inference tensor"):
        cc.causal_conv1d_update(torch.ones(1, 2), state, torch.ones(2, 3))
    assert torch.equal(state, before)
    with torch.inference_mode():  # inside it, the same call runs
        out = cc.causal_conv1d_update(torch.ones(1, 2), state, torch.ones(2, 3))
    assert torch.equal(state[0, 0], torch.tensor([1.0, 2.0, 3.0, 1.0])) and out.shape == (1, 2)


# ---- 4. other exception types ------------------------------------------------------------------


def test_sparse_tensor_is_a_type_error():
    torch = _torch()
    with pytest.raises(TypeError, match=r"^x must be a dense \(strided\) tensor; got layout"):
        cc.causal_conv1d_fn(torch.ones(1, 2, 5).to_sparse(), torch.ones(2, 3))


def test_negative_bit_tensor_is_read_by_value():
    torch = _torch()
    a, b = torch.randn(1, 2, 6, dtype=torch.float64), torch.randn(1, 2, 6, dtype=torch.float64)
    x = torch.complex(a, b).conj().imag  # -b, with the negative bit set
    assert x.is_neg()
    w = torch.randn(2, 3, dtype=torch.float64)
    got = cc.causal_conv1d_fn(x, w)
    assert_close(got, reference.causal_conv1d_fn(-b.numpy(), w.numpy()))


def test_cuda_interface_without_dlpack_device_and_without_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError
    x = types.SimpleNamespace(
        __cuda_array_interface__=dict(
            shape=(1, 2, 5), typestr="<f4", data=(0x7F0000000000, False), strides=None, version=3
        )
    )
    with pytest.raises(TypeError, match="^x is a CUDA array .* needs CuPy"):
        cc.causal_conv1d_fn(x, np.ones((2, 3), np.float32))


# ---- 5. messages that name the argument --------------------------------------------------------


def test_activation_array_is_named():
    with pytest.raises(ValueError, match=r"^activation must be one of"):
        cc.causal_conv1d_fn(np.ones((1, 2, 5)), np.ones((2, 3)), activation=np.array(["silu"]))


def test_cu_seqlens_past_the_tokens():
    with pytest.raises(ValueError, match="^cu_seqlens must end at most at the number of tokens"):
        cc.causal_conv1d_varlen_states(np.ones((5, 2)), np.array([0, 9], np.int32), 3)


def test_huge_state_len_is_refused_before_allocating():
    with pytest.raises(ValueError, match="^state_len must be between 0 and"):
        cc.causal_conv1d_varlen_states(np.ones((5, 2)), np.array([0, 5], np.int32), 2**40)


def test_conv_state_index_out_of_range():
    with pytest.raises(ValueError, match=r"^conv_state_indices must be below conv_state.shape"):
        cc.causal_conv1d_update(
            np.ones((2, 3)), np.zeros((2, 3, 4)), np.ones((3, 3)),
            conv_state_indices=np.array([1, 2], np.int32),
        )  # fmt: skip


def test_big_endian_is_a_byte_order_error():
    x = np.ones((1, 2, 5), ">f4")
    with pytest.raises(TypeError, match="^x must be in the machine's byte order; got a byte-swap"):
        cc.causal_conv1d_fn(x, np.ones((2, 3), np.float32))


# ---- 6. index values: checked on the CPU, and on the GPU in debug mode ------------------------


@pytest.mark.parametrize(
    "cu,message",
    [
        ([1, 3, 5], "^cu_seqlens must start at 0; got 1"),
        ([0, 4, 2, 5], "^cu_seqlens must be non-decreasing; got 4 then 2"),
        ([0, 6], "^cu_seqlens must end at most"),
    ],
)
def test_cu_seqlens_values(cu, message):
    with pytest.raises(ValueError, match=message):
        cc.causal_conv1d_varlen_states(np.ones((5, 2)), np.array(cu, np.int64), 2)


def test_debug_mode_reads_gpu_index_values(monkeypatch):
    """Without debug mode a GPU index array is not read (it would synchronise); with it, its
    values are copied to the host and checked."""
    from cupyconv import _validate

    seen = []
    monkeypatch.setattr(_arrays.Array, "on_gpu", property(lambda self: True))
    cu = _arrays.describe(np.array([0, 9], np.int32), "cu_seqlens")
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(
        asarray=lambda a: a, asnumpy=lambda a: seen.append(a) or np.asarray(a)
    ))  # fmt: skip
    monkeypatch.setattr(_validate, "DEBUG_ENV", False)
    _validate.cu_seqlens_values(cu, 5)  # not read
    assert seen == []
    with cc.debug(), pytest.raises(ValueError, match="^cu_seqlens must end at most"):
        _validate.cu_seqlens_values(cu, 5)
    assert len(seen) == 1 and not _validate.debug_enabled()
    monkeypatch.setattr(_validate, "DEBUG_ENV", True)  # CUPYCONV_DEBUG=1 at import
    assert _validate.debug_enabled()


# ---- the property: random invalid calls ------------------------------------------------------

OUTPUTS = {"fn": ("out", "final_states_out"), "bwd": ("dx",), "update": ("conv_state",)}
NAMES = {
    "fn": ("x", "weight", "bias", "seq_idx", "initial_states", "final_states_out", "out",
           "activation", "return_final_states"),
    "bwd": ("x", "weight", "bias", "dout", "seq_idx", "initial_states", "dfinal_states", "dx",
            "activation", "return_dinitial_states"),
    "update": ("x", "conv_state", "weight", "bias", "activation", "cache_seqlens",
               "conv_state_indices"),
    "varlen": ("x", "cu_seqlens", "state_len"),
}  # fmt: skip
INDEX_ARGS = ("seq_idx", "cache_seqlens", "conv_state_indices", "cu_seqlens")
# Sizes that may grow in a valid call: the tokens of packed x, the pool and state_len of
# conv_state, the new tokens and the width of the update (state_len allowing), the channels
# of packed x, the sequences.
FREE_SIZES = {("varlen", "x", 0), ("update", "conv_state", 0), ("update", "conv_state", 2)}
FREE_SIZES |= {("update", "x", 2), ("update", "weight", 1), ("varlen", "x", 1)}
FREE_SIZES |= {("varlen", "cu_seqlens", 0)}


def _corrupt(draw, op: str, args: dict) -> None:
    """Make one argument of a valid call invalid, in one of many ways (in place)."""
    arrays = [n for n, a in args.items() if isinstance(a, np.ndarray)]
    outputs = [n for n in OUTPUTS.get(op, ()) if args.get(n) is not None]
    kinds = ["shape", "ndim", "dtype", "not_array", "activation", "index"]
    kinds += ["alias", "self_overlap", "read_only", "requires_grad"] if outputs else []
    kind = draw(st.sampled_from(kinds))
    if kind == "activation" and "activation" in args:
        args["activation"] = draw(st.sampled_from(["relu", "SiLU", 1, np.array(["silu"])]))
        return
    if kind == "index" and op in ("update", "varlen"):
        if op == "update":
            args["conv_state_indices"] = np.array([0, draw(st.integers(2, 9))], np.int32)
        else:
            args["cu_seqlens"] = np.array(draw(st.sampled_from([[1, 5], [0, 4, 2], [0, 99]])))
        return
    if kind in ("alias", "self_overlap", "read_only", "requires_grad"):
        name = draw(st.sampled_from(outputs))
        a = args[name]
        if kind == "self_overlap":  # strides that write some element twice
            axis = draw(st.sampled_from([d for d in range(a.ndim) if a.shape[d] > 1]))
            strides = list(a.strides)
            strides[axis] = draw(st.sampled_from([0, a.itemsize])) if axis != a.ndim - 1 else 0
            args[name] = np.lib.stride_tricks.as_strided(a, a.shape, strides)
        elif kind == "read_only":
            a.flags.writeable = False
        elif kind == "requires_grad":
            torch = pytest.importorskip("torch")
            args[name] = torch.from_numpy(a).requires_grad_(True)
        else:  # the output becomes a view overlapping an input
            other = draw(st.sampled_from([n for n in arrays if n != name]))
            src = args[other]
            flat = src.reshape(-1)
            need = a.size
            if flat.size < need or flat.dtype != a.dtype:
                return _corrupt(draw, op, args)
            start = draw(st.integers(0, flat.size - need))
            args[name] = flat[start : start + need].reshape(a.shape)
        return
    name = draw(st.sampled_from(arrays))
    a = args[name]
    axes = [d for d in range(a.ndim) if (op, name, d) not in FREE_SIZES]
    if kind == "shape" and not axes:
        kind = "dtype"
    if kind == "shape":
        axis = draw(st.sampled_from(axes))
        shape = list(a.shape)
        shape[axis] += draw(st.sampled_from([1, 2, 5]))
        args[name] = np.zeros(shape, a.dtype)
    elif kind == "ndim":
        args[name] = a[None] if draw(st.booleans()) else a.reshape(-1)[:1].reshape(())
    elif kind == "dtype":
        bad = np.float32 if name in INDEX_ARGS else draw(st.sampled_from([np.int32, np.bool_]))
        args[name] = a.astype(bad)
    else:
        args[name] = a.tolist()
    if args[name] is not None and not isinstance(args[name], list) and args[name].shape == a.shape:
        if args[name].dtype == a.dtype:  # the change did nothing: try another
            return _corrupt(draw, op, args)
    return None


def _snapshot(args: dict) -> dict:
    snap = {}
    for n, a in args.items():
        if isinstance(a, np.ndarray):
            base = a if a.base is None else a.base
            snap[n] = (base, np.array(base, copy=True).tobytes())
        elif type(a).__module__.startswith("torch"):
            snap[n] = (a, a.detach().clone().numpy().tobytes())
    return snap


@settings(
    max_examples=600, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(st.data())
def test_random_invalid_calls_raise_named_errors_and_change_nothing(data):
    op = data.draw(st.sampled_from(list(OPS)))
    args = valid_args(op)
    for a in args.values():  # non-finite values in the valid arrays change nothing here
        if isinstance(a, np.ndarray) and a.dtype.kind == "f" and data.draw(st.booleans()):
            a.reshape(-1)[data.draw(st.integers(0, a.size - 1))] = np.nan
    _corrupt(data.draw, op, args)
    snap = _snapshot(args)
    with pytest.raises((ValueError, TypeError)) as info:
        OPS[op](**args)
    assert type(info.value) in (ValueError, TypeError)
    message = str(info.value)
    assert any(re.search(rf"\b{n}\b", message) for n in NAMES[op]), message
    for n, (obj, before) in snap.items():
        now = obj.detach().numpy() if hasattr(obj, "detach") else obj
        assert np.array(now).tobytes() == before, f"{n} changed by a refused call ({message})"
