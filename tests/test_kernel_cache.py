"""Kernel loading: sources read once with their headers inlined, modules built once per
(device, instance) even when threads race for them. Runs without a GPU: a stand-in for CuPy
records what would be compiled."""

from __future__ import annotations

import sys
import threading
import time
import types

import pytest

from cupyconv import _compile
from cupyconv._forward_plan import SOURCES

TIME, GENERAL = SOURCES["fwd_time.cu"], SOURCES["fwd_general.cu"]


class FakeCupy(types.ModuleType):
    """Just what _compile.get_kernel touches: RawModule, cuda.Device."""

    def __init__(self):
        super().__init__("cupy")
        self.built = []
        self.capability = "90"
        outer = self

        class Device:
            def __init__(self, index):
                self.index = index
                self.compute_capability = outer.capability

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

        class RawModule:
            def __init__(self, code, options, name_expressions):
                outer.built.append(name_expressions)
                time.sleep(0.05)  # a slow compile widens the race window
                self.names = name_expressions

            def get_function(self, name):
                assert name in self.names
                return types.SimpleNamespace(kernel=("kernel", name))

        def getDeviceProperties(index):  # noqa: N802 (CUDA's name)
            return {"name": b"Tesla T4"}

        self.RawModule = RawModule
        runtime = types.SimpleNamespace(getDeviceProperties=getDeviceProperties)
        self.cuda = types.SimpleNamespace(Device=Device, runtime=runtime)


@pytest.fixture
def fake_cupy(monkeypatch):
    fake = FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(_compile, "_kernels", {})
    return fake


def test_gpus_older_than_compute_capability_8_are_refused_before_any_compile(fake_cupy):
    """A GPU below compute capability 8.0 (no cp.async, no bfloat16 MMAs) gets one clear
    error naming it on the first kernel it would need, before NVRTC runs."""
    fake_cupy.capability = "75"
    with pytest.raises(RuntimeError) as err:
        _compile.get_kernel(TIME, "fwd_time<float, 4, false, 8, 1>", 0)
    assert str(err.value) == (
        "cupyconv's kernels need a GPU of compute capability 8.0 or newer; device 0 (Tesla T4) "
        "has 7.5. CPU arrays (numpy, or torch / JAX on the CPU) take the float64 reference path"
    )
    assert fake_cupy.built == [] and _compile._kernels == {}
    fake_cupy.capability = "80"
    _compile.get_kernel(TIME, "fwd_time<float, 4, false, 8, 1>", 0)
    assert fake_cupy.built == [("fwd_time<float, 4, false, 8, 1>",)]


def test_racing_threads_compile_once(fake_cupy):
    name = "fwd_time<__nv_bfloat16, 4, false, 8, 1>"
    results = []
    barrier = threading.Barrier(8)

    def ask():
        barrier.wait()
        results.append(_compile.get_kernel(TIME, name, 0))

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert fake_cupy.built == [(name,)]
    assert len(results) == 8 and all(r is results[0] for r in results)


def test_memoised_per_device_and_instance(fake_cupy):
    a = _compile.get_kernel(GENERAL, "fwd_general<float>", 0)
    assert _compile.get_kernel(GENERAL, "fwd_general<float>", 0) is a
    _compile.get_kernel(GENERAL, "fwd_general<float>", 1)
    _compile.get_kernel(GENERAL, "fwd_general<double>", 0)
    assert fake_cupy.built == [("fwd_general<float>",)] * 2 + [("fwd_general<double>",)]


def test_source_is_the_prelude_then_the_file_with_its_headers_inlined():
    text = TIME.text
    assert text.startswith(TIME.prelude)
    assert '#include "common.cuh"' not in text and '#include "fwd_common.cuh"' not in text
    assert "__device__ __forceinline__ A input_at(" in text  # fwd_common.cuh
    assert text.count("typedef long long int64;") == 1  # common.cuh, inlined once
    assert "fwd_time(FWD_ARRAYS" in text
    assert TIME.text is text  # read once


def test_prelude_declares_the_tables():
    """The prelude is C++ generated from Python tables: the dtype codes, the constants, and
    each struct's fields in the given order."""
    text = _compile.prelude("here", {"RUN": 8, "WARPS": 4}, {"P": ("a", "b_c"), "Q": ()})
    assert "enum DtypeCode : int { F32 = 0, F16 = 1, BF16 = 2, F64 = 3, I32 = 4, I64 = 5 };" in text
    assert "    RUN = 8,\n    WARPS = 4,\n};" in text
    assert "struct P { long long a, b_c; };" in text
    assert "struct Q {};" in text


def test_replay_parameter_buffers_are_per_thread():
    """A Replay's parameter buffers (the arrays' addresses are written into them before each
    launch) belong to one thread each: a thread's launch never reads another's addresses."""
    from cupyconv import _launch

    # function, grid, block, smem, PDL, parameters (no PDL launch: no launch configuration)
    steps = ((7, 40, 128, 1, 0, False, (1, 2, 3)),)
    local = _launch._Steps(steps)
    theirs = []
    thread = threading.Thread(target=lambda: theirs.append(local.steps))
    thread.start()
    thread.join()
    (mine,), (other,) = local.steps, theirs[0]
    assert mine[:5] == other[:5] == steps[0][:5] and mine[5] is other[5] is None
    assert mine[6] is not other[6] and mine[7] != other[7]  # own words, own `extra` address
    for words, extra in ((mine[6], mine[7]), (other[6], other[7])):
        assert extra == words.ctypes.data and list(words[_launch.ParamBlock.HEADER :]) == [1, 2, 3]
    assert local.steps[0][6] is mine[6]  # the same thread keeps its buffers


@pytest.mark.parametrize(
    ("capability", "driver", "bindings", "pdl"),
    [("90", 13000, True, True), ("90", 12030, True, True), ("100", 12080, True, True),
     ("90", 12020, True, False), ("89", 13000, True, False), ("80", 13000, True, False),
     ("90", 13000, False, False)],
)  # fmt: skip
def test_programmatic_dependent_launch_needs_sm_90_a_cuda_12_3_driver_and_cuda_bindings(
    monkeypatch, capability, driver, bindings, pdl
):
    """The backward's PDL launches are taken only where they work (captured into CUDA graphs
    too); elsewhere its kernels launch through CuPy, their waits no-ops."""
    from cupyconv import _launch

    fake = types.ModuleType("cupy")
    fake.cuda = types.SimpleNamespace(
        Device=lambda index: types.SimpleNamespace(compute_capability=capability),
        runtime=types.SimpleNamespace(driverGetVersion=lambda: driver),
    )
    monkeypatch.setitem(sys.modules, "cupy", fake)
    if not bindings:
        monkeypatch.setitem(sys.modules, "cuda.bindings", None)  # import raises ImportError
    monkeypatch.setattr(_launch, "_pdl_devices", {})
    monkeypatch.setattr(_launch, "_bindings", None)
    assert _launch._pdl(3) is pdl
    assert (_launch._bindings is not None) is pdl


def test_pdl_launch_builds_its_configuration_once_and_sets_its_stream_when_it_changes(
    monkeypatch,
):
    """A PdlLaunch (a Replay's, one a thread) configures grid, block, shared memory and the
    PDL attribute once; a launch on the stream before sets nothing again; a driver error
    raises as CuPy's does."""
    from cupyconv import _launch

    calls, streams = [], []

    class Config:
        pass

    bindings = types.SimpleNamespace(
        CUlaunchConfig=Config,
        CUlaunchAttribute=lambda: types.SimpleNamespace(value=types.SimpleNamespace()),
        CUlaunchAttributeID=types.SimpleNamespace(
            CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION="pss"
        ),
        CUfunction=lambda handle: ("function", handle),
        CUstream=lambda handle: streams.append(handle) or ("stream", handle),
        cuLaunchKernelEx=lambda config, f, params, extra: (
            calls.append((config, f, extra)) or (len(calls) == 3 and 700,)
        ),
    )

    class DriverError(Exception):
        def __init__(self, status):
            self.status = status

    monkeypatch.setattr(_launch, "_bindings", bindings)
    monkeypatch.setattr(_launch, "_DriverError", DriverError)
    pdl = _launch.PdlLaunch(1234, 96, (128, 2), 4096)
    config = pdl.config
    grid = (config.gridDimX, config.gridDimY, config.gridDimZ)
    block = (config.blockDimX, config.blockDimY, config.blockDimZ)
    assert grid == (96, 1, 1) and block == (128, 2, 1) and config.sharedMemBytes == 4096
    (attribute,) = config.attrs
    assert config.numAttrs == 1 and attribute.id == "pss"
    assert attribute.value.programmaticStreamSerializationAllowed == 1
    pdl(7, 111)
    pdl(7, 222)
    with pytest.raises(DriverError) as err:
        pdl(8, 333)
    assert err.value.status == 700
    assert streams == [7, 8] and config.hStream == ("stream", 8)
    assert calls == [(config, ("function", 1234), e) for e in (111, 222, 333)]
