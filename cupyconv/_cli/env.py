"""What the command finds on this machine: the GPU (or why there is none), the CUDA driver,
runtime and NVRTC, the versions of the packages around cupyconv, and the kernel caches.

``python -m cupyconv info`` prints :func:`report`; every other subcommand asks :func:`probe_gpu`
whether it can run on a GPU.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import os
import platform
from pathlib import Path

import cupyconv

#: Packages whose versions ``info`` reports: (label, import name, distribution names). torch and
#: JAX are read from their distributions' metadata, without importing them (seconds each).
PACKAGES = (
    ("numpy", "numpy", ("numpy",)),
    ("ml_dtypes", "ml_dtypes", ("ml_dtypes",)),
    ("CuPy", "cupy", ("cupy-cuda13x", "cupy-cuda12x", "cupy")),
    ("torch", "torch", ("torch",)),
    ("JAX", "jax", ("jax",)),
    ("causal_conv1d", "causal_conv1d", ("causal-conv1d", "causal_conv1d")),
    ("tqdm", "tqdm", ("tqdm",)),
    ("matplotlib", "matplotlib", ("matplotlib",)),
)


@dataclasses.dataclass(frozen=True)
class Gpu:
    """Device 0 as CuPy sees it."""

    name: str
    capability: str  # "9.0"
    memory_gib: float
    count: int


def probe_gpu() -> tuple[Gpu | None, str]:
    """(device 0, "") where CuPy sees a CUDA device, else (None, why not) in a few words."""
    try:
        import cupy
    except ImportError:
        return None, "CuPy is not installed: pip install cupyconv[cuda13] or cupyconv[cuda12]"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
        if count == 0:
            return None, "no CUDA device is present"
        props = cupy.cuda.runtime.getDeviceProperties(0)
    except cupy.cuda.runtime.CUDARuntimeError as e:  # no driver, or no device
        return None, f"no CUDA device: {str(e).split(':')[0]}"
    name = props["name"]
    name = name.decode() if isinstance(name, bytes) else str(name)
    memory = props["totalGlobalMem"] / 2**30
    return Gpu(name, f"{props['major']}.{props['minor']}", memory, count), ""


def package_version(module: str, distributions: tuple[str, ...]) -> str | None:
    """The installed version of ``module`` (from its distribution's metadata), or None."""
    if importlib.util.find_spec(module) is None:
        return None
    for dist in distributions:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "installed (version unknown)"


def _cuda_version(number: int) -> str:
    """12040 -> '12.4' (the CUDA API's encoding of versions)."""
    return f"{number // 1000}.{number % 1000 // 10}"


def cuda_versions() -> dict[str, str]:
    """The CUDA driver, runtime and NVRTC versions, each as text (or why it is unknown)."""
    found = {}
    try:
        from cupy.cuda import nvrtc, runtime
    except ImportError:
        unknown = "unknown (CuPy is not installed)"
        found = {"driver": unknown, "runtime": unknown, "nvrtc": unknown}
    else:
        try:
            driver = runtime.driverGetVersion()
            found["driver"] = _cuda_version(driver) if driver else "none (no CUDA driver)"
        except Exception as e:  # noqa: BLE001 - any failure means "unknown"
            found["driver"] = f"unknown ({type(e).__name__})"
        try:
            found["runtime"] = _cuda_version(runtime.runtimeGetVersion()) + " (CuPy's)"
        except Exception as e:  # noqa: BLE001
            found["runtime"] = f"unknown ({type(e).__name__})"
        try:
            major, minor = nvrtc.getVersion()
            found["nvrtc"] = f"{major}.{minor} (CuPy's, run-time compiles)"
        except Exception as e:  # noqa: BLE001
            found["nvrtc"] = f"unknown to CuPy ({type(e).__name__})"
    version = offline_nvrtc()
    found["nvrtc offline"] = (
        f"{version} (cuda-bindings: compiles without a GPU)"
        if version
        else "not installed (cuda-bindings, cuda-pathfinder)"
    )
    return found


def offline_nvrtc() -> str | None:
    """The version of the NVRTC that compiles without a GPU (``cuda-bindings``), or None."""
    try:
        from cupyconv._compile import nvrtc_version

        return nvrtc_version()
    except Exception:  # noqa: BLE001 - not installed, or no NVRTC library: not available
        return None


def cupy_cache_dir() -> Path | None:
    """CuPy's on-disk kernel cache (``CUPY_CACHE_DIR``, default ``~/.cupy/kernel_cache``), or
    None where CuPy keeps compiled kernels in memory only (``CUPY_CACHE_IN_MEMORY=1``)."""
    if os.environ.get("CUPY_CACHE_IN_MEMORY", "0") not in ("", "0"):
        return None
    return Path(os.environ.get("CUPY_CACHE_DIR", "~/.cupy/kernel_cache")).expanduser()


def kernel_templates() -> tuple[str, ...]:
    """The names of cupyconv's kernel templates (every instance's mangled name contains one)."""
    from cupyconv import _backward_plan, _forward_plan, _update_plan, _varlen_plan

    kernels = (*_forward_plan.KERNELS, *_backward_plan.KERNELS)
    kernels += (_update_plan.UPDATE, _varlen_plan.VARLEN)
    return tuple(sorted({k.template for k in kernels}))


@dataclasses.dataclass(frozen=True)
class CacheContents:
    files: int  # compiled programs (.cubin) of every CuPy user
    bytes: int
    ours: int  # those holding a cupyconv kernel


def cache_contents(directory: Path | None) -> CacheContents | None:
    """What CuPy's kernel cache holds; None where it does not exist (yet). A cached program is
    cupyconv's when a kernel template name of cupyconv occurs in it (its symbol table holds the
    mangled name)."""
    if directory is None or not directory.is_dir():
        return None
    templates = [t.encode() for t in kernel_templates()]
    files = size = ours = 0
    for path in directory.glob("*.cubin"):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        files += 1
        size += len(data)
        ours += any(t in data for t in templates)
    return CacheContents(files, size, ours)


def describe_cache(directory: Path | None) -> str:
    """One line on CuPy's kernel cache: where it is and what it holds."""
    if directory is None:
        return "in memory only (CUPY_CACHE_IN_MEMORY is set): nothing is kept between runs"
    contents = cache_contents(directory)
    if contents is None:
        return f"{directory} (CuPy's disk cache; does not exist yet: nothing compiled here)"
    return (
        f"{directory} (CuPy's disk cache): {contents.files} compiled programs, "
        f"{contents.bytes / 2**20:.1f} MiB; {contents.ours} of them hold cupyconv kernels"
    )


def describe_sources() -> str:
    """One line on cupyconv's kernel sources: where they are and how many files."""
    from cupyconv._compile import kernel_dir

    try:
        directory = kernel_dir()
    except FileNotFoundError as e:
        return f"not found ({e})"
    cu = len(list(directory.glob("*.cu")))
    headers = len(list(directory.glob("*.cuh")))
    return f"{directory} ({cu} .cu files, {headers} headers; compiled at run time with NVRTC)"


def report(gpu: Gpu | None, reason: str) -> None:
    """``info``: print the environment report (``gpu`` and ``reason`` from :func:`probe_gpu`)."""
    cuda = cuda_versions()
    print(f"cupyconv {cupyconv.__version__}")
    rows = [("Python", f"{platform.python_version()} ({platform.system()} {platform.machine()})")]
    if gpu is not None:
        more = f", {gpu.count} devices" if gpu.count > 1 else ""
        rows.append(
            ("GPU", f"{gpu.name} (compute capability {gpu.capability}, "
                    f"{gpu.memory_gib:.0f} GiB{more})")
        )  # fmt: skip
    else:
        rows.append(("GPU", f"none: {reason}"))
    rows += [
        ("CUDA driver", cuda["driver"]),
        ("CUDA runtime", cuda["runtime"]),
        ("NVRTC", cuda["nvrtc"]),
        ("NVRTC offline", cuda["nvrtc offline"]),
    ]
    for label, module, dists in PACKAGES:
        rows.append((label, package_version(module, dists) or "not installed"))
    rows.append(("kernel sources", describe_sources()))
    rows.append(("kernel cache", describe_cache(cupy_cache_dir())))
    width = max(len(label) for label, _ in rows)
    for label, text in rows:
        print(f"  {label:{width}s}  {text}")
