"""``python -m cupyconv check``: every operator against the float64 reference
(``cupyconv.reference``) on a default problem set.

Problems: three shapes (batch, dim, seqlen, width) = (2, 256, 2048, 4), (3, 100, 301, 3) (odd
sizes: partial tiles, channel counts that do not fill a vector) and (1, 128, 512, 32) (a wide
filter: tensor cores for bfloat16), each channel-first and channel-last, in bfloat16 and float32.
Operators on each problem:

- ``fwd``: ``causal_conv1d_fn`` with bias and SiLU;
- ``fwd+states``: the same with initial states, returning the final states;
- ``bwd``: ``causal_conv1d_bwd`` -> dx, dweight, dbias;
- ``update sliding`` / ``update circular``: ``causal_conv1d_update`` on rows of a state pool of
  2 (batch + 1) rows gathered by ``conv_state_indices`` with one padding row (-1); one token in
  sliding mode, two tokens and a state of width + 1 entries in circular mode;
- ``varlen states``: ``causal_conv1d_varlen_states`` of batch + 2 packed sequences (one empty).

Outputs, dx and states are compared with ``cupyconv.testing.assert_close`` at the dtype's
tolerance, dweight and dbias at the reduction's (``GRAD_TOLERANCE``, the atol scaled by
sqrt(batch * seqlen)); the updated state pool and the varlen states must equal the reference
exactly. On a GPU the arrays are CuPy arrays and the kernels run; without one the arrays are
numpy arrays (the CPU path), and a compile check with NVRTC stands in for running the kernels.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable

import numpy as np
from tqdm import tqdm

import cupyconv
from cupyconv import reference
from cupyconv.testing import GRAD_TOLERANCE, assert_close, to_numpy, tolerance

#: (batch, dim, seqlen, width) of the problems.
SHAPES = ((2, 256, 2048, 4), (3, 100, 301, 3), (1, 128, 512, 32))
DTYPES = ("bfloat16", "float32")
LAYOUTS = ("cf", "cl")
#: Memory order (dims outermost first) of a [batch, dim, n] array in each layout.
ORDER = {"cf": (0, 1, 2), "cl": (0, 2, 1)}
SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}


@dataclasses.dataclass(frozen=True)
class Problem:
    batch: int
    dim: int
    seqlen: int
    width: int
    layout: str  # "cf" channel-first (time contiguous), "cl" channel-last (channels contiguous)
    dtype: str

    @property
    def name(self) -> str:
        size = f"{self.batch}x{self.dim}x{self.seqlen}"
        return f"{self.layout}-{SHORT[self.dtype]}-{size}-w{self.width}"

    @property
    def np_dtype(self) -> np.dtype:
        return numpy_dtype(self.dtype)


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of a dtype name (``ml_dtypes.bfloat16`` for bfloat16)."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def default_problems() -> list[Problem]:
    return [
        Problem(*shape, layout, dtype) for shape in SHAPES for dtype in DTYPES for layout in LAYOUTS
    ]


#: Makes a device array from a dense numpy array (numpy itself, ``cupy.asarray``, ...).
Put = Callable[[np.ndarray], object]


def place(values: np.ndarray, dtype, order: tuple[int, ...], put: Put):
    """``values`` rounded to ``dtype`` as (the array ``put`` makes, laid out with its dims
    outermost first in ``order``; the numpy array of the same values, for the reference)."""
    dense = np.ascontiguousarray(values.transpose(order)).astype(dtype)
    inverse = tuple(int(d) for d in np.argsort(order))
    return put(dense).transpose(inverse), dense.transpose(inverse)


def assert_equal(actual, expected, name: str) -> None:
    """Raise AssertionError unless ``actual`` equals ``expected`` exactly (NaN never does)."""
    got = to_numpy(actual)
    want = np.asarray(expected, dtype=np.float64)
    if got.shape != want.shape:
        raise AssertionError(f"{name}: shape {got.shape} != expected {want.shape}")
    bad = ~(got == want)
    if bad.any():
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        raise AssertionError(
            f"{name}: {int(bad.sum())} of {bad.size} elements differ (exact equality expected); "
            f"first at {first}: got {got[first]!r}, expected {want[first]!r}"
        )


def _filter(p: Problem, rng, put: Put):
    """(weight, bias) of ``p`` on the device and for the reference."""
    k = p.width
    w = place(rng.standard_normal((p.dim, k)) / np.sqrt(k), p.np_dtype, (0, 1), put)
    b = place(rng.standard_normal(p.dim), p.np_dtype, (0,), put)
    return w, b


def check_forward(p: Problem, rng, put: Put, states: bool) -> None:
    """causal_conv1d_fn (with initial and final states when ``states``)."""
    order = ORDER[p.layout]
    x, x_ref = place(rng.standard_normal((p.batch, p.dim, p.seqlen)), p.np_dtype, order, put)
    (w, w_ref), (b, b_ref) = _filter(p, rng, put)
    if not states:
        want = reference.causal_conv1d_fn(x_ref, w_ref, b_ref, activation="silu")
        out = cupyconv.causal_conv1d_fn(x, w, b, activation="silu")
        assert_close(out, want, p.dtype)
        return
    init_values = rng.standard_normal((p.batch, p.dim, p.width - 1))
    init, init_ref = place(init_values, p.np_dtype, order, put)
    want, want_final = reference.causal_conv1d_fn(
        x_ref, w_ref, b_ref, initial_states=init_ref, return_final_states=True, activation="silu"
    )
    out, final = cupyconv.causal_conv1d_fn(
        x, w, b, initial_states=init, return_final_states=True, activation="silu"
    )
    assert_close(out, want, p.dtype)
    assert_close(final, want_final, p.dtype, name="final_states")


def check_backward(p: Problem, rng, put: Put) -> None:
    """causal_conv1d_bwd: dx at the dtype's tolerance, dweight and dbias at the reduction's."""
    order = ORDER[p.layout]
    shape = (p.batch, p.dim, p.seqlen)
    x, x_ref = place(rng.standard_normal(shape), p.np_dtype, order, put)
    (w, w_ref), (b, b_ref) = _filter(p, rng, put)
    dout, dout_ref = place(rng.standard_normal(shape), p.np_dtype, order, put)
    want = reference.causal_conv1d_bwd(x_ref, w_ref, b_ref, dout_ref, activation="silu")
    dx, dweight, dbias, _ = cupyconv.causal_conv1d_bwd(x, w, b, dout, activation="silu")
    rtol = max(GRAD_TOLERANCE[0], tolerance(p.dtype)[0])
    atol = GRAD_TOLERANCE[1] * (p.batch * p.seqlen) ** 0.5
    assert_close(dx, want[0], p.dtype, name="dx")
    assert_close(dweight, want[1], rtol=rtol, atol=atol, name="dweight")
    assert_close(dbias, want[2], rtol=rtol, atol=atol, name="dbias")


def check_update(p: Problem, rng, put: Put, circular: bool) -> None:
    """causal_conv1d_update on rows of a pool, one of them a padding row; the pool exactly."""
    rows, k = p.batch + 1, p.width
    pool_rows = 2 * rows
    state_len, tokens = (k + 1, 2) if circular else (k - 1, 1)
    if circular:
        x_values, x_order = rng.standard_normal((rows, p.dim, tokens)), ORDER[p.layout]
    else:
        x_values, x_order = rng.standard_normal((rows, p.dim)), (0, 1)
    x, x_ref = place(x_values, p.np_dtype, x_order, put)
    pool_values = rng.standard_normal((pool_rows, p.dim, state_len))
    pool, pool_ref = place(pool_values, p.np_dtype, ORDER[p.layout], put)
    (w, w_ref), (b, b_ref) = _filter(p, rng, put)
    indices = rng.permutation(pool_rows)[:rows]
    indices[rng.integers(rows)] = -1  # a padding row: output 0, no state touched
    idx, idx_ref = place(indices, np.int32, (0,), put)
    lens = lens_ref = None
    if circular:
        lens, lens_ref = place(rng.integers(0, 50, rows), np.int32, (0,), put)
    want, want_pool = reference.causal_conv1d_update(
        x_ref, pool_ref, w_ref, b_ref, "silu", lens_ref, idx_ref
    )
    out = cupyconv.causal_conv1d_update(x, pool, w, b, "silu", lens, idx)
    assert_close(out, want, p.dtype)
    assert_equal(pool, want_pool, "conv_state (the pool after the update)")


def check_varlen(p: Problem, rng, put: Put) -> None:
    """causal_conv1d_varlen_states of batch + 2 packed sequences, one of them empty; exactly."""
    total = p.seqlen
    cuts = np.sort(rng.integers(1, total, p.batch))
    cu = np.concatenate([[0], cuts[:1], cuts, [total]])  # cuts[0] twice: an empty sequence
    order = (0, 1) if p.layout == "cl" else (1, 0)  # x [tokens, dim]: cf keeps tokens fastest
    x, x_ref = place(rng.standard_normal((total, p.dim)), p.np_dtype, order, put)
    cu_seqlens, cu_ref = place(cu, np.int32, (0,), put)
    want = reference.causal_conv1d_varlen_states(x_ref, cu_ref, p.width - 1)
    states = cupyconv.causal_conv1d_varlen_states(x, cu_seqlens, p.width - 1)
    assert_equal(states, want, "states")


#: The operator checks, by name: fn(problem, rng, put) raises AssertionError on a mismatch.
CHECKS: dict[str, Callable] = {
    "fwd": lambda p, rng, put: check_forward(p, rng, put, states=False),
    "fwd+states": lambda p, rng, put: check_forward(p, rng, put, states=True),
    "bwd": check_backward,
    "update sliding": lambda p, rng, put: check_update(p, rng, put, circular=False),
    "update circular": lambda p, rng, put: check_update(p, rng, put, circular=True),
    "varlen states": check_varlen,
}


def run_checks(problems: list[Problem], put: Put, checks=CHECKS) -> tuple[int, list[str]]:
    """Every check on every problem, with a progress bar: (checks run, failure messages)."""
    items = [(p, name) for p in problems for name in checks]
    failures = []
    for p, name in tqdm(items, desc="check", unit="check", disable=None, leave=False):
        rng = np.random.default_rng(zlib.crc32(f"{p.name} {name}".encode()))
        try:
            checks[name](p, rng, put)
        except AssertionError as e:
            failures.append(f"{name} {p.name}: {e}")
        except Exception as e:  # noqa: BLE001 - a crash is a failure of that check, reported
            failures.append(f"{name} {p.name}: {type(e).__name__}: {e}")
    return len(items), failures


def describe_set(problems: list[Problem], checks=CHECKS) -> str:
    shapes = sorted({(p.batch, p.dim, p.seqlen, p.width) for p in problems})
    sizes = ", ".join(f"{b}x{c}x{n} w{k}" for b, c, n, k in shapes)
    layouts = ", ".join(sorted({p.layout for p in problems}))
    dtypes = ", ".join(sorted({p.dtype for p in problems}))
    return f"{', '.join(checks)} on {len(problems)} problems ({sizes}; {layouts}; {dtypes})"


def compile_check() -> list[str]:
    """Without a GPU: the default problem's kernels compile with NVRTC (every forward family
    for sm_80 and sm_90; the backward, update and varlen families for sm_90). Returns the
    failure messages (none when NVRTC is not installed: that is said and skipped)."""
    from .compile import compile_all, compile_check_instances
    from .env import offline_nvrtc

    version = offline_nvrtc()
    if version is None:
        print(
            "compile check: skipped, NVRTC is not installed (cuda-bindings, cuda-pathfinder: "
            "install cupyconv[cuda13] or cupyconv[cuda12])"
        )
        return []
    forward, others = compile_check_instances()
    n_forward = sum(len(n) for n in forward.values())
    n_others = sum(len(n) for n in others.values())
    with tqdm(total=2 * n_forward + n_others, desc="compile", unit="kernel", disable=None,
              leave=False) as bar:  # fmt: skip
        try:
            compile_all(forward, ("sm_80", "sm_90"), bar.update)
            compile_all(others, ("sm_90",), bar.update)
        except RuntimeError as e:
            return [f"compile check: {e}"]
    print(
        f"compile check: {n_forward} forward kernel instances compile with NVRTC {version} for "
        f"sm_80 and sm_90, {n_others} backward, update and varlen instances for sm_90"
    )
    return []


def command(args, gpu, reason: str) -> int:
    """``check``: 0 when every check passes, 1 otherwise (the failures printed)."""
    problems = default_problems()
    on_gpu = gpu is not None and not args.cpu
    if on_gpu:
        import cupy

        put, where = cupy.asarray, f"on the GPU ({gpu.name}, CuPy arrays)"
    else:
        if gpu is None:
            print(
                f"check: no GPU ({reason}): the GPU kernels cannot run here; checking the CPU "
                "path (numpy arrays)"
                + ("" if args.no_compile else " and that the kernels compile (NVRTC)")
            )
        put, where = np.copy, "on the CPU path (numpy arrays)"
    count, failures = run_checks(problems, put)
    if failures:
        print(f"check FAILED {where}: {len(failures)} of {count} checks")
        for message in failures:
            print(f"  FAILED {message}")
    else:
        print(f"check {where}: all {count} match the float64 reference: {describe_set(problems)}")
    if not on_gpu and gpu is None and not args.no_compile:
        compile_failures = compile_check()
        for message in compile_failures:
            print(f"FAILED {message}")
        failures += compile_failures
    return 1 if failures else 0
