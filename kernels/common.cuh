// common.cuh: types and small device helpers shared by every cupyconv kernel.
//
// Strides are in elements and 64-bit everywhere. Inputs whose dtype is not a template
// parameter (weight, bias, states, seq_idx) are passed as `const void*` with a dtype code and
// read through load_as<>(), so one kernel instance serves every combination of those dtypes.
#pragma once
#include "ptx.cuh"

typedef long long int64;

// The dtype codes of the kernels' dtype fields, `enum DtypeCode { F32, F16, BF16, F64, I32,
// I64 }`, come with the prelude cupyconv prepends to every source (cupyconv/_compile.py:
// DTYPE_CODES).

// Accumulation type: float32, or float64 for float64 data.
template <typename T> struct AccOf { using type = float; };
template <> struct AccOf<double> { using type = double; };

__device__ __forceinline__ float to_acc(float v) { return v; }
__device__ __forceinline__ float to_acc(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_acc(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ double to_acc(double v) { return v; }

template <typename T> __device__ __forceinline__ T from_acc(float v);
template <> __device__ __forceinline__ float from_acc<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_acc<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float v) {
    return __float2bfloat16_rn(v);
}
template <typename T> __device__ __forceinline__ T from_acc(double v);
template <> __device__ __forceinline__ double from_acc<double>(double v) { return v; }

// Element i of a float array of run-time dtype `code`, converted to A.
template <typename A>
__device__ __forceinline__ A load_as(const void* p, int code, int64 i) {
    switch (code) {
        case F32: return (A)static_cast<const float*>(p)[i];
        case F16: return (A)__half2float(static_cast<const __half*>(p)[i]);
        case BF16: return (A)__bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
        default: return (A)static_cast<const double*>(p)[i];
    }
}

// Calls f(typed pointer) for the float array p of run-time dtype `code`: lets a fully unrolled
// loop of loads be generated once per dtype instead of a switch per element.
template <typename F>
__device__ __forceinline__ void with_dtype(const void* p, int code, F&& f) {
    switch (code) {
        case F32: f(static_cast<const float*>(p)); break;
        case F16: f(static_cast<const __half*>(p)); break;
        case BF16: f(static_cast<const __nv_bfloat16*>(p)); break;
        default: f(static_cast<const double*>(p)); break;
    }
}

// The float of run-time dtype `code` whose bits are u (zero-extended), as A.
template <typename A>
__device__ __forceinline__ A bits_as(unsigned long long u, int code) {
    switch (code) {
        case F32: return (A)__uint_as_float((unsigned)u);
        case F16: return (A)__half2float(__ushort_as_half((unsigned short)u));
        case BF16: return (A)__uint_as_float((unsigned)u << 16);
        default: return (A)__longlong_as_double((long long)u);
    }
}

// This warp's index in the grid and the number of warps in it.
__device__ __forceinline__ int64 grid_warp() { return blockIdx.x * (int64)(blockDim.x / 32) + threadIdx.x / 32; }
__device__ __forceinline__ int64 grid_warps() { return (int64)gridDim.x * (blockDim.x / 32); }

// q = a / d, r = a % d for non-negative a, d; 32-bit arithmetic when both fit.
__device__ __forceinline__ void divmod(int64 a, int64 d, int64& q, int64& r) {
    if (((a | d) >> 31) == 0) {
        const unsigned ua = (unsigned)a, ud = (unsigned)d;
        q = ua / ud;
        r = ua - (unsigned)q * ud;
    } else {
        q = a / d;
        r = a - q * d;
    }
}

// a / d for 0 <= a < 2^31, given d's fast form `magic` = m | k << 32 (cupyconv/_launch.py:
// fast_divisor): a m >> k (m < 2^32, k <= 62), without a division.
__device__ __forceinline__ unsigned quotient(unsigned a, int64 magic) {
    return (unsigned)(((unsigned long long)a * (unsigned)magic) >> (int)(magic >> 32));
}

// divmod for a divisor d given with its fast form `magic` (quotient for 0 <= a < 2^31).
__device__ __forceinline__ void divmod_fast(int64 a, int64 d, int64 magic, int64& q, int64& r) {
    if ((a >> 31) == 0) {
        q = (int64)quotient((unsigned)a, magic);
        r = (int64)((unsigned)a - (unsigned)q * (unsigned)d);
    } else {
        q = a / d;
        r = a - q * d;
    }
}

// Stores v at element i of a float array p of run-time dtype `code`.
template <typename A>
__device__ __forceinline__ void store_as(void* p, int code, int64 i, A v) {
    switch (code) {
        case F32: static_cast<float*>(p)[i] = (float)v; break;
        case F16: static_cast<__half*>(p)[i] = __float2half_rn((float)v); break;
        case BF16: static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn((float)v); break;
        default: static_cast<double*>(p)[i] = (double)v; break;
    }
}

// Element i of an int32 or int64 index array.
__device__ __forceinline__ int64 load_index(const void* p, int code, int64 i) {
    return code == I32 ? (int64)static_cast<const int*>(p)[i] : static_cast<const int64*>(p)[i];
}

// The inputs of a convolution, shared by every operator's kernels: P is a kernel's parameter
// struct, with the call's fields (seq_dtype, seq_batch_stride, x_batch_stride, init_dtype, ...).

// Segment id of position s of row b (s < 0 belongs to the first segment of the row).
template <typename P>
__device__ __forceinline__ int64 segment_id(const void* seq_idx, const P& p, int64 b, int64 s) {
    return load_index(seq_idx, (int)p.seq_dtype, b * p.seq_batch_stride + (s < 0 ? 0 : s) * p.seq_l_stride);
}

// The input at position s >= -(K-1) of row (b, c), before seq_idx masking: x, or before the
// row initial_states (zeros without them).
template <typename A, typename T, typename P>
__device__ __forceinline__ A input_at(const T* x, const void* initial_states, const P& p, int64 b,
                                      int64 c, int64 s) {
    if (s >= 0) return A(to_acc(x[b * p.x_batch_stride + c * p.x_c_stride + s * p.x_l_stride]));
    if (!initial_states) return A(0);
    return load_as<A>(initial_states, (int)p.init_dtype,
                      b * p.init_batch_stride + c * p.init_c_stride + (p.width - 1 + s) * p.init_l_stride);
}

// The input at position pos of row (b, c) for a window slot: x, the initial states, or 0
// (before the states, past the row, past the last channel).
template <typename T, typename P>
__device__ __forceinline__ T window_input(const T* x, const void* initial_states, const P& p, int64 b, int64 c,
                                          int64 pos) {
    if (c >= p.dim || pos >= p.seqlen || pos < -(p.width - 1)) return T();
    return pos >= 0 ? x[b * p.x_batch_stride + c * p.x_c_stride + pos * p.x_l_stride]
                    : from_acc<T>(input_at<float>(x, initial_states, p, b, c, pos));
}

// SiLU(z) = z * sigmoid(z). float: fast exp and reciprocal (relative error ~1e-7; exp(-z) = inf
// for z < -88 gives -0, the limit). double: exact.
__device__ __forceinline__ float silu(float z) { return __fdividef(z, 1.0f + __expf(-z)); }
__device__ __forceinline__ double silu(double z) { return z / (1.0 + exp(-z)); }

// SiLU of a float32 sum for an output of type T. 16-bit outputs: z sigmoid(z) = h + h tanh(h)
// with h = z / 2, one MUFU.TANH and two FP instructions (silu: two MUFUs and three); at most
// 1.1e-5 from the exact SiLU up to 64 in magnitude (benchmarks/NOTES.md, "SiLU through
// tanh.approx"), so a 16-bit output is within one rounding of the exact one. z = -inf gives
// NaN, as silu does. float32 outputs: silu.
template <typename T>
__device__ __forceinline__ float silu_out(float z) {
    if constexpr (sizeof(T) == 2) {
        const float h = 0.5f * z;
        return fmaf(h, tanh_approx(h), h);
    } else {
        return silu(z);
    }
}

// A compile-time bool as a value, to pass to generic lambdas: f(Flag<true>()).
template <bool B> struct Flag { static constexpr bool value = B; };

template <typename A, typename B> constexpr bool same_type = false;
template <typename A> constexpr bool same_type<A, A> = true;

// Select<B, X, Y>::type: X if B, else Y.
template <bool B, typename X, typename Y> struct Select { using type = X; };
template <typename X, typename Y> struct Select<false, X, Y> { using type = Y; };

// dst[i] = A(src[i]) for N values of T: bfloat16 pairs are widened with one shift or mask each,
// float16 pairs with one conversion (src 4-byte aligned), an odd last value alone.
template <typename T, typename A, int N>
__device__ __forceinline__ void widen(const T* src, A* dst) {
    if constexpr (N % 2 && sizeof(T) == 2) {  // (the half types)
        widen<T, A, N - 1>(src, dst);
        dst[N - 1] = A(to_acc(src[N - 1]));
    } else if constexpr (same_type<T, __nv_bfloat16>) {
        #pragma unroll
        for (int i = 0; i < N; i += 2) {
            const unsigned u = *reinterpret_cast<const unsigned*>(src + i);
            dst[i] = __uint_as_float(u << 16);
            dst[i + 1] = __uint_as_float(u & 0xffff0000u);
        }
    } else if constexpr (same_type<T, __half>) {
        #pragma unroll
        for (int i = 0; i < N; i += 2) {
            const float2 f = __half22float2(*reinterpret_cast<const __half2*>(src + i));
            dst[i] = f.x;
            dst[i + 1] = f.y;
        }
    } else {
        #pragma unroll
        for (int i = 0; i < N; ++i) dst[i] = to_acc(src[i]);
    }
}

// Raw storage of one aligned access of BYTES bytes.
template <int BYTES> struct RawOf;
template <> struct RawOf<2> { using type = unsigned short; };
template <> struct RawOf<4> { using type = unsigned; };
template <> struct RawOf<8> { using type = uint2; };
template <> struct RawOf<16> { using type = uint4; };

// One vector of V elements of T, loaded and stored as one BYTES-wide access.
template <typename T, int BYTES = 16>
struct Vec {
    static constexpr int V = BYTES / sizeof(T);
    using Raw = typename RawOf<BYTES>::type;
    union { Raw raw; T e[V]; };
};

// A run of N consecutive elements of S is read in accesses of run_width<N, S>() bytes: the
// widest (at most 16) that N sizeof(S) divides into; its start must be aligned to that width.
template <int N, typename S>
__host__ __device__ constexpr int run_width() {
    constexpr int bytes = N * (int)sizeof(S);
    return bytes % 16 == 0 ? 16 : bytes % 8 == 0 ? 8 : bytes % 4 == 0 ? 4 : 2;
}
template <int N, typename S>
__device__ __forceinline__ bool run_aligned(const S* p) {
    return (reinterpret_cast<unsigned long long>(p) & (run_width<N, S>() - 1)) == 0;
}
// dst[i] = A(p[i]) for the run of N elements at p (run_aligned).
template <int N, typename S, typename A>
__device__ __forceinline__ void load_run(const S* p, A* dst) {
    constexpr int W = run_width<N, S>();
    using Raw = typename RawOf<W>::type;
    union { Raw raw[N * sizeof(S) / W]; S e[N]; } u;
    #pragma unroll
    for (int j = 0; j < N * (int)sizeof(S) / W; ++j) u.raw[j] = reinterpret_cast<const Raw*>(p)[j];
    if constexpr (N % 2 == 0) {
        widen<S, A, N>(u.e, dst);
    } else {
        #pragma unroll
        for (int i = 0; i < N; ++i) dst[i] = A(to_acc(u.e[i]));
    }
}

// The fast kernels fold SiLU's first multiply into their weights and bias: they accumulate
// a = s z with s = act_scale<A>(silu_act) (-log2(e) for SiLU in float32, else 1), and
// silu_scaled(a) = z / (1 + 2^a) = a / (s + s 2^a): one exp2, one FMA, one reciprocal and one
// FMA per output (its + 0 makes a zero a +0). float64 is not scaled and takes the exact silu.
constexpr float SILU_SCALE = -1.4426950408889634f;  // -log2(e)
template <typename A>
__device__ __forceinline__ A act_scale(int silu_act) {
    return silu_act && same_type<A, float> ? A(SILU_SCALE) : A(1);
}
__device__ __forceinline__ float silu_scaled(float a) {
    constexpr float s = SILU_SCALE;
    const float z = mul_plus_zero(a, rcp_approx(fmaf(ex2_approx(a), s, s)));
    return z;  // z = -inf: a = inf, 2^a = inf, r = -0, NaN (as z / (1 + exp(-z)))
}
__device__ __forceinline__ double silu_scaled(double z) { return silu(z); }

// out[i] = T(act(z[i])) for N values accumulated as acc[i] = act_scale<A>(silu_act) z[i]: the
// activation as one uniform branch for all of them, and half types converted two at a time.
template <typename T, typename A, int N>
__device__ __forceinline__ void activate_store(A (&acc)[N], int silu_act, T* out) {
    if (silu_act) {
        #pragma unroll
        for (int i = 0; i < N; ++i) acc[i] = silu_scaled(acc[i]);
    }
    if constexpr (same_type<T, __nv_bfloat16> && N % 2 == 0) {
        #pragma unroll
        for (int i = 0; i < N; i += 2)
            *reinterpret_cast<__nv_bfloat162*>(out + i) = __floats2bfloat162_rn(acc[i], acc[i + 1]);
    } else if constexpr (same_type<T, __half> && N % 2 == 0) {
        #pragma unroll
        for (int i = 0; i < N; i += 2)
            *reinterpret_cast<__half2*>(out + i) = __floats2half2_rn(acc[i], acc[i + 1]);
    } else {
        #pragma unroll
        for (int i = 0; i < N; ++i) out[i] = from_acc<T>(acc[i]);
    }
}
