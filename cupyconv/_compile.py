"""Kernel sources and their compilation.

The ``.cu`` files are read once. A quoted ``#include "x.cuh"`` of a file beside them is inlined,
so the source text (and so CuPy's disk-cache key) changes whenever any header changes.

On a GPU, :func:`get_kernel` builds a ``cupy.RawModule`` with exactly the template instance asked
for and memoises the loaded function per device; two threads asking for the same kernel at once
compile it once. Without a GPU, :func:`compile_offline` runs NVRTC from the ``cuda-bindings`` and
``nvidia-cuda-nvrtc`` wheels to check that instances compile for a given architecture.
"""

from __future__ import annotations

import functools
import re
import threading
from pathlib import Path

OPTIONS = ("-std=c++17",)
_INCLUDE = re.compile(r'^#include "([\w.]+)"\s*$', re.MULTILINE)


def kernel_dir() -> Path:
    """The folder with the ``.cu`` sources: ``cupyconv/kernels`` in a wheel, ``kernels/`` in a
    source checkout."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "kernels", here.parent / "kernels"):
        if (candidate / "common.cuh").is_file():
            return candidate
    raise FileNotFoundError(f"cupyconv kernel sources not found beside {here}")


@functools.cache
def source(name: str) -> str:
    """The text of ``kernels/<name>`` with its local includes inlined (each at most once)."""
    seen: set[str] = set()

    def expand(file: str) -> str:
        if file in seen:
            return ""
        seen.add(file)
        text = (kernel_dir() / file).read_text()
        return _INCLUDE.sub(lambda m: expand(m.group(1)), text)

    return expand(name)


_lock = threading.Lock()
_kernels: dict[tuple[int, str, str], tuple] = {}


def _load(file: str, name: str, device: int) -> tuple:
    """(cupy.cuda.Function, cupy.RawKernel) of template instance ``name`` of ``kernels/<file>``
    on ``device``: compiled on first use, then memoised."""
    key = (device, file, name)
    loaded = _kernels.get(key)
    if loaded is None:
        with _lock:
            loaded = _kernels.get(key)
            if loaded is None:
                import cupy

                with cupy.cuda.Device(device):
                    module = cupy.RawModule(
                        code=source(file), options=OPTIONS, name_expressions=(name,)
                    )
                    raw = module.get_function(name)
                    loaded = _kernels[key] = (raw.kernel, raw)
    return loaded


def get_kernel(file: str, name: str, device: int):
    """The loaded ``cupy.cuda.Function`` for template instance ``name`` of ``kernels/<file>`` on
    ``device`` (compiled on first use, then memoised)."""
    return _load(file, name, device)[0]


def get_raw_kernel(file: str, name: str, device: int):
    """The same instance as a ``cupy.RawKernel``, for its attributes (registers, shared memory)."""
    return _load(file, name, device)[1]


def compile_offline(file: str, names, arch: str) -> bytes:
    """Compile instances ``names`` of ``kernels/<file>`` with NVRTC for ``arch`` (``sm_90`` gives
    a cubin, ``compute_90`` PTX) without a GPU; return the image. Raises RuntimeError with the
    compiler log on failure."""
    from cuda.bindings import nvrtc
    from cuda.pathfinder import find_nvidia_header_directory

    def check(result):
        err, *rest = result
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"NVRTC call failed: {err}")
        return rest[0] if len(rest) == 1 else rest

    include = find_nvidia_header_directory("cudart")
    prog = check(nvrtc.nvrtcCreateProgram(source(file).encode(), file.encode(), 0, [], []))
    try:
        for name in names:
            check(nvrtc.nvrtcAddNameExpression(prog, name.encode()))
        opts = [*OPTIONS, f"-arch={arch}", f"--include-path={include}", "-ftz=true"]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            size = check(nvrtc.nvrtcGetProgramLogSize(prog))
            log = b" " * size
            check(nvrtc.nvrtcGetProgramLog(prog, log))
            raise RuntimeError(
                f"{file} failed to compile for {arch}:\n{log.decode(errors='replace')}"
            )
        if arch.startswith("sm_"):
            size = check(nvrtc.nvrtcGetCUBINSize(prog))
            image = b" " * size
            check(nvrtc.nvrtcGetCUBIN(prog, image))
        else:
            size = check(nvrtc.nvrtcGetPTXSize(prog))
            image = b" " * size
            check(nvrtc.nvrtcGetPTX(prog, image))
            image = image.rstrip(b"\0")
        return image
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
