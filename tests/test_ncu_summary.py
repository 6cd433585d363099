"""benchmarks/ncu_summary.py on a small synthetic Nsight Compute source table."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import ncu_summary  # noqa: E402 (after the path set-up above)

TABLE = """==PROF== Connected to process 1
some program output
"Kernel Name","void fwd_tc<...>"
"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","stall_wait","stall_long_sb","stall_wait (Not Issued)"
"0x10","LDS.128 R4, [R2]","10","100","2","8","1"
"0x20","FFMA R1, R2, R3, R1","30","100","30","0","5"
"0x30","@!P0 BRA 0x10","0","100","0","0","0"
"0x40","EXIT","60","1","0","60","0"
"""  # noqa: E501


def test_summary_of_a_table(tmp_path, capsys):
    path = tmp_path / "profile.csv"
    path.write_text(TABLE)
    ncu_summary.main([str(path), "--top", "2"])
    text = capsys.readouterr().out
    assert "executed instructions: 301   stall samples: 100" in text
    assert "stalls: long_sb 68%, wait 32%" in text
    assert "100 x    3 = 99.7%   LDS 1, FFMA 1, BRA 1" in text  # the loop body
    lines = text.splitlines()
    top = lines[lines.index("top 2 instructions by stall samples:") + 1 :]
    assert top[0].split()[:2] == ["60", "1"] and "EXIT" in top[0]
    assert "FFMA" in top[1] and top[1].rstrip().endswith("wait 30")


def test_a_file_without_a_table_is_refused(tmp_path):
    path = tmp_path / "empty.csv"
    path.write_text("no profile here\n")
    with pytest.raises(ValueError, match="no ncu source table"):
        ncu_summary.read_rows(str(path))
