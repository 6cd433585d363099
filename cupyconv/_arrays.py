"""Array interop: one description of every array cupyconv accepts, and results in the caller's
framework.

``describe`` reads an array's metadata without touching its data:
- torch tensors (CPU or CUDA): ``data_ptr()``, ``stride()``, ``shape``, ``dtype`` directly (no
  DLPack round trip); kernels run on ``torch.cuda.current_stream()``; results are allocated with
  ``torch.empty_strided`` (CUDA-graph capture and torch's memory accounting work).
- CuPy arrays: run on CuPy's current stream; results are CuPy arrays.
- JAX arrays on a GPU: imported zero-copy with DLPack on CuPy's current stream (which makes JAX's
  pending work visible there); results are exported back to JAX with DLPack.
- numpy arrays and CPU torch/JAX arrays: the CPU path (the float64 reference).
- any other ``__cuda_array_interface__`` or ``__dlpack__`` producer: read as a CUDA array;
  results are CuPy arrays.
torch, JAX and CuPy are only imported when one of their arrays arrives.
"""

from __future__ import annotations

import sys

import numpy as np

CPU = -1  # the device of a CPU array

CACHE_ENTRIES = 4096  # most entries of one memo dict; a full one starts over


def remember(cache: dict, key, value):
    """``cache[key] = value`` for a bounded memo dict (emptied first when full); returns value."""
    if len(cache) >= CACHE_ENTRIES:
        cache.clear()
    cache[key] = value
    return value


def _bfloat16():
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


_dtype_names: dict = {}


def dtype_name(dtype) -> str:
    """'bfloat16', 'float32', ... for a numpy, ml_dtypes, torch or JAX dtype (also for dtypes
    numpy cannot name); memoised."""
    name = _dtype_names.get(dtype)
    if name is None:
        name = _dtype_names[dtype] = str(dtype).rsplit(".", 1)[-1]
    return name


class Array:
    """What cupyconv needs to know of an array: where it lives and how it is laid out.

    ``strides`` are in elements; ``dtype`` is a numpy dtype (``ml_dtypes.bfloat16`` for
    bfloat16) or, for dtypes numpy cannot name, the framework's own dtype object. ``native`` is
    the array to launch on (the caller's, or a zero-copy CuPy view of it); ``obj`` the caller's.
    """

    __slots__ = (
        "obj",
        "kind",
        "device",
        "ptr",
        "shape",
        "strides",
        "dtype",
        "dtype_name",
        "native",
        "odd_strides",
    )

    def __init__(self, obj, kind, device, ptr, shape, strides, dtype, native=None):
        self.obj = obj
        self.kind = kind
        self.device = device
        self.ptr = ptr
        self.shape = shape
        self.strides = strides
        self.dtype = dtype
        self.dtype_name = dtype_name(dtype)
        self.native = obj if native is None else native
        self.odd_strides = None  # byte strides, where they are not whole elements

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def on_gpu(self) -> bool:
        return self.device != CPU

    @property
    def device_name(self) -> str:
        return "cpu" if self.device == CPU else f"cuda:{self.device}"

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize if isinstance(self.dtype, np.dtype) else 1

    @property
    def byte_strides(self) -> tuple[int, ...]:
        """Strides in bytes (exact also where a numpy view's strides are not whole elements)."""
        if self.odd_strides is not None:
            return self.odd_strides
        itemsize = self.itemsize
        return tuple(s * itemsize for s in self.strides)


# ---- torch -----------------------------------------------------------------------------------

_torch_dtypes: dict = {}


def _torch_to_numpy_dtype(torch, dtype):
    if not _torch_dtypes:
        _torch_dtypes.update(
            {
                torch.float32: np.dtype(np.float32),
                torch.float16: np.dtype(np.float16),
                torch.bfloat16: _bfloat16(),
                torch.float64: np.dtype(np.float64),
                torch.int32: np.dtype(np.int32),
                torch.int64: np.dtype(np.int64),
            }
        )
    return _torch_dtypes.get(dtype, dtype)


def _describe_torch(torch, t, name):
    if t.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor; got layout {t.layout}")
    if t.is_cuda:
        index = t.get_device()
        if t.is_neg():
            raise ValueError(
                f"{name} has torch's negative bit set (a lazily negated view, such as the "
                "imaginary part of a conjugate); the kernels read its memory as it is: pass "
                f"{name}.resolve_neg()"
            )
    elif t.is_cpu:
        index = CPU
    else:
        raise ValueError(f"{name} must be on a CUDA device or the CPU; got device {t.device}")
    return Array(
        t,
        "torch",
        index,
        t.data_ptr(),
        tuple(t.shape),
        tuple(t.stride()),
        _torch_to_numpy_dtype(torch, t.dtype),
    )


# ---- CuPy, JAX, numpy and other producers ----------------------------------------------------


def _describe_cupy(a, obj, kind, native=None, name="out"):
    itemsize = a.dtype.itemsize
    _whole_elements(a.strides, itemsize, name)
    return Array(
        obj,
        kind,
        a.device.id,
        a.data.ptr,
        tuple(a.shape),
        tuple(s // itemsize for s in a.strides),
        a.dtype,
        native=a if native is None else native,
    )


def _describe_numpy(a, obj, kind):
    itemsize = a.dtype.itemsize
    arr = Array(
        obj,
        kind,
        CPU,
        a.ctypes.data,
        tuple(a.shape),
        tuple(s // itemsize for s in a.strides),
        a.dtype,
        native=a,
    )
    if any(s % itemsize for s in a.strides):  # numpy computes with these; record the bytes
        arr.odd_strides = tuple(a.strides)
    return arr


def _describe_jax(jax, a, name):
    if isinstance(a, jax.core.Tracer):
        raise TypeError(
            f"{name} is a traced JAX value (inside jax.jit or a transformation); "
            "call cupyconv on concrete JAX arrays"
        )
    devices = a.devices()
    if len(devices) != 1:
        raise ValueError(
            f"{name} must live on one device; got a JAX array sharded over {len(devices)}"
        )
    (device,) = devices
    if device.platform == "cpu":
        host = np.asarray(a)  # zero-copy view of a CPU JAX array
        return _describe_numpy(host, a, "jax")
    import cupy

    return _describe_cupy(cupy.from_dlpack(a), a, "jax", name=name)


def _whole_elements(byte_strides, itemsize: int, name: str) -> None:
    """GPU kernels index whole elements: refuse strides that are not."""
    if any(s % itemsize for s in byte_strides):
        raise ValueError(
            f"{name} must have strides that are whole elements on the GPU; got byte strides "
            f"{tuple(byte_strides)} for itemsize {itemsize}"
        )


def _describe_cuda_interface(obj, name):
    cai = obj.__cuda_array_interface__
    dtype = np.dtype(cai["typestr"])
    shape = tuple(cai["shape"])
    if cai.get("strides") is None:
        strides = tuple(int(np.prod(shape[i + 1 :], dtype=np.int64)) for i in range(len(shape)))
    else:
        _whole_elements(cai["strides"], dtype.itemsize, name)
        strides = tuple(s // dtype.itemsize for s in cai["strides"])
    if hasattr(obj, "__dlpack_device__"):
        device = int(obj.__dlpack_device__()[1])
    else:
        try:
            import cupy
        except ImportError:
            raise TypeError(
                f"{name} is a CUDA array (__cuda_array_interface__), which needs CuPy; CuPy is "
                "not installed (pip install cupyconv[cuda13] or cupyconv[cuda12])"
            ) from None
        device = cupy.cuda.runtime.pointerGetAttributes(cai["data"][0]).device
    return Array(obj, "cuda", device, cai["data"][0], shape, strides, dtype)


_KDLCPU, _KDLCUDA = 1, 2


def describe(obj, name: str) -> Array:
    """Describe ``obj`` (argument ``name`` of a public function). Raises TypeError for
    non-arrays."""
    if isinstance(obj, np.ndarray):
        return _describe_numpy(obj, obj, "numpy")
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        return _describe_torch(torch, obj, name)
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(obj, cupy.ndarray):
        return _describe_cupy(obj, obj, "cupy", name=name)
    jax = sys.modules.get("jax")
    if jax is not None and isinstance(obj, jax.Array):
        return _describe_jax(jax, obj, name)
    if hasattr(obj, "__cuda_array_interface__"):
        return _describe_cuda_interface(obj, name)
    if hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
        device_type = obj.__dlpack_device__()[0]
        if device_type == _KDLCPU:
            return _describe_numpy(np.from_dlpack(obj), obj, "numpy")
        if device_type == _KDLCUDA:
            import cupy

            return _describe_cupy(cupy.from_dlpack(obj), obj, "cuda", name=name)
    raise TypeError(
        f"{name} must be an array (torch, CuPy, JAX or numpy); got {type(obj).__name__}"
    )


def describe_optional(obj, name: str) -> Array | None:
    return None if obj is None else describe(obj, name)


# ---- results in the caller's framework -------------------------------------------------------


def dense_strides(shape, order) -> tuple[int, ...]:
    """Strides (elements) of a dense array of ``shape`` whose dims, outermost first, are
    ``order``."""
    strides = [0] * len(shape)
    step = 1
    for dim in reversed(order):
        strides[dim] = step
        step *= max(shape[dim], 1)
    return tuple(strides)


_like_strides: dict[tuple, tuple[int, ...]] = {}


def strides_like(arr: Array) -> tuple[int, ...]:
    """Dense strides for a new array of ``arr``'s shape in ``arr``'s stride order; memoised."""
    key = (arr.shape, arr.strides)
    strides = _like_strides.get(key)
    if strides is None:
        strides = remember(_like_strides, key, dense_strides(arr.shape, stride_order(arr)))
    return strides


def rows_aligned(a: Array, along: int, nbytes: int = 16) -> bool:
    """Whether ``a`` is contiguous along dim ``along`` (or has one element there) and every run
    along it starts on an ``nbytes`` boundary: the base pointer and the other dims' strides
    (where they have more than one element) are multiples of ``nbytes``."""
    if a.strides[along] != 1 and a.shape[along] != 1:
        return False
    if a.ptr % nbytes:
        return False
    itemsize = a.itemsize
    for d, (n, s) in enumerate(zip(a.shape, a.strides)):
        if d != along and n > 1 and (s * itemsize) % nbytes:
            return False
    return True


def stride_order(arr: Array) -> tuple[int, ...]:
    """Dims of ``arr`` outermost first, by decreasing stride (ties keep the logical order):
    torch's ``empty_like`` rule."""
    keyed = [(-abs(s) if n > 1 else 0, d) for d, (s, n) in enumerate(zip(arr.strides, arr.shape))]
    return tuple(d for _, d in sorted(keyed, key=lambda kd: (kd[0], kd[1])))


def empty(like: Array, shape, strides, dtype) -> Array:
    """A new uninitialised GPU array of the framework of ``like`` (CuPy for JAX and other
    producers), on ``like``'s device."""
    if like.kind == "torch":
        torch = sys.modules["torch"]
        t = torch.empty_strided(
            shape, strides, dtype=_numpy_to_torch_dtype(torch, dtype), device=like.obj.device
        )
        return _describe_torch(torch, t, "out")
    import cupy

    dtype = np.dtype(dtype)
    size = sum((n - 1) * s for n, s in zip(shape, strides)) + 1 if all(shape) else 0
    with cupy.cuda.Device(like.device):
        flat = cupy.empty(size, dtype)
    a = cupy.ndarray(shape, dtype, flat.data, tuple(s * dtype.itemsize for s in strides))
    return _describe_cupy(a, a, "cupy")


def _numpy_to_torch_dtype(torch, dtype):
    name = np.dtype(dtype).name
    return getattr(torch, name)


def result(like: Array, arr: Array):
    """``arr`` (made by ``empty``) as the caller of ``like`` expects it."""
    if like.kind == "jax":
        import jax

        return jax.dlpack.from_dlpack(arr.native)
    return arr.obj


class _StreamPtr:
    """A raw stream handle in the form CuPy's kernel launcher takes (``.ptr``)."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr


def stream_of(arr: Array):
    """The stream to launch on for ``arr``: torch's current stream for torch tensors, else None
    (CuPy's current stream)."""
    if arr.kind == "torch":
        return _StreamPtr(_torch_stream(arr.device))
    return None


def stream_ptr(stream) -> int:
    """The raw handle of a stream from ``stream_of`` (None: CuPy's current stream)."""
    if stream is None:
        import cupy

        return cupy.cuda.get_current_stream().ptr
    return stream.ptr


def _torch_stream(device: int) -> int:
    """torch's current stream on ``device``, as a raw handle."""
    return (_current_raw_stream or current_stream_reader())(device)


_current_raw_stream = None  # torch's accessor of the current stream's handle, looked up once


def current_stream_reader():
    """torch's own accessor of the current stream's raw handle on a device (what its kernels
    use), or the public equivalent."""
    global _current_raw_stream
    if _current_raw_stream is None:
        torch = sys.modules["torch"]
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        if raw is None:

            def raw(device: int) -> int:
                return torch.cuda.current_stream(device).cuda_stream

        _current_raw_stream = raw
    return _current_raw_stream
