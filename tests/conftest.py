"""Markers and device probes shared by the test files.

``gpu`` tests are collected everywhere (so every run shows the size of the GPU plan) and skip
with a reason where CuPy or a CUDA device is missing. ``slow`` marks the full grids.
"""

from __future__ import annotations

import functools

import pytest


@functools.cache
def gpu_unavailable_reason() -> str | None:
    try:
        import cupy
    except ImportError as e:
        return f"CuPy is not installed ({e})"
    try:
        if cupy.cuda.runtime.getDeviceCount() == 0:
            return "no CUDA device"
    except Exception as e:  # noqa: BLE001 - any CUDA runtime failure means no usable GPU
        return f"no usable CUDA device ({type(e).__name__}: {e})"
    return None


def pytest_collection_modifyitems(config, items):
    reason = gpu_unavailable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"GPU test: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
