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

// The output of a sum acc: 0 at padding, else act(acc).
template <typename A>
__device__ __forceinline__ A finish(A acc, bool padding, int silu_act) {
    if (padding) return A(0);
    return silu_act ? silu(acc) : acc;
}
