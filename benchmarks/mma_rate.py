"""Tensor-core ceilings on this device: bf16 products with float32 sums issued as mma.sync
(m16n8k16, what every cupyconv kernel issues) and as wgmma (m64nNk16 for N from 16 to 256,
sm_90a), in TFLOP/s.

python benchmarks/mma_rate.py [--check]

mma.sync: every warp runs CHAINS independent accumulators through ITERS products each, its
fragments in registers. wgmma: every warpgroup issues ITERS products into one accumulator
block from operands in shared memory (no swizzle; the values are whatever the buffer holds,
since only the rate is measured), BATCH of them back to back between waits. Grids of a few
blocks an SM, the median of a few timed launches. The wgmma kernels are compiled with
-arch=sm_90a beside the -arch=sm_90 CuPy adds. --check compiles the kernels with NVRTC for
sm_90a and stops (no GPU needed).
"""

import argparse
import sys

ITERS, CHAINS, BATCH = 2048, 8, 16
WGMMA_N = (16, 32, 64, 128, 256)  # the n of m64nNk16 measured

SRC = r"""
extern "C" __global__ void mma_sync_rate(float* out, int iters) {
    unsigned a[4], b[2];
    #pragma unroll
    for (int i = 0; i < 4; ++i) a[i] = 0x3f803f80u ^ (threadIdx.x * (i + 1));  // bf16 pairs
    b[0] = 0x3f803f80u ^ threadIdx.x, b[1] = 0x3f803f80u;
    float c[CHAINS][4] = {};
    for (int it = 0; it < iters; ++it) {
        #pragma unroll
        for (int j = 0; j < CHAINS; ++j)
            asm volatile(
                "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                "{%8,%9}, {%0,%1,%2,%3};\n"
                : "+f"(c[j][0]), "+f"(c[j][1]), "+f"(c[j][2]), "+f"(c[j][3])
                : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
    float s = 0.f;
    #pragma unroll
    for (int j = 0; j < CHAINS; ++j) s += c[j][0] + c[j][1] + c[j][2] + c[j][3];
    if (s == 12345.f) out[0] = s;  // (keeps the products)
}

// A shared-memory matrix descriptor without swizzle: start address, leading and stride byte
// offsets, each in 16-byte units.
__device__ unsigned long long descriptor(const void* smem, unsigned lead, unsigned stride) {
    const unsigned long long at = (unsigned)__cvta_generic_to_shared(smem);
    return ((at >> 4) & 0x3fff) | ((unsigned long long)((lead >> 4) & 0x3fff) << 16) |
           ((unsigned long long)((stride >> 4) & 0x3fff) << 32);
}

"""


WGMMA = r"""
extern "C" __global__ void wgmma_rate_N(float* out, int iters) {
    __shared__ __align__(128) unsigned short tile[(64 + N) * 16];  // A (64 x 16), then B (N x 16)
    for (int i = threadIdx.x; i < (64 + N) * 16; i += blockDim.x) tile[i] = 0x3f80 ^ (i & 7);
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
    const unsigned long long da = descriptor(tile, 128, 256);
    const unsigned long long db = descriptor(tile + 64 * 16, 128, 256);
    float d[REGS] = {};
    for (int it = 0; it < iters; it += BATCH) {  // BATCH products back to back, then a wait
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
        #pragma unroll
        for (int j = 0; j < BATCH; ++j)
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                         "wgmma.mma_async.sync.aligned.m64nNk16.f32.bf16.bf16 "
                         "{LIST}, DESCS, p, 1, 1, 0, 0;\n}\n"
                         : OUTS : "l"(da), "l"(db));
        asm volatile("wgmma.commit_group.sync.aligned;\n"
                     "wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    }
    float s = 0.f;
    for (int i = 0; i < REGS; ++i) s += d[i];
    if (s == 12345.f) out[0] = s;
}
"""


def source() -> str:
    """The kernels: mma.sync, then one wgmma kernel for each n of WGMMA_N (n / 2 float32
    accumulators a thread, each an operand of the asm statement)."""
    text = SRC.replace("CHAINS", str(CHAINS))
    for n in WGMMA_N:
        regs = n // 2
        text += (
            WGMMA.replace("LIST", ",".join(f"%{i}" for i in range(regs)))
            .replace("DESCS", f"%{regs}, %{regs + 1}")
            .replace("OUTS", ", ".join(f'"+f"(d[{i}])' for i in range(regs)))
            .replace("REGS", str(regs))
            .replace("BATCH", str(BATCH))
            .replace("_N(", f"_{n}(")
            .replace("64 + N", f"64 + {n}")
            .replace("m64nNk16", f"m64n{n}k16")
        )
    return text


def compile_check() -> tuple[bool, str]:
    """(whether NVRTC compiled the kernels, its log), for sm_90a with the -arch=sm_90 CuPy
    appends beside it and CuPy's other options, as ``main`` builds them (no GPU needed)."""
    import bench

    return bench.nvrtc_check(source(), "mma_rate.cu", (), "sm_90a", ("-arch=sm_90",))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compile only (NVRTC, no GPU)")
    if parser.parse_args().check:
        ok, log = compile_check()
        print("compiled" if ok else "failed", log)
        sys.exit(0 if ok else 1)
    import bench
    import cupy as cp

    mod, sms = bench.stand_alone_module(source(), options=("-std=c++17", "-arch=sm_90a"))
    out = cp.zeros(1, cp.float32)
    start, stop = cp.cuda.Event(), cp.cuda.Event()

    def rate(kernel, grid, block, flops_per_block):
        kernel((grid,), (block,), (out, cp.int32(ITERS)))  # warm-up (and compile)
        times = []
        for _ in range(5):
            start.record()
            kernel((grid,), (block,), (out, cp.int32(ITERS)))
            stop.record()
            stop.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, stop) * 1e-3)
        t = sorted(times)[len(times) // 2]
        return grid * flops_per_block / t / 1e12, t * 1e6

    mma = mod.get_function("mma_sync_rate")
    for warps, per_sm in ((4, 2), (4, 4), (8, 2), (8, 4)):
        flops = warps * ITERS * CHAINS * 16 * 8 * 16 * 2
        tf, us = rate(mma, sms * per_sm, 32 * warps, flops)
        label = f"{warps} warps x {per_sm} blocks an SM"
        print(f"mma.sync m16n8k16  {label}: {tf:6.1f} TFLOP/s ({us:.0f} us)")
    for n in WGMMA_N:
        kernel = mod.get_function(f"wgmma_rate_{n}")
        for per_sm in (1, 2, 3):  # one warpgroup a block
            tf, us = rate(kernel, sms * per_sm, 128, ITERS * 64 * n * 16 * 2)
            print(f"wgmma m64n{n}k16  {per_sm} warpgroups an SM: {tf:6.1f} TFLOP/s ({us:.0f} us)")


if __name__ == "__main__":
    main()
