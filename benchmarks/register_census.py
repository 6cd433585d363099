"""Registers and spills of the plans' kernel instances, compiled offline (no GPU needed).

    python benchmarks/register_census.py [--widths 4,8,16,31,64,128,256] [--dtypes bfloat16,float32]
                                         [--seq] [--arch sm_90] [--all]

Compiles every forward and backward template instance the plans can produce for the given x
dtypes and widths (``all_forward_instances``, ``all_backward_instances``; with ``--seq`` the
seq_idx instances too, which take minutes more), each source's instances in one NVRTC program
(``cupyconv._compile.ptxas_report``: the options CuPy passes, and ``-Xptxas=-v``), and prints
the instances that spill (``--all``: every instance): source, registers, spill stores / loads in
bytes, name. A budget that NVRTC
compiles with spills is a register budget to measure again (benchmarks/NOTES.md, "Register
budgets under NVRTC 13").
"""

from __future__ import annotations

import argparse
import re
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's cupyconv

from cupyconv._backward_plan import all_backward_instances  # noqa: E402
from cupyconv._compile import ptxas_report  # noqa: E402
from cupyconv._forward_plan import all_forward_instances  # noqa: E402

_ENTRY = re.compile(r"Compiling entry function '(\S+)'")
_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")


def parse_log(log: str) -> list[tuple[str, int, int, int]]:
    """(mangled name, registers, spill store bytes, spill load bytes) of each entry function in
    a ptxas -v log."""
    found, entry, spill = [], None, (0, 0)
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            entry, spill = m.group(1), (0, 0)
        elif m := _SPILL.search(line):
            spill = (int(m.group(1)), int(m.group(2)))
        elif (m := _USED.search(line)) and entry is not None:
            found.append((entry, int(m.group(1)), *spill))
            entry = None
    return found


def _census(job):
    source, names, arch = job
    return source.file, parse_log(ptxas_report(source, names, arch))


def jobs(dtypes, widths, seq: bool, arch: str) -> list[tuple]:
    """(source, instance names, arch) for each source of the forward and backward plans."""
    found = []
    for table in (all_forward_instances(dtypes, widths), all_backward_instances(dtypes, widths)):
        for source, names in table.items():
            names = [n for n in names if seq or ", true" not in n]
            if names:
                found.append((source, names, arch))
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--widths", default="4,8,16,31,64,128,256")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--seq", action="store_true", help="the seq_idx instances too")
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--all", action="store_true", help="every instance, not only spills")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    widths = tuple(int(w) for w in args.widths.split(","))
    work = jobs(tuple(args.dtypes.split(",")), widths, args.seq, args.arch)
    with ProcessPoolExecutor(args.workers) as pool:
        for file, rows in pool.map(_census, work):
            for name, regs, stores, loads in rows:
                if args.all or stores or loads:
                    print(
                        f"{file:18s} {regs:4d} registers  spills {stores:5d} / {loads:5d} B  {name}"
                    )


if __name__ == "__main__":
    main()
