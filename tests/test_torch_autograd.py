"""torch autograd and torch.compile through cupyconv's custom operators (cupyconv/_torch_ops.py).

Every case runs on the CPU (the float64 reference path, in CI) and, with the ``gpu`` marker, on
a CUDA device. Gradients are checked three ways: ``torch.autograd.gradcheck`` in float64 (finite
differences), against the float64 oracle ``reference.causal_conv1d_bwd`` with the tolerances of
``cupyconv.testing``, and compiled against eager. ``torch.library.opcheck`` checks each
operator's schema, fake implementation (same shapes and strides as the real one), autograd
registration and AOT dispatch. On the CPU torch.compile uses the ``aot_eager`` backend (dynamo
and AOTAutograd with the fake implementations, no C++ compiler); the GPU adds inductor and
``mode="reduce-overhead"`` (CUDA graphs).
"""

from __future__ import annotations

import math
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cupyconv  # noqa: E402
import cupyconv._torch_ops as torch_ops  # noqa: E402 - registers the operators
from cupyconv import reference  # noqa: E402
from cupyconv.testing import GRAD_TOLERANCE, assert_close, tolerance  # noqa: E402

BATCH, DIM, SEQLEN, WIDTH = 2, 3, 9, 4
SEQ_IDX = [[0, 0, 0, 0, 1, 1, 1, -1, -1], [-1, 0, 0, 1, 1, 1, 1, 2, 2]]  # -1: padding
LAYOUTS = ("cf", "cl", "slice")  # channel-first, channel-last, channel slice of a projection
CPU = "cpu"
CUDA = pytest.param("cuda", marks=pytest.mark.gpu)
DEVICES = (CPU, CUDA)


@pytest.fixture(autouse=True)
def _cuda_torch(request):
    """A gpu test also needs a CUDA build of torch."""
    if "gpu" in request.keywords and not torch.cuda.is_available():
        pytest.skip("GPU test: torch has no CUDA device")


# ---- inputs ----------------------------------------------------------------------------------


def rounded(rng, shape, dtype, scale=1.0) -> np.ndarray:
    """Standard normal values times ``scale``, rounded to ``dtype`` (kept in float64)."""
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype
    return (scale * rng.standard_normal(shape)).astype(np_dtype).astype(np.float64)


def tensor(values, dtype, device, grad=False):
    t = torch.tensor(values, dtype=getattr(torch, dtype), device=device)
    return t.requires_grad_(grad)


class Input:
    """x [batch, dim, seqlen] in a layout: ``leaf`` is the tensor autograd differentiates (the
    caller's buffer) and ``view(leaf)`` the x passed to cupyconv. cf: the leaf itself; cl: a
    [batch, seqlen, dim] leaf transposed; slice: the middle third of the channels of a
    [batch, seqlen, 3 * dim] projection, transposed."""

    def __init__(self, x64, layout, dtype, device, grad=True, seed=0):
        batch, dim, seqlen = x64.shape
        self.layout, self.dim = layout, dim
        if layout == "cf":
            base = x64
        elif layout == "cl":
            base = x64.transpose(0, 2, 1)
        elif layout == "slice":
            base = rounded(np.random.default_rng(seed + 99), (batch, seqlen, 3 * dim), dtype)
            base[:, :, dim : 2 * dim] = x64.transpose(0, 2, 1)
        else:
            raise ValueError(layout)
        self.leaf = tensor(base, dtype, device, grad)

    def view(self, leaf):
        if self.layout == "cf":
            return leaf
        if self.layout == "cl":
            return leaf.transpose(1, 2)
        return leaf[:, :, self.dim : 2 * self.dim].transpose(1, 2)

    @property
    def x(self):
        return self.view(self.leaf)

    def dx(self):
        """The gradient of x; for a slice, the rest of the projection's gradient must be 0."""
        grad = self.leaf.grad
        if self.layout == "slice":
            rest = torch.cat([grad[:, :, : self.dim], grad[:, :, 2 * self.dim :]], dim=2)
            assert torch.count_nonzero(rest) == 0, "gradient outside the channel slice"
        return self.view(grad)


class Problem:
    """One call's inputs in float64 (already rounded to the test dtype) and as torch tensors."""

    def __init__(
        self, device, dtype="float64", layout="cf", bias=True, silu=True, seq=False,
        init=False, final=False, shape=(BATCH, DIM, SEQLEN), width=WIDTH, seed=0, grad=True,
    ):  # fmt: skip
        rng = np.random.default_rng(seed)
        batch, dim, seqlen = shape
        self.final, self.width = final, width
        self.activation = "silu" if silu else None
        self.x64 = rounded(rng, shape, dtype)
        self.w64 = rounded(rng, (dim, width), dtype, scale=width**-0.5)
        self.b64 = rounded(rng, (dim,), dtype) if bias else None
        self.i64 = rounded(rng, (batch, dim, width - 1), dtype) if init else None
        self.s = None
        if seq:
            ids = np.array(SEQ_IDX) if shape == (BATCH, DIM, SEQLEN) else None
            if ids is None:  # any shape: two segments and a padded tail per row
                ids = np.zeros((batch, seqlen), np.int32)
                ids[:, seqlen // 2 :] = 1
                ids[:, -max(1, seqlen // 8) :] = -1
            self.s = ids.astype(np.int32)
        self.input = Input(self.x64, layout, dtype, device, grad, seed)
        self.w = tensor(self.w64, dtype, device, grad)
        self.b = tensor(self.b64, dtype, device, grad) if bias else None
        self.i = tensor(self.i64, dtype, device, grad) if init else None
        self.seq_idx = torch.tensor(self.s, device=device) if seq else None
        self.dtype, self.device = dtype, device

    def leaves(self):
        return tuple(t for t in (self.input.leaf, self.w, self.b, self.i) if t is not None)

    def call(self, leaf, w, b, i):
        """causal_conv1d_fn on x = view(leaf): out, or (out, final_states)."""
        return cupyconv.causal_conv1d_fn(
            self.input.view(leaf), w, b, self.seq_idx, i, return_final_states=self.final,
            activation=self.activation,
        )  # fmt: skip

    def expected(self, dout64, dfinal64):
        return reference.causal_conv1d_bwd(
            self.x64, self.w64, self.b64, dout64, self.s, self.i64, dfinal64,
            activation=self.activation,
        )  # fmt: skip


def grad_tolerance(dtype, reduction_terms):
    """dweight/dbias: GRAD_TOLERANCE with the atol scaled by sqrt(terms summed), and at least
    the dtype's own rtol (the result is rounded to it)."""
    rtol, atol = GRAD_TOLERANCE
    return max(rtol, tolerance(dtype)[0]), atol * math.sqrt(reduction_terms)


def check_grads(p: Problem, want, name=""):
    """The gradients on p's leaves against the oracle's (dx, dweight, dbias, dinitial_states)."""
    dtype = p.dtype
    assert_close(p.input.dx(), want[0], dtype, name=f"dx{name}")
    rtol, atol = grad_tolerance(dtype, p.x64.shape[0] * p.x64.shape[2])
    assert_close(p.w.grad, want[1], rtol=rtol, atol=atol, name=f"dweight{name}")
    if p.b is not None:
        assert_close(p.b.grad, want[2], rtol=rtol, atol=atol, name=f"dbias{name}")
    if p.i is not None:
        assert_close(p.i.grad, want[3], dtype, name=f"dinitial_states{name}")


# ---- gradcheck in float64 --------------------------------------------------------------------

GRADCHECK_CASES = {
    "cf-plain": dict(layout="cf", bias=False, silu=False),
    "cf-bias-silu": dict(layout="cf"),
    "cf-seq_idx-padding-init-final": dict(layout="cf", seq=True, init=True, final=True),
    "cl-init-final": dict(layout="cl", init=True, final=True),
    "cl-seq_idx-no_bias": dict(layout="cl", bias=False, seq=True),
    "slice-seq_idx-init-final": dict(layout="slice", seq=True, init=True, final=True),
    "short-rows-init-final": dict(layout="cl", init=True, final=True, shape=(2, 3, 2)),
    "width1": dict(layout="cf", width=1, seq=True, final=True),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", GRADCHECK_CASES)
def test_gradcheck(device, case):
    """Finite differences of every output (out and, where returned, final_states: the dfinal
    path) against the backward; gradcheck also sends undefined gradients (an unused output)."""
    p = Problem(device, **GRADCHECK_CASES[case])
    with_bias, with_init = p.b is not None, p.i is not None

    def fn(leaf, w, *rest):
        rest = list(rest)
        b = rest.pop(0) if with_bias else None
        i = rest.pop(0) if with_init else None
        return p.call(leaf, w, b, i)

    assert torch.autograd.gradcheck(fn, p.leaves(), eps=1e-6, atol=1e-7, rtol=1e-5)


# ---- gradients against the oracle ------------------------------------------------------------


LOSSES = ("weighted", "sum", "final_only")


@pytest.mark.parametrize(
    "device,dtype",
    [(CPU, "float32"), pytest.param("cuda", "float32", marks=pytest.mark.gpu),
     pytest.param("cuda", "bfloat16", marks=pytest.mark.gpu)],
)  # fmt: skip
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("loss", LOSSES)
def test_grads_match_the_oracle(device, dtype, layout, loss):
    """weighted: sum(out * g) + sum(final_states * gf); sum: out.sum() (dout an expanded,
    zero-stride tensor); final_only: only final_states used (dout None in the backward)."""
    shape = (BATCH, DIM, SEQLEN) if device == CPU else (2, 64, 129)
    p = Problem(device, dtype, layout, seq=True, init=True, final=True, shape=shape, seed=3)
    out, final = p.call(p.input.leaf, p.w, p.b, p.i)
    want_out, want_final = reference.causal_conv1d_fn(
        p.x64, p.w64, p.b64, p.s, p.i64, return_final_states=True, activation=p.activation
    )
    assert_close(out, want_out, dtype)
    assert_close(final, want_final, dtype, name="final_states")
    rng = np.random.default_rng(5)
    g64 = rounded(rng, out.shape, dtype)
    gf64 = rounded(rng, final.shape, dtype)
    if loss == "weighted":
        g, gf = tensor(g64, dtype, device), tensor(gf64, dtype, device)
        ((out * g).sum() + (final * gf).sum()).backward()
    elif loss == "sum":
        out.sum().backward()
        g64, gf64 = np.ones_like(g64), None
    else:
        (final * tensor(gf64, dtype, device)).sum().backward()
        g64 = np.zeros_like(g64)
    check_grads(p, p.expected(g64, gf64))


@pytest.mark.parametrize("device", DEVICES)
def test_grads_have_the_dtypes_of_their_inputs(device):
    """Mixed dtypes (and nn.Parameter weights): each gradient comes back in its input's dtype,
    dinitial_states cast from x's dtype to that of initial_states."""
    x = torch.randn(BATCH, DIM, SEQLEN, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(DIM, WIDTH, device=device))
    b = torch.nn.Parameter(torch.randn(DIM, device=device, dtype=torch.float16))
    i = torch.randn(BATCH, DIM, WIDTH - 1, device=device, dtype=torch.float64).requires_grad_()
    out = cupyconv.causal_conv1d_fn(x, w, b, initial_states=i, activation="silu")
    assert out.dtype == torch.bfloat16
    out.float().square().sum().backward()
    assert (x.grad.dtype, w.grad.dtype, b.grad.dtype, i.grad.dtype) == (
        torch.bfloat16, torch.float32, torch.float16, torch.float64,
    )  # fmt: skip
    x64, w64, b64, dout64, i64 = (
        t.detach().double().cpu().numpy() for t in (x, w, b, 2 * out.float(), i)
    )
    want = reference.causal_conv1d_bwd(x64, w64, b64, dout64, initial_states=i64, activation="silu")
    assert_close(x.grad, want[0], "bfloat16", name="dx")
    assert_close(i.grad, want[3], "bfloat16", name="dinitial_states")  # rounded to bf16 once
    for name, got, want_grad, dtype in [
        ("dweight", w.grad, want[1], "float32"), ("dbias", b.grad, want[2], "float16"),
    ]:  # fmt: skip
        rtol, atol = grad_tolerance(dtype, BATCH * SEQLEN)
        assert_close(got, want_grad, rtol=rtol, atol=atol, name=name)


@pytest.mark.parametrize("device", DEVICES)
def test_only_inputs_that_require_grad_get_one(device):
    p = Problem(device, "float32", "cl", init=True, grad=False)
    p.i.requires_grad_()
    p.call(p.input.leaf, p.w, p.b, p.i).square().sum().backward()
    assert p.input.leaf.grad is None and p.w.grad is None and p.b.grad is None
    out64 = reference.causal_conv1d_fn(p.x64, p.w64, p.b64, initial_states=p.i64, activation="silu")
    want = reference.causal_conv1d_bwd(
        p.x64, p.w64, p.b64, 2 * out64, initial_states=p.i64, activation="silu"
    )
    assert_close(p.i.grad, want[3], "float32", name="dinitial_states")


# ---- routing ---------------------------------------------------------------------------------


def _op_path_forbidden(*args, **kwargs):
    raise AssertionError("the custom-op path ran")


@pytest.mark.parametrize("requires", ["x", "weight", "bias", "initial_states"])
def test_an_input_that_requires_grad_gives_a_grad_fn(requires):
    p = Problem(CPU, "float32", init=True, grad=False)
    leaf = {"x": p.input.leaf, "weight": p.w, "bias": p.b, "initial_states": p.i}[requires]
    leaf.requires_grad_()
    out = p.call(p.input.leaf, p.w, p.b, p.i)
    # Eager: the autograd.Function over the direct paths (the operators serve tracers).
    assert type(out.grad_fn).__name__ == "_EagerBackward", out.grad_fn
    out, final = cupyconv.causal_conv1d_fn(
        p.input.x, p.w, p.b, initial_states=p.i, return_final_states=True
    )
    assert out.grad_fn is final.grad_fn is not None


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "no_input_requires_grad"])
def test_eager_inference_takes_the_direct_path(monkeypatch, mode):
    """The custom-op entry is replaced by one that fails: eager inference must not reach it,
    and its results must still be right (and carry no grad_fn)."""
    monkeypatch.setattr(torch_ops, "causal_conv1d_fn", _op_path_forbidden)
    p = Problem(CPU, "float32", seq=True, init=True, grad=mode != "no_input_requires_grad")
    context = {
        "no_grad": torch.no_grad, "inference_mode": torch.inference_mode,
        "no_input_requires_grad": torch.enable_grad,
    }[mode]  # fmt: skip
    with context():
        out = p.call(p.input.leaf, p.w, p.b, p.i)
    assert out.grad_fn is None and not out.requires_grad
    want = reference.causal_conv1d_fn(p.x64, p.w64, p.b64, p.s, p.i64, activation="silu")
    assert_close(out, want, "float32")


def test_training_calls_take_the_op_path(monkeypatch):
    """The converse of the test above: the replaced entry is reached when autograd records
    (eager, it runs the autograd.Function; traced, the operators)."""
    monkeypatch.setattr(torch_ops, "causal_conv1d_fn", _op_path_forbidden)
    p = Problem(CPU, "float32")
    with pytest.raises(AssertionError, match="the custom-op path ran"):
        p.call(p.input.leaf, p.w, p.b, p.i)


def test_numpy_calls_do_not_import_torch():
    code = (
        "import sys, numpy as np, cupyconv\n"
        "x = np.ones((1, 2, 5))\n"
        "cupyconv.causal_conv1d_fn(x, np.ones((2, 3)))\n"
        "cupyconv.causal_conv1d_bwd(x, np.ones((2, 3)), None, x)\n"
        "assert 'torch' not in sys.modules, 'cupyconv imported torch'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_other_tracers_get_the_operators():
    """make_fx with fake tensors (no dynamo): both public functions become operator calls."""
    from torch.fx.experimental.proxy_tensor import make_fx

    p = Problem(CPU, "float32", grad=False)

    def fwd_bwd(x, w, b, dout):
        out = cupyconv.causal_conv1d_fn(x, w, b, activation="silu")
        return out, cupyconv.causal_conv1d_bwd(x, w, b, dout, activation="silu")

    graph = make_fx(fwd_bwd, tracing_mode="fake")(p.input.x, p.w, p.b, p.input.x)
    targets = [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]
    assert "cupyconv.causal_conv1d_fwd.default" in targets, targets
    assert "cupyconv.causal_conv1d_bwd.default" in targets, targets


@pytest.mark.parametrize("buffer", ["out", "final_states_out"])
def test_output_buffers_are_refused_when_autograd_records(buffer):
    p = Problem(CPU, "float32")
    buffers = {
        "out": torch.empty(BATCH, DIM, SEQLEN),
        "final_states_out": torch.empty(BATCH, DIM, WIDTH - 1),
    }
    with pytest.raises(ValueError, match=f"^{buffer} must be None when autograd records"):
        cupyconv.causal_conv1d_fn(
            p.input.x, p.w, p.b, return_final_states=True, **{buffer: buffers[buffer]}
        )


def test_op_path_errors_name_the_argument():
    p = Problem(CPU, "float32")
    with pytest.raises(TypeError, match="^weight must be a torch tensor like x"):
        cupyconv.causal_conv1d_fn(p.input.x, p.w64)
    with pytest.raises(ValueError, match=r"^weight must have shape \(dim, width\)"):
        cupyconv.causal_conv1d_fn(p.input.x, torch.ones(DIM + 1, WIDTH))
    with pytest.raises(ValueError, match="^activation must be one of"):
        cupyconv.causal_conv1d_fn(p.input.x, p.w, activation="relu")
    with pytest.raises(TypeError, match="^return_final_states must be a bool"):
        cupyconv.causal_conv1d_fn(p.input.x, p.w, return_final_states=1)


# ---- opcheck ---------------------------------------------------------------------------------


def _op_args(op, p: Problem):
    """Arguments of one operator for problem p; output buffers in memory orders other than
    their inputs' (channel-last out and dx, a transposed dweight_out)."""
    x, w, b, i = p.input.x, p.w, p.b, p.i
    fwd = (x, w, b, p.seq_idx, i, p.activation)
    if op in ("causal_conv1d_fwd", "causal_conv1d_fwd_final_states"):
        return fwd
    rng = np.random.default_rng(7)
    x, w, b, i = (t.detach() for t in (x, w, b, i))
    dout = torch.empty_like(x).copy_(tensor(rounded(rng, x.shape, p.dtype), p.dtype, p.device))
    dfinal = tensor(rounded(rng, i.shape, p.dtype), p.dtype, p.device)
    bwd = (x, w, b, dout, p.seq_idx, i, dfinal)
    if op == "causal_conv1d_bwd":
        return (*bwd, True, p.activation)
    channel_last = torch.empty(x.shape[0], x.shape[2], x.shape[1], dtype=x.dtype, device=x.device)
    if op == "causal_conv1d_fwd_into":
        final = torch.empty_like(i)
        return (x, w, b, p.seq_idx, i, p.activation, channel_last.transpose(1, 2), final)
    dweight = torch.empty(w.shape[1], w.shape[0], dtype=w.dtype, device=w.device).T
    dinit = torch.empty_like(i)
    return (*bwd, p.activation, channel_last.transpose(1, 2), dweight, torch.empty_like(b), dinit)


OPS = (
    "causal_conv1d_fwd", "causal_conv1d_fwd_final_states", "causal_conv1d_bwd",
    "causal_conv1d_fwd_into", "causal_conv1d_bwd_into",
)  # fmt: skip


# Every check on the sliced layout; the schema and the fake implementation (whose strides
# follow the layout) on the other two. On the GPU, every check everywhere.
ALL_CHECKS = ("test_schema", "test_autograd_registration", "test_faketensor")
ALL_CHECKS += ("test_aot_dispatch_dynamic",)
LAYOUT_CHECKS = ("test_schema", "test_faketensor")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("op", OPS)
def test_opcheck(device, layout, op):
    p = Problem(device, "float64", layout, seq=True, init=True, final=True)
    args = _op_args(op, p)
    checks = ALL_CHECKS if layout == "slice" or device != CPU else LAYOUT_CHECKS
    result = torch.library.opcheck(getattr(torch.ops.cupyconv, op).default, args, test_utils=checks)
    assert result == dict.fromkeys(checks, "SUCCESS"), result


# ---- torch.compile ---------------------------------------------------------------------------

COMPILERS = {  # id: (device, torch.compile keyword arguments)
    "cpu-aot_eager": (CPU, dict(backend="aot_eager")),
    "cuda-aot_eager": ("cuda", dict(backend="aot_eager")),
    "cuda-inductor": ("cuda", dict()),
    "cuda-reduce-overhead": ("cuda", dict(mode="reduce-overhead")),
}
COMPILER_PARAMS = [
    pytest.param(k, marks=pytest.mark.gpu) if device != CPU else k
    for k, (device, _) in COMPILERS.items()
]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles its own functions from scratch: dynamo's per-code-object recompile
    limit (8) would otherwise be reached across the parametrised cases."""
    import torch._dynamo

    torch._dynamo.reset()
    yield


def _same(got, want, dtype, exact, name):
    if exact:  # the CPU path: the same operator calls, the same float64 reference
        assert torch.equal(got, want), f"{name}: compiled differs from eager"
    else:
        assert_close(got, want.double().cpu().numpy(), dtype, name=name)


@pytest.mark.parametrize("compiler", COMPILER_PARAMS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_compiled_training_step_matches_eager(compiler, layout):
    """fullgraph=True: no graph break, the forward and the backward through the operators."""
    device, options = COMPILERS[compiler]
    dtype = "float32"
    shape = (BATCH, DIM, SEQLEN) if device == CPU else (2, 64, 129)
    rng = np.random.default_rng(11)
    g = tensor(rounded(rng, shape, dtype), dtype, device)
    gf = tensor(rounded(rng, (shape[0], shape[1], WIDTH - 1), dtype), dtype, device)

    def step(p, leaf, w, b, i):
        out, final = p.call(leaf, w, b, i)
        return (out * g).sum() + (final * gf).sum()

    problems = [
        Problem(device, dtype, layout, seq=True, init=True, final=True, shape=shape)
        for _ in range(2)
    ]
    eager, compiled = problems
    loss = step(eager, *eager.leaves())
    loss.backward()
    compiled_step = torch.compile(step, fullgraph=True, **options)
    exact = device == CPU
    for run in range(3):  # reduce-overhead: warm-up, capture, replay
        for t in compiled.leaves():
            t.grad = None
        if options.get("mode") == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        got = compiled_step(compiled, *compiled.leaves())
        got.backward()
        _same(got.detach(), loss.detach(), dtype, exact, f"loss (run {run})")
        _same(compiled.input.dx(), eager.input.dx(), dtype, exact, f"dx (run {run})")
        rtol, atol = grad_tolerance(dtype, shape[0] * shape[2])
        for name, got_t, want_t in [
            ("dweight", compiled.w, eager.w),
            ("dbias", compiled.b, eager.b),
        ]:
            if exact:
                _same(got_t.grad, want_t.grad, dtype, exact, name)
            else:
                want_grad = want_t.grad.double().cpu().numpy()
                assert_close(got_t.grad, want_grad, rtol=rtol, atol=atol, name=name)
        _same(compiled.i.grad, eager.i.grad, dtype, exact, f"dinitial_states (run {run})")


@pytest.mark.parametrize("compiler", COMPILER_PARAMS)
def test_compiled_inference_writes_the_callers_buffers(compiler):
    """Under torch.no_grad, out= and final_states_out= go through causal_conv1d_fwd_into
    (mutates_args): the caller's buffers are written and returned."""
    device, options = COMPILERS[compiler]
    p = Problem(device, "float32", "cl", seq=True, init=True, final=True, grad=False)
    out = torch.full((BATCH, SEQLEN, DIM), float("nan"), device=device).transpose(1, 2)
    final = torch.full((BATCH, DIM, WIDTH - 1), float("nan"), device=device)

    def infer(x, w, b, s, i, out, final):
        return cupyconv.causal_conv1d_fn(
            x, w, b, s, i, True, final, activation="silu", out=out
        )  # fmt: skip

    with torch.no_grad():
        res = torch.compile(infer, fullgraph=True, **options)(
            p.input.x, p.w, p.b, p.seq_idx, p.i, out, final
        )
    want = reference.causal_conv1d_fn(
        p.x64, p.w64, p.b64, p.s, p.i64, return_final_states=True, activation="silu"
    )
    assert res[0] is out and res[1] is final
    assert_close(out, want[0], "float32")
    assert_close(final, want[1], "float32", name="final_states")


@pytest.mark.parametrize("compiler", COMPILER_PARAMS)
@pytest.mark.parametrize("buffers", [False, True], ids=["new", "buffers"])
def test_compiled_backward_calls(compiler, buffers):
    """causal_conv1d_bwd called directly under torch.compile: causal_conv1d_bwd, or with
    buffers causal_conv1d_bwd_into; the results of the direct path."""
    device, options = COMPILERS[compiler]
    p = Problem(device, "float32", "cl", seq=True, init=True, grad=False)
    dout = tensor(rounded(np.random.default_rng(2), p.x64.shape, "float32"), "float32", device)
    given = {}
    if buffers:
        given = dict(
            dx=torch.full_like(p.input.x, float("nan")),
            dweight_out=torch.full_like(p.w, float("nan")),
            dbias_out=torch.full_like(p.b, float("nan")),
            dinitial_states_out=torch.full_like(p.i, float("nan")),
        )

    def bwd(x, w, b, dout, s, i, given):
        return cupyconv.causal_conv1d_bwd(
            x, w, b, dout, s, i, return_dinitial_states=True, activation="silu", **given
        )

    res = torch.compile(bwd, fullgraph=True, **options)(
        p.input.x, p.w, p.b, dout, p.seq_idx, p.i, given
    )
    want = reference.causal_conv1d_bwd(
        p.x64, p.w64, p.b64, dout.cpu().double().numpy(), p.s, p.i64, activation="silu"
    )
    if buffers:
        assert all(r is g for r, g in zip(res, given.values()))
    assert_close(res[0], want[0], "float32", name="dx")
    rtol, atol = grad_tolerance("float32", BATCH * SEQLEN)
    assert_close(res[1], want[1], rtol=rtol, atol=atol, name="dweight")
    assert_close(res[2], want[2], rtol=rtol, atol=atol, name="dbias")
    assert_close(res[3], want[3], "float32", name="dinitial_states")


# ---- the decode update under torch.compile ---------------------------------------------------


def _update_args(device, circular: bool):
    """One decode step on a pool of 5 states [5, dim, width] (channel-contiguous memory) with
    a padding row, float32."""
    rng = np.random.default_rng(21)
    x = tensor(rounded(rng, (3, 8), "float32"), "float32", device)
    pool = tensor(rounded(rng, (5, WIDTH, 8), "float32"), "float32", device).transpose(1, 2)
    w = tensor(rounded(rng, (8, WIDTH), "float32"), "float32", device)
    b = tensor(rounded(rng, (8,), "float32"), "float32", device)
    lens = torch.tensor([3, 0, 7], dtype=torch.int32, device=device) if circular else None
    idx = torch.tensor([4, -1, 1], dtype=torch.int32, device=device)
    return x, pool, w, b, "silu", lens, idx


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("circular", (False, True))
def test_update_opcheck(device, circular):
    """The update operator: schema (conv_state mutated), fake allocation, AOT dispatch."""
    args = _update_args(device, circular)
    checks = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
    op = torch.ops.cupyconv.causal_conv1d_update.default
    result = torch.library.opcheck(op, args, test_utils=checks)
    assert result == dict.fromkeys(checks, "SUCCESS"), result


@pytest.mark.parametrize("compiler", COMPILER_PARAMS)
def test_compiled_decode_step_matches_eager(compiler):
    """fullgraph=True: no graph break; the output and the updated pool as in eager mode and as
    the float64 reference has them (the pool exactly)."""
    device, options = COMPILERS[compiler]
    for circular in (False, True):
        x, pool, w, b, act, lens, idx = _update_args(device, circular)
        before = pool.detach().cpu().double().numpy()
        pool_eager = pool.clone()
        want = cupyconv.causal_conv1d_update(x, pool_eager, w, b, act, lens, idx)

        @torch.compile(fullgraph=True, **options)
        def step(x, pool, w, b, lens, idx):
            return cupyconv.causal_conv1d_update(x, pool, w, b, "silu", lens, idx) * 2

        got = step(x, pool, w, b, lens, idx)
        assert torch.equal(got, want * 2), f"{compiler}: compiled out differs from eager"
        assert torch.equal(pool, pool_eager), f"{compiler}: compiled state differs from eager"
        ref_out, ref_pool = reference.causal_conv1d_update(
            x.cpu().double().numpy(), before, w.cpu().double().numpy(),
            b.cpu().double().numpy(), act, None if lens is None else lens.cpu().numpy(),
            idx.cpu().numpy(),
        )  # fmt: skip
        assert_close(got, 2 * ref_out, "float32")
        assert np.array_equal(pool.cpu().double().numpy(), ref_pool), "the pool differs"
