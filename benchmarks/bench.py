"""Forward benchmark of ``cupyconv.causal_conv1d_fn`` against a copy of the same bytes.

    python benchmarks/bench.py [--cases SUBSTR[,SUBSTR...]] [--quick] [--repeats N]
                                            [--no-check] [--json PATH] [--png PATH] [--list]

For every case (batch, dim, seqlen, layout, dtype, width, activation, bias) the script

1. builds x [batch, dim, seqlen], weight [dim, width] and bias [dim] on the GPU with
   ``torch.randn`` after ``torch.manual_seed(0)``;
2. checks every provider's output against the float64 oracle ``cupyconv.reference`` on a subset
   (batch rows 0 and batch-1; a spread of channels when the oracle would be slow); a provider
   whose check fails is not timed and its row says why;
3. times every provider with CUDA events around a loop of n back-to-back calls on torch's
   current stream (``event_loop``), after warm-up, repeated in rounds that run every provider's
   loop once (``interleaved``); the row reports the median per-call time and the spread (min,
   max).

Providers, all in the same run:

- ``copy``: ``dst.copy_(src)`` of two dense buffers of x's dtype and numel, the physical bar: a
  forward pass has to read x and write out, which is the same traffic as this copy.
- ``cupyconv``: ``cupyconv.causal_conv1d_fn(x, weight, bias, activation=...)``.
- ``cupyconv graph``: the same call captured once in a torch CUDA graph and replayed: the GPU
  time alone, where the plain row may also count the host path (about 45 us per call), which
  dominates on small problems.
- ``torch``: ``F.silu(F.conv1d(x, weight.unsqueeze(1), bias, padding=width-1,
  groups=dim)[..., :seqlen])`` (no SiLU when the activation is None), no TF32.
- ``causal_conv1d``: the reference library, when importable and the case is within what it
  supports (widths 2..4).
- ``cudnn``: the cuDNN frontend's ``cudnn.ops.causal_conv1d(x, weight, bias, activation=...)``
  (``pip install nvidia-cudnn-frontend``; its generic route needs cuDNN 9.22 or newer), when
  importable; a call it refuses makes its row an error with the reason.

Bytes moved by a provider are the minimum traffic: x read + out written + weight + bias. GB/s is
those bytes over the median time; ``copy/time`` is the copy's time over the provider's time (1.0
is copy speed). The copy row's GB/s counts the bytes it reads plus the bytes it writes.

Back-to-back calls on the same buffers are what a model does; shapes whose x fits in L2 (60 MB on
an H200) profit from it, and so does the copy they are compared with.

``bench_bwd.py`` times the backward and a training step with the same machinery (``measure_case``,
``event_loop``, ``host_loop``, ``interleaved``, ``print_table``, ``write_json``, ``draw_png``),
which lives here.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

# Runs from any directory: the cupyconv of this checkout comes first.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# The result records and their JSON file are the main command's (``python -m cupyconv bench``).
from cupyconv._cli.bench import spread, with_copy_ratios, write_json  # noqa: E402


def nvrtc_check(text: str, file: str, names, arch: str = "sm_90", extra=()) -> tuple[bool, str]:
    """(whether NVRTC compiled the instances ``names`` of the program ``text`` for ``arch`` with
    CuPy's options and ``extra``, its log): the compile check of a stand-alone benchmark kernel
    (no GPU needed)."""
    from cupyconv._compile import nvrtc_compile

    try:
        return True, nvrtc_compile(text, file, names, arch, extra)[1]
    except RuntimeError as error:
        return False, str(error)


def stand_alone_module(text: str, names=(), options=("-std=c++17",)):
    """(CuPy ``RawModule`` of the program ``text`` with the instances ``names``, the device's SM
    count): a stand-alone benchmark kernel's module, built as the library's are (NVRTC)."""
    import cupy as cp

    module = cp.RawModule(code=text, options=options, name_expressions=names or None)
    return module, cp.cuda.Device().attributes["MultiProcessorCount"]


#: Oracle work per check, in multiply-adds (rows x channels x seqlen x width); above it the
#: check takes a spread of channels instead of all of them.
CHECK_BUDGET = 1 << 27

#: Most calls in one timed loop.
MAX_CALLS = 10_000

PROVIDERS = ("copy", "cupyconv", "cupyconv graph", "torch", "causal_conv1d", "cudnn")

DTYPE_SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclasses.dataclass(frozen=True)
class Case:
    batch: int
    dim: int
    seqlen: int
    layout: str = "cf"  # "cf" channel-first, "cl" channel-last, "slice" channel slice of proj
    dtype: str = "bfloat16"
    width: int = 4
    activation: str | None = "silu"
    bias: bool = True

    @property
    def name(self) -> str:
        name = (
            f"{self.layout}-{DTYPE_SHORT[self.dtype]}-"
            f"{self.batch}x{self.dim}x{self.seqlen}-w{self.width}"
        )
        if self.activation is None:
            name += "-noact"
        if not self.bias:
            name += "-nobias"
        return name

    @property
    def numel(self) -> int:
        """Elements of x (and of out, dout, dx)."""
        return self.batch * self.dim * self.seqlen

    @property
    def x_bytes(self) -> int:
        """Bytes of x (and of out, dout, dx)."""
        return self.numel * DTYPE_BYTES[self.dtype]

    @property
    def param_bytes(self) -> int:
        """Bytes of weight and bias."""
        return self.dim * (self.width + int(self.bias)) * DTYPE_BYTES[self.dtype]


def default_cases() -> list[Case]:
    """The acceptance rows (bf16, width 4, SiLU, bias unless the row says otherwise)."""
    cases = []
    for batch, dim, seqlen in ((8, 5120, 2048), (1, 4096, 16384), (64, 1024, 512)):
        cases += [Case(batch, dim, seqlen, "cf"), Case(batch, dim, seqlen, "cl")]
    cases.append(Case(8, 5120, 2048, "slice"))
    cases += [Case(8, 5120, 2048, layout, dtype="float32") for layout in ("cf", "cl")]
    cases.append(Case(8, 5120, 2048, "cf", dtype="float16"))
    for layout in ("cf", "cl"):  # the wide filters' rows
        cases += [Case(8, 5120, 2048, layout, width=w) for w in (8, 16, 31, 64, 128, 256)]
    for layout in ("cf", "cl"):  # float32's wide rows (CUDA cores)
        cases += [Case(8, 5120, 2048, layout, dtype="float32", width=w) for w in (16, 64)]
    cases.append(Case(8, 5120, 2048, "cl", width=12))  # fwd_mma_cl (fwd_channel below 10)
    return cases


def select_cases(cases: list[Case], pattern: str | None) -> list[Case]:
    """Cases whose name contains any of the comma-separated substrings in ``pattern``."""
    if not pattern:
        return cases
    parts = [p for p in pattern.split(",") if p]
    return [case for case in cases if any(p in case.name for p in parts)]


def make_inputs(case: Case, device: str = "cuda"):
    """x, weight, bias on ``device``; the same values for a case whatever else runs."""
    import torch

    torch.manual_seed(0)
    dtype = getattr(torch, case.dtype)
    batch, dim, seqlen = case.batch, case.dim, case.seqlen
    opts = {"device": device, "dtype": dtype}
    if case.layout == "cf":
        x = torch.randn(batch, dim, seqlen, **opts)
    elif case.layout == "cl":
        x = torch.randn(batch, seqlen, dim, **opts).transpose(1, 2)
    elif case.layout == "slice":  # the middle third of an in_proj output, time stride 3 * dim
        proj = torch.randn(batch, seqlen, 3 * dim, **opts)
        x = proj[:, :, dim : 2 * dim].transpose(1, 2)
    else:
        raise ValueError(f"layout must be 'cf', 'cl' or 'slice'; got {case.layout!r}")
    weight = torch.randn(dim, case.width, **opts)
    bias = torch.randn(dim, **opts) if case.bias else None
    return x, weight, bias


def check_subset(case: Case):
    """(rows, channels) index tensors on the GPU that the check compares."""
    import torch

    rows = sorted({0, case.batch - 1})
    work_per_channel = len(rows) * case.seqlen * case.width
    n_channels = min(case.dim, max(1, CHECK_BUDGET // work_per_channel))
    channels = torch.linspace(0, case.dim - 1, n_channels).round().long().unique()
    return torch.tensor(rows, device="cuda"), channels.to("cuda")


def take(t, rows, channels):
    """t[rows][:, channels] for a [batch, dim, ...] tensor (any strides)."""
    return t.index_select(0, rows).index_select(1, channels)


def oracle(case: Case, x, weight, bias, rows, channels):
    """float64 numpy output of ``cupyconv.reference`` on the checked rows and channels."""
    from cupyconv import reference

    def f64(t):
        return None if t is None else t.double().cpu().numpy()

    return reference.causal_conv1d_fn(
        f64(take(x, rows, channels)),
        f64(weight.index_select(0, channels)),
        f64(None if bias is None else bias.index_select(0, channels)),
        activation=case.activation,
    )


def check(case: Case, provider: str, fn, expected, rows, channels) -> None:
    """Run ``fn`` once and raise AssertionError unless it matches the oracle on the subset."""
    from cupyconv.testing import assert_close

    out = fn()
    assert_close(take(out, rows, channels), expected, dtype=case.dtype, name=provider)


Loop = tuple[int, Callable[[], float]]  # (n, loop): loop() times n calls, per-call microseconds


#: Untimed calls before each timed loop: with the providers interleaved, a loop follows another
#: provider's, and its first calls would pay for the switch (host caches, allocator state).
LOOP_WARMUP = 2


def event_loop(fn, *, target_ms: float, warmup: int = 3) -> Loop:
    """``fn``'s timed loop on the GPU clock: n back-to-back calls between two CUDA events on the
    current stream (after LOOP_WARMUP untimed ones), n chosen (after warm-up) so that one loop
    takes about ``target_ms``."""
    import torch

    for _ in range(warmup):
        fn()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)

    def loop_us(n: int) -> float:
        for _ in range(LOOP_WARMUP):
            fn()
        start.record()
        for _ in range(n):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / n

    torch.cuda.synchronize()
    n = calls_for(loop_us(5) / 1e3, target_ms)
    return n, lambda: loop_us(n)


def host_loop(fn, *, sync, target_ms: float, warmup: int = 3) -> Loop:
    """``fn``'s timed loop on the host clock: n back-to-back calls timed with
    ``time.perf_counter`` (after LOOP_WARMUP untimed ones and a sync), ending with
    ``sync(last result)`` (``torch.cuda.synchronize``, JAX's ``block_until_ready``): what a
    caller waits for per call, host path included, where the GPU is not the limit."""
    last = None
    for _ in range(warmup):
        last = fn()
    sync(last)

    def loop_us(n: int) -> float:
        for _ in range(LOOP_WARMUP):
            result = fn()
        sync(result)
        start = time.perf_counter()
        for _ in range(n):
            result = fn()
        sync(result)
        return (time.perf_counter() - start) * 1e6 / n

    n = calls_for(loop_us(5) / 1e3, target_ms)
    return n, lambda: loop_us(n)


def calls_for(estimate_ms: float, target_ms: float) -> int:
    return max(1, min(MAX_CALLS, round(target_ms / max(estimate_ms, 1e-4))))


def time_fn(fn, *, repeats: int, target_ms: float, warmup: int = 3) -> dict:
    """Per-call time of ``fn`` in microseconds (``event_loop``): median, min and max over
    ``repeats`` loops."""
    n, loop = event_loop(fn, target_ms=target_ms, warmup=warmup)
    return spread([loop() for _ in range(repeats)], n)


def interleaved(loops: dict[str, Loop], repeats: int) -> dict[str, dict | BaseException]:
    """Per-call times of several providers' loops (``spread``), run in ``repeats`` rounds of one
    loop each, the order rotated every round: a drift of the machine's speed during the run
    (clocks, the host's other work) falls on every provider alike. A provider whose loop raises
    gets the exception and leaves the rounds."""
    samples: dict[str, list[float]] = {name: [] for name in loops}
    failed: dict[str, BaseException] = {}
    names = list(loops)
    for r in range(repeats):
        k = r % len(names) if names else 0
        for name in names[k:] + names[:k]:
            if name in failed:
                continue
            try:
                samples[name].append(loops[name][1]())
            except Exception as exc:  # noqa: BLE001 (reported in the provider's row)
                failed[name] = exc
    return {name: failed.get(name) or spread(samples[name], loops[name][0]) for name in names}


def torch_conv(case: Case, x, weight3, bias):
    """The torch baseline, ``weight3`` being the [dim, 1, width] view of weight:
    ``act(F.conv1d(x, weight3, bias, padding=width-1, groups=dim)[..., :seqlen])``."""
    import torch.nn.functional as F

    out = F.conv1d(x, weight3, bias, padding=case.width - 1, groups=case.dim)
    out = out[..., : case.seqlen]
    return out if case.activation is None else F.silu(out)


def copy_provider(x):
    """(fn, None): ``dst.copy_(src)`` of two dense buffers of x's dtype and numel."""
    import torch

    src = torch.empty(x.numel(), dtype=x.dtype, device=x.device)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src), None


def make_providers(case: Case, x, weight, bias, reference_fn, cudnn_fn=None):
    """{provider: (fn, skip reason)} in table order; fn is None where the provider is skipped.
    ``reference_fn`` and ``cudnn_fn``: the optional baselines (None when not importable)."""
    import cupyconv

    weight3 = weight.unsqueeze(1)

    def ours():
        return cupyconv.causal_conv1d_fn(x, weight, bias, activation=case.activation)

    providers = {
        "copy": copy_provider(x),
        "cupyconv": (ours, None),
        "cupyconv graph": graphed(ours),
        "torch": (lambda: torch_conv(case, x, weight3, bias), None),
    }
    if reference_fn is not None:
        if 2 <= case.width <= 4:
            providers["causal_conv1d"] = (
                lambda: reference_fn(x, weight, bias, activation=case.activation),
                None,
            )
        else:
            providers["causal_conv1d"] = (None, f"width {case.width} outside 2..4")
    if cudnn_fn is not None:
        providers["cudnn"] = (lambda: cudnn_fn(x, weight, bias, activation=case.activation), None)
    return providers


def graphed(fn):
    """(replay, None): ``fn`` captured once in a torch CUDA graph, ``replay`` relaunching it and
    returning its output (the GPU time without the host path); (None, reason) when the capture
    fails."""
    import torch

    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # compile and load the kernels, warm the caching allocator
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
    except Exception as exc:  # noqa: BLE001 (recorded in the row, not fatal)
        return None, f"capture failed: {error_text(exc)}"

    def replay():
        graph.replay()
        return out

    return replay, None


def new_row(case: Case, provider: str) -> dict:
    return {
        "case": case.name,
        **dataclasses.asdict(case),
        "provider": provider,
        "status": "ok",  # ok | check failed | error | skipped
        "check": None,  # ok | failed | None (not checked)
        "message": None,
        "bytes": None,
        "us_median": None,
        "us_min": None,
        "us_max": None,
        "calls": None,
        "repeats": None,
        "gbps": None,
        "copy_ratio": None,
    }


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".strip()


#: A provider: (fn, skip reason); fn is None where the provider is skipped.
Provider = tuple[Callable | None, str | None]

#: ``compare(provider, fn)`` runs fn once and raises AssertionError unless it matches the oracle.
Compare = Callable[[str, Callable], None]


def measure_case(
    case: Case,
    setup: Callable[[], tuple[dict[str, Provider], Callable[[], tuple[Compare, str]]]],
    *,
    names: tuple[str, ...],
    bytes_of: Callable[[str], int],
    do_check: bool,
    repeats: int,
    target_ms: float,
    loops: dict[str, Callable[..., Loop]] | None = None,
    timed_if_off: tuple[str, ...] = (),
) -> list[dict]:
    """Check, then time every provider on one case; one row per provider, never raises.

    ``setup()`` builds the inputs and returns ``(providers, checker)``: providers in table order,
    and ``checker()``, called only when checking, which computes the oracle and returns
    ``(compare, where)``, ``where`` describing the checked subset. ``names`` are the rows reported
    when setup itself fails; ``bytes_of(provider)`` the bytes its GB/s counts. Providers are timed
    by their ``event_loop`` unless ``loops`` names another loop for them (same signature:
    ``host_loop`` with its sync bound); those timed by the same loop are timed together
    (``interleaved``), the others each on its own. A provider
    whose check fails is not timed, unless ``timed_if_off`` names it (baselines that are less
    precise than the contract): its row then keeps the failed check and gets the times too.
    """
    try:
        providers, checker = setup()
    except Exception as exc:  # noqa: BLE001 (a failed case must not stop the others)
        rows = [new_row(case, name) for name in names]
        for row in rows:
            row.update(status="error", message=f"inputs: {error_text(exc)}")
        return rows

    rows = {name: new_row(case, name) for name in providers}
    for name, (_, skip) in providers.items():
        rows[name]["bytes"] = bytes_of(name)
        if skip is not None:
            rows[name].update(status="skipped", message=skip)

    if do_check:
        try:
            compare, where = checker()
            oracle_error = None
        except Exception as exc:  # noqa: BLE001 (recorded in the row, not fatal)
            oracle_error = f"oracle: {error_text(exc)}"
        for name, (fn, _) in providers.items():
            if fn is None or name == "copy":
                continue
            row = rows[name]
            try:
                if oracle_error is not None:
                    raise RuntimeError(oracle_error)
                compare(name, fn)
                row["check"] = "ok"
                print(f"check {case.name} {name}: ok ({where})")
            except AssertionError as exc:
                row.update(status="check failed", check="failed", message=str(exc))
                anyway = " (timed anyway)" if name in timed_if_off else ""
                print(f"check {case.name} {name}: FAILED{anyway} {exc}")
            except Exception as exc:  # noqa: BLE001 (recorded in the row, not fatal)
                row.update(status="error", message=error_text(exc))
                print(f"check {case.name} {name}: ERROR {error_text(exc)}")

    timed: dict[Callable, dict[str, Loop]] = {}  # the providers' loops, by their kind of loop
    for name, (fn, _) in providers.items():
        row = rows[name]
        timed_anyway = row["status"] == "check failed" and name in timed_if_off
        if fn is None or (row["status"] != "ok" and not timed_anyway):
            continue
        kind = (loops or {}).get(name, event_loop)
        try:
            timed.setdefault(kind, {})[name] = kind(fn, target_ms=target_ms)
        except Exception as exc:  # noqa: BLE001 (recorded in the row, not fatal)
            row.update(status="error", message=error_text(exc))
    results = {}
    for group in timed.values():  # interleaved with the providers timed alike
        results.update(interleaved(group, repeats))
    for name, result in results.items():
        if isinstance(result, BaseException):
            rows[name].update(status="error", message=error_text(result))
        else:
            rows[name].update(result, gbps=rows[name]["bytes"] / (result["us_median"] * 1e3))
    return with_copy_ratios(rows)


def run_case(
    case: Case, reference_fn, *, do_check: bool, repeats: int, target_ms: float, cudnn_fn=None
):
    """The forward rows of one case (``measure_case``): x read + out written + weight + bias,
    the copy's read + write."""

    def bytes_of(provider: str) -> int:
        if provider == "copy":
            return 2 * case.x_bytes
        return 2 * case.x_bytes + case.param_bytes

    def setup():
        x, weight, bias = make_inputs(case)
        providers = make_providers(case, x, weight, bias, reference_fn, cudnn_fn)

        def checker():
            subset = check_subset(case)
            expected = oracle(case, x, weight, bias, *subset)
            where = (
                f"batch rows {sorted({0, case.batch - 1})}, {len(subset[1])} of {case.dim} channels"
            )
            return (lambda name, fn: check(case, name, fn, expected, *subset)), where

        return providers, checker

    absent = {"causal_conv1d": reference_fn is None, "cudnn": cudnn_fn is None}
    return measure_case(
        case,
        setup,
        names=tuple(name for name in PROVIDERS if not absent.get(name)),
        bytes_of=bytes_of,
        do_check=do_check,
        repeats=repeats,
        target_ms=target_ms,
    )


def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def us_spread(row: dict) -> str:
    if row["us_min"] is None:
        return "-"
    return f"{row['us_min']:.1f}-{row['us_max']:.1f}"


def note(row: dict) -> str:
    text = "" if row["status"] == "ok" else f"{row['status']}: {row['message']}"
    return text if len(text) <= 90 else text[:87] + "..."


#: A table column: (header, cell text of a row, right-aligned).
Column = tuple[str, Callable[[dict], str], bool]

FORWARD_COLUMNS: tuple[Column, ...] = (
    ("case", lambda row: row["case"], False),
    ("provider", lambda row: row["provider"], False),
    ("us", lambda row: fmt(row["us_median"], ".1f"), True),
    ("min-max us", us_spread, True),
    ("GB/s", lambda row: fmt(row["gbps"], ".0f"), True),
    ("copy/time", lambda row: fmt(row["copy_ratio"], ".2f"), True),
    ("note", note, False),
)


def print_table(
    rows: list[dict],
    meta: dict,
    columns: tuple[Column, ...] = FORWARD_COLUMNS,
    *,
    title: str | None = None,
    unit: str = "GB/s",
) -> None:
    """The results table, one line per case and provider, columns aligned; ``unit`` (GB/s or
    TB/s) is the one of the copy's summary line."""
    header = tuple(name for name, _, _ in columns)
    lines = [tuple(cell(row) for _, cell, _ in columns) for row in rows]
    widths = [max(len(line[i]) for line in [header, *lines]) for i in range(len(header))]
    right = {i for i, (_, _, numeric) in enumerate(columns) if numeric}

    def render(line):
        cells = [
            cell.rjust(w) if i in right else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(line, widths, strict=True))
        ]
        return "  ".join(cells).rstrip()

    print()
    if title:
        print(title)
    versions = f"torch {meta['torch']}  cupyconv {meta['cupyconv']}  "
    if "jax" in meta:
        versions += f"jax {meta['jax'] or 'not installed'}  "
    versions += f"causal_conv1d {meta['causal_conv1d'] or 'not installed'}"
    if "cudnn" in meta:
        versions += f"  cudnn frontend {meta['cudnn'] or 'not installed'}"
    print(f"device: {meta['device']}  {versions}")
    copy_rates = [row["gbps"] for row in rows if row["provider"] == "copy" and row["gbps"]]
    if copy_rates:
        scale, spec = (1e-3, ".2f") if unit == "TB/s" else (1.0, ".0f")
        copy_rates = [rate * scale for rate in copy_rates]
        print(
            f"copy (read + write): median {statistics.median(copy_rates):{spec}} {unit}, "
            f"{min(copy_rates):{spec}}-{max(copy_rates):{spec}} over {len(copy_rates)} cases"
        )
    print(render(header))
    print(render(tuple("-" * w for w in widths)))
    previous = None
    for row, line in zip(rows, lines, strict=True):
        if previous is not None and row["case"] != previous:
            print()
        previous = row["case"]
        print(render(line))


def draw_png(
    path: str,
    rows: list[dict],
    meta: dict,
    *,
    title: str = "causal_conv1d forward",
    marks: tuple[tuple[float, str], ...] = (),
) -> None:
    """Grouped bars of copy/time per case and provider; the copy is the line at 1.0, ``marks``
    more dotted lines as (height, label)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys(row["case"] for row in rows))
    providers = [p for p in dict.fromkeys(row["provider"] for row in rows) if p != "copy"]
    ratio = {(row["case"], row["provider"]): row["copy_ratio"] for row in rows}
    bar = 0.8 / max(1, len(providers))
    fig, ax = plt.subplots(figsize=(max(8.0, 0.35 * len(cases) * max(1, len(providers))), 5))
    for i, provider in enumerate(providers):
        values = [ratio.get((case, provider)) for case in cases]
        values = [float("nan") if v is None else v for v in values]
        positions = [j + (i - (len(providers) - 1) / 2) * bar for j in range(len(cases))]
        ax.bar(positions, values, bar, label=provider)
    ax.axhline(1.0, color="black", linewidth=1, linestyle="--", label="copy")
    for height, label in marks:
        ax.axhline(height, color="gray", linewidth=1, linestyle=":", label=label)
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels(cases, rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("copy time / provider time")
    ax.set_title(f"{title}, {meta['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def use_ieee_fp32_convs(torch) -> None:
    """No TF32 in torch's float32 conv1d, so that the baseline passes the float32 check."""
    conv = getattr(torch.backends.cudnn, "conv", None)
    if conv is not None:  # torch >= 2.9; mixing it with the legacy flag raises on reads
        conv.fp32_precision = "ieee"
    else:
        torch.backends.cudnn.allow_tf32 = False


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every benchmark table takes."""
    parser.add_argument(
        "--cases",
        metavar="SUBSTR",
        help="run the cases whose name contains any of these "
        "comma-separated substrings (see --list)",
    )
    parser.add_argument("--list", action="store_true", help="print the case names and exit")
    parser.add_argument("--quick", action="store_true", help="fewer and shorter timed loops")
    parser.add_argument(
        "--repeats", type=int, metavar="N", help="timed loops per provider (default 10, quick 3)"
    )
    parser.add_argument(
        "--no-check", action="store_true", help="time without checking against the oracle"
    )
    parser.add_argument("--json", metavar="PATH", help="write every row (and meta) as JSON")
    parser.add_argument(
        "--png", metavar="PATH", help="bar chart of copy/time per case and provider (matplotlib)"
    )


def timing_options(parser: argparse.ArgumentParser, args) -> tuple[int, float]:
    """(repeats, target_ms) from the options; a parser error for an invalid --repeats."""
    if args.repeats is not None and args.repeats < 1:
        parser.error(f"--repeats must be >= 1; got {args.repeats}")
    return args.repeats or (3 if args.quick else 10), 10.0 if args.quick else 25.0


def load_reference():
    """(causal_conv1d module, its causal_conv1d_fn), or (None, None) when not importable."""
    try:
        import causal_conv1d
        from causal_conv1d import causal_conv1d_fn as reference_fn
    except ImportError:
        return None, None
    return causal_conv1d, reference_fn


def load_cudnn():
    """(the cuDNN frontend's ``cudnn.ops.causal_conv1d``, its version and its cuDNN's), or
    (None, None) when it is not importable (not installed, or no cuDNN library it can load)."""
    try:
        cudnn = importlib.import_module("cudnn")
        fn = importlib.import_module("cudnn.ops").causal_conv1d
        backend = cudnn.backend_version()
    except Exception:  # noqa: BLE001 (any failure to load it means: not importable)
        return None, None
    return fn, f"{getattr(cudnn, '__version__', 'unknown')} (cuDNN {backend})"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Forward benchmark of cupyconv.causal_conv1d_fn against a device-to-device "
        "copy of x's bytes, torch conv1d, causal_conv1d and the cuDNN frontend (when "
        "importable).",
    )
    add_arguments(parser)
    args = parser.parse_args(argv)

    cases = select_cases(default_cases(), args.cases)
    if args.list:
        for case in cases:
            print(case.name)
        return
    if not cases:
        parser.error(f"no case name contains any of {args.cases!r} (see --list)")
    repeats, target_ms = timing_options(parser, args)
    if args.png and importlib.util.find_spec("matplotlib") is None:
        parser.error("--png needs matplotlib, which is not installed")

    import torch

    import cupyconv

    if not torch.cuda.is_available():
        raise SystemExit("bench.py needs a CUDA device; torch sees none")
    use_ieee_fp32_convs(torch)
    causal_conv1d, reference_fn = load_reference()
    cudnn_fn, cudnn_version = load_cudnn()

    meta = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cupyconv": getattr(cupyconv, "__version__", "unknown"),
        "causal_conv1d": causal_conv1d and getattr(causal_conv1d, "__version__", "unknown"),
        "cudnn": cudnn_version,
        "repeats": repeats,
        "target_ms": target_ms,
        "checked": not args.no_check,
    }
    rows = []
    for case in cases:
        rows += run_case(
            case, reference_fn, do_check=not args.no_check, repeats=repeats, target_ms=target_ms,
            cudnn_fn=cudnn_fn,
        )  # fmt: skip
        torch.cuda.empty_cache()

    print_table(rows, meta)
    if args.json:
        write_json(args.json, rows, meta)
    if args.png:
        draw_png(args.png, rows, meta)


if __name__ == "__main__":
    main()
