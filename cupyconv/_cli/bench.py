"""``python -m cupyconv bench``: the forward, the backward and the decode update on the GPU,
each against a device-to-device copy of the same bytes, with torch and the reference library
``causal_conv1d`` as baselines where they are importable.

For every case (bfloat16 unless the name says fp32; width 4, SiLU, bias) and provider:

1. check: one call against the float64 oracle (``cupyconv.reference``) on a spread of channels
   (the forward also on batch rows 0 and batch - 1 only): out and dx at the dtype's tolerance,
   dweight and dbias at the reduction's, the update's state pool exactly. A cupyconv row whose
   check fails is not timed (and the command exits 1); a baseline's row says so and is timed;
2. time: CUDA events (CuPy's, on the null stream, where torch's default stream also runs)
   around loops of n back-to-back calls, n chosen so that a loop takes about ``target_ms``;
   ``us`` is the median per-call time over the loops, with their min-max;
3. ``GB/s``: the provider's minimum traffic over ``us``: the forward reads x and writes out
   (2 x's bytes, plus weight and bias), the backward reads x and dout and writes dx (3 x's
   bytes, plus weight and bias), the update reads x, weight, bias and the indices and writes
   out, and reads and writes the used state rows (sliding) or reads width - 1 entries and
   writes one of each (circular). ``copy`` is a device-to-device copy of half that traffic
   (so it reads and writes as many bytes), and ``copy/time`` the copy's time over the
   provider's: 1.0 is copy speed.

The update calls are short: their times include the host path of each call (about 15-25 us).
``benchmarks/`` in a source checkout holds the full benchmarks (CUDA-graph replays, training
steps, host time per call, more cases).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import statistics
from collections.abc import Callable

import numpy as np
from tqdm import tqdm

import cupyconv
from cupyconv import reference
from cupyconv.testing import GRAD_TOLERANCE, assert_close, tolerance

from .check import SHORT, assert_equal, numpy_dtype

TABLES = ("forward", "backward", "update")
LAYOUTS = ("cf", "cl")
MODES = ("sliding", "circular")
#: Memory order (dims outermost first) of a [batch, dim, n] array in each layout.
ORDER = {"cf": (0, 1, 2), "cl": (0, 2, 1)}
#: Most channels a check compares (the float64 oracle runs on the host).
CHECK_CHANNELS = 64
#: Most calls in one timed loop.
MAX_CALLS = 10_000
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclasses.dataclass(frozen=True)
class Case:
    table: str  # "forward" | "backward" | "update"
    batch: int
    dim: int
    seqlen: int = 1  # the update: one token
    layout: str = "cf"
    dtype: str = "bfloat16"
    width: int = 4
    mode: str | None = None  # the update: "sliding" | "circular"

    @property
    def name(self) -> str:
        short = SHORT[self.dtype]
        if self.table == "update":
            return f"{self.mode}-{short}-B{self.batch}-C{self.dim}-w{self.width}"
        size = f"{self.batch}x{self.dim}x{self.seqlen}"
        return f"{self.layout}-{short}-{size}-w{self.width}"

    @property
    def traffic(self) -> int:
        """The bytes a provider reads and writes at least (see the module docstring)."""
        item, b, c, k = ITEMSIZE[self.dtype], self.batch, self.dim, self.width
        params = c * (k + 1) * item
        x_bytes = b * c * self.seqlen * item
        if self.table == "forward":
            return 2 * x_bytes + params
        if self.table == "backward":
            return 3 * x_bytes + params
        if self.mode == "sliding":
            state, index = 2 * b * c * (k - 1), 4 * b
        else:
            state, index = b * c * k, 8 * b
        return 2 * x_bytes + params + state * item + index


def default_cases(quick: bool = False, tables=TABLES) -> list[Case]:
    """The cases of ``tables``: a few headline shapes, or (quick) smaller and fewer."""
    if quick:
        cases = [Case("forward", 4, 2048, 2048, layout) for layout in LAYOUTS]
        cases += [Case("backward", 4, 2048, 2048, layout) for layout in LAYOUTS]
        cases += [Case("update", 64, 5120, mode=mode) for mode in MODES]
    else:
        cases = [
            Case("forward", b, c, n, layout)
            for b, c, n in ((8, 5120, 2048), (64, 1024, 512))
            for layout in LAYOUTS
        ]
        cases.append(Case("forward", 8, 5120, 2048, "cf", "float32"))
        cases += [Case("backward", 8, 5120, 2048, layout) for layout in LAYOUTS]
        cases.append(Case("backward", 64, 1024, 512, "cf"))
        cases += [Case("update", b, 5120, mode="sliding") for b in (1, 64, 256)]
        cases.append(Case("update", 64, 5120, mode="circular"))
    return [case for case in cases if case.table in tables]


# ---- inputs -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class HostArray:
    """One input's values on the host, in memory order (float32, or int32 for indices)."""

    dense: np.ndarray
    order: tuple[int, ...]

    @property
    def inverse(self) -> tuple[int, ...]:
        return tuple(int(d) for d in np.argsort(self.order))

    def logical(self) -> np.ndarray:
        """The values as the operator sees them (a view)."""
        return self.dense.transpose(self.inverse)


def host_inputs(case: Case) -> dict[str, HostArray]:
    """The inputs of ``case`` by argument name, the same values whatever else runs."""
    rng = np.random.default_rng(0)
    b, c, k = case.batch, case.dim, case.width

    def values(shape, order, scale=1.0):
        dense = rng.standard_normal(tuple(shape[d] for d in order), dtype=np.float32)
        return HostArray(dense * np.float32(scale), order)

    order = ORDER[case.layout]
    found = {
        "weight": values((c, k), (0, 1), 1 / np.sqrt(k)),
        "bias": values((c,), (0,)),
    }
    if case.table in ("forward", "backward"):
        found["x"] = values((b, c, case.seqlen), order)
        if case.table == "backward":
            found["dout"] = values((b, c, case.seqlen), order)
        return found
    pool_rows = 2 * b
    found["x"] = values((b, c), (0, 1))
    found["conv_state"] = values((pool_rows, c, k - 1), order)
    found["conv_state_indices"] = HostArray(rng.permutation(pool_rows)[:b].astype(np.int32), (0,))
    if case.mode == "circular":
        found["cache_seqlens"] = HostArray(rng.integers(0, 1000, b).astype(np.int32), (0,))
    return found


def cupy_arrays(case: Case, inputs: dict[str, HostArray]) -> dict:
    """The inputs as CuPy arrays of the case's dtype (indices int32), laid out as on the host."""
    import cupy

    dtype = numpy_dtype(case.dtype)

    def put(h: HostArray):
        dense = h.dense if h.dense.dtype == np.int32 else h.dense.astype(dtype)
        return cupy.asarray(dense).transpose(h.inverse)

    return {name: put(h) for name, h in inputs.items()}


def torch_tensors(torch, case: Case, inputs: dict[str, HostArray]) -> dict:
    """The inputs as CUDA torch tensors with the same values and layouts."""
    dtype = getattr(torch, case.dtype)

    def put(h: HostArray):
        t = torch.from_numpy(h.dense).to("cuda")
        return (t if h.dense.dtype == np.int32 else t.to(dtype)).permute(h.inverse)

    return {name: put(h) for name, h in inputs.items()}


# ---- the oracle and the check -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Subset:
    rows: list[int]  # batch rows compared (forward), all rows otherwise
    channels: list[int]


def check_subset(case: Case) -> Subset:
    channels = np.unique(np.linspace(0, case.dim - 1, min(case.dim, CHECK_CHANNELS)).round())
    rows = sorted({0, case.batch - 1}) if case.table == "forward" else list(range(case.batch))
    return Subset(rows, [int(c) for c in channels])


def oracle(case: Case, inputs: dict[str, HostArray], subset: Subset) -> dict[str, np.ndarray]:
    """The float64 reference results that the check compares, by name."""
    dtype = numpy_dtype(case.dtype)

    def ref(name, axis=None):
        """``name`` rounded to the case's dtype, on the checked rows and channels."""
        h = inputs.get(name)
        if h is None:
            return None
        a = h.logical()
        if axis == 1:  # [batch, dim, ...]: rows and channels
            a = a[subset.rows][:, subset.channels]
        elif axis == 0:  # [dim, ...]: channels
            a = a[subset.channels]
        return a.astype(dtype) if a.dtype != np.int32 else a

    if case.table == "forward":
        out = reference.causal_conv1d_fn(
            ref("x", 1), ref("weight", 0), ref("bias", 0), activation="silu"
        )
        return {"out": out}
    if case.table == "backward":
        dx, dweight, dbias, _ = reference.causal_conv1d_bwd(
            ref("x", 1), ref("weight", 0), ref("bias", 0), ref("dout", 1), activation="silu"
        )
        return {"dx": dx, "dweight": dweight, "dbias": dbias}
    out, pool = reference.causal_conv1d_update(
        ref("x"), ref("conv_state"), ref("weight"), ref("bias"), "silu",
        ref("cache_seqlens"), ref("conv_state_indices"),
    )  # fmt: skip
    return {"out": out, "conv_state": pool}


def picked(case: Case, results: dict, subset: Subset) -> dict:
    """A provider's results on the checked rows and channels (the update's whole)."""
    rows, channels = subset.rows, subset.channels
    if case.table == "update":
        return results
    picked = {}
    for name, a in results.items():
        if a is None:
            picked[name] = None
        elif name in ("dweight", "dbias"):
            picked[name] = a[channels]
        else:
            picked[name] = a[rows][:, channels]
    return picked


def compare(case: Case, got: dict, expected: dict) -> None:
    """AssertionError unless every expected result is there and matches."""
    for name, want in expected.items():
        if got.get(name) is None:
            raise AssertionError(f"{name}: no result")
        if name == "conv_state":
            assert_equal(got[name], want, name)
        elif name in ("dweight", "dbias"):
            rtol = max(GRAD_TOLERANCE[0], tolerance(case.dtype)[0])
            atol = GRAD_TOLERANCE[1] * (case.batch * case.seqlen) ** 0.5
            assert_close(got[name], want, case.dtype, rtol=rtol, atol=atol, name=name)
        else:
            assert_close(got[name], want, case.dtype, name=name)


# ---- providers --------------------------------------------------------------------------------


@dataclasses.dataclass
class Provider:
    """``fn()`` runs one call; ``results(output)`` names what the check compares; ``skip`` says
    why the provider does not run this case."""

    fn: Callable | None = None
    results: Callable[[object], dict] | None = None
    skip: str | None = None


@dataclasses.dataclass
class Baselines:
    """What is importable besides cupyconv: torch (with CUDA), causal_conv1d's functions."""

    torch: object = None
    torch_reason: str | None = "torch is not installed"
    fwd: Callable | None = None
    bwd: Callable | None = None
    update: Callable | None = None
    version: str | None = None


def load_baselines() -> Baselines:
    found = Baselines()
    if importlib.util.find_spec("torch") is not None:
        try:
            import torch
        except Exception as e:  # noqa: BLE001 - a broken install is "not importable"
            found.torch_reason = f"torch is not importable ({type(e).__name__})"
        else:
            if torch.cuda.is_available():
                found.torch, found.torch_reason = torch, None
                _ieee_fp32_convs(torch)
            else:
                found.torch_reason = f"torch {torch.__version__} sees no CUDA device"
    if found.torch is None:
        return found
    try:
        import causal_conv1d
        from causal_conv1d import causal_conv1d_fn, causal_conv1d_update
    except Exception:  # noqa: BLE001 - not installed or not built: no such baseline
        return found
    found.fwd, found.update = causal_conv1d_fn, causal_conv1d_update
    found.version = getattr(causal_conv1d, "__version__", "installed")
    try:
        from causal_conv1d.cpp_functions import causal_conv1d_bwd_function as bwd
    except ImportError:
        try:
            from causal_conv1d_cuda import causal_conv1d_bwd as bwd
        except ImportError:
            return found

    def backward(x, weight, bias, dout):
        # seq_idx, initial_states, dfinal_states, dx, return_dinitial_states, silu
        return bwd(x, weight, bias, dout, None, None, None, None, False, True)

    found.bwd = backward
    return found


def _ieee_fp32_convs(torch) -> None:
    """No TF32 in torch's float32 conv1d, so that the baseline passes the float32 check."""
    conv = getattr(torch.backends.cudnn, "conv", None)
    if conv is not None:  # torch >= 2.9
        conv.fp32_precision = "ieee"
    else:
        torch.backends.cudnn.allow_tf32 = False


def copy_provider(nbytes: int) -> Provider:
    """A device-to-device copy of ``nbytes`` between two CuPy buffers."""
    import cupy

    src, dst = cupy.empty(nbytes, cupy.uint8), cupy.empty(nbytes, cupy.uint8)
    return Provider(lambda: dst.data.copy_from_device_async(src.data, nbytes))


def providers(case: Case, inputs: dict[str, HostArray], env: Baselines) -> dict[str, Provider]:
    """{provider: Provider} of ``case`` in table order."""
    found = {"copy": copy_provider(case.traffic // 2)}
    a = cupy_arrays(case, inputs)
    t = torch_tensors(env.torch, case, inputs) if env.torch is not None else None
    k = case.width
    in_range = 2 <= k <= 4
    outside = f"width {k} outside causal_conv1d's 2..4"
    if case.table == "forward":
        found["cupyconv"] = Provider(
            lambda: cupyconv.causal_conv1d_fn(a["x"], a["weight"], a["bias"], activation="silu"),
            lambda out: {"out": out},
        )
        if t is None:
            found["torch"] = Provider(skip=env.torch_reason)
            return found
        F = env.torch.nn.functional
        weight3 = t["weight"].unsqueeze(1)

        def torch_fwd():
            out = F.conv1d(t["x"], weight3, t["bias"], padding=k - 1, groups=case.dim)
            return F.silu(out[..., : case.seqlen])

        found["torch"] = Provider(torch_fwd, lambda out: {"out": out})
        if env.fwd is not None:
            found["causal_conv1d"] = Provider(
                lambda: env.fwd(t["x"], t["weight"], t["bias"], activation="silu"),
                lambda out: {"out": out},
                None if in_range else outside,
            )
        return found
    if case.table == "backward":
        names = ("dx", "dweight", "dbias")
        found["cupyconv"] = Provider(
            lambda: cupyconv.causal_conv1d_bwd(
                a["x"], a["weight"], a["bias"], a["dout"], activation="silu"
            ),
            lambda grads: dict(zip(names, grads[:3])),
        )
        if t is None:
            found["torch"] = Provider(skip=env.torch_reason)
            return found
        torch, F = env.torch, env.torch.nn.functional
        leaves = [t[n].detach().requires_grad_() for n in ("x", "weight", "bias")]
        with torch.enable_grad():
            z = F.conv1d(leaves[0], leaves[1].unsqueeze(1), leaves[2], padding=k - 1,
                         groups=case.dim)  # fmt: skip
            out = F.silu(z[..., : case.seqlen])

        def torch_bwd():
            return torch.autograd.grad(out, leaves, t["dout"], retain_graph=True)

        found["torch"] = Provider(torch_bwd, lambda grads: dict(zip(names, grads)))
        if env.bwd is not None:
            found["causal_conv1d"] = Provider(
                lambda: env.bwd(t["x"], t["weight"], t["bias"], t["dout"]),
                lambda grads: dict(zip(names, grads[:3])),
                None if in_range else outside,
            )
        return found

    def update_args(arrays):
        return (
            arrays["x"], arrays["conv_state"], arrays["weight"], arrays["bias"], "silu",
            arrays.get("cache_seqlens"), arrays["conv_state_indices"],
        )  # fmt: skip

    found["cupyconv"] = Provider(
        lambda: cupyconv.causal_conv1d_update(*update_args(a)),
        lambda out: {"out": out, "conv_state": a["conv_state"]},
    )
    if env.update is not None:
        found["causal_conv1d"] = Provider(
            lambda: env.update(*update_args(t)),
            lambda out: {"out": out, "conv_state": t["conv_state"]},
            None if in_range else outside,
        )
    return found


# ---- timing -----------------------------------------------------------------------------------


def time_fn(fn, *, repeats: int, target_ms: float, warmup: int = 3) -> dict:
    """Per-call time of ``fn`` in microseconds: median, min and max over ``repeats`` loops of n
    back-to-back calls between two CUDA events on CuPy's current stream, n chosen so that a
    loop takes about ``target_ms``."""
    import cupy

    for _ in range(warmup):
        fn()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()

    def loop_ms(n: int) -> float:
        start.record()
        for _ in range(n):
            fn()
        end.record()
        end.synchronize()
        return cupy.cuda.get_elapsed_time(start, end)

    cupy.cuda.Device().synchronize()
    estimate_ms = loop_ms(5) / 5
    n = max(1, min(MAX_CALLS, round(target_ms / max(estimate_ms, 1e-4))))
    return spread([loop_ms(n) * 1e3 / n for _ in range(repeats)], n)


def spread(per_call_us: list[float], calls: int) -> dict:
    """A timing result: median, min and max per-call microseconds over the repeated loops."""
    return {
        "us_median": statistics.median(per_call_us),
        "us_min": min(per_call_us),
        "us_max": max(per_call_us),
        "calls": calls,
        "repeats": len(per_call_us),
    }


# ---- rows -------------------------------------------------------------------------------------


def new_row(case: Case, provider: str) -> dict:
    return {
        "table": case.table,
        "case": case.name,
        **dataclasses.asdict(case),
        "provider": provider,
        "status": "ok",  # ok | check failed | error | skipped
        "check": None,  # ok | failed | None (not checked)
        "message": None,
        "bytes": case.traffic,
        "us_median": None,
        "us_min": None,
        "us_max": None,
        "calls": None,
        "repeats": None,
        "gbps": None,
        "copy_ratio": None,
    }


def error_text(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    return text.splitlines()[0] if text else type(e).__name__


def skipped_rows(case: Case, reason: str) -> list[dict]:
    rows = [new_row(case, name) for name in ("copy", "cupyconv")]
    for row in rows:
        row.update(status="skipped", message=reason)
    return rows


def run_case(case: Case, env: Baselines, *, repeats: int, target_ms: float, timer=time_fn):
    """Check, then time every provider of ``case``: one row each, never raises."""
    try:
        inputs = host_inputs(case)
        found = providers(case, inputs, env)
        subset = check_subset(case)
        expected = oracle(case, inputs, subset)
    except Exception as e:  # noqa: BLE001 - a failed case must not stop the others
        rows = [new_row(case, name) for name in ("copy", "cupyconv")]
        for row in rows:
            row.update(status="error", message=f"inputs: {error_text(e)}")
        return rows
    rows = {}
    for name, p in found.items():
        row = rows[name] = new_row(case, name)
        if p.skip is not None:
            row.update(status="skipped", message=p.skip)
            continue
        if p.results is not None:
            try:
                compare(case, picked(case, p.results(p.fn()), subset), expected)
                row["check"] = "ok"
            except AssertionError as e:
                row.update(check="failed", message=f"check failed: {str(e).splitlines()[0]}")
                if name == "cupyconv":
                    row["status"] = "check failed"
                    continue
            except Exception as e:  # noqa: BLE001 - recorded in the row
                row.update(status="error", message=error_text(e))
                continue
        try:
            row.update(timer(p.fn, repeats=repeats, target_ms=target_ms))
        except Exception as e:  # noqa: BLE001 - recorded in the row
            row.update(status="error", message=error_text(e))
            continue
        row["gbps"] = row["bytes"] / (row["us_median"] * 1e3)
    return with_copy_ratios(rows)


def with_copy_ratios(rows: dict) -> list:
    """The rows of a case (by provider) as a list, each timed one with ``copy_ratio``: the
    device copy's median time over its own."""
    copy_us = rows["copy"]["us_median"]
    for row in rows.values():
        if copy_us is not None and row["us_median"] is not None:
            row["copy_ratio"] = copy_us / row["us_median"]
    return list(rows.values())


# ---- output -----------------------------------------------------------------------------------


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _note(row: dict) -> str:
    text = row["message"] or ""
    if row["status"] not in ("ok",) and not text.startswith(row["status"]):
        text = f"{row['status']}: {text}"
    return text if len(text) <= 80 else text[:77] + "..."


def _us_spread(row: dict) -> str:
    return "-" if row["us_min"] is None else f"{row['us_min']:.1f}-{row['us_max']:.1f}"


#: The table's columns: (header, cell text of a row, right-aligned).
COLUMNS = (
    ("case", lambda r: r["case"], False),
    ("provider", lambda r: r["provider"], False),
    ("us", lambda r: _fmt(r["us_median"], ".1f"), True),
    ("min-max us", _us_spread, True),
    ("GB/s", lambda r: _fmt(r["gbps"], ".0f"), True),
    ("copy/time", lambda r: _fmt(r["copy_ratio"], ".2f"), True),
    ("note", _note, False),
)


def format_table(rows: list[dict]) -> list[str]:
    """The rows as aligned text lines, a blank line between cases."""
    header = tuple(name for name, _, _ in COLUMNS)
    cells = [tuple(cell(row) for _, cell, _ in COLUMNS) for row in rows]
    widths = [max(len(line[i]) for line in [header, *cells]) for i in range(len(header))]

    def render(line):
        parts = [
            text.rjust(w) if numeric else text.ljust(w)
            for text, w, (_, _, numeric) in zip(line, widths, COLUMNS)
        ]
        return "  ".join(parts).rstrip()

    lines = [render(header), render(tuple("-" * w for w in widths))]
    previous = None
    for row, line in zip(rows, cells):
        if previous is not None and row["case"] != previous:
            lines.append("")
        previous = row["case"]
        lines.append(render(line))
    return lines


TITLES = {
    "forward": "forward: causal_conv1d_fn (GB/s over x read + out written)",
    "backward": "backward: causal_conv1d_bwd (GB/s over x and dout read + dx written)",
    "update": "update: causal_conv1d_update on a pool of 2 batch rows (GB/s over bytes touched)",
}


def print_tables(rows: list[dict], meta: dict) -> None:
    print(
        f"bench on {meta['device']}: cupyconv {meta['cupyconv']}, CuPy {meta['cupy']}, torch "
        f"{meta['torch'] or 'not used'}, causal_conv1d {meta['causal_conv1d'] or 'not importable'}"
    )
    for table in TABLES:
        table_rows = [row for row in rows if row["table"] == table]
        if table_rows:
            print()
            print(TITLES[table])
            for line in format_table(table_rows):
                print(line)


def write_json(path: str, rows: list[dict], meta: dict) -> None:
    """``{"meta": meta, "rows": rows}`` as JSON at ``path``."""
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
        f.write("\n")


def draw_chart(path: str, rows: list[dict], meta: dict) -> str:
    """Bars of GB/s per case and provider, the copy's bar beside the others, one panel per
    table, at ``path`` (PNG). Returns what was done, in words (matplotlib may be missing)."""
    try:
        import matplotlib
    except ImportError:
        return "chart skipped: --png needs matplotlib (pip install cupyconv[plot])"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tables = [t for t in TABLES if any(r["table"] == t and r["gbps"] for r in rows)]
    if not tables:
        return "chart skipped: no timed rows"
    fig, axes = plt.subplots(1, len(tables), figsize=(6 * len(tables), 4.5), squeeze=False)
    for ax, table in zip(axes[0], tables):
        table_rows = [r for r in rows if r["table"] == table]
        cases = list(dict.fromkeys(r["case"] for r in table_rows))
        names = list(dict.fromkeys(r["provider"] for r in table_rows))
        gbps = {(r["case"], r["provider"]): r["gbps"] for r in table_rows}
        bar = 0.8 / len(names)
        for i, name in enumerate(names):
            heights = [gbps.get((case, name)) or float("nan") for case in cases]
            positions = [j + (i - (len(names) - 1) / 2) * bar for j in range(len(cases))]
            style = {"color": "0.6", "hatch": "//"} if name == "copy" else {}
            ax.bar(positions, heights, bar, label=name, **style)
        ax.set_xticks(range(len(cases)))
        ax.set_xticklabels(cases, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("GB/s (bytes read + written)")
        ax.set_title(table)
        ax.legend(fontsize=8)
    fig.suptitle(f"cupyconv {meta['cupyconv']} on {meta['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"chart: {path}"


# ---- the command ------------------------------------------------------------------------------


def command(args, gpu, reason: str) -> int:
    """``bench``: 0 unless a cupyconv row failed its check or raised."""
    cases = default_cases(args.quick, args.tables)
    if args.list:
        for case in cases:
            print(f"{case.table:9s} {case.name}")
        return 0
    repeats = args.repeats or (3 if args.quick else 10)
    target_ms = 5.0 if args.quick else 20.0
    png = args.png
    if png and importlib.util.find_spec("matplotlib") is None:
        print("bench: --png needs matplotlib, which is not installed (pip install "
              "cupyconv[plot]): no chart")  # fmt: skip
        png = None
    meta = {
        "device": gpu.name if gpu is not None else None,
        "cupyconv": cupyconv.__version__,
        "quick": bool(args.quick),
        "repeats": repeats,
        "target_ms": target_ms,
    }
    if gpu is None:
        print(f"bench: no GPU ({reason}): nothing to time ({len(cases)} cases skipped)")
        rows = [row for case in cases for row in skipped_rows(case, f"no GPU: {reason}")]
        if args.json:
            write_json(args.json, rows, meta | {"cupy": None, "torch": None})
            print(f"rows: {args.json} (every case skipped)")
        if png:
            print(draw_chart(png, rows, meta))
        return 0
    import cupy

    env = load_baselines()
    meta |= {
        "cupy": cupy.__version__,
        "torch": env.torch.__version__ if env.torch is not None else None,
        "causal_conv1d": env.version,
    }
    rows = []
    for case in tqdm(cases, desc="bench", unit="case", disable=None, leave=False):
        rows += run_case(case, env, repeats=repeats, target_ms=target_ms)
        cupy.get_default_memory_pool().free_all_blocks()
        if env.torch is not None:
            env.torch.cuda.empty_cache()
    print_tables(rows, meta)
    if args.json:
        write_json(args.json, rows, meta)
        print(f"rows: {args.json}")
    if png:
        print(draw_chart(png, rows, meta))
    bad = [r for r in rows if r["provider"] == "cupyconv" and r["status"] in ("check failed",
                                                                            "error")]  # fmt: skip
    for row in bad:
        print(f"FAILED {row['table']} {row['case']}: {row['message']}")
    return 1 if bad else 0


def add_arguments(parser) -> None:
    parser.add_argument("--quick", action="store_true", help="fewer, smaller cases, shorter loops")
    parser.add_argument(
        "--tables",
        type=_tables,
        default=list(TABLES),
        help="comma-separated: forward, backward, update (default all)",
    )
    parser.add_argument("--repeats", type=_positive, help="timed loops per provider (10; quick 3)")
    parser.add_argument("--json", metavar="PATH", help="write every row (and meta) as JSON")
    parser.add_argument(
        "--png", metavar="PATH", help="bar chart of GB/s per case and provider (matplotlib)"
    )
    parser.add_argument("--list", action="store_true", help="print the cases and exit")


def _positive(text: str) -> int:
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer; got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1; got {value}")
    return value


def _tables(text: str) -> list[str]:
    from .warmup import choice_list

    return choice_list(TABLES)(text)
