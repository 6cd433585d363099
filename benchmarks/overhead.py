"""Host overhead of one cupyconv forward call (tiny problem, so the GPU is never the limit).

    python benchmarks/overhead.py [--profile]

Prints microseconds per call for torch and CuPy inputs, measured on the host over many calls
(the kernel is a few microseconds), and with --profile the hottest Python functions.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

# Runs from any directory: the cupyconv of this checkout comes first.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def per_call_us(fn, calls=2000):
    for _ in range(50):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", action="store_true", help="show the hottest functions")
    args = parser.parse_args()

    import cupy
    import torch

    import cupyconv

    x = torch.randn(1, 64, 16, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(64, 4, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(64, device="cuda", dtype=torch.bfloat16)
    xc, wc, bc = (cupy.from_dlpack(t) for t in (x, w, b))

    def torch_call():
        return cupyconv.causal_conv1d_fn(x, w, b, activation="silu")

    def cupy_call():
        return cupyconv.causal_conv1d_fn(xc, wc, bc, activation="silu")

    def torch_baseline():
        return torch.nn.functional.silu(x)

    rows = [
        ("torch silu (one torch kernel)", torch_baseline),
        ("cupyconv, torch inputs", torch_call),
        ("cupyconv, CuPy inputs", cupy_call),
    ]
    for name, fn in rows:
        us = per_call_us(fn)
        torch.cuda.synchronize()
        print(f"{name:32s} {us:8.1f} us/call")
    if args.profile:
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(2000):
            torch_call()
        profile.disable()
        torch.cuda.synchronize()
        pstats.Stats(profile).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
