"""The comparison every test relies on fails when it should, and says where."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from cupyconv.testing import TOLERANCES, assert_close, to_numpy, tolerance


def test_within_tolerance_passes():
    want = np.linspace(-3, 3, 50)
    rtol, atol = TOLERANCES["bfloat16"]
    got = (want + 0.9 * (atol + rtol * np.abs(want))).astype(np.float32)
    assert_close(got, want, "bfloat16")


def test_error_beyond_tolerance_names_the_first_bad_index():
    want = np.zeros((2, 3, 4))
    got = want.copy().astype(np.float32)
    got[1, 2, 3] = 0.01  # float32 atol is 1e-3
    with pytest.raises(
        AssertionError, match=r"out: 1 of 24 elements off.*first bad index \(1, 2, 3\)"
    ):
        assert_close(got, want)


def test_nan_never_passes():
    got = np.array([1.0, np.nan], np.float32)
    with pytest.raises(AssertionError, match="1 of 2 elements off"):
        assert_close(got, np.array([1.0, 2.0]), name="dx")


def test_shape_mismatch_fails():
    with pytest.raises(AssertionError, match=r"final_states: shape \(2,\) != expected \(3,\)"):
        assert_close(np.zeros(2, np.float32), np.zeros(3), name="final_states")


def test_overrides_and_dtype_names():
    assert tolerance("torch.bfloat16") == TOLERANCES["bfloat16"]
    assert tolerance(np.dtype(ml_dtypes.bfloat16)) == TOLERANCES["bfloat16"]
    with pytest.raises(ValueError, match="dtype must be one of"):
        tolerance("int32")
    assert_close(np.float32([1.5]), np.array([1.0]), rtol=0, atol=0.6)
    with pytest.raises(AssertionError):
        assert_close(np.float32([1.5]), np.array([1.0]), rtol=0, atol=0.4)


def test_to_numpy_widens_bfloat16():
    a = np.array([1.5, -2.25], ml_dtypes.bfloat16)
    out = to_numpy(a)
    assert out.dtype == np.float64 and out.tolist() == [1.5, -2.25]
