// bwd_common.cuh: what every backward kernel shares.
//
// The backward of out[b,c,t] = act(z[b,c,t]), z = bias[c] + sum_k weight[c,k] h(b,c,t, t-(K-1)+k)
// (docs/semantics.md, "Backward"), with dz = dout act'(z) (0 at padding; SiLU's derivative taken
// at the recomputed z, the forward output is not saved):
//
//   dx[b,c,s]      = sum_k weight[c,k] dz[b,c,s+(K-1)-k]   over the outputs that see s
//                    + dfinal_states[b,c,j]              for s = L-(K-1)+j visible from L-1
//   dinitial_states  the same sum for the positions s < 0 (the first segment's)
//   dweight[c,k]   = sum_{b,t} dz[b,c,t] h(b,c,t, t-(K-1)+k)
//   dbias[c]       = sum_{b,t} dz[b,c,t]
//
// dweight and dbias are reduced without floating-point atomics: each work item of a kernel
// writes its own partial sums, partials[part][c][k] (k = K: the bias), and bwd_reduce adds
// them in a fixed order, so every result is the same from run to run. A call of a single part
// has no partials array (null): its sums are the results, written straight into dweight and
// dbias (write_sum), and it launches no bwd_reduce.
//
// Every backward kernel takes the thirteen array pointers (BWD_ARRAYS; null for absent ones)
// and one parameter struct by value, generated from cupyconv/_backward_plan.py (CONSTANTS,
// FIELDS, KERNELS) as the forward's are: the call's FIELDS (batch, dim, seqlen, width; the
// arrays' strides in elements: x_*, weight_*, bias_stride, seq_*, init_*, dout_*, dfinal_*,
// dx_*, dinit_*, dweight_*, dbias_stride; dtype codes; silu_act; n_parts), then the fields of
// its own kernel's plan.
#pragma once
#include "common.cuh"

#define BWD_ARRAYS                                                                                    \
    const T* __restrict__ x, const void* __restrict__ weight, const void* __restrict__ bias,          \
        const void* __restrict__ seq_idx, const void* __restrict__ initial_states,                    \
        const T* __restrict__ dout, const void* __restrict__ dfinal_states, T* __restrict__ dx,       \
        void* __restrict__ dweight, void* __restrict__ dbias, T* __restrict__ dinitial_states,        \
        typename AccOf<T>::type* __restrict__ partials, typename AccOf<T>::type* __restrict__ scratch

// Warps per SM that the fast kernels' register budgets (__launch_bounds__) are set for, by the
// bytes of an element, the channels a lane computes and the width: WARPS_PER_SM (the plan's),
// 16 for four channels a lane or widths from 6 (bwd_channel's rings and taps: at WARPS_PER_SM's
// 96 registers they spilled, 52-524 bytes a thread at widths 6-8; benchmarks/NOTES.md,
// "Register budgets under NVRTC 13"), 12 for one channel a lane past width 16 (168 registers:
// no spills up to width 24 without seq_idx; "bwd_channel one channel a lane"), 8 for float64.
__host__ __device__ constexpr int bwd_warps_per_sm(int bytes, int channels, int width = 0) {
    return bytes == 8 ? 8 : channels == 1 && width > 16 ? 12 : channels > 2 || width >= 6 ? 16 : WARPS_PER_SM;
}

// Sum k of channel c (k < width: of dweight[c, k]; k == width: of dbias[c]) as the result
// itself, rounded once to its dtype as bwd_reduce rounds its totals. Out of line: the fast
// kernels' code stays as compact as with partials alone.
template <typename A, typename P>
__device__ __noinline__ void write_result(void* dweight, void* dbias, const P& p, int64 c, int64 k, A v) {
    if (k < p.width)
        store_as(dweight, (int)p.weight_dtype, c * p.dweight_c_stride + k * p.dweight_width_stride, v);
    else if (dbias)
        store_as(dbias, (int)p.bias_dtype, c * p.dbias_stride, v);
}

// Sum k of channel c over work item `part`: into the partials, or without them (a single
// part) into dweight / dbias (write_result).
template <typename A, typename P>
__device__ __forceinline__ void write_sum(A* partials, void* dweight, void* dbias, const P& p, int64 part,
                                          int64 c, int64 k, A v) {
    if (partials)
        partials[(part * p.dim + c) * (p.width + 1) + k] = v;
    else
        write_result(dweight, dbias, p, c, k, v);
}

// A warp's sums of channel c as part `part` (write_sum): dweight's taps k = lane + 32 j (this
// lane's dw[j]) and dbias (this lane's db, summed over the warp); zeroes them.
template <int N, typename A, typename P>
__device__ __forceinline__ void write_warp_sums(A* partials, void* dweight, void* dbias, const P& p, int64 part,
                                                int64 c, A (&dw)[N], A& db) {
    const int lane = threadIdx.x & 31, width = (int)p.width;
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) db += __shfl_xor_sync(0xffffffffu, db, o);
    #pragma unroll
    for (int j = 0; j < N; ++j) {
        if (lane + 32 * j < width) write_sum(partials, dweight, dbias, p, part, c, lane + 32 * j, dw[j]);
        dw[j] = 0.f;
    }
    if (lane == 0) write_sum(partials, dweight, dbias, p, part, c, width, db);
    db = 0.f;
}

// SiLU's derivative, sigmoid(z) (1 + z (1 - sigmoid(z))). float: fast exp and reciprocal
// (exp(-z) = inf gives sigmoid 0), then r + r (z - z r) in two FMAs (6 instructions); double:
// exact.
__device__ __forceinline__ float silu_grad(float z) {
    const float r = rcp_approx(1.0f + __expf(-z));
    return fmaf(r, fmaf(-z, r, z), r);
}
__device__ __forceinline__ double silu_grad(double z) {
    const double s = 1.0 / (1.0 + exp(-z));
    return s * (1.0 + z * (1.0 - s));
}

// The same in the frame of bwd_time and bwd_channel with SiLU: their taps and bias come
// multiplied by act_scale (common.cuh; float: -log2(e)), so the pre-activation they sum is
// z' = scale z, ready for ex2; their dz is dz' = dz / scale (so dx = sum of scaled taps x dz'),
// and their dweight / dbias sums are multiplied by the scale once at the end.
// silu_grad_scaled(z') = silu_grad(z) / scale: 6 instructions an element, as many as
// silu_grad's with its exp scale since silu_grad ends in two FMAs (the frame saved one before).
__device__ __forceinline__ float silu_grad_scaled(float zs) {
    constexpr float ln2 = 0.6931471805599453f, ln2_sq = 0.4804530139182014f;
    const float r = rcp_approx(1.0f + ex2_approx(zs));
    // r (1 + z (1 - r)) / scale = r (z' (1 - r) ln2^2 - ln2)
    return r * fmaf(zs, fmaf(r, -ln2_sq, ln2_sq), -ln2);
}
__device__ __forceinline__ double silu_grad_scaled(double z) { return silu_grad(z); }

// dz at (b, c, t), 0 <= t < L, computed from scratch: any strides, any width.
template <typename A, typename T, typename P>
__device__ A dz_at(const T* x, const void* weight, const void* bias, const void* seq_idx,
                   const void* initial_states, const T* dout, const P& p, int64 b, int64 c, int64 t) {
    const int64 sid = seq_idx ? segment_id(seq_idx, p, b, t) : 0;
    if (sid < 0) return A(0);  // padding
    const A g = A(to_acc(dout[b * p.dout_batch_stride + c * p.dout_c_stride + t * p.dout_l_stride]));
    if (!p.silu_act) return g;
    A z = bias ? load_as<A>(bias, (int)p.bias_dtype, c * p.bias_stride) : A(0);
    for (int k = 0; k < (int)p.width; ++k) {
        const int64 s = t - (p.width - 1) + k;
        if (seq_idx && segment_id(seq_idx, p, b, s) != sid) continue;
        z += load_as<A>(weight, (int)p.weight_dtype, c * p.weight_c_stride + k * p.weight_width_stride) *
             input_at<A>(x, initial_states, p, b, c, s);
    }
    return g * silu_grad(z);
}

// dx of bfloat16 row (b, c) at positions start + o, from <= o < n, each from its own taps and
// dz computed from scratch (dz_at): the tensor-core kernels' exact path for non-finite values.
// Out of line: finite inputs never call it.
template <typename P>
__device__ __noinline__ void exact_dx(const __nv_bfloat16* x, const void* weight, const void* bias,
                                      const void* initial_states, const __nv_bfloat16* dout, __nv_bfloat16* dx,
                                      const P& p, int64 b, int64 c, int64 start, int from, int n) {
    const int lane = threadIdx.x & 31, width = (int)p.width, wcode = (int)p.weight_dtype;
    const int64 wc = c * p.weight_c_stride, ws = p.weight_width_stride;
    __nv_bfloat16* const dxr = dx + b * p.dx_batch_stride + c * p.dx_c_stride;
    for (int o = from + lane; o < n; o += 32) {
        const int64 s = start + o;
        float a = 0.f;
        for (int k = 0; k < width; ++k) {
            const int64 t = s + width - 1 - k;
            if (t < p.seqlen)
                a += load_as<float>(weight, wcode, wc + k * ws) *
                     dz_at<float>(x, weight, bias, nullptr, initial_states, dout, p, b, c, t);
        }
        dxr[s * p.dx_l_stride] = __float2bfloat16_rn(a);
    }
}

// The dfinal_states term of position s >= L-(K-1) (s may be negative when L < K-1): the
// gradient of final_states[b,c,s-(L-(K-1))] when s is visible from the last token.
template <typename A, typename P>
__device__ __forceinline__ A dfinal_at(const void* dfinal_states, const void* seq_idx, const P& p, int64 b,
                                       int64 c, int64 s) {
    if (seq_idx) {
        const int64 last = segment_id(seq_idx, p, b, p.seqlen - 1);
        if (last < 0 || segment_id(seq_idx, p, b, s) != last) return A(0);
    }
    const int64 j = s - (p.seqlen - (p.width - 1));
    return load_as<A>(dfinal_states, (int)p.dfinal_dtype,
                      b * p.dfinal_batch_stride + c * p.dfinal_c_stride + j * p.dfinal_l_stride);
}
