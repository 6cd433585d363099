"""Summarise an Nsight Compute source-level profile of one kernel.

    ncu --section SourceCounters --page source --print-source sass --csv \\
        -k regex:fwd_tc -c 1 python benchmarks/bench.py --cases cf-bf16-8x5120x2048-w4 \\
        --no-check --repeats 1 --quick > profile.csv
    python benchmarks/ncu_summary.py profile.csv [--top N]

Prints the executed instruction total, the warp-stall reasons as shares of all samples, the
instructions grouped by how often they ran (a loop body runs once per iteration, so the largest
groups are the hot loops, with their opcode mix), and the instructions with the most stall
samples.
"""

from __future__ import annotations

import argparse
import collections
import csv


def read_rows(path: str) -> list[dict]:
    """The per-instruction rows of the CSV (ncu prints the program's own output first)."""
    with open(path) as f:
        lines = f.read().splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"Address"')), None)
    if start is None:
        raise ValueError(f'{path}: no ncu source table (a line starting with "Address")')
    return list(csv.DictReader(lines[start:]))


def number(text: str | None) -> float:
    try:
        return float((text or "").replace(",", ""))
    except ValueError:
        return 0.0


def opcode(source: str) -> str:
    words = source.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else "?"


def summarise(rows: list[dict], top: int = 12) -> str:
    executed = [number(r.get("Instructions Executed")) for r in rows]
    samples = [number(r.get("Warp Stall Sampling (All Samples)")) for r in rows]
    total, total_samples = sum(executed), sum(samples) or 1.0
    out = [f"executed instructions: {total:,.0f}   stall samples: {sum(samples):,.0f}"]

    stalls = collections.Counter()
    for r in rows:
        for key, value in r.items():
            if key.startswith("stall_") and "Not Issued" not in key:
                stalls[key[len("stall_") :]] += number(value)
    shares = ", ".join(f"{k} {v / total_samples:.0%}" for k, v in stalls.most_common(8) if v)
    out.append(f"stalls: {shares}")

    groups: dict[float, list[str]] = collections.defaultdict(list)
    for r, n in zip(rows, executed):
        if n:
            groups[n].append(opcode(r.get("Source", "")))
    out.append("instructions by execution count (count x instructions = share; opcodes):")
    for n, ops in sorted(groups.items(), key=lambda kv: -kv[0] * len(kv[1]))[:6]:
        mix = ", ".join(f"{op} {c}" for op, c in collections.Counter(ops).most_common(8))
        out.append(f"  {n:>10,.0f} x {len(ops):4d} = {n * len(ops) / total:5.1%}   {mix}")

    out.append(f"top {top} instructions by stall samples:")
    ranked = sorted(zip(rows, samples, executed), key=lambda t: -t[1])[:top]
    for r, s, n in ranked:
        reasons = sorted(
            ((k[len("stall_") :], number(v)) for k, v in r.items()
             if k.startswith("stall_") and "Not Issued" not in k and number(v)),
            key=lambda kv: -kv[1],
        )[:2]  # fmt: skip
        why = ", ".join(f"{k} {v:.0f}" for k, v in reasons)
        out.append(f"  {s:6.0f} {n:10,.0f}  {r.get('Source', '').strip()[:60]:60s} {why}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", help="ncu --page source --print-source sass --csv output")
    parser.add_argument("--top", type=int, default=12, help="hottest instructions to list")
    args = parser.parse_args(argv)
    print(summarise(read_rows(args.csv), args.top))


if __name__ == "__main__":
    main()
