"""cupyconv's kernels run on the CPU: the tests' stand-in for a GPU.

``emulated_gpu`` (a context manager) makes cupyconv treat host memory as device memory: arrays
wrapped in :class:`HostArray` take the GPU path (validation, the plan, the packed parameters),
and each launch runs the planned kernel instance, compiled from its ``.cu`` source with the
host C++ compiler against ``tests/emulator/cuda_emu.h`` (threads as fibers, warp-wide
operations and ``mma.sync`` computed from all their lanes). The device is an H200 (sm_90) or an
A100 (sm_80). Every array it allocates, and every :class:`HostArray` made by :func:`host`, sits
between guard bytes that must be untouched after the call (:func:`check_guards`), and a
``cp.async`` that reads bytes outside every live HostArray's elements fails the launch.

Slow (a block's threads run one at a time): for small shapes only.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
import weakref
from pathlib import Path

import numpy as np

from cupyconv import (
    _arrays,
    _backward_plan,
    _compile,
    _forward_plan,
    _update_plan,
    _validate,
    _varlen_plan,
    backward,
    forward,
    update,
    varlen,
)

HERE = Path(__file__).resolve().parent / "emulator"
_DEFAULT_CACHE = Path(tempfile.gettempdir()) / "cupyconv-emulator"
CACHE = Path(os.environ.get("CUPYCONV_EMULATOR_CACHE", _DEFAULT_CACHE))
CXX = os.environ.get("CXX", "g++")
#: Opt-in dynamic shared memory a block on the emulated devices (sm_90, sm_80).
SMEM_LIMITS = {900: 232448, 800: 166912}
GUARD = 4096  # bytes of 0xff before and after every array's elements
_DYNAMIC = re.compile(r"extern __shared__ (?:__align__\(\d+\) )?unsigned char (\w+)\[\];")


@functools.cache
def compiler_available() -> bool:
    """Whether the host C++ compiler builds what the emulator needs (C++17, _Float16)."""
    if shutil.which(CXX) is None:
        return False
    probe = "_Float16 half(float f) { return (_Float16)f; }\n"
    run = subprocess.run(
        [CXX, "-std=c++17", "-fsyntax-only", "-x", "c++", "-"], input=probe, capture_output=True,
        text=True,
    )  # fmt: skip
    return run.returncode == 0


def emulated_text(source: _compile.Source) -> str:
    """``source``'s program text with the emulator's headers in place of kernels/ptx.cuh."""
    seen: set[str] = set()

    def expand(file: str) -> str:
        if file in seen:
            return ""
        seen.add(file)
        path = HERE / file if (HERE / file).is_file() else _compile.kernel_dir() / file
        return _compile._INCLUDE.sub(lambda m: expand(m.group(1)), path.read_text())

    return source.prelude + expand(source.file)


_libraries: dict[tuple, ctypes.CDLL] = {}
_lock = threading.Lock()


def library(source: _compile.Source, name: str, arch: int) -> ctypes.CDLL:
    """Kernel instance ``name`` of ``source`` built for the CPU (cached on disk by its text and
    the emulator's headers)."""
    return text_library(emulated_text(source), name, arch)


def text_library(program: str, name: str, arch: int) -> ctypes.CDLL:
    """Kernel instance ``name`` of the program text ``program`` (the emulator's headers on its
    include path, its dynamic shared memory the emulator's arena) built for the CPU, cached on
    disk by its text and the emulator's headers."""
    key = (program, name, arch)
    with _lock:
        lib = _libraries.get(key)
        if lib is None:
            text = _DYNAMIC.sub(r"unsigned char* \1 = cpc_dynamic_shared();", program)
            text += _entry(name)
            flags = ["-std=c++17", "-O1", "-shared", "-fPIC", f"-DCPC_ARCH={arch}", "-w"]
            key_text = text + " ".join(flags) + CXX + _headers()
            digest = hashlib.sha256(key_text.encode()).hexdigest()[:24]
            so = CACHE / f"{digest}.so"
            if not so.exists():
                CACHE.mkdir(parents=True, exist_ok=True)
                with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
                    cpp, out = Path(tmp) / "kernel.cpp", Path(tmp) / "kernel.so"
                    cpp.write_text(text)
                    run = subprocess.run(
                        [CXX, *flags, f"-I{HERE}", str(cpp), "-o", str(out)],
                        capture_output=True, text=True,
                    )  # fmt: skip
                    if run.returncode:
                        log = run.stderr[-4000:]
                        raise RuntimeError(f"{name} did not build for the CPU:\n{log}")
                    os.replace(out, so)
            lib = _libraries[key] = ctypes.CDLL(str(so))
            lib.cpc_run.restype = ctypes.c_int
    return lib


@functools.cache
def _headers() -> str:
    """The emulator's headers, part of each built library's cache key."""
    return "".join(p.read_text() for p in sorted(HERE.iterdir()) if p.is_file())


def _entry(name: str) -> str:
    return f"""
extern "C" int cpc_run(const long long* words, int n, unsigned grid, unsigned bx, unsigned by,
                       unsigned smem, char* err, int len) {{
    try {{
        cpc::launch(&{name}, words, n, grid, bx, by, smem);
    }} catch (const std::exception& e) {{
        std::snprintf(err, len, "%s", e.what());
        return 1;
    }}
    return 0;
}}
extern "C" void cpc_set_arrays(const unsigned long long* ranges, int n) {{
    cpc::arrays.clear();
    for (int i = 0; i < n; ++i) cpc::arrays.emplace_back(ranges[2 * i], ranges[2 * i + 1]);
}}
"""


class EmulationError(RuntimeError):
    """A kernel did something the hardware would not allow (or would make undefined)."""


def run_launch(plan, params, arch: int) -> None:
    """Runs one planned launch (cupyconv._launch.Launch) with its ParamBlock."""
    lib = library(plan.source, plan.name, arch)
    words = np.array(params.values, dtype=np.int64)
    _run(lib, words, plan.name, plan.grid, plan.block, plan.smem)


def run_kernel(program: str, name: str, args, grid: int, block, smem: int, arch: int = 900):
    """Runs kernel instance ``name`` of the program text ``program`` (``text_library``) with
    ``args`` in the order of its parameters: HostArrays (passed as their elements' address) and
    numpy scalars (their bytes)."""
    parts = [
        np.uint64(a.data.ctypes.data) if isinstance(a, HostArray) else np.asarray(a) for a in args
    ]
    raw = b"".join(p.tobytes() for p in parts)
    words = np.frombuffer(raw + bytes(-len(raw) % 8), dtype=np.int64)
    _run(text_library(program, name, arch), words, name, grid, block, smem)


def _run(lib, words: np.ndarray, name: str, grid: int, block, smem: int) -> None:
    ranges = np.array([a.span() for a in list(_live) if a.data.size], dtype=np.uint64)
    lib.cpc_set_arrays(ctypes.c_void_p(ranges.ctypes.data), len(ranges))
    words = np.ascontiguousarray(words)
    err = ctypes.create_string_buffer(2048)
    bx, by = block
    status = lib.cpc_run(
        ctypes.c_void_p(words.ctypes.data), len(words), grid, bx, by, smem, err, len(err)
    )  # fmt: skip
    if status:
        raise EmulationError(f"{name} (grid {grid}, block {block}): {err.value.decode()}")


# ---- arrays -----------------------------------------------------------------------------------


#: The HostArrays alive: a launch may read any of them, and a cp.async nothing else.
_live: weakref.WeakSet = weakref.WeakSet()


class HostArray:
    """Host memory presented as a CUDA array (``__cuda_array_interface__`` with the host address,
    device 0): ``data`` is the numpy view into ``raw``, whose other bytes are guards."""

    def __init__(self, raw: np.ndarray, data: np.ndarray):
        self.raw, self.data = raw, data
        _live.add(self)
        self.__cuda_array_interface__ = {
            "shape": data.shape,
            "typestr": data.dtype.str,
            "data": (data.ctypes.data, False),
            "strides": data.strides,
            "version": 3,
        }

    def __dlpack_device__(self):
        return (2, 0)

    def span(self) -> tuple[int, int]:
        """The address range [begin, end) of the array's elements (strides are non-negative)."""
        begin = self.data.ctypes.data
        last = sum((n - 1) * s for n, s in zip(self.data.shape, self.data.strides))
        return begin, begin + last + self.data.itemsize

    def outside(self) -> np.ndarray:
        """The bytes of ``raw`` that are not the array's elements."""
        itemsize = self.data.itemsize
        at = np.zeros((), np.int64) + (self.data.ctypes.data - self.raw.ctypes.data)
        for n, s in zip(self.data.shape, self.data.strides):
            at = at[..., None] + s * np.arange(n)
        at = (at.reshape(-1)[:, None] + np.arange(itemsize)).reshape(-1)
        keep = np.ones(self.raw.size, bool)
        keep[at] = False
        return self.raw[keep]


def alloc(shape, strides, dtype, offset=0) -> HostArray:
    """An array of ``shape`` and non-negative element ``strides``, ``offset`` elements into its
    buffer, 64-byte aligned as device memory is, between guard bytes; every byte 0xff (NaN in
    every float dtype)."""
    dtype = np.dtype(dtype)
    span = offset + 1 + sum((n - 1) * s for n, s in zip(shape, strides) if n)
    raw = np.full(2 * GUARD + span * dtype.itemsize + 64, 0xFF, np.uint8)
    start = GUARD + (-(raw.ctypes.data + GUARD)) % 64 + offset * dtype.itemsize
    first = raw[start : start + dtype.itemsize].view(dtype)
    data = np.lib.stride_tricks.as_strided(first, shape, tuple(s * dtype.itemsize for s in strides))
    return HostArray(raw, data)


def host(values: np.ndarray, dtype, strides=None, offset=0) -> HostArray:
    """``values`` as ``dtype`` in an array of element ``strides`` (default dense), ``offset``
    elements into its buffer (the bytes it skips hold NaN)."""
    if strides is None:
        strides = _arrays.dense_strides(values.shape, tuple(range(values.ndim)))
    arr = alloc(values.shape, strides, dtype, offset)
    arr.data[...] = values.astype(dtype)
    return arr


def check_guards(*arrays) -> None:
    """AssertionError where a write reached bytes of a HostArray's buffer outside its elements."""
    for a in arrays:
        if a is not None and (a.outside() != 0xFF).any():
            raise AssertionError("a kernel wrote outside an array's elements")


# ---- the emulated device ------------------------------------------------------------------------


@contextlib.contextmanager
def emulated_gpu(arch: int = 900, resident: int = 2):
    """Within it, HostArray arguments take cupyconv's GPU path and launches run on the CPU, on a
    device of compute capability ``arch`` / 100 that holds ``resident`` blocks of any kernel at
    once (a small GPU: persistent grids give each block several items). Yields the allocations
    made (HostArrays) and the launches run."""
    smem_limit = SMEM_LIMITS[arch]
    record = {"allocations": [], "launches": []}

    def fake_empty(like, shape, strides, dtype):
        arr = alloc(shape, strides, dtype)
        record["allocations"].append(arr)
        return describe(arr, "out")

    def describe(obj, name):
        if not isinstance(obj, HostArray):
            return real_describe(obj, name)
        d = obj.data  # (the CUDA array interface has no name for bfloat16)
        strides = tuple(s // d.itemsize for s in d.strides)
        return _arrays.Array(obj, "cuda", 0, d.ctypes.data, d.shape, strides, d.dtype)

    real_describe = _validate.describe

    def fake_launch(plan, device, params, stream):
        record["launches"].append(plan.name)
        run_launch(plan, params, arch)

    def fit(device, smem, blocks):
        return blocks * (smem + 1024) <= smem_limit + 1024

    patches = [(_validate, "describe", describe), (_arrays, "describe", describe)]
    for module in (forward, backward, update, varlen):
        patches += [(module, "empty", fake_empty), (module, "launch", fake_launch)]
        patches += [(module, "stream_of", lambda a: None)]
        patches += [(module, "result", lambda like, arr: arr.obj)]
    for plan in (_forward_plan, _backward_plan, _update_plan, _varlen_plan):
        for attr, value in (
            ("resident_blocks", lambda device, source, name, threads, smem: resident),
            ("shared_memory_limit", lambda device: smem_limit),
            ("multiprocessors", lambda device: 132),
            ("blocks_fit", fit),
            ("_plans", {}),
        ):
            if hasattr(plan, attr):
                patches.append((plan, attr, value))
    saved = [(m, a, getattr(m, a)) for m, a, _ in patches]
    try:
        for m, a, value in patches:
            setattr(m, a, value)
        yield record
    finally:
        for m, a, value in saved:
            setattr(m, a, value)
