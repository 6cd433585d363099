"""Copy ceilings 2: cache-hinted copies (.cs, .lu) and TMA bulk copies (sm_90: one cp.async.bulk per chunk, stored by a bulk copy or by the threads), against torch copy_.

python benchmarks/ceiling_tma.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench.py, from any directory
import cupy as cp
import torch
from bench import time_fn

SRC = r"""
__device__ __forceinline__ unsigned sa(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
extern "C" __global__ void plain(const uint4* __restrict__ a, uint4* __restrict__ b, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        b[i] = a[i];
}
extern "C" __global__ void plain_cs(const uint4* __restrict__ a, uint4* __restrict__ b, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        __stcs(b + i, __ldcs(a + i));
}
extern "C" __global__ void plain_lu(const uint4* __restrict__ a, uint4* __restrict__ b, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        __stwt(b + i, __ldlu(a + i));
}
// one cp.async.bulk per chunk into smem, S stages; TMA_STORE: bulk store from smem, else threads
template <int CH, int S, bool TMA_STORE>
__device__ __forceinline__ void bulk_body(const char* __restrict__ a, char* __restrict__ b, long long nchunks) {
    extern __shared__ __align__(128) unsigned char sm[];
    __shared__ __align__(8) unsigned long long bars[S];
    const long long first = blockIdx.x, step = gridDim.x;
    const long long mine = first < nchunks ? (nchunks - 1 - first) / step + 1 : 0;
    auto load = [&](long long k) {
        const int s = k % S;
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(sa(bars + s)), "r"(CH) : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     :: "r"(sa(sm + s * CH)), "l"(a + (first + k * step) * CH), "r"(CH), "r"(sa(bars + s)) : "memory");
    };
    if (threadIdx.x == 0) {
        for (int s = 0; s < S; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(sa(bars + s)));
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (threadIdx.x == 0) for (long long k = 0; k < S && k < mine; ++k) load(k);
    for (long long k = 0; k < mine; ++k) {
        const int s = k % S;
        const unsigned phase = (k / S) & 1;
        unsigned done = 0;
        while (!done)
            asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                         : "=r"(done) : "r"(sa(bars + s)), "r"(phase) : "memory");
        char* dst = b + (first + k * step) * CH;
        if constexpr (TMA_STORE) {
            if (threadIdx.x == 0) {
                asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" :: "l"(dst), "r"(sa(sm + s * CH)), "r"(CH) : "memory");
                asm volatile("cp.async.bulk.commit_group;" ::: "memory");
                if (k >= 1) {
                    asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
                    if (k - 1 + S < mine) load(k - 1 + S);
                }
            }
        } else {
            const uint4* src = reinterpret_cast<const uint4*>(sm + s * CH);
            for (int i = threadIdx.x; i < CH / 16; i += blockDim.x) reinterpret_cast<uint4*>(dst)[i] = src[i];
            __syncthreads();
            if (threadIdx.x == 0 && k + S < mine) load(k + S);
        }
    }
    if (TMA_STORE && threadIdx.x == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
#define BULK(CH, S, TS) extern "C" __global__ void bulk_##CH##_##S##_##TS(const char* a, char* b, long long n) { bulk_body<CH, S, TS>(a, b, n); }
BULK(4096, 4, true) BULK(8192, 4, true) BULK(16384, 2, true) BULK(16384, 4, true) BULK(32768, 3, true)
BULK(4096, 4, false) BULK(8192, 4, false) BULK(16384, 3, false)
"""
mod = cp.RawModule(code=SRC, options=("-std=c++17",))
sms = cp.cuda.Device().attributes["MultiProcessorCount"]
for nbytes in (8 * 5120 * 2048 * 2, 64 * 1024 * 512 * 2):
    src = torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    a = cp.from_dlpack(src).view(cp.uint8)
    b = cp.from_dlpack(dst).view(cp.uint8)
    base = time_fn(lambda: dst.copy_(src), repeats=7, target_ms=30)["us_median"]
    print(
        f"bytes {nbytes / 1e6:.1f} MB  torch copy {base:.1f} us  ({2 * nbytes / base / 1e6:.2f} TB/s)",
        flush=True,
    )

    def trial(label, f):
        dst.zero_()
        f()
        cp.cuda.runtime.deviceSynchronize()
        ok = torch.equal(src, dst)
        t = time_fn(f, repeats=7, target_ms=30)["us_median"]
        print(
            f"  {label:34s} {t:7.1f} us  copy/time {base / t:.3f} {'ok' if ok else 'WRONG'}",
            flush=True,
        )

    n = nbytes // 16
    for name in ("plain", "plain_cs", "plain_lu"):
        k = mod.get_function(name)
        trial(f"{name} 256x4/SM", lambda: k((sms * 4,), (256,), (a, b, cp.int64(n))))
    for name in (
        "bulk_4096_4_true",
        "bulk_8192_4_true",
        "bulk_16384_2_true",
        "bulk_16384_4_true",
        "bulk_32768_3_true",
        "bulk_4096_4_false",
        "bulk_8192_4_false",
        "bulk_16384_3_false",
    ):
        ch, st, ts = name.split("_")[1:]
        ch, st = int(ch), int(st)
        k = mod.get_function(name)
        smem = ch * st
        k.max_dynamic_shared_size_bytes = smem
        nch = nbytes // ch
        for per_sm in (1, 2, 4, 8):
            if per_sm * (smem + 1024) > 227 * 1024:
                continue
            threads = 32 if ts == "true" else 256
            trial(
                f"{name} {threads}x{per_sm}/SM",
                lambda: k((sms * per_sm,), (threads,), (a, b, cp.int64(nch)), shared_mem=smem),
            )
