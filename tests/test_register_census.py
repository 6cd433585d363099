"""benchmarks/register_census.py: its ptxas log parser on a synthetic log, its instance list, and
one real offline compile (NVRTC, no GPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import register_census as census  # noqa: E402 (after the path set-up above)

LOG = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_Z3fooIfEvv' for 'sm_90'
ptxas info    : Function properties for _Z3fooIfEvv
ptxas         .     40 bytes stack frame, 68 bytes spill stores, 168 bytes spill loads
ptxas info    : Used 80 registers, used 0 barriers, 40 bytes cumulative stack size
ptxas info    : Compiling entry function '_Z3barIfEvv' for 'sm_90'
ptxas info    : Function properties for _Z3barIfEvv
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 128 registers, used 1 barriers, 24576 bytes smem
"""


def test_parse_log():
    assert census.parse_log(LOG) == [("_Z3fooIfEvv", 80, 68, 168), ("_Z3barIfEvv", 128, 0, 0)]


def test_jobs_leave_seq_instances_out_unless_asked():
    without = census.jobs(("bfloat16",), (4,), False, "sm_90")
    with_seq = census.jobs(("bfloat16",), (4,), True, "sm_90")
    names = [n for _, ns, _ in without for n in ns]
    seq_names = [n for _, ns, _ in with_seq for n in ns]
    assert names and not any(", true" in n for n in names)
    assert any(", true" in n for n in seq_names) and set(names) < set(seq_names)


def test_census_of_a_real_compile():
    pytest.importorskip("cuda.bindings.nvrtc", reason="needs the cuda-bindings wheel")
    pytest.importorskip("cuda.pathfinder", reason="needs the cuda-pathfinder wheel")
    (job,) = [
        j for j in census.jobs(("float32",), (4,), False, "sm_90") if j[0].file == "fwd_general.cu"
    ]
    file, rows = census._census(job)
    assert file == "fwd_general.cu" and len(rows) == len(job[1])
    assert all(name.startswith("_Z") and 0 < regs <= 255 for name, regs, _, _ in rows)
