// fwd_common.cuh: what every forward kernel shares.
//
//   out[b,c,t] = act(bias[c] + sum_k weight[c,k] * h(b,c,t, t-(K-1)+k))
//
// h is the input the output at t may see at position s: x[b,c,s] for s >= 0, initial_states
// for s < 0, zero across a seq_idx boundary; a negative seq_idx marks padding (output 0).
//
// Every forward kernel takes the seven array pointers (FWD_ARRAYS; null for absent inputs)
// and one parameter struct by value. The structs and the launch constants the kernels share
// with their plan (GENERAL_RUN, MMA_BLOCKS, ...) are not written here: cupyconv generates them
// from its forward plan (cupyconv/_forward_plan.py: CONSTANTS, FIELDS, KERNELS) and
// prepends them to the source, so each is defined once. Each struct holds, in 8-byte fields,
// the call's FIELDS (batch, dim, seqlen, width; x_batch_stride, x_c_stride, x_l_stride and the
// other arrays' strides, in elements; their dtype codes; silu_act), then the fields its own
// kernel's plan sets (x_aligned, chunk_divisor, ...), named for what that kernel does with them.
#pragma once
#include "common.cuh"

#define FWD_ARRAYS                                                                           \
    const T* __restrict__ x, const void* __restrict__ weight, const void* __restrict__ bias, \
        const void* __restrict__ seq_idx, const void* __restrict__ initial_states,           \
        T* __restrict__ out, T* __restrict__ final_states

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

// The output of a sum acc: 0 at padding, else act(acc).
template <typename A>
__device__ __forceinline__ A finish(A acc, bool padding, int silu_act) {
    if (padding) return A(0);
    return silu_act ? silu(acc) : acc;
}
