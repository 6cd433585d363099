"""Host time per call of every cupyconv operator, for every input framework, on problems small
enough that the GPU is never the limit; the reference library beside it when importable.

    python benchmarks/overhead.py [--calls N] [--json PATH] [--profile ROW]

Each row is the wall time per call over N back-to-back calls (after warm-up; the median of 5
loops of N / 5 calls, each ending with one synchronisation): what a caller pays per call on the
host. The table is measured ``--passes`` times over and each row shows its least: on the
benchmark machine the host runs slower for the first seconds of a process. Problems: the
forward and backward on (1, 256, 512), the update on (1, 5120) with a state of width - 1, the
varlen states of 4 packed sequences of (512, 256); bfloat16, width 4, SiLU, bias. The training
step on (1, 256, 512) comes in parts: the whole step through torch autograd (grads set to None,
forward, ``.backward(dout)``), the forward under autograd alone and ``torch.autograd.grad`` of a
graph kept from one forward (what ``.backward()`` adds beyond those two: the graph's build and
release, the gradients' accumulation into ``.grad``); after the table, whether autograd took
each gradient as the backward made it (stolen) or copied it. ``--profile ROW`` shows the
hottest Python functions of that row, ``--ops ROW`` the torch operators it runs (a copy behind
``AccumulateGrad`` shows there).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

# Runs from any directory: the cupyconv of this checkout comes first.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def per_call_us(fn, sync, calls: int, repeats: int = 5) -> float:
    """Median over ``repeats`` loops of ``calls // repeats`` calls each (host noise on a shared
    machine shows up as single slow loops)."""
    for _ in range(50):
        fn()
    sync()
    n = max(1, calls // repeats)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        times.append((time.perf_counter() - start) / n * 1e6)
    return statistics.median(times)


def _jax_forward(x, w, b):
    """(fn, sync) of the forward on JAX GPU arrays, made when first timed."""
    import jax
    import jax.numpy as jnp

    import cupyconv

    jx, jw, jb = (jnp.asarray(t.float().cpu().numpy(), dtype=jnp.bfloat16) for t in (x, w, b))
    last = []

    def jax_forward():
        last[:] = [cupyconv.causal_conv1d_fn(jx, jw, jb, activation="silu")]

    return jax_forward, lambda: jax.block_until_ready(last[0]) if last else None


SHAPES = ((1, 256, 512), (256, 4), (256,))  # the forward's and backward's x, weight, bias


def rows_for(torch, cupy, jax_rows: bool, reference):
    """{row name: (fn, sync)} for every operator and framework present."""
    import cupyconv

    bf16 = torch.bfloat16
    dev = "cuda"
    x, w, b = (torch.randn(*shape, device=dev, dtype=bf16) for shape in SHAPES)
    x_cl = torch.randn(1, 512, 256, device=dev, dtype=bf16).transpose(1, 2)
    dout = torch.randn_like(x)
    ux = torch.randn(1, 5120, device=dev, dtype=bf16)
    uw = torch.randn(5120, 4, device=dev, dtype=bf16)
    ub = torch.randn(5120, device=dev, dtype=bf16)
    state = torch.randn(1, 5120, 3, device=dev, dtype=bf16)
    vx = torch.randn(512, 256, device=dev, dtype=bf16)
    cu = torch.tensor([0, 100, 300, 301, 512], device=dev, dtype=torch.int32)
    sync = torch.cuda.synchronize
    fn, bwd = cupyconv.causal_conv1d_fn, cupyconv.causal_conv1d_bwd
    update = cupyconv.causal_conv1d_update
    varlen = cupyconv.causal_conv1d_varlen_states
    rows = {
        "torch silu (one torch kernel)": (lambda: torch.nn.functional.silu(x), sync),
        "forward, torch": (lambda: fn(x, w, b, activation="silu"), sync),
        "forward + final states, torch (cl)": (
            lambda: fn(x_cl, w, b, return_final_states=True, activation="silu"),
            sync,
        ),
        "backward, torch": (lambda: bwd(x, w, b, dout, activation="silu"), sync),
        "update, torch": (lambda: update(ux, state, uw, ub, "silu"), sync),
        "varlen states, torch": (lambda: varlen(vx, cu, 3), sync),
    }
    rows.update(step_rows("", fn, torch, x, w, b, dout))
    if reference is not None:
        rfn, rupdate, rvarlen = reference
        rows.update(step_rows(": causal_conv1d", rfn, torch, x, w, b, dout))
        rows["forward, torch: causal_conv1d"] = (lambda: rfn(x, w, b, activation="silu"), sync)
        rows["forward + final states (cl): causal_conv1d"] = (
            lambda: rfn(x_cl, w, b, return_final_states=True, activation="silu"),
            sync,
        )
        rows["update, torch: causal_conv1d"] = (lambda: rupdate(ux, state, uw, ub, "silu"), sync)
        rows["varlen states, torch: causal_conv1d"] = (lambda: rvarlen(vx, cu, 3), sync)
    if cupy is not None:
        c = {k: cupy.from_dlpack(t) for k, t in dict(x=x, w=w, b=b, dout=dout, ux=ux, uw=uw,
                                                     ub=ub, state=state).items()}  # fmt: skip
        cs = cupy.cuda.get_current_stream().synchronize
        rows["forward, CuPy"] = (lambda: fn(c["x"], c["w"], c["b"], activation="silu"), cs)
        rows["backward, CuPy"] = (
            lambda: bwd(c["x"], c["w"], c["b"], c["dout"], activation="silu"),
            cs,
        )
        rows["update, CuPy"] = (lambda: update(c["ux"], c["state"], c["uw"], c["ub"], "silu"), cs)
    if jax_rows:  # last: an initialised JAX runtime keeps threads busy beside the other rows
        rows["forward, JAX (outside jit)"] = lambda: _jax_forward(x, w, b)  # made when timed
    return rows


def leaves(x, w, b):
    """Leaves that require grad, on the same storage."""
    return [t.detach().requires_grad_() for t in (x, w, b)]


def step_rows(suffix: str, conv, torch, x, w, b, dout) -> dict:
    """The training step's parts through torch autograd for ``conv`` (a causal_conv1d_fn)."""
    xg, wg, bg = leaves(x, w, b)
    kept = []

    def step():
        xg.grad = wg.grad = bg.grad = None
        conv(xg, wg, bg, activation="silu").backward(dout)

    def grad_of_kept_graph():
        if not kept:
            kept.append(conv(xg, wg, bg, activation="silu"))
        torch.autograd.grad(kept[0], (xg, wg, bg), dout, retain_graph=True)

    sync = torch.cuda.synchronize
    return {
        f"training step (autograd), torch{suffix}": (step, sync),
        f"forward under autograd, torch{suffix}": (
            lambda: conv(xg, wg, bg, activation="silu"),
            sync,
        ),
        f"autograd.grad of a kept graph, torch{suffix}": (grad_of_kept_graph, sync),
    }


def stolen(conv, torch, x, w, b, dout) -> list[bool]:
    """Whether x's, weight's and bias's .grad after a step are the very tensors the backward
    made (a hook on each leaf sees them before they are accumulated)."""
    made = []
    grads = leaves(x, w, b)
    for t in grads:
        t.register_hook(lambda g: made.append(g.data_ptr()))
    conv(*grads, activation="silu").backward(dout)
    torch.cuda.synchronize()
    return [t.grad.data_ptr() == p for t, p in zip(grads, made)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument(
        "--passes", type=int, default=3, help="times over the whole table; the least is shown"
    )
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--profile", help="a row name (substring) to profile")
    parser.add_argument("--ops", help="a row name (substring) whose torch operators to list")
    args = parser.parse_args()

    import torch

    try:
        import cupy
    except ImportError:
        cupy = None
    import importlib.util

    jax_rows = importlib.util.find_spec("jax") is not None
    try:
        from causal_conv1d import causal_conv1d_fn, causal_conv1d_update
        from causal_conv1d.causal_conv1d_varlen import causal_conv1d_varlen_states

        reference = (causal_conv1d_fn, causal_conv1d_update, causal_conv1d_varlen_states)
    except ImportError:
        reference = None

    rows = rows_for(torch, cupy, jax_rows, reference)
    results: dict[str, float] = {}
    for _ in range(args.passes):  # whole passes: a host that speeds up over time favours none
        for name, entry in rows.items():
            fn, sync = rows[name] = entry() if callable(entry) else entry
            us = per_call_us(fn, sync, args.calls)
            results[name] = min(us, results.get(name, us))
    print(f"{'row':46s} {'us/call':>8s}")
    for name, us in results.items():
        print(f"{name:46s} {us:8.1f}")
    import cupyconv

    x, w, b = (torch.randn(*shape, device="cuda", dtype=torch.bfloat16) for shape in SHAPES)
    dout = torch.randn_like(x)
    convs = {"cupyconv": cupyconv.causal_conv1d_fn}
    if reference is not None:
        convs["causal_conv1d"] = reference[0]
    for name, conv in convs.items():
        print(f"gradients stolen (x, weight, bias), {name}: {stolen(conv, torch, x, w, b, dout)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"calls": args.calls, "us_per_call": results}, f, indent=1)
    if args.profile:
        name = next(n for n in rows if args.profile in n)
        fn, sync = rows[name]
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.calls):
            fn()
        profile.disable()
        sync()
        print(f"\nprofile of {name!r}")
        pstats.Stats(profile).sort_stats("tottime").print_stats(18)
    if args.ops:
        name = next(n for n in rows if args.ops in n)
        fn, sync = rows[name]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(100):
                fn()
            sync()
        print(f"\ntorch operators of {name!r} (100 calls)")
        print(prof.key_averages().table(sort_by="count", row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    main()
