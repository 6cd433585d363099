// ptx.cuh: every inline PTX statement of cupyconv's kernels, each in a function of its own, so
// that the kernels themselves are plain CUDA C++ (tests/emulator/ptx.cuh gives the same functions
// for the CPU emulation that runs the kernels in the tests without a GPU).
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

// ---- shared memory, cp.async, barriers ------------------------------------------------------

// A generic pointer into shared memory as a shared-memory address.
__device__ __forceinline__ unsigned smem_address(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}
// 4-byte shared-memory accesses at an address as smem_address gives it.
__device__ __forceinline__ void st_shared32(unsigned at, unsigned v) {
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(at), "r"(v) : "memory");
}
__device__ __forceinline__ unsigned ld_shared32(unsigned at) {
    unsigned v;
    asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(at) : "memory");
    return v;
}
// A 16-byte global store (v4 even where the compiler cannot see the address's alignment).
__device__ __forceinline__ void st_global16(void* at, uint4 v) {
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(at), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}
// An 8-byte global store of two words, where `on`.
__device__ __forceinline__ void st_global8(void* at, unsigned lo, unsigned hi, bool on = true) {
    asm volatile("{ .reg .pred p; setp.ne.b32 p, %3, 0; @p st.global.v2.b32 [%0], {%1, %2}; }\n" ::"l"(at), "r"(lo),
                 "r"(hi), "r"((int)on)
                 : "memory");
}

// Staging through shared memory with cp.async (sm_80 and newer): the copy does not pass through
// registers, so a warp keeps several pieces of x in flight while it computes an earlier one.
// Copies the first `bytes` (0..BYTES) of the BYTES at src into dst and zero-fills the rest;
// both addresses BYTES-aligned. PREFETCH (0, 128 or 256): whether a miss in L2 brings in the
// whole 128- or 256-byte block around src, not just the sectors read. Taken where it measured
// level or better (benchmarks/NOTES.md, "cp.async's L2 prefetch"): most of all by fwd_mma_cl,
// whose blocks read 64-byte runs of a position's channels that neighbouring blocks complete soon
// after (the line then comes from DRAM once, in one burst), not by bwd_mma's channel-last form
// (15 % slower); 256 by bwd_channel, whose warps' 128-byte rows the next strip's warp completes
// ("bwd_channel's tiles and the L2's 256-byte prefetch on the H200": 0.9-1.7 % faster).
template <int BYTES, int PREFETCH = 0>
__device__ __forceinline__ void cp_async(void* dst, const void* src, int bytes) {
    static_assert(PREFETCH == 0 || PREFETCH == 128 || PREFETCH == 256, "cp_async: PREFETCH is 0, 128 or 256");
    // .cg (L2 only) takes 16-byte copies, .ca the others.
#define CP_ASYNC(LEVEL, HINT)                                                                      \
    asm volatile("cp.async." LEVEL ".shared.global" HINT " [%0], [%1], %2, %3;\n" ::"r"(smem_address(dst)), \
                 "l"(src), "n"(BYTES), "r"(bytes) : "memory")
    if constexpr (BYTES == 16 && PREFETCH == 256) CP_ASYNC("cg", ".L2::256B");
    else if constexpr (BYTES == 16 && PREFETCH) CP_ASYNC("cg", ".L2::128B");
    else if constexpr (PREFETCH == 256) CP_ASYNC("ca", ".L2::256B");
    else if constexpr (BYTES == 16) CP_ASYNC("cg", "");
    else if constexpr (PREFETCH) CP_ASYNC("ca", ".L2::128B");
    else CP_ASYNC("ca", "");
#undef CP_ASYNC
}
// cp_async<16> of a whole vector to a shared-memory address as smem_address gives it.
__device__ __forceinline__ void cp_async_shared16(unsigned dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Barrier `id` (1 .. 15; __syncthreads is 0) of `threads` threads of the block, whole warps.
__device__ __forceinline__ void named_barrier(int id, int threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Programmatic dependent launch (sm_90): a kernel launched with it (the plan's Launch.pdl) may
// be scheduled while the kernel before it in the stream finishes, and waits here, before it
// touches memory, until that kernel has completed and its writes are visible. Without it, and
// below sm_90, a no-op.
__device__ __forceinline__ void wait_for_previous_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// ---- float32 arithmetic ---------------------------------------------------------------------

// 2^a and 1 / a, approximate, subnormals flushed (MUFU.EX2, MUFU.RCP).
__device__ __forceinline__ float ex2_approx(float a) {
    float e;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(a));
    return e;
}
__device__ __forceinline__ float rcp_approx(float a) {
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(a));
    return r;
}
// tanh(a), approximate (MUFU.TANH; measured within 8e-6, and 1.1e-5 relative, of tanh).
__device__ __forceinline__ float tanh_approx(float a) {
    float t;
    asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(a));
    return t;
}
// a b + 0 (a zero product is +0), subnormals flushed.
__device__ __forceinline__ float mul_plus_zero(float a, float b) {
    float z;
    asm("fma.rn.ftz.f32 %0, %1, %2, 0f00000000;" : "=f"(z) : "f"(a), "f"(b));
    return z;
}
// a and b rounded to bfloat16, a in the low half.
__device__ __forceinline__ unsigned bf16x2_bits(float a, float b) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(b), "f"(a));
    return r;
}
// a computed where the call stands (an empty statement that reads it): the compiler may not move
// a's computation into a branch that alone uses it.
__device__ __forceinline__ void computed_here(float a) { asm volatile("" ::"f"(a)); }

// ---- tensor cores (16-bit operands, float32 accumulators) -----------------------------------

// acc += A B for one m16n8k16 MMA of 16-bit TYPE ("bf16" or "f16") operands, float32 accumulator.
#define MMA_SYNC(TYPE, acc, a, b0, b1)                                                           \
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TYPE "." TYPE                         \
                 ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"                 \
                 : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])                     \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))
__device__ __forceinline__ void mma_bf16(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    MMA_SYNC("bf16", c, a, b0, b1);
}
__device__ __forceinline__ void mma_f16(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    MMA_SYNC("f16", c, a, b0, b1);
}
#undef MMA_SYNC

// The four 8x8 matrices of 16-bit values whose rows lanes 8 q .. 8 q + 7 address (16 bytes a
// row, 16-byte aligned), transposed: r[q] holds, for lane (g, tg), elements (2 tg, g) and
// (2 tg + 1, g) of matrix q. (`row`: a shared-memory address.)
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], unsigned row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(row));
}
// The two 8x8 matrices whose rows lanes 0 .. 15 address, transposed (ldmatrix_x4_trans's first two).
__device__ __forceinline__ void ldmatrix_x2_trans(unsigned (&r)[2], unsigned row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(row));
}
// The four 8x8 matrices whose rows lanes 8 q .. 8 q + 7 address, as they lie: r[q] holds, for
// lane (g, tg), elements (g, 2 tg) and (g, 2 tg + 1) of matrix q.
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_address(row)));
}
// The two 8x8 matrices whose rows lanes 0 .. 15 address, as they lie (ldmatrix_x4's first two).
__device__ __forceinline__ void ldmatrix_x2(unsigned (&r)[2], const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(smem_address(row)));
}
// ldmatrix_x4's inverse, transposed (sm_90; mma_common.cuh's stmatrix_x4_trans takes it there):
// matrix q's row j (at the address of lane 8 q + j) gets column j of the matrix that r[q]
// holds as ldmatrix_x4 gives it.
__device__ __forceinline__ void stmatrix_x4_trans_sm90(const unsigned (&r)[4], void* row) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1,%2,%3,%4};\n" ::"r"(smem_address(row)),
                 "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
                 : "memory");
}
// The 8 x 8 matrix of 16-bit values whose fragment a is (lane (g, tg): row g, columns 2 tg and
// 2 tg + 1), transposed, as the same fragment.
__device__ __forceinline__ unsigned transposed(unsigned a) {
    unsigned d;
    asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(d) : "r"(a));
    return d;
}
