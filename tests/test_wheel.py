"""The wheel carries the kernel sources and runs ``python -m cupyconv`` outside the checkout."""

from __future__ import annotations

import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from cupyconv import _forward_plan

ROOT = Path(__file__).resolve().parents[1]


def run(*cmd, cwd):
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_wheel_installs_and_runs(tmp_path):
    pytest.importorskip("hatchling", reason="building the wheel needs hatchling")
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w",
        str(tmp_path), str(ROOT), cwd=tmp_path)  # fmt: skip
    (wheel,) = tmp_path.glob("cupyconv-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for source in ("common.cuh", "fwd_common.cuh", *_forward_plan.SOURCES):
        assert f"cupyconv/kernels/{source}" in names

    env_dir = tmp_path / "env"
    venv.create(env_dir, system_site_packages=True, with_pip=True)
    python = env_dir / "bin" / "python"
    run(str(python), "-m", "pip", "install", "--no-deps", "--no-index", str(wheel), cwd=tmp_path)
    out = run(str(python), "-m", "cupyconv", cwd=tmp_path)
    assert str(env_dir) in out  # the kernels were found inside the installed package
    assert out.rstrip().endswith("ok")
