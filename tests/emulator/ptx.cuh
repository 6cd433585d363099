// ptx.cuh for the CPU emulation (cuda_emu.h): kernels/ptx.cuh's functions, each as its PTX
// instruction behaves.
#pragma once
#include "cuda_emu.h"

// ---- shared memory, cp.async, barriers ------------------------------------------------------

inline unsigned smem_address(const void* p) { return cpc::shared_address(p); }
inline void st_shared32(unsigned at, unsigned v) { std::memcpy(cpc::shared_pointer(at), &v, 4); }
inline unsigned ld_shared32(unsigned at) {
    unsigned v;
    std::memcpy(&v, cpc::shared_pointer(at), 4);
    return v;
}
inline void st_global16(void* at, uint4 v) {
    if ((uintptr_t)at % 16) cpc::fail("st_global16: an address that is not 16-byte aligned");
    std::memcpy(at, &v, 16);
}
inline void st_global8(void* at, unsigned lo, unsigned hi, bool on = true) {
    if (!on) return;
    if ((uintptr_t)at % 8) cpc::fail("st_global8: an address that is not 8-byte aligned");
    const unsigned v[2] = {lo, hi};
    std::memcpy(at, v, 8);
}

// cp.async: the destination is undefined until the copy's group is waited for (NaN bytes here).
inline void cpc_copy(unsigned char* dst, const void* src, int bytes, int size) {
    if ((uintptr_t)dst % size || (bytes && (uintptr_t)src % size)) cpc::fail("cp.async: a misaligned address");
    if (bytes < 0 || bytes > size) cpc::fail("cp.async: a source size outside 0 .. the copy's size");
    if (bytes && !cpc::inside_an_array(src, bytes)) cpc::fail("cp.async: a read outside every array");
    std::memset(dst, 0xff, size);
    cpc::block.current->copies.push_back({dst, src, bytes, size, 0});
}
template <int BYTES, int PREFETCH = 0>
inline void cp_async(void* dst, const void* src, int bytes) {
    static_assert(PREFETCH == 0 || PREFETCH == 128 || PREFETCH == 256, "cp_async: PREFETCH is 0, 128 or 256");
    cpc_copy(static_cast<unsigned char*>(dst), src, bytes, BYTES);
}
inline void cp_async_shared16(unsigned dst, const void* src) { cpc_copy(cpc::shared_pointer(dst), src, 16, 16); }
inline void cp_async_commit() {
    cpc::Thread& t = *cpc::block.current;
    ++t.committed;
    for (auto& c : t.copies)
        if (!c.group) c.group = t.committed;
}
// Lands every copy of the groups but the N most recent. A copy may land at any time between
// its issue and its wait, so a store into its destination meanwhile (any thread's, another
// copy's data included) races with it: its bytes must still be the NaN bytes of its issue.
template <int N> inline void cp_async_wait() {
    cpc::Thread& t = *cpc::block.current;
    std::vector<cpc::Thread::Copy> left;
    for (const auto& c : t.copies) {
        if (c.group && c.group <= t.committed - N) {
            for (int i = 0; i < c.size; ++i)
                if (c.dst[i] != 0xff) cpc::fail("cp.async: its destination was written while the copy was in flight");
            if (c.bytes) std::memcpy(c.dst, c.src, c.bytes);
            std::memset(c.dst + c.bytes, 0, c.size - c.bytes);
        } else {
            left.push_back(c);
        }
    }
    t.copies.swap(left);
}

inline void named_barrier(int id, int threads) {
    if (id < 1 || id > 15 || threads % 32) cpc::fail("named_barrier: an id outside 1 .. 15 or a count of part of a warp");
    cpc::barrier(id, threads);
}
inline void wait_for_previous_kernel() {}

// ---- float32 arithmetic ---------------------------------------------------------------------

inline float cpc_ftz(float a) { return std::fpclassify(a) == FP_SUBNORMAL ? std::copysign(0.f, a) : a; }
inline float ex2_approx(float a) { return cpc_ftz(std::exp2(cpc_ftz(a))); }
inline float rcp_approx(float a) { return cpc_ftz(1.f / cpc_ftz(a)); }
inline float tanh_approx(float a) { return std::tanh(a); }  // exact: MUFU.TANH is within 8e-6
inline float mul_plus_zero(float a, float b) { return cpc_ftz(std::fma(cpc_ftz(a), cpc_ftz(b), 0.f)); }
inline unsigned bf16x2_bits(float a, float b) {
    return (unsigned)cpc::bf16_bits(a) | (unsigned)cpc::bf16_bits(b) << 16;
}
inline void computed_here(float) {}

// ---- tensor cores ---------------------------------------------------------------------------

inline void cpc_mma(bool bf16, float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    cpc::Thread& t = *cpc::block.current;
    for (int i = 0; i < 4; ++i) t.in[i] = a[i];
    t.in[4] = b0;
    t.in[5] = b1;
    t.in[6] = cpc::f2u(c[0]) | (unsigned long long)cpc::f2u(c[1]) << 32;
    t.in[7] = cpc::f2u(c[2]) | (unsigned long long)cpc::f2u(c[3]) << 32;
    t.arg = bf16;
    cpc::warp_op(cpc::MMA, 0xffffffffu);
    for (int i = 0; i < 4; ++i) c[i] = cpc::u2f((unsigned)t.out[i]);
}
inline void mma_bf16(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) { cpc_mma(true, c, a, b0, b1); }
inline void mma_f16(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) { cpc_mma(false, c, a, b0, b1); }

template <int N>
inline void cpc_ldmatrix(unsigned (&r)[N], const void* row, bool trans) {
    cpc::Thread& t = *cpc::block.current;
    t.addr = row;
    t.arg = N;
    t.trans = trans;
    cpc::warp_op(cpc::LDMATRIX, 0xffffffffu);
    for (int i = 0; i < N; ++i) r[i] = (unsigned)t.out[i];
}
inline void ldmatrix_x4_trans(unsigned (&r)[4], unsigned row) { cpc_ldmatrix(r, cpc::shared_pointer(row), true); }
inline void ldmatrix_x2_trans(unsigned (&r)[2], unsigned row) { cpc_ldmatrix(r, cpc::shared_pointer(row), true); }
inline void ldmatrix_x4(unsigned (&r)[4], const void* row) { cpc_ldmatrix(r, row, false); }
inline void ldmatrix_x2(unsigned (&r)[2], const void* row) { cpc_ldmatrix(r, row, false); }

inline void stmatrix_x4_trans_sm90(const unsigned (&r)[4], void* row) {
    cpc::Thread& t = *cpc::block.current;
    for (int i = 0; i < 4; ++i) t.in[i] = r[i];
    t.addr = row;
    cpc::warp_op(cpc::STMATRIX, 0xffffffffu);
}

inline unsigned transposed(unsigned a) {
    cpc::Thread& t = *cpc::block.current;
    t.in[0] = a;
    cpc::warp_op(cpc::MOVMATRIX, 0xffffffffu);
    return (unsigned)t.out[0];
}
