"""A/B of cupyconv source trees on the GPU: the same cases timed with each tree's cupyconv, every
tree in a process of its own, the trees' processes interleaved over rounds, and their outputs
compared bitwise.

    python benchmarks/ab.py TREE [TREE ...] [--cases NAME[,NAME...]] [--op fwd|bwd]
                            [--rounds N] [--repeats N] [--json PATH]

A tree is a directory holding ``cupyconv/`` and ``kernels/``: ``.`` for this checkout, and for
another revision ``git worktree add DIR REV`` or ``git archive REV cupyconv kernels | tar -x -C
DIR``. Cases are bench.py's names (``cl-bf16-8x5120x2048-w16``: layout cf / cl / slice, dtype
bf16 / fp16 / fp32, ``-noact``, ``-nobias``, and ``-wf32``: weight and bias in float32, x's
dtype otherwise), their inputs made by ``bench.make_inputs``. A
tree's process times, for each case, a device-to-device copy of x's bytes and the call
(``causal_conv1d_fn``, or ``causal_conv1d_bwd`` with a dout like x) in ``bench.interleaved``
loops on torch's stream, and hashes the call's outputs. The table shows each tree's figure per
round (forward: copy/time; backward: TB/s over x, dout and dx) and whether every tree's outputs
were bitwise the same, printed (and the JSON written) after every round. The kernels compile in
each process (CuPy's disk cache keeps those of sources already seen), so the first round of a
tree also warms the cache.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
_NAME = re.compile(
    r"(cf|cl|slice)-(bf16|fp16|fp32)-(\d+)x(\d+)x(\d+)-w(\d+)((?:-noact|-nobias)*)(?:-wf32)?"
)
_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def parse_case(name: str):
    """bench.Case of a case name, as ``bench.Case.name`` writes it (a ``-wf32`` suffix, which
    only ``float32_weights`` reads, allowed)."""
    import bench

    m = _NAME.fullmatch(name)
    if m is None:
        raise ValueError(
            f"case must read like cl-bf16-8x5120x2048-w16[-noact][-nobias][-wf32]; got {name!r}"
        )
    layout, dtype, b, c, seqlen, width, flags = m.groups()
    return bench.Case(
        int(b), int(c), int(seqlen), layout, _DTYPES[dtype], int(width),
        None if "-noact" in flags else "silu", "-nobias" not in flags,
    )  # fmt: skip


def float32_weights(name: str) -> bool:
    """Whether case ``name`` takes its weight and bias in float32 (``-wf32``)."""
    return name.endswith("-wf32")


def digest(tensors) -> str:
    """The first 12 hex digits of the md5 of the tensors' bits (in their logical order)."""
    import torch

    h = hashlib.md5()
    for t in tensors:
        if t is not None:
            h.update(t.contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()[:12]


def worker(tree: str, names: list[str], op: str, repeats: int, target_ms: float) -> None:
    """One tree's process: a JSON line a case on stdout."""
    sys.path.insert(0, str(Path(tree).resolve()))
    import cupyconv  # the tree's, before bench puts this checkout first

    sys.path.insert(0, str(HERE))
    import bench
    import torch

    for name in names:
        case = parse_case(name)
        x, weight, bias = bench.make_inputs(case)
        if float32_weights(name):
            weight, bias = weight.float(), None if bias is None else bias.float()
        if op == "fwd":
            fn, args = cupyconv.causal_conv1d_fn, (x, weight, bias)
        else:
            fn, args = cupyconv.causal_conv1d_bwd, (x, weight, bias, torch.randn_like(x))
        call = functools.partial(fn, *args, activation=case.activation)
        out = call()
        loops = {
            "copy": bench.event_loop(bench.copy_provider(x)[0], target_ms=target_ms),
            "call": bench.event_loop(call, target_ms=target_ms),
        }
        times = bench.interleaved(loops, repeats)
        for result in times.values():
            if isinstance(result, BaseException):
                raise result
        copy_us, call_us = times["copy"]["us_median"], times["call"]["us_median"]
        value = copy_us / call_us if op == "fwd" else 3 * case.x_bytes / call_us / 1e6
        row = {"tree": tree, "case": name, "op": op, "us": call_us, "copy_us": copy_us}
        outs = out if isinstance(out, tuple) else (out,)
        print(json.dumps({**row, "value": value, "digest": digest(outs)}), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trees", nargs="+", metavar="TREE")
    parser.add_argument("--cases", default="cl-bf16-8x5120x2048-w16", help="comma-separated")
    parser.add_argument("--op", choices=("fwd", "bwd"), default="fwd")
    parser.add_argument("--rounds", type=int, default=2, help="processes a tree (default 2)")
    parser.add_argument("--repeats", type=int, default=7, help="timed loops a case and process")
    parser.add_argument("--target-ms", type=float, default=5.0, help="length of a timed loop")
    parser.add_argument("--json", metavar="PATH", help="write every row as JSON")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    names = args.cases.split(",")
    if args.worker:
        worker(args.trees[0], names, args.op, args.repeats, args.target_ms)
        return
    for tree in args.trees:
        if not (Path(tree) / "cupyconv").is_dir() or not (Path(tree) / "kernels").is_dir():
            parser.error(f"TREE must hold cupyconv/ and kernels/; got {tree!r}")
    for name in names:
        try:
            parse_case(name)
        except ValueError as exc:
            parser.error(str(exc))
    rows = []
    for r in range(args.rounds):
        for tree in args.trees:
            cmd = [sys.executable, __file__, tree, "--worker", "--cases", args.cases]
            cmd += ["--op", args.op, "--repeats", str(args.repeats)]
            cmd += ["--target-ms", str(args.target_ms)]
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if done.returncode:
                sys.exit(f"tree {tree}, round {r + 1} failed:\n{done.stderr[-3000:]}")
            rows += [{**json.loads(line), "round": r + 1} for line in done.stdout.splitlines()]
        # The table so far after every round (and the JSON rewritten): a run stopped by a time
        # limit keeps its finished rounds.
        print(f"after round {r + 1}:\n" + table(rows, args.trees, names, args.op), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))


def table(rows: list[dict], trees: list[str], names: list[str], op: str) -> str:
    """Each case's figures by tree (one a round, ' / '-separated) and whether every output
    digest was the same."""
    unit = "copy/time" if op == "fwd" else "TB/s over x, dout, dx"
    lines = [f"{op}: {unit}; " + " | ".join(trees) + " | outputs"]
    for name in names:
        mine = [r for r in rows if r["case"] == name]
        cells = [
            " / ".join(f"{r['value']:.3f}" for r in mine if r["tree"] == tree) for tree in trees
        ]
        same = "bitwise the same" if len({r["digest"] for r in mine}) == 1 else "DIFFER"
        lines.append(f"{name}: " + " | ".join(cells) + f" | {same}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
