"""Markers and device probes shared by the test files.

``gpu`` tests are collected everywhere (so every run shows the size of the GPU plan) and skip
with a reason where CuPy or a CUDA device is missing. ``slow`` marks the full grids.
"""

from __future__ import annotations

import functools
import os

import pytest

# JAX takes 75 % of the GPU's memory at its first use unless told otherwise, which would leave
# CuPy and torch in the same process, and parallel workers (pytest -n), short of memory.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


@functools.cache
def gpu_unavailable_reason() -> str | None:
    try:
        import cupy
    except ImportError as e:
        return f"CuPy is not installed ({e})"
    try:
        if cupy.cuda.runtime.getDeviceCount() == 0:
            return "no CUDA GPU is present"
    except cupy.cuda.runtime.CUDARuntimeError as e:
        # Without a GPU the CUDA runtime finds no driver (cudaErrorInsufficientDriver or
        # cudaErrorNoDevice): there is no GPU to test on.
        return f"no CUDA GPU is present (the CUDA runtime says: {e})"
    return None


def pytest_collection_modifyitems(config, items):
    reason = gpu_unavailable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"GPU test: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
