"""Backward and training-step benchmarks of cupyconv against a copy of x's bytes.

    python benchmarks/bench_bwd.py [--table bwd,train] [--headline] [--cases SUBSTR[,SUBSTR...]]
                                   [--quick] [--repeats N] [--no-check] [--json PATH] [--png PATH]
                                   [--list]

The machinery is the forward benchmark's (``bench.py``: inputs, check first, CUDA-event timing
with median and spread, copy/time, JSON and chart); this script adds two tables.

``bwd``: the backward alone, ``causal_conv1d_bwd(x, weight, bias, dout, activation=...)``.

- ``copy``: the forward's copy of x's bytes, measured in the same run.
- ``cupyconv``: ``cupyconv.causal_conv1d_bwd`` -> (dx, dweight, dbias, dinitial_states).
- ``cupyconv graph``: the same call captured once in a torch CUDA graph and replayed.
- ``torch``: the forward's torch baseline built once with autograd, then per call
  ``torch.autograd.grad(out, (x, weight, bias), dout, retain_graph=True)``: torch's backward
  alone (conv1d, slice and SiLU backward), no TF32.
- ``causal_conv1d``: the reference library's backward binding
  (``causal_conv1d.cpp_functions.causal_conv1d_bwd_function``, or
  ``causal_conv1d_cuda.causal_conv1d_bwd`` in releases without it), widths 2..4, when importable.
- ``cudnn``: the cuDNN frontend's ``cudnn.ops.causal_conv1d`` built once with autograd, then per
  call ``torch.autograd.grad`` as for torch: its backward alone, when importable
  (``bench.load_cudnn``).

``train``: one training step, forward and backward, on leaf tensors with requires_grad:
``out = f(x, weight, bias); out.backward(dout)``, the gradients set to None before each step (as
``optimizer.zero_grad()`` does) so that none is accumulated into an old one.

- ``copy``; ``cupyconv`` (``cupyconv.causal_conv1d_fn``: its torch autograd); ``torch``
  (``F.conv1d`` autograd); ``causal_conv1d`` (the reference library's autograd, widths 2..4);
  ``cudnn`` (the cuDNN frontend's autograd).
- ``cupyconv jax``: ``jax.jit`` of a step returning out and its vector-Jacobian product with
  dout (``jax.vjp`` of ``cupyconv.jax.causal_conv1d_fn``): the analogue of ``.backward(dout)``
  (``jax.grad`` of a scalar loss would add a reduction over out that the torch rows do not pay).
- ``jax conv``: the same step through ``lax.conv_general_dilated(feature_group_count=dim)``,
  float32 accumulation, one rounding.
- JAX arrays are row-major: for channel-last cases x and dout are [batch, seqlen, dim] arrays,
  which ``cupyconv.jax`` takes with ``channel_last=True`` and ``jax conv`` as "NHC", both in
  place. The JAX rows are timed on the host: n steps, then
  ``block_until_ready`` on the last.

Every provider is checked first against ``cupyconv.reference`` on all batch rows and a spread
of channels (all of them when the oracle is cheap): out and dx with the dtype's tolerance,
dweight and dbias with ``GRAD_TOLERANCE``, the atol scaled by sqrt(batch * seqlen) (the terms
each sums) and the rtol at least the dtype's (they are rounded to weight's dtype). A cupyconv
row whose check fails is not timed; a baseline's (torch, causal_conv1d, jax conv) is, and its
row keeps "check failed" with the reason (torch's bf16 autograd rounds SiLU's gradient to bf16
before the convolution backward: its bf16 dweight misses the contract's tolerance).

Bytes counted: backward, x and dout read and dx written (3 x x's bytes); training step, 5 x x's
bytes (the forward's x and out, the backward's x, dout and dx); weight, bias and their gradients
are not counted; the copy's row counts its read and write. ``TB/s`` is those bytes over the
median time; ``copy/time`` the copy's time over the provider's (the backward at copy bandwidth
would reach 2/3, a training step 2/5); ``bw/copy`` the provider's TB/s over the copy's (1.0:
copy bandwidth). Host-bound cases (x of at most ``HOST_TIMED_NUMEL`` elements, e.g.
(1, 256, 512)) also report ``host us``: wall time per call over back-to-back direct calls that
end with a sync (``torch.cuda.synchronize``, JAX's ``block_until_ready``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
import importlib.util
import math
import os
import platform
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

# Runs from any directory: the cupyconv of this checkout, and bench.py beside this file.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench  # noqa: E402 (after the path set-up above)
from bench import Case, error_text, fmt, note, us_spread  # noqa: E402

TABLES = ("bwd", "train")

PROVIDERS = {
    "bwd": ("copy", "cupyconv", "cupyconv graph", "torch", "causal_conv1d", "cudnn"),
    "train": ("copy", "cupyconv", "torch", "causal_conv1d", "cudnn", "cupyconv jax", "jax conv"),
}

#: x's bytes a provider moves at least, per table (the copy: 2, its read and write).
TRAFFIC = {"bwd": 3, "train": 5}

#: Oracle work per check, in multiply-adds (batch x channels x seqlen x width); above it the
#: check takes a spread of channels instead of all of them (about 1 s of the float64 oracle).
CHECK_BUDGET = 1 << 24

#: Cases with at most this many elements in x are host-bound: also timed on the host clock.
HOST_TIMED_NUMEL = 1 << 20

#: The outputs a provider returns, in order, and the axis that indexes channels in each.
CHANNEL_AXIS = {"out": 1, "dx": 1, "dweight": 0, "dbias": 0}
RESULTS = {"bwd": ("dx", "dweight", "dbias"), "train": ("out", "dx", "dweight", "dbias")}

JAX_PROVIDERS = ("cupyconv jax", "jax conv")

#: Baselines timed even when their check fails (the row says so): torch's autograd rounds SiLU's
#: gradient to bfloat16 before its convolution backward, which puts its bf16 dweight (and at
#: some widths dx) outside the contract's tolerances.
BASELINES = ("torch", "causal_conv1d", "cudnn", "jax conv")


def bwd_cases() -> list[Case]:
    """The backward rows (bf16, width 4, SiLU, bias unless the row says otherwise)."""
    cases = [Case(8, 5120, 2048, layout) for layout in ("cf", "cl", "slice")]
    for batch, dim, seqlen in ((1, 4096, 16384), (64, 1024, 512), (1, 256, 512)):
        cases += [Case(batch, dim, seqlen, layout) for layout in ("cf", "cl")]
    cases += [Case(8, 5120, 2048, layout, dtype="float32") for layout in ("cf", "cl")]
    for layout in ("cf", "cl"):  # the wide-filter rows
        cases += [Case(8, 5120, 2048, layout, width=w) for w in (8, 16, 31, 64, 128, 256)]
    return cases


def train_cases() -> list[Case]:
    """The training-step rows (bf16, width 4, SiLU, bias)."""
    shapes = ((1, 256, 512), (8, 5120, 2048))
    return [Case(b, d, s, layout) for b, d, s in shapes for layout in ("cf", "cl")]


#: --headline: the shapes of platform.md's "numbers to beat", the host-bound row and width 64.
HEADLINE = {
    "bwd": (
        "cf-bf16-8x5120x2048-w4",
        "cl-bf16-8x5120x2048-w4",
        "slice-bf16-8x5120x2048-w4",
        "cf-bf16-64x1024x512-w4",
        "cl-bf16-64x1024x512-w4",
        "cf-bf16-1x256x512-w4",
        "cl-bf16-1x256x512-w4",
        "cf-bf16-8x5120x2048-w64",
        "cl-bf16-8x5120x2048-w64",
    ),
    "train": tuple(case.name for case in train_cases()),
}


def table_cases(table: str, pattern: str | None = None, headline: bool = False) -> list[Case]:
    """A table's cases, narrowed to --headline and to the --cases substrings."""
    cases = bwd_cases() if table == "bwd" else train_cases()
    if headline:
        cases = [case for case in cases if case.name in HEADLINE[table]]
    return bench.select_cases(cases, pattern)


def bytes_of(table: str, case: Case, provider: str) -> int:
    """Bytes a provider's TB/s counts: the copy's read + write, else ``TRAFFIC`` x x's bytes."""
    return (2 if provider == "copy" else TRAFFIC[table]) * case.x_bytes


def host_timed(case: Case) -> bool:
    return case.numel <= HOST_TIMED_NUMEL


def grad_tolerance(case: Case) -> tuple[float, float]:
    """(rtol, atol) of dweight and dbias: ``GRAD_TOLERANCE`` with the atol scaled by sqrt(terms
    summed, batch * seqlen), the rtol at least the dtype's (rounded to weight's dtype)."""
    from cupyconv.testing import GRAD_TOLERANCE, tolerance

    rtol, atol = GRAD_TOLERANCE
    return max(rtol, tolerance(case.dtype)[0]), atol * math.sqrt(case.batch * case.seqlen)


# ---- what the run found importable ------------------------------------------------------------


@dataclasses.dataclass
class Env:
    """The optional providers' entry points, or why they are absent."""

    device: str = "cuda"
    reference_fn: Callable | None = None  # causal_conv1d.causal_conv1d_fn (autograd)
    reference_bwd: Callable | None = None  # (x, weight, bias, dout, silu) -> (dx, dw, db, dinit)
    reference_bwd_name: str | None = None
    cudnn_fn: Callable | None = None  # cudnn.ops.causal_conv1d (autograd)
    jax: Any = None
    jax_reason: str | None = "JAX not loaded"
    cupyconv_jax: Any = None
    cupyconv_jax_reason: str | None = "cupyconv.jax not loaded"


def load_reference_bwd():
    """(bwd(x, weight, bias, dout, silu), its name) from the reference library, or (None, None)."""
    try:
        from causal_conv1d.cpp_functions import causal_conv1d_bwd_function as bwd

        name = "causal_conv1d.cpp_functions.causal_conv1d_bwd_function"
    except ImportError:
        try:
            import causal_conv1d_cuda
        except ImportError:
            return None, None
        bwd = causal_conv1d_cuda.causal_conv1d_bwd
        name = "causal_conv1d_cuda.causal_conv1d_bwd"

    def call(x, weight, bias, dout, silu):
        # seq_idx, initial_states, dfinal_states, dx, return_dinitial_states
        return bwd(x, weight, bias, dout, None, None, None, None, False, silu)

    return call, name


def load_jax(env: Env) -> None:
    """Imports JAX (without its default preallocation of most GPU memory: torch shares the
    device) and ``cupyconv.jax``; records why either is unusable."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    try:
        import jax
    except Exception as exc:  # noqa: BLE001 (recorded in the rows, not fatal)
        env.jax_reason = f"jax is not importable ({error_text(exc)})"
        env.cupyconv_jax_reason = env.jax_reason
        return
    backend = jax.default_backend()
    if env.device == "cuda" and backend != "gpu":
        env.jax_reason = f"JAX has no GPU backend (default backend {backend!r})"
        env.cupyconv_jax_reason = env.jax_reason
        return
    env.jax, env.jax_reason = jax, None
    try:
        module = importlib.import_module("cupyconv.jax")
    except Exception as exc:  # noqa: BLE001 (recorded in the rows, not fatal)
        env.cupyconv_jax_reason = f"cupyconv.jax is not importable ({error_text(exc)})"
        return
    if not hasattr(module, "causal_conv1d_fn"):
        env.cupyconv_jax_reason = "cupyconv.jax has no causal_conv1d_fn"
        return
    env.cupyconv_jax, env.cupyconv_jax_reason = module, None


# ---- inputs, oracle, check --------------------------------------------------------------------


def make_dout(case: Case, device: str = "cuda"):
    """dout, dense in the memory order of x's output (channel-last for cl and slice)."""
    import torch

    torch.manual_seed(1)
    opts = {"device": device, "dtype": getattr(torch, case.dtype)}
    if case.layout == "cf":
        return torch.randn(case.batch, case.dim, case.seqlen, **opts)
    return torch.randn(case.batch, case.seqlen, case.dim, **opts).transpose(1, 2)


def check_channels(case: Case, device: str = "cuda"):
    """The channels a check compares (every batch row is compared: dweight sums over them)."""
    import torch

    work_per_channel = case.batch * case.seqlen * case.width
    n_channels = min(case.dim, max(1, CHECK_BUDGET // work_per_channel))
    return torch.linspace(0, case.dim - 1, n_channels).round().long().unique().to(device)


def oracle(table: str, case: Case, x, weight, bias, dout, channels) -> dict:
    """float64 numpy results of ``cupyconv.reference`` on the checked channels, by name."""
    from cupyconv import reference

    def f64(t, axis):
        return None if t is None else t.index_select(axis, channels).double().cpu().numpy()

    args = f64(x, 1), f64(weight, 0), f64(bias, 0)
    dx, dweight, dbias, _ = reference.causal_conv1d_bwd(
        *args, f64(dout, 1), activation=case.activation
    )
    expected = {"dx": dx, "dweight": dweight, "dbias": dbias}
    if table == "train":
        expected["out"] = reference.causal_conv1d_fn(*args, activation=case.activation)
    return expected


def pick_torch(names: tuple[str, ...], result, channels) -> dict:
    """The checked channels of a provider's torch results (given in the order of ``names``)."""
    return {
        name: None if t is None else t.index_select(CHANNEL_AXIS[name], channels)
        for name, t in zip(names, result, strict=False)
    }


def assert_results(case: Case, provider: str, got: dict, expected: dict) -> None:
    """AssertionError unless every expected result is there and within tolerance."""
    from cupyconv.testing import assert_close

    for name, want in expected.items():
        if want is None:
            continue
        label = f"{provider} {name}"
        if got.get(name) is None:
            raise AssertionError(f"{label}: no result")
        if name in ("dweight", "dbias"):
            rtol, atol = grad_tolerance(case)
            assert_close(got[name], want, dtype=case.dtype, rtol=rtol, atol=atol, name=label)
        else:
            assert_close(got[name], want, dtype=case.dtype, name=label)


# ---- providers --------------------------------------------------------------------------------


def leaves(*tensors):
    """Detached copies of the tensors' views (same storage and strides) that require grad."""
    return [None if t is None else t.detach().requires_grad_() for t in tensors]


def bwd_providers(case: Case, x, weight, bias, dout, env: Env) -> dict:
    """{provider: (fn, skip reason)}; fn() returns (dx, dweight, dbias, ...)."""
    import torch

    import cupyconv

    def ours():
        return cupyconv.causal_conv1d_bwd(x, weight, bias, dout, activation=case.activation)

    def backward_of(forward):
        """fn() -> torch.autograd.grad of ``forward``'s output, built once, for dout."""
        xg, wg, bg = leaves(x, weight, bias)
        with torch.enable_grad():
            out = forward(xg, wg, bg)
        inputs = [t for t in (xg, wg, bg) if t is not None]

        def grads():
            result = torch.autograd.grad(out, inputs, dout, retain_graph=True)
            return result if bg is not None else (*result, None)

        return grads

    providers = {
        "copy": bench.copy_provider(x),
        "cupyconv": (ours, None),
        "cupyconv graph": bench.graphed(ours),
        "torch": (backward_of(lambda x, w, b: bench.torch_conv(case, x, w.unsqueeze(1), b)), None),
    }
    if env.reference_bwd is not None:
        silu = case.activation is not None
        if 2 <= case.width <= 4:
            providers["causal_conv1d"] = (
                lambda: env.reference_bwd(x, weight, bias, dout, silu),
                None,
            )
        else:
            providers["causal_conv1d"] = (None, f"width {case.width} outside 2..4")
    if env.cudnn_fn is not None:
        cudnn_forward = partial(env.cudnn_fn, activation=case.activation)
        try:
            providers["cudnn"] = (backward_of(cudnn_forward), None)
        except Exception as exc:  # noqa: BLE001 (recorded in the row, not fatal)
            providers["cudnn"] = (None, f"forward refused: {error_text(exc)}")
    return providers


def autograd_step(forward, x, weight, bias, dout):
    """fn() of one training step through torch autograd -> (out, dx, dweight, dbias)."""
    xg, wg, bg = leaves(x, weight, bias)
    params = [t for t in (xg, wg, bg) if t is not None]

    def step():
        for t in params:
            t.grad = None
        out = forward(xg, wg, bg)
        if out.grad_fn is None:
            raise RuntimeError("the output has no grad_fn: this function is not differentiable")
        out.backward(dout)
        return out, xg.grad, wg.grad, None if bg is None else bg.grad

    return step


def to_jax(jax, t):
    """A dense torch tensor as a JAX array on JAX's default device (DLPack, else a host copy)."""
    try:
        return jax.dlpack.from_dlpack(t)
    except Exception:  # noqa: BLE001 (the copy is the fallback)
        import jax.numpy as jnp

        return jnp.asarray(t.float().cpu().numpy(), dtype=str(t.dtype).removeprefix("torch."))


def jax_step(case: Case, env: Env, conv, x, weight, bias, dout):
    """(fn, pick): fn() runs the jitted step ``(out, *vjp(dout))`` of ``conv(x, weight, bias)``
    with x and dout in the case's memory order ([batch, seqlen, dim] for channel-last)."""
    jax = env.jax
    import jax.numpy as jnp

    channel_last = case.layout != "cf"
    user = (lambda t: t.transpose(1, 2)) if channel_last else (lambda t: t)
    args = [None if t is None else to_jax(jax, t.contiguous()) for t in (weight, bias)]
    xj, gj = to_jax(jax, user(x).contiguous()), to_jax(jax, user(dout).contiguous())

    def step(x, weight, bias, dout):
        out, vjp = jax.vjp(conv, x, weight, bias)
        return (out, *vjp(dout))

    jitted = jax.jit(step)

    def pick(result, channels) -> dict:
        """The checked channels as numpy arrays, out and dx as [batch, channels, seqlen]."""
        index = jnp.asarray(channels.cpu().numpy())
        picked = {}
        for name, a in zip(RESULTS["train"], result, strict=True):
            if a is not None and channel_last and name in ("out", "dx"):
                a = jnp.swapaxes(jnp.take(a, index, axis=2), 1, 2)
            elif a is not None:
                a = jnp.take(a, index, axis=CHANNEL_AXIS[name])
            picked[name] = None if a is None else jax.device_get(a)
        return picked

    return (lambda: jitted(xj, *args, gj)), pick


def cupyconv_jax_conv(case: Case, env: Env):
    """conv(x, weight, bias) through ``cupyconv.jax.causal_conv1d_fn``, x in the case's order
    (``channel_last`` for [batch, seqlen, dim] arrays)."""
    fn = env.cupyconv_jax.causal_conv1d_fn
    channel_last = case.layout != "cf"
    return lambda x, w, b: fn(x, w, b, activation=case.activation, channel_last=channel_last)


def lax_conv(case: Case, env: Env):
    """conv(x, weight, bias) through ``lax.conv_general_dilated``, x in the case's order."""
    jax = env.jax
    import jax.numpy as jnp

    spec = "NCH" if case.layout == "cf" else "NHC"
    bias_shape = [1, 1, 1]
    bias_shape[spec.index("C")] = case.dim

    def conv(x, w, b):
        out = jax.lax.conv_general_dilated(
            x,
            w[:, None, :],  # [dim, 1, width]: OIH
            window_strides=(1,),
            padding=[(case.width - 1, 0)],
            dimension_numbers=(spec, "OIH", spec),
            feature_group_count=case.dim,
            preferred_element_type=jnp.float32,
        )
        if b is not None:
            out = out + b.astype(jnp.float32).reshape(bias_shape)
        if case.activation is not None:
            out = jax.nn.silu(out)
        return out.astype(x.dtype)

    return conv


def train_providers(case: Case, x, weight, bias, dout, env: Env):
    """({provider: (fn, skip reason)}, {provider: pick}) for the training-step table; fn()
    returns (out, dx, dweight, dbias); a pick takes them to the checked channels."""
    import cupyconv

    def ours(x, w, b):
        return cupyconv.causal_conv1d_fn(x, w, b, activation=case.activation)

    def torch_fwd(x, w, b):
        return bench.torch_conv(case, x, w.unsqueeze(1), b)

    providers = {
        "copy": bench.copy_provider(x),
        "cupyconv": (autograd_step(ours, x, weight, bias, dout), None),
        "torch": (autograd_step(torch_fwd, x, weight, bias, dout), None),
    }
    if env.reference_fn is not None:
        if 2 <= case.width <= 4:

            def reference(x, w, b):
                return env.reference_fn(x, w, b, activation=case.activation)

            providers["causal_conv1d"] = (autograd_step(reference, x, weight, bias, dout), None)
        else:
            providers["causal_conv1d"] = (None, f"width {case.width} outside 2..4")
    if env.cudnn_fn is not None:
        cudnn_forward = partial(env.cudnn_fn, activation=case.activation)
        providers["cudnn"] = (autograd_step(cudnn_forward, x, weight, bias, dout), None)
    picks = {}
    for name, reason, make_conv in (
        ("cupyconv jax", env.cupyconv_jax_reason, cupyconv_jax_conv),
        ("jax conv", env.jax_reason, lax_conv),
    ):
        if reason is not None:
            providers[name] = (None, reason)
            continue
        try:
            fn, picks[name] = jax_step(case, env, make_conv(case, env), x, weight, bias, dout)
            providers[name] = (fn, None)
        except Exception as exc:  # noqa: BLE001 (recorded in the row, not fatal)
            providers[name] = (None, f"set-up failed: {error_text(exc)}")
    return providers, picks


# ---- one case ---------------------------------------------------------------------------------


def run_case(
    table: str,
    case: Case,
    env: Env,
    *,
    do_check: bool,
    repeats: int,
    target_ms: float,
    loop: Callable | None = None,
    host_loop: Callable | None = None,
) -> list[dict]:
    """Check, then time every provider of ``table`` on one case (``bench.measure_case``), then
    time the host-bound cases on the host clock (the providers again interleaved); one row per
    provider, never raises.

    ``loop`` and ``host_loop`` replace ``bench.event_loop`` and ``bench.host_loop`` (tests).
    """
    built: dict = {}

    def setup():
        x, weight, bias = bench.make_inputs(case, env.device)
        dout = make_dout(case, env.device)
        if table == "bwd":
            providers, picks = bwd_providers(case, x, weight, bias, dout, env), {}
        else:
            providers, picks = train_providers(case, x, weight, bias, dout, env)
        built.update(providers)

        def checker():
            channels = check_channels(case, env.device)
            expected = oracle(table, case, x, weight, bias, dout, channels)

            def compare(name, fn):
                result = fn()
                pick = picks.get(name, partial(pick_torch, RESULTS[table]))
                assert_results(case, name, pick(result, channels), expected)

            where = f"all {case.batch} batch rows, {len(channels)} of {case.dim} channels"
            return compare, where

        return providers, checker

    sync = torch_sync if env.device == "cuda" else (lambda result: None)
    host_loop = host_loop or bench.host_loop
    loops = {name: partial(host_loop, sync=jax_sync) for name in JAX_PROVIDERS}
    if loop is not None:
        loops.update({name: loop for name in PROVIDERS[table] if name not in JAX_PROVIDERS})
    absent = {
        "causal_conv1d": (env.reference_bwd if table == "bwd" else env.reference_fn) is None,
        "cudnn": env.cudnn_fn is None,
    }
    names = tuple(name for name in PROVIDERS[table] if not absent.get(name))
    rows = bench.measure_case(
        case,
        setup,
        names=names,
        bytes_of=partial(bytes_of, table, case),
        do_check=do_check,
        repeats=repeats,
        target_ms=target_ms,
        loops=loops,
        timed_if_off=BASELINES,
    )

    copy_gbps = next((row["gbps"] for row in rows if row["provider"] == "copy"), None)
    host_loops = {}
    for row in rows:
        name = row["provider"]
        row.update(
            table=table,
            timing="host" if name in JAX_PROVIDERS else "cuda events",
            tbps=None if row["gbps"] is None else row["gbps"] / 1e3,
            bw_ratio=None if None in (row["gbps"], copy_gbps) else row["gbps"] / copy_gbps,
            host_us=None,
        )
        if not host_timed(case) or row["us_median"] is None:
            continue
        if name in JAX_PROVIDERS:
            row["host_us"] = row["us_median"]
            continue
        try:
            host_loops[name] = host_loop(built[name][0], sync=sync, target_ms=target_ms)
        except Exception as exc:  # noqa: BLE001 (recorded in the row, not fatal)
            row.update(status="error", message=f"host timing: {error_text(exc)}")
    by_name = {row["provider"]: row for row in rows}
    for name, host in bench.interleaved(host_loops, repeats).items():
        if isinstance(host, BaseException):
            by_name[name].update(status="error", message=f"host timing: {error_text(host)}")
        else:
            by_name[name]["host_us"] = host["us_median"]
    return rows


def torch_sync(result) -> None:
    import torch

    torch.cuda.synchronize()


def jax_sync(result) -> None:
    import jax

    jax.block_until_ready(result)


# ---- output -----------------------------------------------------------------------------------

COLUMNS = {
    "bwd": (
        ("case", lambda row: row["case"], False),
        ("provider", lambda row: row["provider"], False),
        ("us", lambda row: fmt(row["us_median"], ".1f"), True),
        ("min-max us", us_spread, True),
        ("TB/s", lambda row: fmt(row["tbps"], ".2f"), True),
        ("copy/time", lambda row: fmt(row["copy_ratio"], ".2f"), True),
        ("bw/copy", lambda row: fmt(row["bw_ratio"], ".2f"), True),
        ("host us", lambda row: fmt(row["host_us"], ".1f"), True),
        ("note", note, False),
    ),
}
COLUMNS["train"] = (
    *COLUMNS["bwd"][:-1],
    ("timing", lambda row: "host" if row["timing"] == "host" else "events", False),
    COLUMNS["bwd"][-1],
)

TITLES = {
    "bwd": "backward: causal_conv1d_bwd; TB/s over x, dout and dx (3 x x's bytes)",
    "train": "training step: forward + backward; TB/s over 5 x x's bytes",
}

#: Chart marks: copy/time of a provider moving its bytes at copy bandwidth.
MARKS = {
    "bwd": ((2 / 3, "3 x bytes at copy bandwidth"),),
    "train": ((2 / 5, "5 x bytes at copy bandwidth"),),
}

CHART_TITLES = {"bwd": "causal_conv1d backward", "train": "causal_conv1d training step"}


def png_path(path: str, table: str, tables: list[str]) -> str:
    """--png's PATH for the first table run, PATH with '-<table>' before its suffix for the
    others."""
    if table == tables[0]:
        return path
    p = Path(path)
    return str(p.with_name(f"{p.stem}-{table}{p.suffix or '.png'}"))


def parse_tables(parser: argparse.ArgumentParser, text: str) -> list[str]:
    tables = [t for t in dict.fromkeys(text.split(",")) if t]
    bad = [t for t in tables if t not in TABLES]
    if bad or not tables:
        parser.error(
            f"--table takes a comma-separated list of {', '.join(TABLES)}; got {text!r}"
            + (" (bench.py runs the forward table)" if "fwd" in bad else "")
        )
    return tables


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Backward (cupyconv.causal_conv1d_bwd) and training-step (torch autograd, "
        "JAX) benchmarks against a device-to-device copy of x's bytes, torch conv1d, "
        "causal_conv1d and the cuDNN frontend (when importable).",
    )
    parser.add_argument(
        "--table",
        default="bwd,train",
        metavar="TABLES",
        help="comma-separated tables to run: bwd, train (default both)",
    )
    parser.add_argument(
        "--headline",
        action="store_true",
        help="only the headline cases (platform.md's shapes, (1, 256, 512), width 64)",
    )
    bench.add_arguments(parser)
    args = parser.parse_args(argv)
    tables = parse_tables(parser, args.table)

    cases = {table: table_cases(table, args.cases, args.headline) for table in tables}
    if args.list:
        for table in tables:
            for case in cases[table]:
                print(f"{table:5s} {case.name}")
        return
    if not any(cases.values()):
        parser.error(f"no case name contains any of {args.cases!r} (see --list)")
    repeats, target_ms = bench.timing_options(parser, args)
    draw = bool(args.png)
    if draw and importlib.util.find_spec("matplotlib") is None:
        print("--png: matplotlib is not installed; no chart will be drawn")
        draw = False

    import torch

    import cupyconv

    if not torch.cuda.is_available():
        raise SystemExit("bench_bwd.py needs a CUDA device; torch sees none")
    bench.use_ieee_fp32_convs(torch)

    causal_conv1d, reference_fn = bench.load_reference()
    env = Env(reference_fn=reference_fn)
    env.reference_bwd, env.reference_bwd_name = load_reference_bwd()
    env.cudnn_fn, cudnn_version = bench.load_cudnn()
    if "train" in tables and cases["train"]:
        load_jax(env)

    meta = {
        "tables": tables,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cupyconv": getattr(cupyconv, "__version__", "unknown"),
        "cupy": module_version("cupy"),
        "causal_conv1d": causal_conv1d and getattr(causal_conv1d, "__version__", "unknown"),
        "causal_conv1d_bwd": env.reference_bwd_name,
        "cudnn": cudnn_version,
        "python": platform.python_version(),
        "repeats": repeats,
        "target_ms": target_ms,
        "checked": not args.no_check,
        "check_budget": CHECK_BUDGET,
        "host_timed_numel": HOST_TIMED_NUMEL,
        "bytes": {
            "bwd": "x + dout + dx (3 x x's bytes); copy: read + write (2 x)",
            "train": "fwd x + out, bwd x + dout + dx (5 x x's bytes); copy: read + write (2 x)",
        },
    }
    if "train" in tables:
        meta["jax"] = env.jax and env.jax.__version__
        meta["jax_skipped"] = env.jax_reason
        meta["cupyconv_jax_skipped"] = env.cupyconv_jax_reason

    rows = {table: [] for table in tables}
    for table in tables:
        for case in cases[table]:
            rows[table] += run_case(
                table, case, env, do_check=not args.no_check, repeats=repeats, target_ms=target_ms
            )
            torch.cuda.empty_cache()

    for table in tables:
        if rows[table]:
            bench.print_table(rows[table], meta, COLUMNS[table], title=TITLES[table], unit="TB/s")
    if args.json:
        bench.write_json(args.json, [row for table in tables for row in rows[table]], meta)
    if draw:
        for table in tables:
            if rows[table]:
                title = CHART_TITLES[table]
                path = png_path(args.png, table, tables)
                bench.draw_png(path, rows[table], meta, title=title, marks=MARKS[table])


def module_version(name: str) -> str | None:
    try:
        return importlib.import_module(name).__version__
    except Exception:  # noqa: BLE001 (a version is informative only)
        return None


if __name__ == "__main__":
    main()
