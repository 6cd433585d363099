"""Copy ceilings on this device: grid-stride CUDA C copies (plain, unrolled) and copies in which each warp walks a contiguous region of its own, against torch copy_.

python benchmarks/ceiling.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench.py, from any directory
import cupy as cp
import torch
from bench import time_fn

SRC = r"""
extern "C" __global__ void copy_plain(const uint4* __restrict__ a, uint4* __restrict__ b, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        b[i] = a[i];
}
template <int U>
__device__ void copy_unroll_body(const uint4* __restrict__ a, uint4* __restrict__ b, long long n) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    for (; i + (U - 1) * stride < n; i += U * stride) {
        uint4 v[U];
        #pragma unroll
        for (int u = 0; u < U; ++u) v[u] = a[i + u * stride];
        #pragma unroll
        for (int u = 0; u < U; ++u) b[i + u * stride] = v[u];
    }
    for (; i < n; i += stride) b[i] = a[i];
}
extern "C" __global__ void copy_u4(const uint4* __restrict__ a, uint4* __restrict__ b, long long n) { copy_unroll_body<4>(a, b, n); }
extern "C" __global__ void copy_u8(const uint4* __restrict__ a, uint4* __restrict__ b, long long n) { copy_unroll_body<8>(a, b, n); }
// contiguous warp shares, like fwd_tc: warp w copies [w*per, (w+1)*per) in chunks of 32*U vectors
template <int U>
__device__ void copy_share_body(const uint4* __restrict__ a, uint4* __restrict__ b, long long n) {
    const long long warps = (long long)gridDim.x * (blockDim.x / 32);
    const long long w = blockIdx.x * (long long)(blockDim.x / 32) + threadIdx.x / 32;
    const long long per = (n + warps - 1) / warps;
    long long i = w * per, end = min(n, i + per);
    const int lane = threadIdx.x & 31;
    for (; i + 32 * U <= end; i += 32 * U) {
        uint4 v[U];
        #pragma unroll
        for (int u = 0; u < U; ++u) v[u] = a[i + 32 * u + lane];
        #pragma unroll
        for (int u = 0; u < U; ++u) b[i + 32 * u + lane] = v[u];
    }
    for (i += lane; i < end; i += 32) b[i] = a[i];
}
extern "C" __global__ void share_u4(const uint4* __restrict__ a, uint4* __restrict__ b, long long n) { copy_share_body<4>(a, b, n); }
extern "C" __global__ void share_u8(const uint4* __restrict__ a, uint4* __restrict__ b, long long n) { copy_share_body<8>(a, b, n); }
"""
mod = cp.RawModule(code=SRC, options=("-std=c++17",))
sms = cp.cuda.Device().attributes["MultiProcessorCount"]
for nbytes in (8 * 5120 * 2048 * 2, 64 * 1024 * 512 * 2, 8 * 5120 * 2048 * 4):
    src = torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    a = cp.from_dlpack(src).view(cp.uint8)
    b = cp.from_dlpack(dst).view(cp.uint8)
    n = nbytes // 16
    base = time_fn(lambda: dst.copy_(src), repeats=7, target_ms=30)["us_median"]
    print(
        f"bytes {nbytes / 1e6:.1f} MB  torch copy {base:.1f} us  ({2 * nbytes / base / 1e6:.2f} TB/s)",
        flush=True,
    )
    for name in ("copy_plain", "copy_u4", "copy_u8", "share_u4", "share_u8"):
        k = mod.get_function(name)
        for threads, per_sm in ((256, 8), (128, 16), (128, 8), (256, 4), (512, 4)):
            grid = sms * per_sm
            f = lambda: k((grid,), (threads,), (a, b, cp.int64(n)))
            f()
            cp.cuda.runtime.deviceSynchronize()
            assert torch.equal(src, dst)
            t = time_fn(f, repeats=7, target_ms=30)["us_median"]
            print(
                f"  {name:10s} {threads:4d} x {per_sm:2d}/SM  {t:7.1f} us  copy/time {base / t:.3f}",
                flush=True,
            )
        dst.zero_()
