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


class FakeCupy(types.ModuleType):
    """Just what _compile.get_kernel touches: RawModule, cuda.Device."""

    def __init__(self):
        super().__init__("cupy")
        self.built = []
        outer = self

        class Device:
            def __init__(self, index):
                self.index = index

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

        self.RawModule = RawModule
        self.cuda = types.SimpleNamespace(Device=Device)


@pytest.fixture
def fake_cupy(monkeypatch):
    fake = FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(_compile, "_kernels", {})
    return fake


def test_racing_threads_compile_once(fake_cupy):
    name = "fwd_tc<__nv_bfloat16, 4, false, 8>"
    results = []
    barrier = threading.Barrier(8)

    def ask():
        barrier.wait()
        results.append(_compile.get_kernel("fwd.cu", name, 0))

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert fake_cupy.built == [(name,)]
    assert len(results) == 8 and all(r is results[0] for r in results)


def test_memoised_per_device_and_instance(fake_cupy):
    a = _compile.get_kernel("fwd.cu", "fwd_general<float>", 0)
    assert _compile.get_kernel("fwd.cu", "fwd_general<float>", 0) is a
    _compile.get_kernel("fwd.cu", "fwd_general<float>", 1)
    _compile.get_kernel("fwd.cu", "fwd_general<double>", 0)
    assert fake_cupy.built == [("fwd_general<float>",)] * 2 + [("fwd_general<double>",)]


def test_source_inlines_the_header():
    text = _compile.source("fwd.cu")
    assert '#include "common.cuh"' not in text
    assert "enum DtypeCode" in text and "fwd_tc" in text
    assert _compile.source("fwd.cu") is text  # read once
