"""Stand-ins shared by the tests that run without a GPU."""

from __future__ import annotations

import numpy as np


class FakeCudaArray:
    """Metadata of a CUDA array (its data is never touched): ``__cuda_array_interface__`` and
    ``__dlpack_device__`` only. Each one gets its own 4 GiB-aligned address range, plus
    ``offset`` elements."""

    _next_ptr = 0x7F0000000000

    def __init__(self, shape, strides=None, dtype=np.float32, offset=0, device=0):
        dtype = np.dtype(dtype)
        if strides is None:
            strides = [1] * len(shape)
            for d in range(len(shape) - 2, -1, -1):
                strides[d] = strides[d + 1] * max(shape[d + 1], 1)
        FakeCudaArray._next_ptr += 1 << 32
        self.device = device
        self.__cuda_array_interface__ = {
            "shape": tuple(shape),
            "typestr": dtype.str,
            "data": (FakeCudaArray._next_ptr + offset * dtype.itemsize, False),
            "strides": tuple(s * dtype.itemsize for s in strides),
            "version": 3,
        }

    def __dlpack_device__(self):
        return (2, self.device)  # (kDLCUDA, device id)

    def __dlpack__(self, *args, **kwargs):
        raise AssertionError("cupyconv read the data of a fake CUDA array")

    def __array__(self, *args, **kwargs):
        raise AssertionError("cupyconv copied a fake CUDA array to the host")
