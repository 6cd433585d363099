"""The channel-last tensor-core forward's memory pattern alone: x copied to out as ``fwd_mma_cl``
moves it, without its arithmetic, for runs of 64, 128 and 256 bytes a unit and position.

    python benchmarks/ceiling_cl.py [--quick]

``fwd_mma_cl`` takes items of 8 units (pieces of ``span`` steps of the batch rows) and one group
of channels, and walks them in steps of 16 positions: each step's 16 x 8 runs of a group's bytes
(64 today: 32 bfloat16 channels) come by ``cp.async`` with the L2's 128-byte prefetch into a
staging buffer, the block meets at a barrier, and the same bytes leave by 16-byte stores. Here
every thread stores the pieces it copied, after the step's barrier; a second barrier guards
the buffer's reuse, as the kernel's blocks of 4 warps do. A run of R bytes is R / 16 lanes'
pieces, so an instruction covers 32 / (R / 16) units. Printed: copy/time against torch's copy
of the same bytes in the same process, by run, warps a block, blocks an SM (extra dynamic shared
memory stands for the rings) and span; every configuration's output is checked against x. The
copies are the kernels' own (``cp_async`` of kernels/ptx.cuh). What it answers: whether wider
runs (64 channels a block) would lift the kernel's ceiling.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench.py, from any directory

KERNEL = r"""
template <int RUN, int W>
__global__ void __launch_bounds__(32 * W) cl_runs(const char* __restrict__ x, char* __restrict__ out,
                                                  long long row_bytes, long long batch_bytes, int seqlen,
                                                  int span, long long pieces, long long units,
                                                  long long groups, long long n_items) {
    constexpr int PU = RUN / 16, UI = 32 / PU, IPP = 8 / UI, RP = 16 / W;
    constexpr int STEP = 16 * 8 * PU;  // 16-byte pieces a step (two steps staged)
    extern __shared__ uint4 stage[];  // two steps (and the rest of the block's shared memory)
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, m = lane % PU;
    const int n_steps = (span + 15) / 16;
    for (long long item = blockIdx.x; item < n_items; item += gridDim.x) {
        const long long grp = item % groups, q = item / groups;
        const char* src[IPP];
        char* dst[IPP];
        int len[IPP];
        #pragma unroll
        for (int j = 0; j < IPP; ++j) {
            const long long U = q * 8 + j * UI + lane / PU;
            const long long b = U / pieces, start = (U % pieces) * span;
            const bool ok = U < units && grp * RUN + 16 * m < row_bytes;
            len[j] = ok ? (int)min((long long)span, seqlen - start) : 0;
            const long long at = b * batch_bytes + start * row_bytes + grp * RUN + 16 * m;
            src[j] = x + (ok ? at : 0);
            dst[j] = out + (ok ? at : 0);
        }
        auto slot = [&](int buf, int pos, int j) {
            return stage + buf * STEP + (pos * 8 + j * UI + lane / PU) * PU + m;
        };
        auto copy = [&](int a) {
            #pragma unroll
            for (int r = 0; r < RP; ++r) {
                const int pos = warp + W * r, t = 16 * a + pos;
                #pragma unroll
                for (int j = 0; j < IPP; ++j) {
                    const bool live = t < len[j];
                    cp_async<16, 128>(slot(a & 1, pos, j), src[j] + (live ? t * row_bytes : 0), live ? 16 : 0);
                }
            }
            cp_async_commit();
        };
        copy(0);
        for (int a = 0; a < n_steps; ++a) {
            if (a + 1 < n_steps) copy(a + 1);
            else cp_async_commit();
            cp_async_wait<1>();
            __syncthreads();
            #pragma unroll
            for (int r = 0; r < RP; ++r) {
                const int pos = warp + W * r, t = 16 * a + pos;
                #pragma unroll
                for (int j = 0; j < IPP; ++j)
                    if (t < len[j]) *reinterpret_cast<uint4*>(dst[j] + t * row_bytes) = *slot(a & 1, pos, j);
            }
            __syncthreads();
        }
    }
}
"""

RUNS, WARPS = (64, 128, 256), (4, 8)
NAMES = [f"cl_runs<{r}, {w}>" for r in RUNS for w in WARPS]


def source() -> str:
    """The program: the kernels' own cp.async helpers (kernels/ptx.cuh), then the copy kernel."""
    from cupyconv._compile import Source

    return Source("ptx.cuh", "").text + KERNEL


def compile_check() -> tuple[bool, str]:
    """(whether NVRTC compiled every instance for sm_90, its log), with CuPy's options (no GPU
    needed)."""
    import bench

    return bench.nvrtc_check(source(), "ceiling_cl.cu", NAMES, "sm_90")


def main(argv: list[str] | None = None) -> None:
    import cupy as cp
    import torch
    from bench import stand_alone_module, time_fn

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the (8, 5120, 2048) shape alone")
    args = parser.parse_args(argv)
    mod, sms = stand_alone_module(source(), NAMES)
    shapes = [(8, 5120, 2048)] + ([] if args.quick else [(1, 4096, 16384), (64, 1024, 512)])
    for batch, dim, seqlen in shapes:
        x = torch.randn(batch, seqlen, dim, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(x)
        xa, oa = cp.from_dlpack(x), cp.from_dlpack(out)
        base = time_fn(lambda: out.copy_(x), repeats=5, target_ms=20)["us_median"]
        print(f"({batch}, {dim}, {seqlen}) channel-last bf16: torch copy {base:.1f} us", flush=True)
        row = dim * 2
        for run in RUNS:
            groups = -(-row // run)
            for w in WARPS:
                kernel = mod.get_function(f"cl_runs<{run}, {w}>")
                step_bytes = 2 * 16 * 8 * run
                for per_sm in (2, 4, 6):
                    smem = min(227 * 1024 // per_sm - 1024, 99 * 1024)
                    if smem < step_bytes:
                        continue
                    kernel.max_dynamic_shared_size_bytes = smem
                    for span in (1024, 512, 256):
                        if span > seqlen:
                            continue
                        pieces = -(-seqlen // span)
                        units = batch * pieces
                        items = groups * -(-units // 8)
                        grid = min(items, sms * per_sm)
                        args_ = (
                            xa, oa, cp.int64(row), cp.int64(seqlen * row),
                            cp.int32(seqlen), cp.int32(span), cp.int64(pieces), cp.int64(units),
                            cp.int64(groups), cp.int64(items),
                        )  # fmt: skip
                        out.zero_()

                        def call(kernel=kernel, grid=grid, w=w, smem=smem, args_=args_):
                            kernel((grid,), (32 * w,), args_, shared_mem=smem)

                        call()
                        torch.cuda.synchronize()
                        same = torch.equal(out, x)
                        t = time_fn(call, repeats=5, target_ms=20)["us_median"]
                        print(
                            f"  run {run:3d} B  {w} warps  {per_sm} blocks/SM  span {span:4d}  "
                            f"items {items:5d}  {t:7.1f} us  copy/time {base / t:.3f}"
                            + ("" if same else "  OUTPUT DIFFERS"),
                            flush=True,
                        )


if __name__ == "__main__":
    main()
