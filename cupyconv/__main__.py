"""``python -m cupyconv``: environment report, a check against the float64 reference on a
default problem, and on a GPU a short timing; without a GPU, the CPU path and a compile check of
the default problem's kernels with NVRTC.

Exits 0 when every check passes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import importlib
import platform
import sys

import numpy as np

import cupyconv
from cupyconv import reference
from cupyconv.testing import GRAD_TOLERANCE, assert_close, tolerance

DEFAULT = {"batch": 2, "dim": 256, "seqlen": 2048, "width": 4}


def _version(module: str) -> str:
    try:
        return getattr(importlib.import_module(module), "__version__", "installed")
    except Exception as e:  # noqa: BLE001 - report any import failure as "not available"
        return f"not available ({type(e).__name__})"


def gpu_name() -> str | None:
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() == 0:
            return None
        return cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    except Exception:  # noqa: BLE001 - no CuPy, no driver, no device: all mean "no GPU"
        return None


def report(gpu: str | None) -> None:
    print(f"cupyconv {cupyconv.__version__} (Python {platform.python_version()})")
    for module in ("numpy", "ml_dtypes", "cupy", "torch", "jax"):
        print(f"  {module:10s} {_version(module)}")
    from cupyconv._compile import kernel_dir

    print(f"  kernels    {kernel_dir()}")
    print(f"  GPU        {gpu or 'none: running the CPU path and the compile check'}")


def problem(seed: int = 0):
    rng = np.random.default_rng(seed)
    b, c, length, k = DEFAULT["batch"], DEFAULT["dim"], DEFAULT["seqlen"], DEFAULT["width"]
    x = rng.standard_normal((b, c, length)).astype(np.float32)
    w = (rng.standard_normal((c, k)) / np.sqrt(k)).astype(np.float32)
    bias = rng.standard_normal(c).astype(np.float32)
    return x, w, bias


def check_cpu() -> None:
    x, w, bias = problem()
    out, final = cupyconv.causal_conv1d_fn(x, w, bias, activation="silu", return_final_states=True)
    want, want_final = reference.causal_conv1d_fn(
        x, w, bias, activation="silu", return_final_states=True
    )
    assert_close(out, want, "float32")
    assert_close(final, want_final, "float32", name="final_states")
    check_backward(x, w, bias, np.float32, lambda a: a)
    print(f"CPU path: float32 {x.shape} width {w.shape[1]} matches the reference (fwd, bwd)")


def check_backward(x, w, bias, dtype, to_device) -> None:
    """causal_conv1d_bwd on the default problem (arrays made by ``to_device``) against the
    reference: dx at the dtype's tolerance, dweight and dbias at the reduction's."""
    rng = np.random.default_rng(2)
    dout = rng.standard_normal(x.shape).astype(np.float32)
    args = [a.astype(dtype) for a in (x, w, bias, dout)]
    dx, dweight, dbias, _ = cupyconv.causal_conv1d_bwd(*map(to_device, args), activation="silu")
    want = reference.causal_conv1d_bwd(*args, activation="silu")
    name = np.dtype(dtype).name
    rtol = max(GRAD_TOLERANCE[0], tolerance(name)[0])
    atol = GRAD_TOLERANCE[1] * (x.shape[0] * x.shape[2]) ** 0.5
    assert_close(dx, want[0], name, name="dx")
    assert_close(dweight, want[1], rtol=rtol, atol=atol, name="dweight")
    assert_close(dbias, want[2], rtol=rtol, atol=atol, name="dbias")


def check_gpu() -> None:
    import cupy
    import ml_dtypes

    x, w, bias = problem()
    for dtype in (np.float32, ml_dtypes.bfloat16):
        xg, wg, bg = (cupy.asarray(a.astype(dtype)) for a in (x, w, bias))
        out = cupyconv.causal_conv1d_fn(xg, wg, bg, activation="silu")
        want = reference.causal_conv1d_fn(
            *(a.astype(dtype) for a in (x, w, bias)), activation="silu"
        )
        assert_close(out, want, np.dtype(dtype).name)
        check_backward(x, w, bias, dtype, cupy.asarray)
        print(
            f"GPU: {np.dtype(dtype).name} {x.shape} width {w.shape[1]} matches the reference "
            "(fwd, bwd)"
        )
    # A short timing against a device-to-device copy of the same bytes.
    shape = (8, 1024, 4096)
    rng = np.random.default_rng(1)
    big = cupy.asarray(rng.standard_normal(shape, np.float32).astype(ml_dtypes.bfloat16))
    wb = cupy.asarray(rng.standard_normal((shape[1], 4), np.float32).astype(ml_dtypes.bfloat16))
    dst = cupy.empty_like(big)

    def median_us(fn, n=50):
        """Per-call time of ``fn``: median over 5 loops of n back-to-back calls (the host
        prepares the next call while the GPU runs the last one, as in a model)."""
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        for _ in range(5):
            fn()
        times = []
        for _ in range(5):
            start.record()
            for _ in range(n):
                fn()
            stop.record()
            stop.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, stop) * 1e3 / n)
        return float(np.median(times))

    copy_us = median_us(lambda: dst.data.copy_from_device_async(big.data, big.nbytes))
    conv_us = median_us(lambda: cupyconv.causal_conv1d_fn(big, wb, activation="silu"))
    print(
        f"GPU timing, bf16 {shape} width 4 silu: {conv_us:.1f} us; device-to-device copy of "
        f"x's bytes {copy_us:.1f} us; copy/cupyconv {copy_us / conv_us:.2f}"
    )


def check_compile() -> None:
    """Every forward kernel family, on the default problem's dtype and width (and width 64 for
    the wide-filter kernels), compiles with NVRTC for sm_80 and sm_90, and every backward
    family (without seq_idx) for sm_90."""
    from cupyconv._backward_plan import all_backward_instances
    from cupyconv._compile import compile_offline, nvrtc_version
    from cupyconv._forward_plan import all_forward_instances

    instances = all_forward_instances(dtypes=("bfloat16",), widths=(DEFAULT["width"], 64))
    backward = all_backward_instances(dtypes=("bfloat16",), widths=(DEFAULT["width"],))
    try:
        version = nvrtc_version()
    except ImportError as e:
        print(f"compile check skipped: {e} (install cupyconv[cuda13] or [cuda12] for NVRTC)")
        return
    count = sum(len(names) for names in instances.values())
    for arch in ("sm_80", "sm_90"):
        for source, names in instances.items():
            compile_offline(source, names, arch)
    backward = {s: [n for n in names if "true" not in n] for s, names in backward.items()}
    for source, names in backward.items():
        compile_offline(source, names, "sm_90")
    print(
        f"compile check: {count} forward kernels compile with NVRTC {version} for sm_80, sm_90, "
        f"{sum(len(n) for n in backward.values())} backward kernels for sm_90"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cupyconv", description=__doc__.split("\n")[0])
    parser.parse_args(argv)
    gpu = gpu_name()
    report(gpu)
    try:
        check_cpu()
        if gpu:
            check_gpu()
        else:
            check_compile()
    except (AssertionError, RuntimeError) as e:
        print(f"FAILED: {e}")
        return 1
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
