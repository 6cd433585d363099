"""Decode-update benchmark of ``cupyconv.causal_conv1d_update``: host time per call, GPU time
per call from a CUDA-graph replay, and bandwidth over the bytes touched.

    python benchmarks/bench_update.py [--cases SUBSTR[,SUBSTR...]] [--json PATH] [--png PATH]

For every case (batch, dim, width 4, bfloat16, SiLU, bias; sliding or circular mode; the states
in a pool of 2 * batch rows gathered by a shuffled conv_state_indices) and provider (cupyconv,
and the reference library causal_conv1d when importable):

1. check: one call against the float64 oracle (``cupyconv.reference``): out within bfloat16's
   tolerance, the updated pool exactly;
2. ``host us``: wall time per call over 2000 back-to-back calls on the host (``perf_counter``,
   then one synchronisation): what a decode loop pays per layer and token, host path included;
3. ``graph us``: 100 calls captured in one torch CUDA graph, the replay timed with CUDA events
   (median of repeats) and divided by 100: the GPU time per call, launch gaps included;
4. ``GB/s``: bytes touched per call over ``graph us``: x read, out written, weight and bias
   read, the indices (and cache_seqlens) read, and the used state rows: read and written whole
   in sliding mode (every entry moves), width - 1 entries read and one written in circular mode.

The state pool is [2 batch, dim, width - 1] (state_len = width - 1, dense): what a serving
engine keeps per layer.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HOST_CALLS = 2000
GRAPH_CALLS = 100
WIDTH = 4


@dataclasses.dataclass(frozen=True)
class Case:
    batch: int
    dim: int
    mode: str  # "sliding" | "circular"

    @property
    def name(self) -> str:
        return f"{self.mode}-B{self.batch}-C{self.dim}"


def default_cases() -> list[Case]:
    modes, dims, batches = ("sliding", "circular"), (5120, 8192), (1, 64, 256)
    return [Case(b, c, mode) for mode in modes for c in dims for b in batches]


def make_inputs(case: Case, seed: int = 0):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    b, c = case.batch, case.dim
    bf16 = torch.bfloat16

    def randn(*shape):
        return torch.randn(*shape, generator=g, device="cuda").to(bf16)

    x, weight, bias = randn(b, c), randn(c, WIDTH) / 2, randn(c)
    pool = randn(2 * b, c, WIDTH - 1)
    idx = torch.randperm(2 * b, generator=g, device="cuda")[:b].to(torch.int32)
    lens = None
    if case.mode == "circular":
        lens = torch.randint(0, 1000, (b,), generator=g, device="cuda", dtype=torch.int32)
    return x, pool, weight, bias, lens, idx


def touched_bytes(case: Case) -> int:
    b, c, k = case.batch, case.dim, WIDTH
    state = 2 * b * c * (k - 1) if case.mode == "sliding" else b * c * k
    index = 4 * b * (2 if case.mode == "circular" else 1)
    return 2 * (2 * b * c + c * k + c + state) + index


def check(case: Case, fn) -> str:
    """'ok', or what went wrong, for one call of ``fn(x, pool, w, b, lens, idx)``."""
    import numpy as np

    from cupyconv import reference
    from cupyconv.testing import assert_close, to_numpy

    x, pool, weight, bias, lens, idx = make_inputs(case, seed=1)
    args = [to_numpy(a) if a is not None else None for a in (x, pool, weight, bias)]
    host_lens = None if lens is None else lens.cpu().numpy()
    want, want_pool = reference.causal_conv1d_update(
        *args, activation="silu", cache_seqlens=host_lens, conv_state_indices=idx.cpu().numpy()
    )
    try:
        out = fn(x, pool, weight, bias, lens, idx)
        assert_close(out, want, "bfloat16")
        if not np.array_equal(to_numpy(pool), want_pool):
            return "check failed: conv_state differs from the oracle"
    except Exception as exc:  # noqa: BLE001 - recorded in the row
        return f"check failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    return "ok"


def host_us(fn, args) -> float:
    import torch

    for _ in range(20):
        fn(*args)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(HOST_CALLS):
        fn(*args)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / HOST_CALLS * 1e6


def graph_us(fn, args, repeats: int = 7) -> float:
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            fn(*args)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    times = []
    for _ in range(repeats):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / GRAPH_CALLS)
    return statistics.median(times)


def providers():
    import cupyconv

    found = {
        "cupyconv": lambda x, s, w, b, lens, idx: cupyconv.causal_conv1d_update(
            x, s, w, b, "silu", lens, idx
        )
    }
    try:
        from causal_conv1d import causal_conv1d_update as reference_update
    except ImportError:
        return found, None
    found["causal_conv1d"] = lambda x, s, w, b, lens, idx: reference_update(
        x, s, w, b, "silu", lens, idx
    )
    return found, __import__("causal_conv1d").__version__


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", help="comma-separated substrings of case names")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--png", help="draw GB/s per case and provider here")
    args = parser.parse_args(argv)
    import torch

    cases = default_cases()
    if args.cases:
        cases = [c for c in cases if any(p in c.name for p in args.cases.split(","))]
    found, reference_version = providers()
    meta = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "causal_conv1d": reference_version or "not importable",
        "host_calls": HOST_CALLS,
        "graph_calls": GRAPH_CALLS,
    }
    print(f"# {meta}")
    print(f"{'case':24s} {'provider':14s} {'host us':>8s} {'graph us':>9s} {'GB/s':>7s}  check")
    rows = []
    for case in cases:
        for name, fn in found.items():
            status = check(case, fn)
            row = {"case": case.name, **dataclasses.asdict(case), "provider": name}
            row["status"] = status
            if status == "ok":
                inputs = make_inputs(case)
                row["host_us"] = host_us(fn, inputs)
                row["graph_us"] = graph_us(fn, inputs)
                row["gb_s"] = touched_bytes(case) / row["graph_us"] / 1e3
                print(
                    f"{case.name:24s} {name:14s} {row['host_us']:8.1f} {row['graph_us']:9.2f} "
                    f"{row['gb_s']:7.0f}  ok"
                )
            else:
                print(f"{case.name:24s} {name:14s} {'':8s} {'':9s} {'':7s}  {status}")
            rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    if args.png:
        draw_png(args.png, rows, meta)


def draw_png(path: str, rows: list[dict], meta: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys(r["case"] for r in rows))
    names = list(dict.fromkeys(r["provider"] for r in rows))
    value = {(r["case"], r["provider"]): r.get("graph_us") for r in rows}
    fig, ax = plt.subplots(figsize=(10, 4.5))
    bar = 0.8 / len(names)
    for i, name in enumerate(names):
        heights = [value.get((c, name)) or float("nan") for c in cases]
        ax.bar([j + (i - (len(names) - 1) / 2) * bar for j in range(len(cases))], heights, bar,
               label=name)  # fmt: skip
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels(cases, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(f"GPU us per call (graph replay of {GRAPH_CALLS})")
    ax.set_title(f"causal_conv1d_update, bf16, width {WIDTH}, {meta['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
