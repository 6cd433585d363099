"""cupyconv.compat, the drop-in for causal-conv1d 1.5.0: its functions against cupyconv's float64
oracle (``cupyconv.reference``, tolerances of ``cupyconv.testing``; states exactly), the
results 1.5.0 documents (return structures, layouts of final_states and dinitial_states,
writes into the caller's buffers, the extension's positional signatures), the lifted
restrictions, and ``install()`` (in fresh interpreters, and in this one for a Mamba-style
block written against the ``causal_conv1d`` import path).

Every case runs on CPU torch tensors (the reference path, in CI); the ``gpu`` variants run the
same code on CUDA tensors.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cupyconv.compat as compat  # noqa: E402
from cupyconv import reference  # noqa: E402
from cupyconv.compat import causal_conv1d_cuda  # noqa: E402
from cupyconv.testing import GRAD_TOLERANCE, assert_close, to_numpy, tolerance  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CPU = "cpu"
CUDA = pytest.param("cuda", marks=pytest.mark.gpu)
DEVICES = (CPU, CUDA)
BATCH, DIM, SEQLEN, WIDTH = 2, 16, 9, 4


_generator = torch.Generator()


@pytest.fixture(autouse=True)
def _cuda_torch_and_seed(request):
    """A gpu test also needs a CUDA build of torch; every test draws its inputs from a
    generator seeded by its name (the same values in any order of the tests)."""
    if "gpu" in request.keywords and not torch.cuda.is_available():
        pytest.skip("GPU test: torch has no CUDA device")
    _generator.manual_seed(zlib.crc32(request.node.name.encode()))


# ---- inputs and the oracle -------------------------------------------------------------------


def randn(*shape, dtype="float32", device=CPU, scale=1.0):
    values = scale * torch.randn(*shape, generator=_generator, dtype=torch.float64)
    return values.to(device=device, dtype=getattr(torch, dtype))


def channel_last(batch, dim, seqlen, dtype="float32", device=CPU):
    """x [batch, dim, seqlen] viewed from a [batch, seqlen, dim] buffer."""
    return randn(batch, seqlen, dim, dtype=dtype, device=device).transpose(1, 2)


def nan_buffer(shape, dtype, device, order=None):
    """A NaN-filled buffer of ``shape``, dims laid out outermost first in ``order``."""
    order = order or tuple(range(len(shape)))
    laid = torch.full([shape[d] for d in order], math.nan, dtype=dtype, device=device)
    return laid.permute(*np.argsort(order).tolist())


def oracle(x, weight, bias=None, seq_idx=None, initial_states=None, final=False, act=None):
    n = lambda a: None if a is None else to_numpy(a)
    return reference.causal_conv1d_fn(
        n(x), n(weight), n(bias), n(seq_idx), n(initial_states), return_final_states=final,
        activation=act,
    )  # fmt: skip


def oracle_bwd(x, weight, bias, dout, seq_idx=None, initial_states=None, dfinal=None, act=None):
    n = lambda a: None if a is None else to_numpy(a)
    return reference.causal_conv1d_bwd(
        n(x), n(weight), n(bias), n(dout), n(seq_idx), n(initial_states), n(dfinal),
        activation=act,
    )  # fmt: skip


def assert_grad_close(actual, expected, terms, name):
    """dweight / dbias: GRAD_TOLERANCE with the atol scaled by sqrt(terms in the reduction),
    and at least the rtol of the result's dtype (the sum is rounded to it once)."""
    rtol, atol = GRAD_TOLERANCE
    rtol = max(rtol, tolerance(actual.dtype)[0])
    assert_close(actual, expected, rtol=rtol, atol=atol * math.sqrt(terms), name=name)


def equal(actual, expected, name):
    """States are copies: exactly the oracle's values."""
    np.testing.assert_array_equal(to_numpy(actual), np.asarray(expected), err_msg=name)


# ---- causal_conv1d_fn and CausalConv1dFn ------------------------------------------------------

# (id, layout, dtype, width, has seq_idx, has initial_states): the first two run on 1.5.0 as
# well, the others on restrictions compat lifts.
FN_CASES = [
    ("channel-first", "cf", "float32", 4, False, False),
    ("channel-last-states", "cl", "bfloat16", 4, False, True),
    ("channel-first-seq_idx-states", "cf", "float32", 3, True, True),  # lifted: layout, combo
    ("channel-last-width-7-float64", "cl", "float64", 7, True, False),  # lifted: width, dtype
]
SEQ_IDX = [[0, 0, 0, 0, 1, 1, 1, -1, -1], [-1, 0, 0, 1, 1, 1, 1, 2, 2]]  # -1: padding


def fn_inputs(layout, dtype, width, has_seq_idx, has_init, device=CPU):
    if layout == "cl":
        x = channel_last(BATCH, DIM, SEQLEN, dtype, device)
    else:
        x = randn(BATCH, DIM, SEQLEN, dtype=dtype, device=device)
    weight = randn(DIM, width, device=device, scale=0.5)
    bias = randn(DIM, device=device)
    seq_idx = torch.tensor(SEQ_IDX, dtype=torch.int32, device=device) if has_seq_idx else None
    init = None
    if has_init:  # laid out [batch, width - 1, dim], as 1.5.0's callers make it
        init = randn(BATCH, width - 1, DIM, dtype=dtype, device=device).transpose(1, 2)
    return x, weight, bias, seq_idx, init


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", FN_CASES, ids=lambda c: c[0])
def test_fn_out_and_final_states(case, device):
    _, layout, dtype, width, has_seq_idx, has_init = case
    x, weight, bias, seq_idx, init = fn_inputs(layout, dtype, width, has_seq_idx, has_init, device)
    res = compat.causal_conv1d_fn(x, weight, bias, seq_idx, init, True, activation="silu")
    assert isinstance(res, tuple) and len(res) == 2
    out, final = res
    want, want_final = oracle(x, weight, bias, seq_idx, init, final=True, act="silu")
    assert_close(out, want)
    assert out.dtype == x.dtype and out.stride() == x.stride()  # x's memory order
    equal(final, want_final, "final_states")
    # final_states: [batch, dim, width - 1] laid out [batch, width - 1, dim], x's dtype
    assert final.shape == (BATCH, DIM, width - 1) and final.dtype == x.dtype
    assert final.stride() == ((width - 1) * DIM, 1, DIM)
    plain = compat.causal_conv1d_fn(x, weight, bias, seq_idx, init, activation="silu")
    assert isinstance(plain, torch.Tensor)  # one tensor without return_final_states
    assert torch.equal(plain, out)


@pytest.mark.parametrize("device", DEVICES)
def test_fn_writes_final_states_out(device):
    x, weight, bias, _, init = fn_inputs("cl", "float32", WIDTH, False, True, device)
    buffer = nan_buffer((BATCH, DIM, WIDTH - 1), x.dtype, device)  # dense [batch, dim, width-1]
    out, final = compat.causal_conv1d_fn(x, weight, bias, None, init, True, buffer)
    assert final is buffer
    equal(buffer, oracle(x, weight, bias, None, init, final=True)[1], "final_states_out")
    # without return_final_states the buffer is ignored, as in 1.5.0
    untouched = nan_buffer((BATCH, DIM, WIDTH - 1), x.dtype, device)
    out2 = compat.causal_conv1d_fn(x, weight, bias, None, init, False, untouched)
    assert isinstance(out2, torch.Tensor) and torch.isnan(untouched).all()
    assert torch.equal(out2, out)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_buffer", [False, True], ids=["new-final", "final_states_out"])
def test_causal_conv1d_fn_apply_gradients(with_buffer, device):
    """``CausalConv1dFn.apply`` in 1.5.0's argument order, differentiated through out and
    final_states (into final_states_out: the caller's tensor joins the graph)."""
    x, weight, bias, _, init = fn_inputs("cl", "float32", WIDTH, False, True, device)
    leaves = [t.detach().clone().requires_grad_() for t in (x, weight, bias, init)]
    buffer = (
        nan_buffer((BATCH, DIM, WIDTH - 1), x.dtype, device, (0, 2, 1)) if with_buffer else None
    )
    out, final = compat.CausalConv1dFn.apply(*leaves[:3], None, leaves[3], True, buffer, "silu")
    assert (final is buffer) == with_buffer
    dout = randn(BATCH, DIM, SEQLEN, device=device)
    dfinal = randn(BATCH, DIM, WIDTH - 1, device=device)
    ((out * dout).sum() + (final * dfinal).sum()).backward()
    dx, dweight, dbias, dinit = oracle_bwd(x, weight, bias, dout, None, init, dfinal, "silu")
    assert_close(leaves[0].grad, dx, name="dx")
    assert_grad_close(leaves[1].grad, dweight, BATCH * SEQLEN, "dweight")
    assert_grad_close(leaves[2].grad, dbias, BATCH * SEQLEN, "dbias")
    assert_close(leaves[3].grad, dinit, name="dinitial_states")


def test_final_states_out_checked_under_autograd():
    x, weight, bias, _, _ = fn_inputs("cl", "float32", WIDTH, False, False)
    weight.requires_grad_()
    wrong = torch.empty(BATCH, DIM, WIDTH)
    with pytest.raises(ValueError, match=r"final_states_out must have shape .*= \(2, 16, 3\)"):
        compat.causal_conv1d_fn(x, weight, bias, None, None, True, wrong)
    tracked = torch.zeros(BATCH, DIM, WIDTH - 1, requires_grad=True)
    with pytest.raises(ValueError, match="final_states_out must not require grad"):
        compat.causal_conv1d_fn(x, weight, bias, None, None, True, tracked)
    half = torch.empty(BATCH, DIM, WIDTH - 1, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"final_states_out must have the dtype of x"):
        compat.causal_conv1d_fn(x, weight, bias, None, None, True, half)


ACTIVATION_CALLS = {
    "causal_conv1d_fn": lambda x, s, w: compat.causal_conv1d_fn(x, w, activation="relu"),
    "causal_conv1d_update": lambda x, s, w: compat.causal_conv1d_update(x, s, w, None, "relu"),
    "causal_conv1d_ref": lambda x, s, w: compat.causal_conv1d_ref(x, w, activation="relu"),
    "causal_conv1d_update_ref": lambda x, s, w: compat.causal_conv1d_update_ref(
        x, s, w, None, "relu"
    ),
}


@pytest.mark.parametrize("name", ACTIVATION_CALLS)
def test_bad_activation_is_1_5_0s_error_and_cupyconvs(name):
    x, weight = randn(BATCH, DIM, SEQLEN), randn(DIM, WIDTH)
    state = torch.zeros(BATCH, DIM, WIDTH - 1)
    message = r"activation must be one of \(None, 'silu', 'swish'\); got 'relu'"
    for error in (NotImplementedError, ValueError):
        with pytest.raises(error, match=message):
            ACTIVATION_CALLS[name](x, state, weight)
    assert torch.equal(state, torch.zeros_like(state))  # refused before any write


# ---- causal_conv1d_update ---------------------------------------------------------------------

# (id, tokens (0: x is [batch, dim]), state_len, circular, gathered from a pool with padding)
UPDATE_CASES = [
    ("one-token-2d", 0, WIDTH - 1, False, False),
    ("three-tokens-sliding", 3, WIDTH + 2, False, False),
    ("circular-longer-than-state", 9, WIDTH + 1, True, False),
    ("pool-circular-padding", 2, WIDTH + 3, True, True),
]


def update_inputs(tokens, state_len, circular, pool, device=CPU, dtype="float32"):
    shape = (BATCH, DIM) if tokens == 0 else (BATCH, DIM, tokens)
    x = randn(*shape, dtype=dtype, device=device)
    rows = 5 if pool else BATCH
    # conv_state laid out [rows, state_len, dim], as vLLM-style pools are
    state = randn(rows, state_len, DIM, dtype=dtype, device=device).transpose(1, 2)
    lens = torch.tensor([7, 2], dtype=torch.int32, device=device) if circular else None
    idx = torch.tensor([3, -1], dtype=torch.int32, device=device) if pool else None
    return x, state, randn(DIM, WIDTH, device=device), randn(DIM, device=device), lens, idx


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", UPDATE_CASES, ids=lambda c: c[0])
def test_update_in_place(case, device):
    _, tokens, state_len, circular, pool = case
    x, state, weight, bias, lens, idx = update_inputs(tokens, state_len, circular, pool, device)
    before = to_numpy(state)
    out = compat.causal_conv1d_update(x, state, weight, bias, "silu", lens, idx)
    n = lambda a: None if a is None else to_numpy(a)
    want, want_state = reference.causal_conv1d_update(
        n(x), before, n(weight), n(bias), "silu", n(lens), n(idx)
    )
    assert out.shape == x.shape and out.dtype == x.dtype
    assert_close(out, want)
    equal(state, want_state, "conv_state")  # written in place, exactly
    if pool:  # the padding row gives 0 and touches nothing: only row 3 of the pool changed
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        changed = np.flatnonzero((to_numpy(state) != before).any(axis=(1, 2)))
        assert changed.tolist() == [3]


def test_update_refuses_a_short_state_before_writing():
    x, state, weight, bias, _, _ = update_inputs(1, WIDTH - 2, False, False)
    before = state.clone()
    with pytest.raises(ValueError, match=r"conv_state.shape\[2\] \(state_len\) must be at least"):
        compat.causal_conv1d_update(x, state, weight, bias)
    assert torch.equal(state, before)


# ---- the reference functions (torch, in weight's dtype) ----------------------------------------


@pytest.mark.parametrize("has_init", [False, True], ids=["zeros-before", "initial_states"])
@pytest.mark.parametrize("seqlen", [2, SEQLEN], ids=["shorter-than-width", "long"])
def test_causal_conv1d_ref_against_the_oracle(seqlen, has_init):
    x = randn(BATCH, DIM, seqlen)
    weight, bias = randn(DIM, WIDTH), randn(DIM)
    init = randn(BATCH, DIM, WIDTH - 1) if has_init else None
    buffer = nan_buffer((BATCH, DIM, WIDTH - 1), x.dtype, CPU, (0, 2, 1))
    out, final = compat.causal_conv1d_ref(x, weight, bias, init, True, buffer, "silu")
    want, want_final = oracle(x, weight, bias, None, init, final=True, act="silu")
    assert_close(out, want)
    assert final is buffer
    equal(final, want_final, "final_states")
    assert_close(
        compat.causal_conv1d_ref(x, weight, bias, init), oracle(x, weight, bias, None, init)
    )


def test_causal_conv1d_ref_computes_in_weight_dtype():
    """As in 1.5.0: x is cast to weight's dtype, the result back to x's."""
    x, weight = randn(BATCH, DIM, SEQLEN), randn(DIM, WIDTH, dtype="bfloat16")
    out = compat.causal_conv1d_ref(x, weight, activation="silu")
    assert out.dtype == torch.float32
    in_bf16 = compat.causal_conv1d_ref(x.to(torch.bfloat16), weight, activation="silu")
    assert torch.equal(out, in_bf16.float())
    assert not torch.equal(out, compat.causal_conv1d_ref(x, weight.float(), activation="silu"))


@pytest.mark.parametrize("case", UPDATE_CASES[:3], ids=lambda c: c[0])
def test_causal_conv1d_update_ref_against_the_oracle(case):
    _, tokens, state_len, circular, _ = case
    x, state, weight, bias, lens, _ = update_inputs(tokens, state_len, circular, False)
    before = to_numpy(state)
    out = compat.causal_conv1d_update_ref(x, state, weight, bias, "silu", lens)
    lens64 = None if lens is None else to_numpy(lens)
    want, want_state = reference.causal_conv1d_update(
        to_numpy(x), before, to_numpy(weight), to_numpy(bias), "silu", lens64
    )
    assert out.shape == x.shape
    assert_close(out, want)
    equal(state, want_state, "conv_state")


# ---- causal_conv1d_varlen ---------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_varlen_states(device):
    cu = torch.tensor([0, 3, 3, 12, 14], dtype=torch.int32, device=device)  # lengths 3 0 9 2
    x = randn(14, DIM, device=device, dtype="bfloat16")
    want = reference.causal_conv1d_varlen_states(to_numpy(x), to_numpy(cu), 5)
    ref = compat.causal_conv1d_varlen_states_ref(x, cu, 5)  # an empty sequence: zeros
    states = compat.causal_conv1d_varlen_states(x, cu, 5)
    for name, got in (("states", states), ("states_ref", ref)):
        equal(got, want, name)
        assert got.shape == (4, DIM, 5) and got.dtype == x.dtype
        assert got.stride() == (5 * DIM, 1, DIM)  # laid out [batch, state_len, dim]


# ---- causal_conv1d_cuda: the extension's entry points ------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_extension_fwd(device):
    x, weight, bias, seq_idx, init = fn_inputs("cl", "float32", WIDTH, True, True, device)
    x.requires_grad_()  # the extension's result is not differentiable
    buffer = nan_buffer((BATCH, DIM, WIDTH - 1), x.dtype, device, (0, 2, 1))
    out = causal_conv1d_cuda.causal_conv1d_fwd(x, weight, bias, seq_idx, init, buffer, True)
    assert isinstance(out, torch.Tensor) and not out.requires_grad
    want, want_final = oracle(x, weight, bias, seq_idx, init, final=True, act="silu")
    assert_close(out, want)
    equal(buffer, want_final, "final_states_out")
    plain = causal_conv1d_cuda.causal_conv1d_fwd(x, weight, None, None, None, None, False)
    assert_close(plain, oracle(x, weight))


def test_extension_signatures_are_positional():
    x, weight = randn(BATCH, DIM, SEQLEN), randn(DIM, WIDTH)
    with pytest.raises(TypeError, match="positional-only"):
        causal_conv1d_cuda.causal_conv1d_fwd(
            x, weight, None, None, None, None, silu_activation=True
        )
    with pytest.raises(TypeError, match="missing 1 required positional argument"):
        causal_conv1d_cuda.causal_conv1d_fwd(x, weight, None, None, None, None)
    with pytest.raises(TypeError, match="silu_activation must be a bool; got str"):
        causal_conv1d_cuda.causal_conv1d_fwd(x, weight, None, None, None, None, "silu")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("has_init", [False, True], ids=["zero-state", "initial_states"])
def test_extension_bwd(has_init, device):
    """mamba_ssm's call: ``dx, dweight, dbias, *_ = causal_conv1d_bwd(..., dx, False, True)``,
    and 1.5.0's with dinitial_states, laid out [batch, width - 1, dim]."""
    x, weight, bias, _, init = fn_inputs("cl", "float32", WIDTH, False, has_init, device)
    if has_init:  # dense [batch, dim, width - 1]: dinitial_states is still laid out as in 1.5.0
        init = init.contiguous()
    dout = randn(BATCH, SEQLEN, DIM, device=device).transpose(1, 2)
    dfinal = randn(BATCH, DIM, WIDTH - 1, device=device)
    dx = nan_buffer((BATCH, DIM, SEQLEN), x.dtype, device, (0, 2, 1))
    grads = causal_conv1d_cuda.causal_conv1d_bwd(
        x, weight, bias, dout, None, init, dfinal, dx, True, True
    )
    assert isinstance(grads, list) and len(grads) == 4 and grads[0] is dx
    zeros = torch.zeros(BATCH, DIM, WIDTH - 1, device=device)
    want = oracle_bwd(x, weight, bias, dout, None, zeros if init is None else init, dfinal, "silu")
    assert_close(dx, want[0], name="dx")
    assert_grad_close(grads[1], want[1], BATCH * SEQLEN, "dweight")
    assert_grad_close(grads[2], want[2], BATCH * SEQLEN, "dbias")
    assert_close(grads[3], want[3], name="dinitial_states")
    assert grads[3].stride() == ((WIDTH - 1) * DIM, 1, DIM)
    plain = causal_conv1d_cuda.causal_conv1d_bwd(
        x, weight, None, dout, None, None, None, None, False, False
    )
    assert plain[2] is None and plain[3] is None  # no bias, no dinitial_states asked for
    assert plain[1].dtype == weight.dtype and plain[0].stride() == x.stride()
    assert_close(plain[0], oracle_bwd(x, weight, None, dout)[0], name="dx")


@pytest.mark.parametrize("device", DEVICES)
def test_extension_update(device):
    x, state, weight, bias, lens, idx = update_inputs(2, WIDTH + 3, True, True, device)
    before = to_numpy(state)
    out = causal_conv1d_cuda.causal_conv1d_update(x, state, weight, bias, True, lens, idx)
    want, want_state = reference.causal_conv1d_update(
        to_numpy(x), before, to_numpy(weight), to_numpy(bias), "silu", to_numpy(lens),
        to_numpy(idx),
    )  # fmt: skip
    assert_close(out, want)
    equal(state, want_state, "conv_state")


# ---- install() ---------------------------------------------------------------------------------


def run_python(code: str, *pythonpath) -> dict:
    """Run ``code`` in a fresh interpreter with ROOT (and ``pythonpath``) importable; the JSON
    object it prints last."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*map(str, pythonpath), str(ROOT)])}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


INSTALL_TWICE = """
    import json, sys, warnings
    import cupyconv.compat
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        first, second = cupyconv.compat.install(), cupyconv.compat.install()
"""


def test_install_resolves_the_import_paths_once():
    report = run_python(
        INSTALL_TWICE
        + """
    import causal_conv1d, causal_conv1d_cuda
    import causal_conv1d.causal_conv1d_interface as interface
    from causal_conv1d import causal_conv1d_fn, causal_conv1d_update
    from causal_conv1d.causal_conv1d_varlen import causal_conv1d_varlen_states
    c = cupyconv.compat
    try:
        import causal_conv1d.missing
        missing = "imported"
    except ModuleNotFoundError as e:
        missing = str(e)
    print(json.dumps({
        "installed": [first, second, cupyconv.compat.install()],
        "said": [(w.category.__name__, str(w.message)) for w in said],
        "same": [causal_conv1d is c.causal_conv1d, interface is c.causal_conv1d_interface,
                 causal_conv1d_cuda is c.causal_conv1d_cuda,
                 causal_conv1d_fn is c.causal_conv1d_fn,
                 causal_conv1d_update is c.causal_conv1d_update,
                 causal_conv1d_varlen_states is c.causal_conv1d_varlen_states,
                 interface.causal_conv1d_cuda is causal_conv1d_cuda,
                 sys.modules["causal_conv1d.causal_conv1d_varlen"] is c.causal_conv1d_varlen],
        "version": causal_conv1d.__version__,
        "spec": causal_conv1d.__spec__.name,
        "missing": missing,
        "torch": "torch" in sys.modules,
    }))
    """
    )
    assert report["installed"] == [True, True, True]
    ((category, message),) = report["said"]  # once
    assert category == "CompatWarning"
    assert message.startswith("causal_conv1d is not installed: cupyconv.compat.install() resolves")
    assert all(report["same"]), report["same"]
    assert report["version"] == "1.5.0"
    assert report["spec"] == "cupyconv.compat.causal_conv1d"  # the module keeps its own spec
    assert report["missing"] == "No module named 'causal_conv1d.missing'"
    assert report["torch"] is False  # install() and the imports load no torch


def test_install_leaves_the_real_package_alone(tmp_path):
    (tmp_path / "causal_conv1d").mkdir()
    (tmp_path / "causal_conv1d" / "__init__.py").write_text('__version__ = "real"\n')
    report = run_python(
        INSTALL_TWICE
        + """
    import causal_conv1d
    try:
        import causal_conv1d_cuda
        cuda = "imported"
    except ModuleNotFoundError:
        cuda = "absent"
    print(json.dumps({"installed": [first, second], "version": causal_conv1d.__version__,
                      "said": [str(w.message) for w in said], "cuda": cuda}))
    """,
        tmp_path,
    )
    assert report["installed"] == [False, False]
    assert report["version"] == "real" and report["cuda"] == "absent"
    ((message,),) = [report["said"]]
    assert message.startswith("causal_conv1d is importable (") and str(tmp_path) in message
    assert message.endswith("cupyconv.compat.install() leaves it alone")


@pytest.fixture
def causal_conv1d_path(monkeypatch):
    """install() in this process, undone afterwards (meta path, module aliases, its notice)."""
    if importlib.util.find_spec("causal_conv1d") is not None:
        pytest.skip("the real causal-conv1d is importable here")
    monkeypatch.setattr(compat, "_announced", False)
    saved = list(sys.meta_path)
    try:
        with pytest.warns(compat.CompatWarning, match="causal_conv1d is not installed"):
            assert compat.install() is True
        yield
    finally:
        sys.meta_path[:] = saved
        for name in compat.MODULES:
            sys.modules.pop(name, None)


# ---- a Mamba-style block written against causal_conv1d ----------------------------------------


def mamba_block(device, dtype):
    """in_proj -> conv (prefill with final states on a channel-last slice of the projection) ->
    decode token by token from a circular state pool with padding rows -> a training step;
    every conv result against the float64 oracle."""
    from causal_conv1d import causal_conv1d_fn, causal_conv1d_update

    assert causal_conv1d_fn is compat.causal_conv1d_fn
    batch, d_model, dim, width, prompt, steps, state_len = 2, 8, 16, 4, 11, 5, 6
    seqlen = prompt + steps
    kind = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(0)
    make = lambda *shape, scale=1.0: (scale * torch.randn(*shape, generator=gen)).to(device, kind)
    in_proj = torch.nn.Linear(d_model, 2 * dim, bias=False, device=device, dtype=kind)
    out_proj = torch.nn.Linear(dim, d_model, bias=False, device=device, dtype=kind)
    with torch.no_grad():
        in_proj.weight.copy_(make(2 * dim, d_model, scale=0.3))
        out_proj.weight.copy_(make(d_model, dim, scale=0.3))
    weight = make(dim, width, scale=0.5).requires_grad_()
    bias = make(dim).requires_grad_()
    u = make(batch, seqlen, d_model)

    # -- inference: prefill the prompt, then decode from a pool of circular states
    with torch.no_grad():
        xz = in_proj(u)  # [batch, seqlen, 2 * dim]
        x = xz[..., :dim].transpose(1, 2)  # [batch, dim, seqlen]: a channel-last slice
        want = oracle(x, weight, bias, act="silu")
        out, final = causal_conv1d_fn(x[..., :prompt], weight, bias, None, None, True, None, "silu")
        assert final.stride() == ((width - 1) * dim, 1, dim)
        pool = make(5, state_len, dim).transpose(1, 2)  # [rows, dim, state_len]
        rows = torch.tensor([3, -1, 0, -1], dtype=torch.int32, device=device)  # -1: padding
        lens = torch.tensor([prompt, 0, prompt, 0], dtype=torch.int32, device=device)
        history = (prompt - (width - 1) + torch.arange(width - 1, device=device)) % state_len
        pool[3][:, history], pool[0][:, history] = final[0], final[1]
        expected_pool = to_numpy(pool)
        decoded = []
        for t in range(prompt, seqlen):
            token = torch.full((2 * batch, dim), math.nan, dtype=kind, device=device)
            token[0::2] = xz[:, t, :dim]  # padding rows hold NaN: it must reach nothing
            step = causal_conv1d_update(token, pool, weight, bias, "silu", lens, rows)
            assert torch.equal(step[1::2], torch.zeros_like(step[1::2]))
            decoded.append(step[0::2])
            lens += 1
        for b, row in enumerate((3, 0)):
            for t in range(prompt - (width - 1), seqlen):
                expected_pool[row][:, t % state_len] = to_numpy(x[b, :, t])
        whole = torch.cat([out, torch.stack(decoded, dim=2)], dim=2)
    assert_close(whole, want, name="prefill + decode")
    equal(pool, expected_pool, "state pool")

    # -- a training step through autograd
    xz = in_proj(u)
    x, z = xz[..., :dim].transpose(1, 2), xz[..., dim:].transpose(1, 2)
    x.retain_grad()
    conv = causal_conv1d_fn(x, weight, bias, activation="silu")
    conv.retain_grad()
    y = out_proj((conv * torch.nn.functional.silu(z)).transpose(1, 2))
    loss = y.float().pow(2).mean()
    loss.backward()
    assert_close(conv, want, name="training forward")
    dx, dweight, dbias, _ = oracle_bwd(x, weight, bias, conv.grad, act="silu")
    assert_close(x.grad, dx, name="dx")
    assert_grad_close(weight.grad, dweight, batch * seqlen, "dweight")
    assert_grad_close(bias.grad, dbias, batch * seqlen, "dbias")
    assert in_proj.weight.grad is not None and torch.isfinite(in_proj.weight.grad).all()
    params = [weight, bias, *in_proj.parameters(), *out_proj.parameters()]
    torch.optim.SGD(params, lr=0.05).step()
    with torch.no_grad():
        xz = in_proj(u)
        conv = causal_conv1d_fn(xz[..., :dim].transpose(1, 2), weight, bias, activation="silu")
        y = out_proj((conv * torch.nn.functional.silu(xz[..., dim:].transpose(1, 2))).mT)
    assert y.float().pow(2).mean() < loss  # the step went downhill


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mamba_block_through_causal_conv1d(causal_conv1d_path, dtype):
    mamba_block(CPU, dtype)


@pytest.mark.gpu
def test_mamba_block_through_causal_conv1d_gpu(causal_conv1d_path):
    mamba_block("cuda", "bfloat16")
