"""The CPU-checkable parts of benchmarks/bench.py and benchmarks/bench_bwd.py: case lists, byte
counts, the table layout, and the check-then-time driver run on tiny CPU tensors with a stand-in
timer (the GPU timing itself runs on the benchmark machine)."""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import ab  # noqa: E402 (after the path set-up above)
import bench  # noqa: E402
import bench_bwd  # noqa: E402
from bench import Case  # noqa: E402

FORWARD_CASES = [
    "cf-bf16-8x5120x2048-w4",
    "cl-bf16-8x5120x2048-w4",
    "cf-bf16-1x4096x16384-w4",
    "cl-bf16-1x4096x16384-w4",
    "cf-bf16-64x1024x512-w4",
    "cl-bf16-64x1024x512-w4",
    "slice-bf16-8x5120x2048-w4",
    "cf-fp32-8x5120x2048-w4",
    "cl-fp32-8x5120x2048-w4",
    "cf-fp16-8x5120x2048-w4",
    *[
        f"{layout}-bf16-8x5120x2048-w{w}"
        for layout in ("cf", "cl")
        for w in (8, 16, 31, 64, 128, 256)
    ],
    "cf-fp32-8x5120x2048-w16",
    "cf-fp32-8x5120x2048-w64",
    "cl-fp32-8x5120x2048-w16",
    "cl-fp32-8x5120x2048-w64",
    "cl-bf16-8x5120x2048-w12",
]


def fake_loop(fn, *, target_ms, sync=None):
    """Stands in for event_loop / host_loop: runs fn once; its loop reports 10, 11, 12, 10, ...
    us per call."""
    result = fn()
    if sync is not None:
        sync(result)
    times = itertools.cycle([10.0, 11.0, 12.0])
    return 5, lambda: next(times)


def run(table, case, env, **kwargs):
    options = {"do_check": True, "repeats": 3, "target_ms": 1.0}
    return bench_bwd.run_case(
        table, case, env, loop=fake_loop, host_loop=fake_loop, **(options | kwargs)
    )


def by_provider(rows):
    return {row["provider"]: row for row in rows}


# ---- case lists and CLI ------------------------------------------------------------------------


def test_forward_list_is_unchanged(capsys):
    bench.main(["--list"])
    assert capsys.readouterr().out.split() == FORWARD_CASES


def test_bwd_list(capsys):
    bench_bwd.main(["--list"])
    lines = [line.split() for line in capsys.readouterr().out.splitlines()]
    bwd = [name for table, name in lines if table == "bwd"]
    train = [name for table, name in lines if table == "train"]
    assert len(bwd) == len(set(bwd)) == 23
    for name in ("slice-bf16-8x5120x2048-w4", "cl-fp32-8x5120x2048-w4", "cl-bf16-1x256x512-w4"):
        assert name in bwd
    for layout in ("cf", "cl"):
        for width in (8, 16, 31, 64, 128, 256):
            assert f"{layout}-bf16-8x5120x2048-w{width}" in bwd
    assert train == [
        "cf-bf16-1x256x512-w4",
        "cl-bf16-1x256x512-w4",
        "cf-bf16-8x5120x2048-w4",
        "cl-bf16-8x5120x2048-w4",
    ]


def test_headline_names_exist():
    for table in bench_bwd.TABLES:
        names = [case.name for case in bench_bwd.table_cases(table)]
        assert set(bench_bwd.HEADLINE[table]) <= set(names)
        assert len(bench_bwd.table_cases(table, headline=True)) == len(bench_bwd.HEADLINE[table])


def test_list_narrows(capsys):
    bench_bwd.main(["--list", "--table", "bwd", "--headline", "--cases", "1x256,slice"])
    assert capsys.readouterr().out.split() == [
        "bwd",
        "slice-bf16-8x5120x2048-w4",
        "bwd",
        "cf-bf16-1x256x512-w4",
        "bwd",
        "cl-bf16-1x256x512-w4",
    ]


@pytest.mark.parametrize("argv", [["--table", "fwd"], ["--table", ","], ["--cases", "nothing"]])
def test_bad_options(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        bench_bwd.main(argv)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_without_a_gpu_it_says_so():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        bench_bwd.main(["--cases", "1x256", "--table", "bwd", "--quick"])


# ---- bytes, tolerances, names -------------------------------------------------------------------


def test_bytes():
    case = Case(8, 5120, 2048)
    x_bytes = 8 * 5120 * 2048 * 2
    assert case.x_bytes == x_bytes
    assert Case(8, 5120, 2048, dtype="float32").x_bytes == 2 * x_bytes
    assert case.param_bytes == 5120 * 5 * 2
    assert bench_bwd.bytes_of("bwd", case, "copy") == 2 * x_bytes
    assert bench_bwd.bytes_of("bwd", case, "cupyconv") == 3 * x_bytes
    assert bench_bwd.bytes_of("train", case, "torch") == 5 * x_bytes
    # platform.md: the reference's 168 us channel-first backward is 3.0 TB/s over x, dout, dx
    assert round(bench_bwd.bytes_of("bwd", case, "causal_conv1d") / 168e-6 / 1e12, 1) == 3.0


def test_host_timed_cases():
    timed = {case.name for table in bench_bwd.TABLES for case in bench_bwd.table_cases(table)}
    timed = {name for name in timed if bench_bwd.host_timed(bench_bwd.Case(*parse(name)))}
    assert timed == {"cf-bf16-1x256x512-w4", "cl-bf16-1x256x512-w4"}


def parse(name):
    layout, _, shape, width = name.split("-")
    batch, dim, seqlen = (int(n) for n in shape.split("x"))
    return batch, dim, seqlen, layout, "bfloat16", int(width[1:])


def test_grad_tolerance_scales_with_the_reduction():
    rtol, atol = bench_bwd.grad_tolerance(Case(8, 5120, 2048))
    assert rtol == 1e-2  # bfloat16's own rounding
    assert atol == pytest.approx(1e-3 * (8 * 2048) ** 0.5)
    assert bench_bwd.grad_tolerance(Case(1, 64, 100, dtype="float32")) == (1e-3, 1e-2)


def test_png_paths():
    assert bench_bwd.png_path("out/b.png", "bwd", ["bwd", "train"]) == "out/b.png"
    assert bench_bwd.png_path("out/b.png", "train", ["bwd", "train"]) == "out/b-train.png"
    assert bench_bwd.png_path("b.png", "train", ["train"]) == "b.png"


# ---- tables -----------------------------------------------------------------------------------


def test_forward_table_layout(capsys):
    case = Case(8, 5120, 2048)
    copy, ours = bench.new_row(case, "copy"), bench.new_row(case, "cupyconv")
    copy.update(us_median=82.0, us_min=81.9, us_max=82.25, gbps=4092.0, copy_ratio=1.0)
    ours.update(status="error", message="NotImplementedError: not yet")
    meta = {"device": "H200", "torch": "2.11", "cupyconv": "0.1.0", "causal_conv1d": None}
    bench.print_table([copy, ours], meta)
    assert capsys.readouterr().out.splitlines() == [
        "",
        "device: H200  torch 2.11  cupyconv 0.1.0  causal_conv1d not installed",
        "copy (read + write): median 4092 GB/s, 4092-4092 over 1 cases",
        "case                    provider    us  min-max us  GB/s  copy/time  note",
        "----------------------  --------  ----  ----------  ----  ---------  " + "-" * 35,
        "cf-bf16-8x5120x2048-w4  copy      82.0   81.9-82.2  4092       1.00",
        "cf-bf16-8x5120x2048-w4  cupyconv     -           -     -          -"
        "  error: NotImplementedError: not yet",
    ]


def test_interleaved_rounds_rotate_and_keep_failures_apart():
    """Each round runs every provider's loop once, starting one provider later each round; a
    loop that raises leaves the rounds with its exception, the others keep their times."""
    order = []

    def loop(name, fail_at=None):
        count = itertools.count()

        def run():
            i = next(count)
            order.append(name)
            if i == fail_at:
                raise RuntimeError("lost the device")
            return float(i + 1)

        return 7, run

    got = bench.interleaved({"a": loop("a"), "b": loop("b"), "c": loop("c", fail_at=1)}, 3)
    assert order == ["a", "b", "c", "b", "c", "a", "a", "b"]
    assert got["a"] == got["b"] == bench.spread([1.0, 2.0, 3.0], 7)
    assert isinstance(got["c"], RuntimeError) and str(got["c"]) == "lost the device"


def test_measure_case_survives_a_failed_setup():
    def setup():
        raise MemoryError("out of memory")

    rows = bench.measure_case(
        Case(1, 8, 32),
        setup,
        names=("copy", "cupyconv"),
        bytes_of=lambda provider: 0,
        do_check=True,
        repeats=1,
        target_ms=1.0,
    )
    assert [(row["provider"], row["status"]) for row in rows] == [
        ("copy", "error"),
        ("cupyconv", "error"),
    ]
    assert rows[0]["message"] == "inputs: MemoryError: out of memory"


# ---- the driver on CPU tensors ----------------------------------------------------------------


@pytest.fixture
def env():
    pytest.importorskip("torch")
    return bench_bwd.Env(device="cpu", jax_reason="no JAX here", cupyconv_jax_reason="no JAX here")


@pytest.mark.parametrize("layout", ["cf", "cl", "slice"])
def test_bwd_rows_on_cpu(env, layout, capsys):
    rows = run("bwd", Case(2, 16, 40, layout, dtype="float32", width=5), env)
    rows = by_provider(rows)
    assert list(rows) == ["copy", "cupyconv", "cupyconv graph", "torch"]
    for name in ("cupyconv", "torch"):  # checked against the oracle, then timed
        assert rows[name]["status"] == "ok" and rows[name]["check"] == "ok"
        assert rows[name]["copy_ratio"] == 1.0
        assert rows[name]["bw_ratio"] == pytest.approx(1.5)  # 3 x bytes in the copy's time
        assert rows[name]["host_us"] == 11.0  # a host-bound case
    assert rows["cupyconv graph"]["status"] == "skipped"  # no CUDA graphs without CUDA
    assert "ok (all 2 batch rows, 16 of 16 channels)" in capsys.readouterr().out
    json.dumps(list(rows.values()))


def test_a_provider_that_raises_is_reported(env, monkeypatch):
    import cupyconv

    def pending(*args, **kwargs):
        raise NotImplementedError("causal_conv1d_bwd on GPU arrays is not available")

    monkeypatch.setattr(cupyconv, "causal_conv1d_bwd", pending)
    for do_check in (True, False):
        rows = by_provider(run("bwd", Case(1, 8, 32, dtype="float32"), env, do_check=do_check))
        assert rows["cupyconv"]["status"] == "error"
        assert rows["cupyconv"]["message"].startswith("NotImplementedError: causal_conv1d_bwd")
        assert rows["torch"]["status"] == "ok" and rows["torch"]["us_median"] == 11.0


def test_only_baselines_are_timed_after_a_failed_check(env, monkeypatch):
    import cupyconv

    backward, forward = cupyconv.causal_conv1d_bwd, bench.torch_conv

    def off_backward(*args, **kwargs):
        dx, dweight, dbias, dinit = backward(*args, **kwargs)
        return 2 * dx, dweight, dbias, dinit

    monkeypatch.setattr(cupyconv, "causal_conv1d_bwd", off_backward)
    monkeypatch.setattr(bench, "torch_conv", lambda *args: 2 * forward(*args))
    rows = by_provider(run("bwd", Case(1, 8, 32, dtype="float32"), env))
    assert rows["cupyconv"]["status"] == "check failed"
    assert rows["cupyconv"]["message"].startswith("cupyconv dx: ")
    assert rows["cupyconv"]["us_median"] is None
    assert rows["torch"]["status"] == "check failed"  # a baseline: timed all the same
    assert rows["torch"]["us_median"] == 11.0 and rows["torch"]["host_us"] == 11.0


def test_train_rows_on_cpu(env, monkeypatch):
    rows = by_provider(run("train", Case(2, 16, 40, "cl", dtype="float32"), env))
    assert rows["torch"]["check"] == "ok"
    assert rows["torch"]["bw_ratio"] == pytest.approx(2.5)  # 5 x bytes in the copy's time
    assert rows["cupyconv jax"]["status"] == "skipped"
    assert rows["cupyconv jax"]["message"] == "no JAX here"

    import cupyconv

    forward = cupyconv.causal_conv1d_fn

    def untracked(x, weight, bias, **kwargs):  # an output autograd does not track
        return forward(x.detach(), weight.detach(), bias.detach(), **kwargs)

    monkeypatch.setattr(cupyconv, "causal_conv1d_fn", untracked)
    rows = by_provider(run("train", Case(1, 8, 32, dtype="float32"), env))
    assert rows["cupyconv"]["status"] == "error"
    assert "no grad_fn" in rows["cupyconv"]["message"]
    assert rows["torch"]["status"] == "ok"


def test_jax_rows_on_cpu(env):
    pytest.importorskip("jax")
    bench_bwd.load_jax(env)
    rows = by_provider(run("train", Case(1, 8, 24, "cl", dtype="float32", width=3), env))
    assert rows["jax conv"]["check"] == "ok", rows["jax conv"]["message"]
    assert rows["jax conv"]["timing"] == "host"
    if env.cupyconv_jax is not None:
        assert rows["cupyconv jax"]["check"] == "ok", rows["cupyconv jax"]["message"]
    else:
        assert rows["cupyconv jax"]["status"] == "skipped"


# ---- the cuDNN frontend's rows -------------------------------------------------------------------


def fake_cudnn_conv(x, weight, bias=None, activation=None):
    """Stands in for ``cudnn.ops.causal_conv1d`` on CPU tensors (differentiable)."""
    import torch.nn.functional as F

    width, seqlen = weight.shape[1], x.shape[2]
    out = F.conv1d(x, weight.unsqueeze(1), bias, padding=width - 1, groups=x.shape[1])
    out = out[..., :seqlen]
    return out if activation is None else F.silu(out)


@pytest.mark.parametrize("table", bench_bwd.TABLES)
def test_cudnn_rows_on_cpu(env, table):
    env.cudnn_fn = fake_cudnn_conv
    rows = by_provider(run(table, Case(2, 16, 40, "cl", dtype="float32", width=7), env))
    assert list(rows).index("cudnn") == list(rows).index("torch") + 1
    assert rows["cudnn"]["status"] == "ok" and rows["cudnn"]["check"] == "ok"
    assert rows["cudnn"]["us_median"] == 11.0


def test_cudnn_refusing_a_call_is_reported(env):
    def refuses(*args, **kwargs):
        raise NotImplementedError("the current backend cannot execute this call")

    env.cudnn_fn = refuses
    rows = by_provider(run("bwd", Case(1, 8, 32, dtype="float32"), env))
    assert rows["cudnn"]["status"] == "skipped"
    assert rows["cudnn"]["message"] == (
        "forward refused: NotImplementedError: the current backend cannot execute this call"
    )
    rows = by_provider(run("train", Case(1, 8, 32, dtype="float32"), env))
    assert rows["cudnn"]["status"] == "error"
    assert rows["cudnn"]["message"].startswith("NotImplementedError: the current backend")
    assert rows["torch"]["status"] == "ok"


def test_cudnn_absent_leaves_no_row(env):
    rows = by_provider(run("bwd", Case(1, 8, 32, dtype="float32"), env))
    assert "cudnn" not in rows


def test_load_cudnn(monkeypatch):
    import types

    monkeypatch.setitem(sys.modules, "cudnn", None)  # import cudnn raises ImportError
    assert bench.load_cudnn() == (None, None)
    ops = types.ModuleType("cudnn.ops")
    ops.causal_conv1d = fake_cudnn_conv
    module = types.ModuleType("cudnn")
    module.__version__, module.backend_version, module.ops = "1.32.0", lambda: 92200, ops
    monkeypatch.setitem(sys.modules, "cudnn", module)
    monkeypatch.setitem(sys.modules, "cudnn.ops", ops)
    assert bench.load_cudnn() == (fake_cudnn_conv, "1.32.0 (cuDNN 92200)")


def test_forward_providers_and_header_name_cudnn(capsys):
    torch = pytest.importorskip("torch")
    case = Case(1, 8, 32, dtype="float32", width=5)
    x, weight, bias = (torch.randn(*s) for s in ((1, 8, 32), (8, 5), (8,)))
    providers = bench.make_providers(case, x, weight, bias, None, fake_cudnn_conv)
    assert list(providers) == ["copy", "cupyconv", "cupyconv graph", "torch", "cudnn"]
    fn, skip = providers["cudnn"]
    want = bench.torch_conv(case, x, weight.unsqueeze(1), bias)
    assert skip is None and torch.equal(fn(), want)
    meta = {"device": "H200", "torch": "2.11", "cupyconv": "0.1.0", "causal_conv1d": None}
    bench.print_table([], meta | {"cudnn": None})
    assert "causal_conv1d not installed  cudnn frontend not installed" in capsys.readouterr().out


# ---- ab.py: trees against each other ------------------------------------------------------------


def test_ab_reads_every_bench_case_name():
    cases = [*bench.default_cases(), bench.Case(2, 64, 300, "cl", "float16", 31, None, False)]
    for case in cases:
        assert ab.parse_case(case.name) == case
        assert not ab.float32_weights(case.name)
    assert ab.parse_case("cl-bf16-2x64x300-w31-nobias-wf32") == bench.Case(
        2, 64, 300, "cl", "bfloat16", 31, "silu", False
    )
    assert ab.float32_weights("cl-bf16-2x64x300-w31-nobias-wf32")


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--cases", "cl-bf16-8x5120x2048"], "case must read like cl-bf16-8x5120x2048-w16"),
        (["--cases", "cl-bf16-8x5120x2048-w4-gelu"], "got 'cl-bf16-8x5120x2048-w4-gelu'"),
        (["--cases", "tc-bf16-8x5120x2048-w4"], "got 'tc-bf16-8x5120x2048-w4'"),
    ],
)
def test_ab_refuses_bad_case_names(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        ab.main([str(Path(__file__).resolve().parent.parent), *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_ab_refuses_a_directory_without_the_sources(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        ab.main([str(tmp_path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"TREE must hold cupyconv/ and kernels/; got {str(tmp_path)!r}" in err


def test_ab_digest_is_of_the_bits():
    torch = pytest.importorskip("torch")
    a = torch.tensor([[1.0, 0.0], [2.0, 3.0]], dtype=torch.bfloat16)
    assert ab.digest([a, None]) == ab.digest([a.t().contiguous().t().clone()])
    assert ab.digest([a]) != ab.digest([torch.where(a == 0, -a, a)])  # -0.0 differs from 0.0
    assert ab.digest([a]) == ab.digest([a.t().contiguous().t()])  # strides do not matter


def test_ab_table():
    rows = [
        {"tree": t, "case": "cl-bf16-8x5120x2048-w16", "round": r, "value": v, "digest": d}
        for t, r, v, d in (("a", 1, 0.8123, "x"), ("b", 1, 0.75, "x"), ("a", 2, 0.81, "x"))
    ]
    rows.append({**rows[0], "case": "cl-bf16-8x5120x2048-w31", "digest": "y"})
    rows.append({**rows[1], "case": "cl-bf16-8x5120x2048-w31", "digest": "z"})
    names = ["cl-bf16-8x5120x2048-w16", "cl-bf16-8x5120x2048-w31"]
    assert ab.table(rows, ["a", "b"], names, "fwd").splitlines() == [
        "fwd: copy/time; a | b | outputs",
        "cl-bf16-8x5120x2048-w16: 0.812 / 0.810 | 0.750 | bitwise the same",
        "cl-bf16-8x5120x2048-w31: 0.812 | 0.750 | DIFFER",
    ]


@pytest.mark.parametrize("op", ["fwd", "bwd"])
def test_ab_worker_on_the_cpu(op, monkeypatch, capsys):
    """A tree's process end to end on CPU tensors (the float64 reference path), with a stand-in
    timer: a JSON line a case, with the copy's and the call's times and the outputs' digest."""
    pytest.importorskip("torch")
    make = bench.make_inputs
    monkeypatch.setattr(bench, "make_inputs", lambda case: make(case, device="cpu"))
    times = {"copy": 2.0, "call": 4.0}
    calls = []

    def fake_loop(fn, *, target_ms):
        which = "copy" if not calls else "call"
        calls.append(which)
        return 1, lambda: (fn(), times[which])[1]

    monkeypatch.setattr(bench, "event_loop", fake_loop)
    root = str(Path(__file__).resolve().parent.parent)
    ab.worker(root, ["cl-fp32-2x8x40-w4"], op, repeats=3, target_ms=1.0)
    (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert (row["case"], row["op"], row["us"], row["copy_us"]) == ("cl-fp32-2x8x40-w4", op, 4, 2)
    case = ab.parse_case("cl-fp32-2x8x40-w4")
    assert row["value"] == (0.5 if op == "fwd" else 3 * case.x_bytes / 4.0 / 1e6)
    assert len(row["digest"]) == 12


def test_ab_prints_and_writes_every_round(tmp_path, monkeypatch, capsys):
    """The driver with stand-in tree processes: the table and the JSON after each round, so that
    a run stopped by a time limit keeps its finished rounds."""
    trees = [tmp_path / "a", tmp_path / "b"]
    for tree in trees:
        (tree / "cupyconv").mkdir(parents=True)
        (tree / "kernels").mkdir()
    values = iter([0.9, 0.8, 0.7, 0.6])

    def fake_run(cmd, **kwargs):
        line = {
            "tree": cmd[2],
            "case": "cl-bf16-8x5120x2048-w16",
            "value": next(values),
            "digest": "d",
        }
        return ab.subprocess.CompletedProcess(cmd, 0, stdout=json.dumps(line) + "\n", stderr="")

    monkeypatch.setattr(ab.subprocess, "run", fake_run)
    out_json = tmp_path / "ab.json"
    a, b = map(str, trees)
    ab.main([a, b, "--cases", "cl-bf16-8x5120x2048-w16", "--rounds", "2", "--json", str(out_json)])
    assert capsys.readouterr().out.splitlines() == [
        "after round 1:",
        f"fwd: copy/time; {a} | {b} | outputs",
        "cl-bf16-8x5120x2048-w16: 0.900 | 0.800 | bitwise the same",
        "after round 2:",
        f"fwd: copy/time; {a} | {b} | outputs",
        "cl-bf16-8x5120x2048-w16: 0.900 / 0.700 | 0.800 / 0.600 | bitwise the same",
    ]
    assert [(row["tree"], row["round"]) for row in json.loads(out_json.read_text())] == [
        (a, 1), (b, 1), (a, 2), (b, 2)
    ]  # fmt: skip
