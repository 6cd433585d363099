"""cupyconv.jax: causal_conv1d_fn as a differentiable JAX function, against the float64 reference.

Every case builds float64 inputs already rounded to the test dtype, so the reference sees exactly
what JAX sees, and checks the results eagerly and under ``jax.jit``, gradients under
``jax.grad`` (against ``reference.causal_conv1d_bwd`` with the same cotangents), chunks under
``jax.lax.scan`` (carrying final_states into initial_states: equal to one long call), and
``jax.vmap``. The CPU tests pin JAX to the CPU (the pure_callback path, what CI runs); the
``gpu`` tests run the same on GPU arrays (the buffer_callback path) and check that no host round
trip happens under jit. Two CPU tests reach the GPU path's plumbing: the lowering for CUDA holds
the buffer callback as a custom call, and the callback itself runs on host buffers that stand
in for XLA's device buffers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402 - after the skip

import cupyconv.jax as cj  # noqa: E402
from cupyconv import reference  # noqa: E402
from cupyconv.testing import GRAD_TOLERANCE, assert_close, tolerance  # noqa: E402

# ---- cases ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    dtype: str = "float32"  # of x (and of dout, initial_states unless init_dtype)
    wdtype: str | None = None  # of weight and bias (default: dtype)
    batch: int = 2
    dim: int = 5
    seqlen: int = 19
    width: int = 4
    bias: bool = True
    silu: bool = True
    seq_idx: bool = False  # three segments per row and padding (-1) ids
    init: bool = False
    init_dtype: str | None = None
    final: bool = False


CASES = {
    "f32-plain": Case(bias=False, silu=False),
    "f32-bias-silu": Case(),
    "f32-all": Case(seq_idx=True, init=True, final=True),
    "f32-width1-final": Case(width=1, init=True, final=True),
    "f32-short-states": Case(seqlen=2, width=5, init=True, final=True),  # seqlen < width - 1
    "bf16-bias-silu-final": Case(dtype="bfloat16", final=True),
    "bf16-w32-seq-init": Case(dtype="bfloat16", wdtype="float32", seq_idx=True, init=True),
    "bf16-init32-final": Case(dtype="bfloat16", init=True, init_dtype="float32", final=True),
    "f16-silu": Case(dtype="float16", bias=False),
    "f64-all": Case(dtype="float64", seq_idx=True, init=True, final=True),
}


def np_dtype(name):
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def rounded(rng, shape, dtype, scale=1.0):
    """Standard normal values times ``scale``, rounded to ``dtype``, as float64."""
    return (scale * rng.standard_normal(shape)).astype(np_dtype(dtype)).astype(np.float64)


def seq_ids(batch, seqlen):
    """Rows of three segments with padding (-1) in the middle and at the end."""
    ids = np.zeros((batch, seqlen), np.int32)
    for b in range(batch):
        ids[b] = np.minimum(3 * np.arange(seqlen) // max(seqlen, 1), 2)
        if seqlen > 4:
            ids[b, seqlen // 2 + b] = -1
            ids[b, -2:] = -1
    return ids


class Inputs:
    """The float64 values of a case (``values``: the keyword arguments, numpy) and the same as
    JAX arrays on the current default device (``arrays``), plus cotangents for the gradient."""

    def __init__(self, case: Case, seed=0):
        rng = np.random.default_rng(seed)
        b, c, n, k = case.batch, case.dim, case.seqlen, case.width
        wdtype = case.wdtype or case.dtype
        self.dtypes = {"x": case.dtype, "weight": wdtype}
        self.values = {
            "x": rounded(rng, (b, c, n), case.dtype),
            "weight": rounded(rng, (c, k), wdtype, scale=k**-0.5),
        }
        if case.bias:
            self.values["bias"] = rounded(rng, (c,), wdtype)
            self.dtypes["bias"] = wdtype
        if case.init:
            self.dtypes["initial_states"] = case.init_dtype or case.dtype
            self.values["initial_states"] = rounded(
                rng, (b, c, k - 1), self.dtypes["initial_states"]
            )
        self.seq_idx = seq_ids(b, n) if case.seq_idx else None
        self.activation = "silu" if case.silu else None
        self.final = case.final
        self.dout = rounded(rng, (b, c, n), case.dtype)
        self.dfinal = rounded(rng, (b, c, k - 1), case.dtype) if case.final else None

    def arrays(self) -> dict:
        """The differentiable arguments as JAX arrays of their dtypes."""
        return {
            name: jnp.asarray(v, np_dtype(self.dtypes[name])) for name, v in self.values.items()
        }

    def call(self, fn=None):
        """A function of the differentiable arguments (a dict) calling ``fn`` with the rest."""
        fn = fn or cj.causal_conv1d_fn
        seq = None if self.seq_idx is None else jnp.asarray(self.seq_idx)

        def run(diff):
            return fn(
                **diff, seq_idx=seq, return_final_states=self.final, activation=self.activation
            )

        return run

    def loss(self):
        """sum(out * dout) (+ sum(final_states * dfinal)) in float32 (float64 for float64 x):
        its gradient is the VJP with those cotangents (rounded to x's dtype, as they are)."""
        run = self.call()
        acc = jnp.float64 if self.dtypes["x"] == "float64" else jnp.float32
        dout = jnp.asarray(self.dout, acc)
        dfinal = None if self.dfinal is None else jnp.asarray(self.dfinal, acc)

        def loss(diff):
            res = run(diff)
            out, final = res if self.final else (res, None)
            total = jnp.sum(out.astype(acc) * dout)
            if final is not None:
                total += jnp.sum(final.astype(acc) * dfinal)
            return total

        return loss

    def want(self):
        v = self.values
        return reference.causal_conv1d_fn(
            v["x"], v["weight"], v.get("bias"), self.seq_idx, v.get("initial_states"),
            return_final_states=self.final, activation=self.activation,
        )  # fmt: skip

    def want_grads(self) -> dict:
        v = self.values
        dx, dw, db, dinit = reference.causal_conv1d_bwd(
            v["x"], v["weight"], v.get("bias"), self.dout, self.seq_idx, v.get("initial_states"),
            self.dfinal, activation=self.activation,
        )  # fmt: skip
        found = {"x": dx, "weight": dw, "bias": db, "initial_states": dinit}
        return {name: found[name] for name in self.values}


def check_results(inputs: Inputs, res):
    want = inputs.want()
    dtype = inputs.dtypes["x"]
    if inputs.final:
        (out, final), (want_out, want_final) = res, want
        assert final.dtype == np_dtype(dtype)
        assert_close(final, want_final, dtype, name="final_states")
    else:
        out, want_out = res, want
    assert out.dtype == np_dtype(dtype)
    assert_close(out, want_out, dtype)


def check_grads(inputs: Inputs, grads: dict):
    """dx and dinitial_states with x's tolerances; dweight and dbias with GRAD_TOLERANCE, its
    atol scaled by sqrt(batch * seqlen) (the terms of the reduction), but never tighter than
    the rounding of their own dtype (a bfloat16 weight's gradient is rounded to bfloat16)."""
    want = inputs.want_grads()
    assert set(grads) == set(want)
    batch, _, seqlen = inputs.values["x"].shape
    for name, got in grads.items():
        assert got.dtype == np_dtype(inputs.dtypes[name]), name  # a cotangent takes its primal's
        if name in ("weight", "bias"):
            rtol, atol = tolerance(got.dtype)
            scaled = GRAD_TOLERANCE[1] * math.sqrt(batch * seqlen)
            rtol, atol = max(rtol, GRAD_TOLERANCE[0]), max(atol, scaled)
            assert_close(got, want[name], rtol=rtol, atol=atol, name=f"d{name}")
        else:
            assert_close(got, want[name], inputs.dtypes["x"], name=f"d{name}")


def dtype_context(case: Case):
    """64-bit types on for float64 cases (for the duration of the test only)."""
    return jax.enable_x64(True) if case.dtype == "float64" else contextlib.nullcontext()


@pytest.fixture
def on_cpu():
    """CPU JAX arrays (the pure_callback path), also where JAX has a GPU backend."""
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        yield cpu


def split_chunks(x, chunk):
    """[batch, dim, seqlen] -> [seqlen // chunk, batch, dim, chunk]: scan's leading axis."""
    batch, dim, seqlen = x.shape
    return jnp.moveaxis(x.reshape(batch, dim, seqlen // chunk, chunk), 2, 0)


def scan_chunks(x, weight, bias, initial_states, chunk, activation="silu"):
    """out of one long call, computed by lax.scan over chunks carrying final_states."""

    def step(state, xc):
        out, final = cj.causal_conv1d_fn(
            xc, weight, bias, initial_states=state, return_final_states=True,
            activation=activation,
        )  # fmt: skip
        return final, out

    final, outs = jax.lax.scan(step, initial_states, split_chunks(x, chunk))
    batch, dim, seqlen = x.shape
    return jnp.moveaxis(outs, 0, 2).reshape(batch, dim, seqlen), final


# ---- CPU: the pure_callback path -----------------------------------------------------------


@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_forward(on_cpu, case, mode):
    with dtype_context(case):
        inputs = Inputs(case)
        run = inputs.call()
        if mode == "jit":
            run = jax.jit(run)
        res = run(inputs.arrays())
        for a in jax.tree_util.tree_leaves(res):
            assert a.devices() == {on_cpu}
        check_results(inputs, res)


EAGER_GRAD = ("f32-all", "bf16-init32-final")  # eager grad dispatches op by op: slower


@pytest.mark.parametrize(
    ("case", "mode"),
    [(c, "jit") for c in CASES] + [(c, "eager") for c in EAGER_GRAD],
    ids=lambda p: p,
)
def test_grad(on_cpu, case, mode):
    case = CASES[case]
    with dtype_context(case):
        inputs = Inputs(case, seed=1)
        grad = jax.grad(inputs.loss())
        if mode == "jit":
            grad = jax.jit(grad)
        check_grads(inputs, grad(inputs.arrays()))


@pytest.mark.parametrize(("width", "chunk"), [(4, 8), (5, 3)], ids=["chunk8", "chunk3-short"])
def test_scan_over_chunks_equals_one_call(on_cpu, width, chunk):
    """Chunks carried through final_states -> initial_states give the long call's out and
    final_states, and the same gradients (chunk3-short: chunks shorter than width - 1)."""
    inputs = Inputs(Case(seqlen=24, width=width, init=True, final=True), seed=2)
    diff = inputs.arrays()

    def loss(diff):
        out, final = scan_chunks(
            diff["x"], diff["weight"], diff["bias"], diff["initial_states"], chunk
        )
        return jnp.sum(out * inputs.dout) + jnp.sum(final * inputs.dfinal), (out, final)

    grads, res = jax.jit(jax.grad(loss, has_aux=True))(diff)
    check_results(inputs, res)
    check_grads(inputs, grads)


def test_seq_idx_padding_is_zero_in_out_and_dx(on_cpu):
    inputs = Inputs(Case(seq_idx=True, init=True), seed=3)
    pad = inputs.seq_idx < 0
    assert pad.any()
    out = jax.jit(inputs.call())(inputs.arrays())
    grads = jax.jit(jax.grad(inputs.loss()))(inputs.arrays())
    at_pad = np.broadcast_to(pad[:, None, :], out.shape)
    assert not np.asarray(out)[at_pad].any()
    assert not np.asarray(grads["x"])[at_pad].any()  # a padding input reaches no output
    check_grads(inputs, grads)


def test_seq_idx_has_no_gradient(on_cpu):
    """seq_idx passes through jax.vjp as an integer input whose cotangent is a float0 zero."""
    inputs = Inputs(Case(bias=False, silu=False, seq_idx=True))
    a = inputs.arrays()
    _, vjp = jax.vjp(
        lambda x, s: cj.causal_conv1d_fn(x, a["weight"], seq_idx=s),
        a["x"], jnp.asarray(inputs.seq_idx),
    )  # fmt: skip
    dx, dseq = vjp(jnp.asarray(inputs.dout, jnp.float32))
    assert dseq.dtype == jax.dtypes.float0
    assert_close(dx, inputs.want_grads()["x"], name="dx")


def check_vmap():
    """jax.vmap over a stack of two x (one call each, in sequence), against the reference."""
    inputs = Inputs(Case(init=True, final=True), seed=4)
    diff = inputs.arrays()
    xs = jnp.stack([diff["x"], -2 * diff["x"]])
    outs, finals = jax.vmap(
        lambda x: cj.causal_conv1d_fn(
            x, diff["weight"], diff["bias"], initial_states=diff["initial_states"],
            return_final_states=True, activation="silu",
        )
    )(xs)  # fmt: skip
    v = inputs.values
    for i, scale in enumerate((1, -2)):
        out, final = reference.causal_conv1d_fn(
            scale * v["x"], v["weight"], v["bias"], initial_states=v["initial_states"],
            return_final_states=True, activation="silu",
        )  # fmt: skip
        assert_close(outs[i], out)
        assert_close(finals[i], final, name="final_states")


def test_vmap(on_cpu):
    check_vmap()


@pytest.mark.parametrize("dinit", [True, False], ids=["with-dinit", "without-dinit"])
def test_bwd(on_cpu, dinit):
    """The public backward under jit: dx and dinitial_states in x's dtype, dweight and dbias in
    theirs; dinitial_states only when asked for."""
    inputs = Inputs(Case(dtype="bfloat16", wdtype="float32", seq_idx=True, init=True, final=True))
    bwd = jax.jit(
        lambda a, dout, dfinal: cj.causal_conv1d_bwd(
            a["x"], a["weight"], a["bias"], dout, jnp.asarray(inputs.seq_idx),
            a["initial_states"], dfinal, return_dinitial_states=dinit, activation="silu",
        )
    )  # fmt: skip
    dout, dfinal = (jnp.asarray(g, jnp.bfloat16) for g in (inputs.dout, inputs.dfinal))
    dx, dweight, dbias, dinit_got = bwd(inputs.arrays(), dout, dfinal)
    grads = {"x": dx, "weight": dweight, "bias": dbias, "initial_states": dinit_got}
    if not dinit:
        assert dinit_got is None
        grads["initial_states"] = jnp.asarray(inputs.want_grads()["initial_states"], jnp.bfloat16)
    check_grads(inputs, grads)


CHANNEL_LAST = ("f32-all", "bf16-w32-seq-init", "bf16-init32-final", "f32-short-states")


def cl(a):
    """[batch, dim, *] <-> [batch, *, dim] (None kept)."""
    return None if a is None else jnp.swapaxes(a, 1, 2)


def check_channel_last(inputs: Inputs, mode: str):
    """causal_conv1d_fn(channel_last=True) on the case's arrays laid out [batch, seqlen, dim]
    and [batch, width - 1, dim]: out, final_states and the gradients, turned back, against the
    reference; the results on those layouts."""
    seq = None if inputs.seq_idx is None else jnp.asarray(inputs.seq_idx)
    acc = jnp.float64 if inputs.dtypes["x"] == "float64" else jnp.float32
    dout = jnp.asarray(inputs.dout, acc)
    dfinal = None if inputs.dfinal is None else jnp.asarray(inputs.dfinal, acc)

    def run(diff):
        res = cj.causal_conv1d_fn(
            cl(diff["x"]), diff["weight"], diff.get("bias"), seq, cl(diff.get("initial_states")),
            inputs.final, inputs.activation, channel_last=True,
        )  # fmt: skip
        return (cl(res[0]), cl(res[1])) if inputs.final else cl(res)

    def loss(diff):
        res = run(diff)
        out, final = res if inputs.final else (res, None)
        total = jnp.sum(out.astype(acc) * dout)
        return total if final is None else total + jnp.sum(final.astype(acc) * dfinal)

    grad = jax.grad(loss)
    if mode == "jit":
        run, grad = jax.jit(run), jax.jit(grad)
    check_results(inputs, run(inputs.arrays()))
    check_grads(inputs, grad(inputs.arrays()))


@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("case", CHANNEL_LAST)
def test_channel_last(on_cpu, case, mode):
    check_channel_last(Inputs(CASES[case], seed=4), mode)


def test_channel_last_bwd(on_cpu):
    """The public backward with channel_last: dx and dinitial_states as [batch, *, dim]."""
    inputs = Inputs(Case(dtype="bfloat16", wdtype="float32", seq_idx=True, init=True, final=True))
    a = inputs.arrays()
    dout, dfinal = (jnp.asarray(g, jnp.bfloat16) for g in (inputs.dout, inputs.dfinal))
    dx, dweight, dbias, dinit = jax.jit(
        lambda a, dout, dfinal: cj.causal_conv1d_bwd(
            cl(a["x"]), a["weight"], a["bias"], cl(dout), jnp.asarray(inputs.seq_idx),
            cl(a["initial_states"]), cl(dfinal), return_dinitial_states=True,
            activation="silu", channel_last=True,
        )
    )(a, dout, dfinal)  # fmt: skip
    assert dx.shape == (2, 19, 5) and dinit.shape == (2, 3, 5)
    grads = {"x": cl(dx), "weight": dweight, "bias": dbias, "initial_states": cl(dinit)}
    check_grads(inputs, grads)


def test_numpy_arguments_are_accepted(on_cpu):
    inputs = Inputs(Case(init=True, final=True))
    args = {k: v.astype(np.float32) for k, v in inputs.values.items()}
    res = cj.causal_conv1d_fn(**args, return_final_states=True, activation="silu")
    assert all(isinstance(a, jax.Array) for a in res)
    check_results(inputs, res)


def test_empty_seqlen_final_states_come_from_initial_states(on_cpu):
    init = np.arange(2 * 3 * 3, dtype=np.float32).reshape(2, 3, 3)
    out, final = jax.jit(
        lambda x, w, i: cj.causal_conv1d_fn(x, w, initial_states=i, return_final_states=True)
    )(jnp.zeros((2, 3, 0)), jnp.ones((3, 4)), jnp.asarray(init))
    assert out.shape == (2, 3, 0)
    np.testing.assert_array_equal(np.asarray(final), init)


def test_eager_calls_compile_once(on_cpu, caplog):
    """Equal eager calls reuse JAX's compiled callback: one compile per configuration."""
    a = Inputs(Case(dim=6, seqlen=11)).arrays()
    cj.causal_conv1d_fn(a["x"], a["weight"])
    with jax.log_compiles(True), caplog.at_level("DEBUG"):
        cj.causal_conv1d_fn(a["x"] + 1, a["weight"])
        compiles = [r.getMessage() for r in caplog.records if "Compiling" in r.getMessage()]
        cj.causal_conv1d_fn(a["x"], a["weight"], activation="silu")  # a new configuration
        new = [r.getMessage() for r in caplog.records if "Compiling" in r.getMessage()]
    assert not any("pure_callback" in m for m in compiles), compiles
    assert any("pure_callback" in m for m in new), new  # (the check can see a compile)


# ---- CPU: validation -------------------------------------------------------------------------


def _args(**changes):
    base = {
        "x": jnp.zeros((2, 5, 7)),
        "weight": jnp.zeros((5, 4)),
        "bias": jnp.zeros(5),
        "seq_idx": jnp.zeros((2, 7), jnp.int32),
        "initial_states": jnp.zeros((2, 5, 3)),
    }
    base.update(changes)
    return base


INVALID = {
    "x-list": (dict(x=[[[1.0]]]), TypeError, r"^x must be a JAX or numpy array; got list"),
    "x-2d": (dict(x=jnp.zeros((5, 7))), ValueError, r"^x must have 3 dimensions"),
    "x-int": (dict(x=jnp.zeros((2, 5, 7), jnp.int32)), TypeError, r"^x must have dtype among"),
    "weight-dim": (dict(weight=jnp.zeros((6, 4))), ValueError, r"^weight must have shape"),
    "width-0": (
        dict(weight=jnp.zeros((5, 0)), initial_states=None),
        ValueError,
        r"between 1 and 256",
    ),
    "bias-dim": (dict(bias=jnp.zeros(4)), ValueError, r"^bias must have shape"),
    "seq_idx-float": (dict(seq_idx=jnp.zeros((2, 7))), TypeError, r"^seq_idx must have dtype"),
    "seq_idx-seqlen": (
        dict(seq_idx=jnp.zeros((2, 6), jnp.int32)),
        ValueError,
        r"^seq_idx must have shape",
    ),
    "initial_states-width": (
        dict(initial_states=jnp.zeros((2, 5, 4))),
        ValueError,
        r"^initial_states must have shape",
    ),
    "activation": (dict(activation="relu"), ValueError, r"^activation must be one of"),
    "flag": (dict(return_final_states="yes"), TypeError, r"^return_final_states must be a bool"),
}


@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize(("changes", "exc", "match"), INVALID.values(), ids=INVALID.keys())
def test_invalid_arguments(on_cpu, changes, exc, match, mode):
    """The core's checks and messages, on concrete arrays and on tracers (at trace time)."""
    kwargs = _args(**changes)
    arrays = {k: v for k, v in kwargs.items() if isinstance(v, jax.Array)}
    static = {k: v for k, v in kwargs.items() if k not in arrays}
    fn = lambda arrays: cj.causal_conv1d_fn(**arrays, **static)
    if mode == "jit":
        fn = jax.jit(fn)
    with pytest.raises(exc, match=match):
        fn(arrays)


CHANNEL_LAST_INVALID = {
    "flag": ({}, "yes", TypeError, r"^channel_last must be a bool; got str"),
    # (2, 5, 3) is the state shape without channel_last
    "initial_states": (
        {"initial_states": jnp.zeros((2, 5, 3))},
        True,
        ValueError,
        r"^initial_states must have shape \(batch, width - 1, dim\) from x and weight = "
        r"\(2, 3, 5\) \(channel_last\); got \(2, 5, 3\)$",
    ),
    # weight's dim is x's last: named first, before the states it would size
    "weight": (
        {"weight": jnp.zeros((7, 4)), "initial_states": jnp.zeros((2, 5, 3))},
        True,
        ValueError,
        r"^weight must have shape \(dim, width\) with dim = x.shape\[2\] = \(5, \*\) "
        r"\(channel_last\); got \(7, 4\)$",
    ),
    "bias": (
        {"bias": jnp.zeros(7)},
        True,
        ValueError,
        r"^bias must have shape \(dim,\) with dim = x.shape\[2\] = \(5,\) \(channel_last\)",
    ),
    "seq_idx": (
        {"seq_idx": jnp.zeros((2, 5), jnp.int32)},
        True,
        ValueError,
        r"^seq_idx must have shape \(batch, seqlen\) of x = \(2, 7\); got \(2, 5\)",
    ),
}


@pytest.mark.parametrize(
    ("changes", "flag", "exc", "match"), CHANNEL_LAST_INVALID.values(), ids=CHANNEL_LAST_INVALID
)
def test_invalid_channel_last_arguments(on_cpu, changes, flag, exc, match):
    """x [batch, seqlen, dim] = (2, 7, 5): the states' shapes named in channel-last terms."""
    kwargs = _args(**{"x": jnp.zeros((2, 7, 5)), "initial_states": jnp.zeros((2, 3, 5)), **changes})
    with pytest.raises(exc, match=match):
        cj.causal_conv1d_fn(**kwargs, channel_last=flag)


@pytest.mark.parametrize(
    ("name", "shape", "match"),
    [("dout", (2, 5, 7), r"^dout must have shape \(batch, seqlen, dim\) of x = \(2, 7, 5\)"),
     ("dfinal_states", (2, 5, 3), r"^dfinal_states must have shape \(batch, width - 1, dim\)")],
)  # fmt: skip
def test_invalid_channel_last_bwd_arguments(on_cpu, name, shape, match):
    kwargs = {"dout": jnp.zeros((2, 7, 5)), "dfinal_states": jnp.zeros((2, 3, 5))}
    kwargs[name] = jnp.zeros(shape)
    with pytest.raises(ValueError, match=match):
        cj.causal_conv1d_bwd(
            jnp.zeros((2, 7, 5)), jnp.zeros((5, 4)), None, kwargs["dout"],
            initial_states=jnp.zeros((2, 3, 5)), dfinal_states=kwargs["dfinal_states"],
            channel_last=True,
        )  # fmt: skip


@pytest.mark.parametrize(
    ("name", "shape", "match"),
    [("dout", (2, 5, 6), r"^dout must have shape"), ("dfinal_states", (2, 5, 2), r"^dfinal_s")],
)
def test_invalid_bwd_arguments(on_cpu, name, shape, match):
    a = _args()
    kwargs = {"dout": jnp.zeros((2, 5, 7)), "dfinal_states": jnp.zeros((2, 5, 3)), name: None}
    kwargs[name] = jnp.zeros(shape)
    with pytest.raises(ValueError, match=match):
        cj.causal_conv1d_bwd(
            a["x"], a["weight"], a["bias"], kwargs["dout"], a["seq_idx"], a["initial_states"],
            kwargs["dfinal_states"],
        )  # fmt: skip


# ---- CPU: the GPU path's plumbing ------------------------------------------------------------


def _lowered(fn, *args, platform):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def _custom_calls(text):
    return {line.split("custom_call @")[1].split("(")[0] for line in text.splitlines()
            if "custom_call @" in line}  # fmt: skip


LOWERED = {
    "forward": lambda x, w: cj.causal_conv1d_fn(x, w, return_final_states=True),
    "grad": jax.grad(lambda x, w: jnp.sum(cj.causal_conv1d_fn(x, w, activation="silu"))),
    "scan": lambda x, w: scan_chunks(x, w, None, jnp.zeros((2, 5, 3)), chunk=4),
}


@pytest.mark.parametrize("fn", LOWERED.values(), ids=LOWERED.keys())
def test_lowering_for_cuda_holds_the_buffer_callback(fn):
    """Lowered for CUDA (no GPU needed), the function is one buffer callback custom call per
    operator, no host callback (pure_callback's) and no transfer; lowered for the CPU it is the
    host callback only."""
    args = (jnp.zeros((2, 5, 16)), jnp.zeros((5, 4)))
    cuda = _custom_calls(_lowered(fn, *args, platform="cuda"))
    assert cuda == {"xla_buffer_python_gpu_callback"}, cuda
    cpu = _custom_calls(_lowered(fn, *args, platform="cpu"))
    assert cpu == {"xla_ffi_python_cpu_callback"}, cpu


def test_channel_last_lowers_without_transposes():
    """With channel_last the kernels read and write the [batch, seqlen, dim] buffers in place:
    the lowered step (forward and gradient) has the buffer callbacks and no transpose."""

    def loss(x, w, init):
        out, final = cj.causal_conv1d_fn(
            x, w, None, None, init, True, "silu", channel_last=True
        )  # fmt: skip
        return jnp.sum(out) + jnp.sum(final)

    args = (jnp.zeros((2, 16, 5)), jnp.zeros((5, 4)), jnp.zeros((2, 3, 5)))
    text = _lowered(jax.grad(loss, argnums=(0, 1, 2)), *args, platform="cuda")
    assert _custom_calls(text) == {"xla_buffer_python_gpu_callback"}
    assert "transpose" not in text, text


class HostBuffer:
    """Stands in for an XLA device buffer of buffer_callback: a numpy array behind
    ``__cuda_array_interface__`` (bfloat16 reports ``'<V2'``, as XLA's do) and
    ``__dlpack_device__``."""

    def __init__(self, a, device=3):
        self.a, self.device = a, device
        typestr = "<V2" if a.dtype == np_dtype("bfloat16") else a.dtype.str
        self.__cuda_array_interface__ = {
            "shape": a.shape, "typestr": typestr, "data": (a.ctypes.data, False),
            "strides": None, "version": 3,
        }  # fmt: skip

    def __dlpack_device__(self):
        return (2, self.device)


def fake_cupy(seen: dict):
    """A CuPy stand-in whose arrays are the numpy arrays behind HostBuffers (the core then takes
    its CPU path and writes into them); records the device and stream the callback chose."""

    @contextlib.contextmanager
    def device(d):
        seen["device"] = d
        yield

    @contextlib.contextmanager
    def from_external(stream):
        seen["stream"] = stream.__cuda_stream__()
        yield

    def unowned(ptr, size, owner, device):
        assert (ptr, size, device) == (owner.a.ctypes.data, owner.a.nbytes, owner.device)
        return owner

    def ndarray(shape, dtype, memptr, strides=None):
        assert strides is None and tuple(shape) == memptr.a.shape
        return memptr.a.view(dtype)  # the dtype the callback passes, not '<V2'

    cuda = types.SimpleNamespace(
        Device=device,
        Stream=types.SimpleNamespace(from_external=from_external),
        UnownedMemory=unowned,
        MemoryPointer=lambda mem, offset: mem,
    )
    return types.SimpleNamespace(cuda=cuda, ndarray=ndarray)


def _buffers(arrays):
    return [None if a is None else HostBuffer(np.asarray(a)) for a in arrays]


@pytest.mark.parametrize("channel_last", [False, True], ids=["cf", "cl"])
def test_gpu_callback_forward_writes_xla_buffers(on_cpu, monkeypatch, channel_last):
    """The buffer callback body, run on host buffers: it wraps the buffers with the traced dtypes,
    enters the device and XLA's stream, and has cupyconv.causal_conv1d_fn write out and
    final_states into the result buffers (channel_last: [batch, *, dim] buffers, read and
    written through the core's transposed views)."""
    inputs = Inputs(Case(dtype="bfloat16", seq_idx=True, init=True, final=True), seed=5)
    a = inputs.arrays()
    lay = cl if channel_last else (lambda t: t)
    arrays = (
        lay(a["x"]), a["weight"], a["bias"], jnp.asarray(inputs.seq_idx),
        lay(a["initial_states"]),
    )  # fmt: skip
    op = cj._Forward(True, True, cj._types(*arrays), channel_last)
    seen = {}
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy(seen))
    outs = tuple(HostBuffer(np.full(r.shape, np.nan, r.dtype)) for r in op.results())
    op.launch(types.SimpleNamespace(stream=0xC0FFEE), outs, *_buffers(arrays))
    assert seen == {"device": 3, "stream": (0, 0xC0FFEE)}
    check_results(inputs, tuple(lay(jnp.asarray(b.a)) for b in outs))


def test_gpu_callback_backward_writes_xla_buffers(on_cpu, monkeypatch):
    """The same for the backward: dx, dweight, dbias and dinitial_states written into the result
    buffers through causal_conv1d_bwd's output keywords."""
    inputs = Inputs(Case(dtype="bfloat16", wdtype="float32", seq_idx=True, init=True, final=True))
    a = inputs.arrays()
    arrays = (
        a["x"], a["weight"], a["bias"], jnp.asarray(inputs.dout, jnp.bfloat16),
        jnp.asarray(inputs.seq_idx), a["initial_states"], jnp.asarray(inputs.dfinal, jnp.bfloat16),
    )  # fmt: skip
    op = cj._Backward(True, cj._types(*arrays))
    seen = {}
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy(seen))
    outs = tuple(HostBuffer(np.full(r.shape, np.nan, r.dtype)) for r in op.results())
    op.launch(types.SimpleNamespace(stream=7), outs, *_buffers(arrays))
    assert seen == {"device": 3, "stream": (0, 7)}
    names = ("x", "weight", "bias", "initial_states")
    check_grads(inputs, {n: jnp.asarray(b.a) for n, b in zip(names, outs)})


def test_cupyconv_jax_imports_the_real_jax():
    assert cj.jax is sys.modules["jax"] and cj.jax.__name__ == "jax" and cj.jax.custom_vjp


def test_the_core_does_not_import_jax():
    code = "import sys, cupyconv; assert 'jax' not in sys.modules, 'cupyconv imported jax'"
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr


# ---- GPU: the buffer_callback path -----------------------------------------------------------


@pytest.fixture
def on_gpu():
    try:
        gpu = jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip(f"JAX has no GPU backend here (default backend: {jax.default_backend()})")
    with jax.default_device(gpu):
        yield gpu


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_gpu_forward(on_gpu, case, mode):
    with dtype_context(case):
        inputs = Inputs(case)
        run = inputs.call()
        if mode == "jit":
            run = jax.jit(run)
        res = run(inputs.arrays())
        for a in jax.tree_util.tree_leaves(res):
            assert a.devices() == {on_gpu}
        check_results(inputs, res)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_gpu_grad(on_gpu, case, mode):
    with dtype_context(case):
        inputs = Inputs(case, seed=1)
        grad = jax.grad(inputs.loss())
        if mode == "jit":
            grad = jax.jit(grad)
        grads = grad(inputs.arrays())
        for a in grads.values():
            assert a.devices() == {on_gpu}
        check_grads(inputs, grads)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("case", CHANNEL_LAST)
def test_gpu_channel_last(on_gpu, case, mode):
    check_channel_last(Inputs(CASES[case], seed=4), mode)


@pytest.mark.gpu
@pytest.mark.parametrize(("width", "chunk"), [(4, 64), (5, 3)], ids=["chunk64", "chunk3-short"])
def test_gpu_scan_over_chunks_equals_one_call(on_gpu, width, chunk):
    inputs = Inputs(Case(dim=64, seqlen=192, width=width, init=True, final=True), seed=2)
    diff = inputs.arrays()

    def loss(diff):
        out, final = scan_chunks(
            diff["x"], diff["weight"], diff["bias"], diff["initial_states"], chunk
        )
        return jnp.sum(out * inputs.dout) + jnp.sum(final * inputs.dfinal), (out, final)

    grads, res = jax.jit(jax.grad(loss, has_aux=True))(diff)
    check_results(inputs, res)
    check_grads(inputs, grads)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case",
    [Case(dtype="bfloat16", batch=2, dim=48, seqlen=200, init=True, final=True),
     Case(dtype="bfloat16", batch=3, dim=64, seqlen=5000, seq_idx=True)],
    ids=["one-part", "partials"],
)  # fmt: skip
def test_gpu_grad_replays_its_launches(on_gpu, monkeypatch, case):
    """Once a configuration has run, the backward's callback replays its launches into XLA's
    buffers (dweight's partials from CuPy's pool on XLA's stream) without the core's full
    path, with the new values."""
    monkeypatch.setattr(cj, "_ops", {})  # new instances, nothing learned
    for seed in (0, 1, 2):
        inputs = Inputs(case, seed=seed)
        check_grads(inputs, jax.jit(jax.grad(inputs.loss()))(inputs.arrays()))
        if seed == 0:  # (XLA may drop the forward's callback: jax.grad does not use out)
            assert any(type(op) is cj._Backward and op.lean for op in cj._ops)

            def full_path(*args, **kwargs):
                raise AssertionError("the backward took the core's full path")

            monkeypatch.setattr(cj, "_core_bwd", full_path)


@pytest.mark.gpu
def test_gpu_vmap(on_gpu):
    check_vmap()


@pytest.mark.gpu
def test_gpu_no_host_round_trip_under_jit(on_gpu):
    """The compiled GPU program holds the buffer callback as a custom call and no host callback
    (pure_callback's) or host transfer, also inside scan; results stay on the GPU."""
    x, w = jnp.zeros((2, 5, 16)), jnp.zeros((5, 4))
    for name, fn in LOWERED.items():
        hlo = jax.jit(fn).lower(x, w).compile().as_text()
        targets = set(re.findall(r'custom_call_target="([^"]+)"', hlo))
        assert "xla_buffer_python_gpu_callback" in targets, (name, targets)
        assert not {t for t in targets if "callback" in t} - {"xla_buffer_python_gpu_callback"}
        assert not re.search(r"\b(send|recv|infeed|outfeed)(-done)?\(", hlo), name
        for a in jax.tree_util.tree_leaves(jax.jit(fn)(x, w)):
            assert a.devices() == {on_gpu}


@pytest.mark.gpu
def test_gpu_runs_on_xlas_stream(on_gpu):
    """XLA work before and after the kernel, on large arrays: the kernel sees the producer's
    result and the consumer sees the kernel's (a launch on another stream would race)."""
    rng = np.random.default_rng(6)
    x64 = rounded(rng, (8, 1024, 2048), "float32")
    w64 = rounded(rng, (1024, 4), "float32", scale=0.5)

    @jax.jit
    def fn(x, w):
        return cj.causal_conv1d_fn(jnp.sin(x) * 3 + 1, w, activation="silu") * 2 - 1

    got = fn(jnp.asarray(x64, jnp.float32), jnp.asarray(w64, jnp.float32))
    want = 2 * reference.causal_conv1d_fn(np.sin(x64) * 3 + 1, w64, activation="silu") - 1
    assert_close(got, want, "float32", rtol=1e-3, atol=1e-2)  # sin in float32 on both sides


@pytest.mark.gpu
def test_gpu_mixed_devices_are_refused(on_gpu):
    x = jax.device_put(jnp.zeros((2, 5, 7)), jax.devices("cpu")[0])
    with pytest.raises(ValueError, match=r"^all arrays must be on one device; got x on .*weight"):
        cj.causal_conv1d_fn(x, jax.device_put(jnp.zeros((5, 4)), on_gpu))


def test_core_function_refuses_a_traced_value_by_name():
    """``cupyconv.causal_conv1d_fn`` (not ``cupyconv.jax``) under ``jax.jit`` says what to call."""
    import jax

    import cupyconv

    x, w = jnp.ones((1, 4, 8)), jnp.ones((4, 3))
    with pytest.raises(TypeError, match=r"^x is a traced JAX value \(inside jax\.jit"):
        jax.jit(lambda x: cupyconv.causal_conv1d_fn(x, w))(x)
