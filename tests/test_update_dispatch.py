"""Which kernel a decode update launches for each layout (cupyconv/_update_plan.py).

Runs without a GPU: the arrays are stand-ins exposing only ``__cuda_array_interface__`` and
``__dlpack_device__``; the plan is read, nothing is launched. The GPU suite checks every one of
these paths against the reference (tests/test_update_gpu.py).
"""

from __future__ import annotations

import pytest
from fakes import FakeCudaArray

from cupyconv._arrays import describe
from cupyconv._update_plan import CONSTANTS, PLAN_FIELDS, is_lean
from cupyconv.update import _UpdateCall

H = "__half"


def plan(
    batch=19, dim=136, width=4, state_len=None, dtype="float16", wdtype=None, tokens=None,
    circular=False, pool=5, index_dtype="int32", state_strides=None, x_strides=None,
):  # fmt: skip
    """The Launch of an update with these arrays (a pool of batch + pool rows when pool)."""
    state_len = width - 1 if state_len is None else state_len
    shape = (batch, dim) if tokens is None else (batch, dim, tokens)
    x = FakeCudaArray(shape, x_strides, dtype)
    n = batch + pool if pool else batch
    state = FakeCudaArray((n, dim, state_len), state_strides, dtype)
    weight = FakeCudaArray((dim, width), None, wdtype or dtype)
    bias = FakeCudaArray((dim,), None, wdtype or dtype)
    idx = FakeCudaArray((batch,), None, index_dtype) if pool else None
    lens = FakeCudaArray((batch,), None, index_dtype) if circular else None
    return _UpdateCall(x, state, weight, bias, "silu", lens, idx).plan()


@pytest.mark.parametrize("circular", (False, True))
@pytest.mark.parametrize("tokens", (None, 1))
def test_decode_step_takes_the_lean_kernel(circular, tokens):
    """One token, channels contiguous, a dense state of width - 1 entries, one dtype, int32
    indices: conv_update_lean, four rows a thread from 16 rows on, two below and for widths
    5 to 8; a block per channel tile and group of rows, the tiles' fast divisor passed."""
    launch = plan(circular=circular, tokens=tokens)
    assert launch.name == f"conv_update_lean<{H}, 4, 4>"
    tiles = -(-136 // CONSTANTS["UPDATE_THREADS"])
    assert launch.grid == tiles * -(-19 // 4)
    fields = dict(zip(PLAN_FIELDS, launch.plan_fields, strict=True))
    assert fields["channel_tiles"] == tiles
    assert plan(batch=5, circular=circular).name == f"conv_update_lean<{H}, 4, 2>"
    assert plan(width=8, circular=circular).name == f"conv_update_lean<{H}, 8, 2>"
    assert plan(width=2, pool=0, circular=circular).name == f"conv_update_lean<{H}, 2, 4>"


def test_the_plan_reads_no_address():
    """Arrays at odd element offsets get the very launch of aligned ones: the update's lean key
    holds no address bits (cupyconv/update.py, _torch_signature)."""

    def launch(offset, lean):
        x = FakeCudaArray((19, 136), None, "float16", offset=offset)
        state = FakeCudaArray((19, 136, 3 if lean else 5), None, "float16", offset=offset)
        weight = FakeCudaArray((136, 4), None, "float16", offset=offset)
        bias = FakeCudaArray((136,), None, "float16", offset=offset)
        return _UpdateCall(x, state, weight, bias, "silu", None, None).plan()

    for lean in (True, False):
        assert launch(1, lean) == launch(0, lean)
    assert launch(1, True).name.startswith("conv_update_lean")


def test_longer_circular_rows_stay_lean():
    assert plan(state_len=9, circular=True).name == f"conv_update_lean<{H}, 4, 4>"


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"width": 1}, f"conv_update<{H}, 1>"),  # no state row to keep
        ({"width": 9}, f"conv_update<{H}, 9>"),  # wider than the lean kernel's widths
        ({"state_len": 5}, f"conv_update<{H}, 0>"),  # a longer sliding row: the general one
        ({"dtype": "float64"}, "conv_update<double, 4>"),
        ({"wdtype": "float32"}, f"conv_update<{H}, 4>"),  # taps of another dtype
        ({"index_dtype": "int64"}, f"conv_update<{H}, 4>"),
        ({"tokens": 2}, f"conv_update<{H}, 4>"),  # more than one token
        ({"state_strides": (3 * 136, 1, 136)}, f"conv_update<{H}, 4>"),  # [N, S, C] memory
        ({"x_strides": (1, 19)}, f"conv_update<{H}, 4>"),  # x channels not contiguous
    ],
)
def test_other_layouts_take_the_general_kernel(kwargs, name):
    assert plan(**kwargs).name == name


def test_offsets_past_32_bits_are_not_lean():
    """The lean kernel's offsets are 32-bit: a state (or x) reaching 2^31 elements is not."""

    def arrays(state_batch_stride):
        state = FakeCudaArray((2, 136, 3), (state_batch_stride, 3, 1), "float16")
        x, w = FakeCudaArray((2, 136), None, "float16"), FakeCudaArray((136, 4), None, "float16")
        return [describe(a, n) for a, n in ((x, "x"), (w, "weight"), (state, "conv_state"))]

    x, w, state = arrays(2**31 - 408)  # the last entry at 2^31 - 1
    assert is_lean(x, w, None, state, None, None, False)
    x, w, state = arrays(2**31 - 407)
    assert not is_lean(x, w, None, state, None, None, False)
