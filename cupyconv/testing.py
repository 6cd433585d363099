"""Tolerances against the float64 reference, and the comparison every test and benchmark uses.

One per-dtype table (``docs/semantics.md``, "Tolerances"): outputs, ``dx`` and states use
``TOLERANCES[dtype]``; ``dweight``/``dbias`` use ``GRAD_TOLERANCE`` with the atol scaled by the
reduction size.
"""

from __future__ import annotations

import numpy as np

from ._arrays import dtype_name

__all__ = ["TOLERANCES", "GRAD_TOLERANCE", "tolerance", "to_numpy", "assert_close"]

#: (rtol, atol) per dtype name, for outputs, dx and states.
TOLERANCES = {
    "float32": (3e-4, 1e-3),
    "float16": (3e-3, 5e-3),
    "bfloat16": (1e-2, 5e-2),
    "float64": (1e-10, 1e-12),
}

#: (rtol, atol) for dweight and dbias; the atol is multiplied by sqrt(terms in the reduction).
GRAD_TOLERANCE = (1e-3, 1e-3)


def tolerance(dtype) -> tuple[float, float]:
    """(rtol, atol) for results of ``dtype`` (numpy, ml_dtypes, torch or JAX dtype, or its name)."""
    name = dtype_name(dtype)
    if name not in TOLERANCES:
        raise ValueError(f"dtype must be one of {sorted(TOLERANCES)}; got {name}")
    return TOLERANCES[name]


def to_numpy(a) -> np.ndarray:
    """A float64 numpy copy of any array cupyconv accepts (numpy, CuPy, torch, JAX; CPU or GPU)."""
    if isinstance(a, np.ndarray):
        return a.astype(np.float64)
    module = type(a).__module__.split(".", 1)[0]
    if module == "torch":
        return a.detach().to("cpu").double().numpy()
    if module == "cupy":
        return a.astype("float64").get()
    return np.asarray(a).astype(np.float64)  # JAX and other array-likes


def assert_close(actual, expected, dtype=None, *, rtol=None, atol=None, name="out") -> None:
    """Raise AssertionError unless ``|actual - expected| <= atol + rtol * |expected|`` everywhere.

    ``dtype`` picks the tolerances from the table (default: the dtype of ``actual``);
    ``rtol``/``atol`` override them. NaN anywhere in ``actual`` fails. The message carries the
    max abs error, its ratio to the allowed error, and the first bad index.
    """
    if dtype is None:
        dtype = actual.dtype
    table_rtol, table_atol = tolerance(dtype)
    rtol = table_rtol if rtol is None else rtol
    atol = table_atol if atol is None else atol
    got = to_numpy(actual)
    want = np.asarray(expected, dtype=np.float64)
    if got.shape != want.shape:
        raise AssertionError(f"{name}: shape {got.shape} != expected {want.shape}")
    if got.size == 0:
        return
    err = np.abs(got - want)
    allowed = atol + rtol * np.abs(want)
    bad = ~(err <= allowed)  # NaN in either side counts as bad
    if bad.any():
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        ratio = np.nanmax(err / allowed) if np.isfinite(err).any() else np.inf
        raise AssertionError(
            f"{name}: {int(bad.sum())} of {bad.size} elements off (dtype {dtype_name(dtype)}, "
            f"rtol {rtol:g}, atol {atol:g}); max abs error {np.nanmax(err):.3e}, "
            f"{ratio:.2f}x the allowed error; first bad index {first}: "
            f"got {got[first]!r}, expected {want[first]!r}"
        )
