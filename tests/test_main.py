"""The command line, ``python -m cupyconv [info|check|bench|warmup]`` (``cupyconv/_cli``).

Each command runs in a subprocess with the GPU hidden (``CUDA_VISIBLE_DEVICES=""``), so the
no-GPU paths run on every machine: the exit status, what each command says it cannot do, the
CPU-path check, the offline compiles. The GPU paths run in the ``gpu`` tests. In-process: the
argument parsing, the instances the offline warmup records, the benchmark's check-then-time
driver on CPU arrays, its table, JSON rows and chart.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import cupyconv
from cupyconv import _cli
from cupyconv._cli import bench, check, warmup
from cupyconv._compile import kernel_dir

ROOT = Path(__file__).resolve().parents[1]
T = "__nv_bfloat16"


def run_cli(*args: str, gpu: bool = False, **env) -> subprocess.CompletedProcess:
    """``python -m cupyconv ARGS`` from the checkout; the GPU hidden unless ``gpu``."""
    environ = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    if not gpu:
        environ["CUDA_VISIBLE_DEVICES"] = ""
    return subprocess.run(
        [sys.executable, "-m", "cupyconv", *args],
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=600,
    )


def passed(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def nvrtc_missing() -> bool:
    from cupyconv._cli.env import offline_nvrtc

    return offline_nvrtc() is None


needs_nvrtc = pytest.mark.skipif(nvrtc_missing(), reason="needs cuda-bindings' NVRTC")


# ---- each command in a subprocess, without a GPU ----------------------------------------------


def test_default_command_without_gpu():
    """info, the CPU-path check and the compile check; the bench says it cannot run; "ok"."""
    out = passed(run_cli())
    assert f"cupyconv {cupyconv.__version__}" in out
    assert re.search(r"^  GPU +none: ", out, re.MULTILINE), out
    assert "the GPU kernels cannot run here; checking the CPU path" in out
    assert "check on the CPU path (numpy arrays): all 72 match the float64 reference" in out
    if not nvrtc_missing():
        assert "compile check: 15 forward kernel instances compile with NVRTC" in out
        assert "21 backward, update and varlen instances for sm_90" in out
    assert "bench: no GPU (" in out and "nothing to time (6 cases skipped)" in out
    assert out.rstrip().endswith("ok")


def test_info_reports_versions_and_the_kernel_cache(tmp_path):
    """A stand-in CuPy cache of two programs, one holding a cupyconv kernel."""
    (tmp_path / "a.cubin").write_bytes(b"\x7fELF..._Z8fwd_timeI13__nv_bfloat16Li4ELb0E...")
    (tmp_path / "b.cubin").write_bytes(b"\x7fELF..._Z6saxpyPfS_...")
    out = passed(run_cli("info", CUPY_CACHE_DIR=str(tmp_path)))
    lines = {line.split()[0]: line for line in out.splitlines()[1:] if line.strip()}
    for label in ("Python", "GPU", "CUDA", "NVRTC", "CuPy", "torch", "JAX", "numpy"):
        assert label in lines, out
    assert "none: no CUDA device" in lines["GPU"] or "CuPy is not installed" in lines["GPU"]
    for label, module in (("torch", "torch"), ("JAX", "jax")):  # version, or "not installed"
        try:
            version = importlib.metadata.version(module)
        except importlib.metadata.PackageNotFoundError:
            version = "not installed"
        assert lines[label].endswith(f"  {version}"), lines[label]
    sources = len(list(kernel_dir().glob("*.cu")))
    assert f"kernel sources  {kernel_dir()} ({sources} .cu files" in out
    assert f"kernel cache    {tmp_path} (CuPy's disk cache): 2 compiled programs" in out
    assert "1 of them hold cupyconv kernels" in out


def test_check_command_runs_the_cpu_path():
    out = passed(run_cli("check", "--no-compile"))
    assert out.splitlines()[0].startswith("check: no GPU (")
    assert "all 72 match the float64 reference: fwd, fwd+states, bwd, update sliding" in out
    assert "compile check" not in out


def test_bench_without_gpu_writes_skipped_rows(tmp_path):
    rows_path, chart = tmp_path / "rows.json", tmp_path / "chart.png"
    out = passed(run_cli("bench", "--quick", "--json", str(rows_path), "--png", str(chart)))
    assert out.startswith("bench: no GPU (") and "nothing to time (6 cases skipped)" in out
    data = json.loads(rows_path.read_text())
    assert {row["status"] for row in data["rows"]} == {"skipped"}
    assert {row["table"] for row in data["rows"]} == {"forward", "backward", "update"}
    if importlib.util.find_spec("matplotlib") is not None:
        assert "chart skipped: no timed rows" in out
    else:
        assert "--png needs matplotlib, which is not installed" in out
    assert not chart.exists()


@needs_nvrtc
def test_warmup_without_gpu_compiles_offline():
    args = "--dim 64 --width 4 --dtype bfloat16 --batch 1 --seqlen 64 --layout cf --ops fwd,update"
    out = passed(run_cli("warmup", *args.split()))
    assert "cannot load kernels; compiling the same instances offline with NVRTC" in out
    assert "need 2 kernel instances, compiled offline for sm_90:" in out
    listed = [line.strip() for line in out.splitlines() if line.startswith("  ")]
    assert listed == [f"conv_update_lean<{T}, 4, 2>", f"fwd_time<{T}, 4, false, 2, 4>"]


# ---- the same on a GPU ------------------------------------------------------------------------


@pytest.mark.gpu
def test_check_on_gpu():
    out = passed(run_cli("check", gpu=True))
    assert "check on the GPU (" in out and "all 72 match the float64 reference" in out


@pytest.mark.gpu
def test_warmup_on_gpu():
    args = "--dim 64 --width 4 --batch 1,2 --seqlen 64 --layout cf,cl --ops fwd,bwd,update"
    out = passed(run_cli("warmup", *args.split(), gpu=True))
    assert "compiled and loaded:" in out and f"conv_update<{T}, 4>" in out
    assert "kernel cache: " in out


@pytest.mark.gpu
def test_bench_on_gpu(tmp_path):
    rows_path = tmp_path / "rows.json"
    out = passed(run_cli("bench", "--quick", "--tables", "forward", "--json", str(rows_path),
                         gpu=True))  # fmt: skip
    rows = json.loads(rows_path.read_text())["rows"]
    ours = [row for row in rows if row["provider"] == "cupyconv"]
    assert ours and all(row["check"] == "ok" and row["gbps"] > 0 for row in ours), out


# ---- argument parsing -------------------------------------------------------------------------


def parse(*args: str) -> argparse.Namespace:
    parser = _cli.build_parser()
    parsed = parser.parse_args(args)
    if parsed.command == "warmup":
        warmup.check_arguments(parser, parsed)
    return parsed


def test_parse_commands_and_defaults():
    assert parse().command is None
    assert parse("info").command == "info"
    args = parse("check", "--cpu", "--no-compile")
    assert (args.command, args.cpu, args.no_compile) == ("check", True, True)
    args = parse("bench")
    assert (args.quick, args.tables, args.json, args.png) == (False, list(bench.TABLES), None, None)
    args = parse("bench", "--quick", "--tables", "update,forward", "--repeats", "2")
    assert (args.quick, args.tables, args.repeats) == (True, ["update", "forward"], 2)
    args = parse("warmup", "--dim", "5120", "--batch", "1,8", "--layout", "cf,cl", "--ops", "bwd")
    assert (args.dim, args.width, args.dtype, args.weight_dtype) == (5120, 4, "bfloat16", None)
    assert (args.batch, args.seqlen, args.layout, args.ops) == ([1, 8], [2048], ["cf", "cl"],
                                                                ["bwd"])  # fmt: skip
    assert (args.seq_idx, args.states, args.arch) == (False, False, "sm_90")


@pytest.mark.parametrize(
    "args",
    [
        pytest.param(("warmup",), id="warmup-without-dim"),
        pytest.param(("warmup", "--dim", "64", "--batch", "0"), id="batch-0"),
        pytest.param(("warmup", "--dim", "64", "--batch", "1,x"), id="batch-not-int"),
        pytest.param(("warmup", "--dim", "64", "--ops", "fwd,conv"), id="unknown-op"),
        pytest.param(("warmup", "--dim", "64", "--layout", "nhwc"), id="unknown-layout"),
        pytest.param(("warmup", "--dim", "64", "--width", "257"), id="width-257"),
        pytest.param(("warmup", "--dim", "0"), id="dim-0"),
        pytest.param(("bench", "--tables", "train"), id="unknown-table"),
        pytest.param(("bench", "--repeats", "0"), id="repeats-0"),
        pytest.param(("nonsense",), id="unknown-command"),
    ],
)
def test_parse_refuses(args, capsys):
    with pytest.raises(SystemExit) as exc:
        parse(*args)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_warmup_tasks_each_call_once():
    """The update does not depend on seqlen: one call per batch and layout."""
    args = parse("warmup", "--dim", "8", "--batch", "1,8", "--seqlen", "64,128", "--ops",
                 "fwd,update")  # fmt: skip
    names = [task.name for task in warmup.tasks(args)]
    assert names == [
        "fwd cf batch 1 seqlen 64", "fwd cf batch 1 seqlen 128", "fwd cf batch 8 seqlen 64",
        "fwd cf batch 8 seqlen 128", "update cf batch 1", "update cf batch 8",
    ]  # fmt: skip


# ---- the offline warmup's instances (no compile) ------------------------------------------------


def offline_names(*args: str) -> list[str]:
    parsed = parse("warmup", *args)
    instances = warmup.offline_instances(warmup.tasks(parsed), parsed)
    return sorted(name for names in instances.values() for name in names)


@pytest.mark.parametrize(
    "args,expected",
    [
        pytest.param(
            "--dim 256 --seqlen 64 --ops fwd,bwd", [
                f"bwd_time<{T}, 4, false, 1, 2, 1>", f"fwd_time<{T}, 4, false, 2, 4>",
            ], id="cf-short-rows",  # one part: no bwd_reduce
        ),
        pytest.param(
            "--dim 256 --seqlen 64,4096 --ops fwd", [
                f"fwd_time<{T}, 4, false, 2, 4>", f"fwd_time<{T}, 4, false, 8, 1>",
            ], id="cf-short-and-long-rows",
        ),
        pytest.param(
            "--dim 256 --seqlen 64 --batch 8 --layout cl --ops bwd --states --seq-idx", [
                f"bwd_channel<{T}, 4, true, 8, 4, 3, 4>", f"bwd_reduce<{T}, 1>", f"bwd_states<{T}>",
            ], id="cl-bwd-states-seq-idx",
        ),
        pytest.param(
            "--dim 256 --seqlen 64 --layout cl --ops bwd",
            [f"bwd_channel<{T}, 4, false, 8, 4, 3, 4>"],
            id="cl-bwd-block-sums",  # one batch row: a block a strip adds dweight, no bwd_reduce
        ),
        pytest.param(
            "--dim 256 --seqlen 64 --width 64 --ops fwd --layout cf,cl",
            [f"fwd_mma<{T}, 5, false, 0>", f"fwd_mma_cl<{T}, 5>"],
            id="wide-filters",
        ),
        pytest.param(
            "--dim 256 --seqlen 64 --width 16 --ops fwd --layout cl", [f"fwd_mma_cl<{T}, 2>"],
            id="channel-last-tensor-cores",
        ),
        pytest.param(
            "--dim 256 --ops update --dtype float32 --width 20",
            ["conv_update<float, 0>"], id="update-run-time-width",
        ),
    ],
)  # fmt: skip
def test_offline_instances_are_the_ones_warmup_loads(args, expected):
    """The recorder sees what cupyconv.warmup would compile, also where the plan asks the
    device for its occupancy (fwd_mma, fwd_channel_wide)."""
    assert offline_names(*args.split()) == expected


def test_offline_recording_leaves_the_plans_alone():
    from cupyconv import _compile, _forward_plan, _warmup

    offline_names("--dim", "256", "--width", "64", "--ops", "fwd")
    assert _warmup.get_kernel is _compile.get_kernel
    assert _forward_plan.resident_blocks.__module__ == "cupyconv._launch"
    assert not any(plan.grid == 1 for plan in _forward_plan._plans.values())


# ---- the check ----------------------------------------------------------------------------------


def test_assert_equal_is_exact():
    want = np.arange(6.0).reshape(2, 3)
    check.assert_equal(want.astype(np.float32), want, "states")
    for bad in (np.where(want == 1, 1 + 1e-6, want), np.where(want == 4, np.nan, want)):
        with pytest.raises(AssertionError, match=r"states: 1 of 6 elements differ.*first at"):
            check.assert_equal(bad, want, "states")


def test_check_reports_a_wrong_operator(monkeypatch, capsys):
    """A forward that is off by a little fails its two checks, with assert_close's message, and
    the command exits 1; the other operators pass."""
    real = cupyconv.causal_conv1d_fn

    def off(*args, **kwargs):
        result = real(*args, **kwargs)
        if isinstance(result, tuple):
            return result
        return (result.astype(np.float64) + 0.1).astype(result.dtype)

    monkeypatch.setattr(check, "SHAPES", ((1, 16, 40, 4),))
    monkeypatch.setattr(cupyconv, "causal_conv1d_fn", off)
    args = parse("check", "--no-compile")
    assert check.command(args, None, "hidden") == 1
    out = capsys.readouterr().out
    assert "check FAILED on the CPU path (numpy arrays): 4 of 24 checks" in out
    assert "FAILED fwd cf-bf16-1x16x40-w4: out: " in out and "allowed error" in out
    assert "FAILED fwd+states" not in out


# ---- the benchmark's driver, rows and chart on CPU arrays -------------------------------------


def test_bench_case_names_and_traffic():
    forward = bench.Case("forward", 8, 5120, 2048, "cl")
    assert forward.name == "cl-bf16-8x5120x2048-w4"
    assert forward.traffic == 2 * 2 * 8 * 5120 * 2048 + 2 * 5120 * 5
    assert bench.Case("backward", 8, 5120, 2048).traffic == 3 * 2 * 8 * 5120 * 2048 + 2 * 5120 * 5
    # benchmarks/bench_update.py's bytes touched (bfloat16, width 4)
    b, c = 64, 5120
    sliding = bench.Case("update", b, c, mode="sliding")
    assert sliding.name == "sliding-bf16-B64-C5120-w4"
    assert sliding.traffic == 2 * (2 * b * c + c * 4 + c + 2 * b * c * 3) + 4 * b
    circular = bench.Case("update", b, c, mode="circular")
    assert circular.traffic == 2 * (2 * b * c + c * 4 + c + b * c * 4) + 8 * b
    assert len(bench.default_cases(quick=True)) == 6
    assert {c.table for c in bench.default_cases(tables=["update"])} == {"update"}


def numpy_providers(case, inputs, env):
    """The benchmark's providers on CPU arrays: cupyconv's CPU path, a copy, a wrong one."""
    dtype = check.numpy_dtype(case.dtype)
    a = {
        name: h.logical().astype(dtype) if h.dense.dtype != np.int32 else h.logical().copy()
        for name, h in inputs.items()
    }
    src = np.zeros(case.traffic // 2, np.uint8)
    found = {"copy": bench.Provider(lambda: src.copy())}
    if case.table == "forward":
        ours = lambda: cupyconv.causal_conv1d_fn(a["x"], a["weight"], a["bias"], activation="silu")
        found["cupyconv"] = bench.Provider(ours, lambda out: {"out": out})
        found["off"] = bench.Provider(ours, lambda out: {"out": out + 1})
    elif case.table == "backward":
        found["cupyconv"] = bench.Provider(
            lambda: cupyconv.causal_conv1d_bwd(
                a["x"], a["weight"], a["bias"], a["dout"], activation="silu"
            ),
            lambda g: {"dx": g[0], "dweight": g[1], "dbias": g[2]},
        )
    else:
        found["cupyconv"] = bench.Provider(
            lambda: cupyconv.causal_conv1d_update(
                a["x"], a["conv_state"], a["weight"], a["bias"], "silu",
                a.get("cache_seqlens"), a["conv_state_indices"],
            ),
            lambda out: {"out": out, "conv_state": a["conv_state"]},
        )  # fmt: skip
        found["skipped"] = bench.Provider(skip="width 4 outside 5..6")
    return found


def fake_timer(fn, *, repeats, target_ms):
    fn()
    return bench.spread([10.0, 11.0, 12.0][:repeats], 5)


@pytest.mark.parametrize(
    "case",
    [
        bench.Case("forward", 3, 80, 50, "cl"),
        bench.Case("backward", 2, 70, 40, "cf", "float32"),
        bench.Case("update", 3, 40, mode="sliding"),
        bench.Case("update", 3, 40, mode="circular", width=3),
    ],
    ids=lambda case: case.name,
)
def test_run_case_checks_then_times(case, monkeypatch):
    monkeypatch.setattr(bench, "providers", numpy_providers)
    monkeypatch.setattr(bench, "CHECK_CHANNELS", 16)
    rows = {r["provider"]: r for r in bench.run_case(case, None, repeats=3, target_ms=1.0,
                                                      timer=fake_timer)}  # fmt: skip
    ours = rows["cupyconv"]
    assert (ours["status"], ours["check"], ours["us_median"]) == ("ok", "ok", 11.0)
    assert ours["gbps"] == pytest.approx(case.traffic / 11e3)
    assert ours["copy_ratio"] == pytest.approx(1.0)
    assert rows["copy"]["check"] is None and rows["copy"]["us_median"] == 11.0
    if "off" in rows:  # a baseline that fails its check is timed, and says so
        assert rows["off"]["check"] == "failed" and rows["off"]["us_median"] == 11.0
        assert rows["off"]["message"].startswith("check failed: out: ")
    if "skipped" in rows:
        assert rows["skipped"]["status"] == "skipped" and rows["skipped"]["us_median"] is None


def test_run_case_does_not_time_a_failing_cupyconv(monkeypatch):
    def wrong(case, inputs, env):
        found = numpy_providers(case, inputs, env)
        found["cupyconv"] = found.pop("off")
        return found

    monkeypatch.setattr(bench, "providers", wrong)
    case = bench.Case("forward", 2, 16, 30)
    rows = {r["provider"]: r for r in bench.run_case(case, None, repeats=3, target_ms=1.0,
                                                      timer=fake_timer)}  # fmt: skip
    assert rows["cupyconv"]["status"] == "check failed"
    assert rows["cupyconv"]["us_median"] is None and rows["cupyconv"]["copy_ratio"] is None


def timed_rows() -> list[dict]:
    rows = []
    for case in bench.default_cases(quick=True):
        for provider, us in (("copy", 10.0), ("cupyconv", 11.0), ("torch", 40.0)):
            row = bench.new_row(case, provider)
            row.update(bench.spread([us, us + 1, us + 2], 5))
            row["gbps"] = row["bytes"] / (row["us_median"] * 1e3)
            row["copy_ratio"] = 10.0 / (us + 1)
            rows.append(row)
    return rows


def test_table_and_json_rows(tmp_path):
    rows = timed_rows()
    lines = bench.format_table([r for r in rows if r["table"] == "forward"])
    assert lines[0].split() == ["case", "provider", "us", "min-max", "us", "GB/s", "copy/time",
                                "note"]  # fmt: skip
    # 2 x's bytes + weight and bias over 11 us; the copy's time over 11 us
    assert lines[2].split() == ["cf-bf16-4x2048x2048-w4", "copy", "11.0", "10.0-12.0", "6103",
                                "0.91"]  # fmt: skip
    assert lines[5] == ""  # a blank line between cases
    path = tmp_path / "rows.json"
    bench.write_json(str(path), rows, {"device": "stand-in"})
    data = json.loads(path.read_text())
    assert data == {"meta": {"device": "stand-in"}, "rows": rows}


def test_chart(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "chart.png"
    message = bench.draw_chart(str(path), timed_rows(), {"cupyconv": "0", "device": "stand-in"})
    assert message == f"chart: {path}"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_chart_without_matplotlib(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    path = tmp_path / "chart.png"
    message = bench.draw_chart(str(path), timed_rows(), {"cupyconv": "0", "device": "stand-in"})
    assert message.startswith("chart skipped: --png needs matplotlib") and not path.exists()


def test_default_run_draws_its_chart_on_a_gpu_only(monkeypatch, capsys):
    """The command-less run asks the quick bench for its chart in ./cupyconv-bench.png on a
    GPU, and for none without one (nothing is timed there; no file is left behind)."""
    from cupyconv import _cli

    asked = []

    def bench_command(args, gpu, reason):
        asked.append((args.quick, args.png))
        return 0

    monkeypatch.setattr(_cli.env, "report", lambda gpu, reason: None)
    monkeypatch.setattr(_cli.check, "command", lambda args, gpu, reason: 0)
    monkeypatch.setattr(_cli.bench, "command", bench_command)
    parser = _cli.build_parser()
    assert _cli.run_all(parser, None, "no CUDA device") == 0
    assert _cli.run_all(parser, object(), "") == 0
    assert asked == [(True, None), (True, "cupyconv-bench.png")]
    assert capsys.readouterr().out.splitlines()[-1] == "ok"
