// mma_common.cuh: the tensor-core helpers fwd_mma and bwd_mma share (16-bit operands, float32
// accumulators; sm_80 and newer).
#pragma once
#include "common.cuh"

// acc += A B for one m16n8k16 MMA of 16-bit T operands (ptx.cuh), float32 accumulator.
template <typename T> struct MmaOp;
template <> struct MmaOp<__nv_bfloat16> {
    static __device__ __forceinline__ void run(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
        mma_bf16(c, a, b0, b1);
    }
};
template <> struct MmaOp<__half> {
    static __device__ __forceinline__ void run(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
        mma_f16(c, a, b0, b1);
    }
};

// The 16-bit operand type of the MMAs for x of type T and weights of another dtype (SPLIT, split
// into a high and a low part): T itself, or bfloat16 where x is split into two bfloat16 parts
// too: float32 x, and float16 x with other weights (a float16 value is exactly the sum of its
// two bfloat16 parts; the weights' low part would not fit float16's exponent range).
template <typename T, bool SPLIT> struct MmaIn { using type = T; };
template <bool SPLIT> struct MmaIn<float, SPLIT> { using type = __nv_bfloat16; };
template <> struct MmaIn<__half, true> { using type = __nv_bfloat16; };
// Whether x's window is split into two bfloat16 parts (MmaIn is not x's own type).
template <typename T, bool SPLIT>
constexpr bool split_window_of = !same_type<T, typename MmaIn<T, SPLIT>::type>;

// Two values as one 32-bit word of T (the first in the low half).
template <typename T>
__device__ __forceinline__ unsigned pack2(float lo, float hi) {
    T v[2] = {from_acc<T>(lo), from_acc<T>(hi)};
    return *reinterpret_cast<unsigned*>(v);
}

// The bits of a weight as fetched (a float64 one as float32: bits_as reads them as F32).
__device__ __forceinline__ unsigned raw_bits(float v) { return __float_as_uint(v); }
__device__ __forceinline__ unsigned raw_bits(__half v) { return __half_as_ushort(v); }
__device__ __forceinline__ unsigned raw_bits(__nv_bfloat16 v) { return __bfloat16_as_ushort(v); }
__device__ __forceinline__ unsigned raw_bits(double v) { return __float_as_uint((float)v); }
// A 16-bit value of type T from the bits raw_bits gave.
template <typename T>
__device__ __forceinline__ T from_bits(unsigned u) {
    if constexpr (same_type<T, __half>) return __ushort_as_half((unsigned short)u);
    else return __ushort_as_bfloat16((unsigned short)u);
}

// The banded Toeplitz products (fwd_mma's forward, bwd_mma's z and dx): D = 16 (KS - 1) window
// inputs before a 16-output block's first, a channel's taps zero-padded in SIZE floats with the
// taps from PAD on, and N taps a lane when a warp reads them (k = lane + 32 j).
template <int KS>
struct ToeplitzTaps {
    static constexpr int D = 16 * (KS - 1), PAD = D + 15, SIZE = 2 * D + 32, N = (D + 32) / 32;
};

// The offset, from wl = the padded taps + PAD + 4 tg - 2 g - shift (a band starting `shift`
// inputs into the window), of the two weights of word r of lane (g, tg)'s A fragment for k-step
// s. Element (row i, k) is the weight of output o = 2 (i mod 8) + i / 8 and input e of the
// segment (k = 2 tg + h: e = 4 tg + h; k = 2 tg + 8 + h: e = 4 tg + 2 + h): pad[PAD + 16 s + e -
// o - shift]. Words: a0 (g, k lo), a1 (g + 8, k lo), a2 (g, k hi), a3 (g + 8, k hi).
__host__ __device__ constexpr int fragment_offset(int s, int r) { return 16 * s + 2 * (r >> 1) - (r & 1); }

// ldmatrix_x4_trans (ptx.cuh) of rows given as generic pointers.
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* row) { ldmatrix_x4_trans(r, smem_address(row)); }

// ldmatrix_x4's inverse, transposed: matrix q's row j (at the address of lane 8 q + j) gets
// column j of the matrix that r[q] holds as ldmatrix_x4 gives it.
__device__ __forceinline__ void stmatrix_x4_trans(const unsigned (&r)[4], void* row) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    stmatrix_x4_trans_sm90(r, row);
#else
    // (sm_80: the same through shuffles: lane 8 q + j collects column j of matrix q, element
    // (g, j) from lane 4 g + j / 2, two rows a word)
    const int lane = threadIdx.x & 31, q = lane >> 3, j = lane & 7;
    unsigned col[4];
    #pragma unroll
    for (int g = 0; g < 8; ++g) {
        unsigned w[4];
        #pragma unroll
        for (int m = 0; m < 4; ++m) w[m] = __shfl_sync(0xffffffffu, r[m], 4 * g + (j >> 1));
        const unsigned v = q == 0 ? w[0] : q == 1 ? w[1] : q == 2 ? w[2] : w[3];
        const unsigned half = j & 1 ? v >> 16 : v & 0xffffu;
        col[g / 2] = g & 1 ? col[g / 2] | half << 16 : half;
    }
    *reinterpret_cast<uint4*>(row) = make_uint4(col[0], col[1], col[2], col[3]);
#endif
}
// The halves of a bfloat16 pair word as floats.
__device__ __forceinline__ float low_half(unsigned w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float high_half(unsigned w) { return __uint_as_float(w & 0xffff0000u); }
// a, b split into bfloat16 pairs (a in the low half): the high parts hi = bfloat16(a, b) and the
// rest lo = bfloat16(a - hi, b - hi), which together hold them to 2^-17 relative (float32 windows
// and taps, the backward's dz).
__device__ __forceinline__ void split_pair(float a, float b, unsigned& hi, unsigned& lo) {
    hi = bf16x2_bits(a, b);
    lo = bf16x2_bits(a - low_half(hi), b - high_half(hi));
}

// The backward's (bwd_mma, bwd_mma_time): the diagonal sums of dweight's lag products.
//
// Adds the diagonals of lag d's C_d (cd, written by the whole warp) to this lane's dweight sums
// dw[j] (taps k = lane + 32 j): C_d[a][e] belongs to tap k = K - 1 - 16 d - e + a.
template <int KS>
__device__ __forceinline__ void add_diagonals(const float* cd, int d, int width, float (&dw)[ToeplitzTaps<KS>::N]) {
    const int lane = threadIdx.x & 31;
    #pragma unroll
    for (int j = 0; j < ToeplitzTaps<KS>::N; ++j) {
        const int k = lane + 32 * j, e = width - 1 - k - 16 * d;  // e - a
        if (k < width && e > -16 && e < 16) {
            float sum = 0.f;
            for (int a = max(0, -e); a < min(16, 16 - e); ++a) sum += cd[e + 17 * a];
            dw[j] += sum;
        }
    }
}
