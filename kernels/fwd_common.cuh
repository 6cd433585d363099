// fwd_common.cuh: what every forward kernel shares.
//
//   out[b,c,t] = act(bias[c] + sum_k weight[c,k] * h(b,c,t, t-(K-1)+k))
//
// h is the input the output at t may see at position s: x[b,c,s] for s >= 0, initial_states
// for s < 0, zero across a seq_idx boundary; a negative seq_idx marks padding (output 0).
//
// Every forward kernel takes the seven array pointers (FWD_ARRAYS; null for absent inputs)
// and one parameter struct by value. The structs and the launch constants the kernels share
// with their plan (GENERAL_RUN, MMA_WARPS, ...) are not written here: cupyconv generates them
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

// The output at position pos of row (b, c) from its own taps, in float32 sums (bias, SiLU): the
// tensor-core kernels' outputs that came out non-finite, computed again (a non-finite input
// meets their bands' zero weights too, 0 inf = NaN).
template <typename T, typename P>
__device__ __forceinline__ float own_output(const T* x, const void* weight, const void* bias,
                                            const void* initial_states, const P& p, int64 b, int64 c, int64 pos) {
    const int width = (int)p.width;
    float acc = bias ? load_as<float>(bias, (int)p.bias_dtype, c * p.bias_stride) : 0.f;
    for (int k = 0; k < width; ++k)
        acc += load_as<float>(weight, (int)p.weight_dtype, c * p.weight_c_stride + k * p.weight_width_stride) *
               input_at<float>(x, initial_states, p, b, c, pos - (width - 1) + k);
    return p.silu_act ? silu(acc) : acc;
}

// Warps of the main blocks (the grid-stride step of the warp-per-item kernels).
template <typename P>
__device__ __forceinline__ int64 main_warps(const P& p) { return p.main_blocks * (int64)(blockDim.x / 32); }

// final_states[b,c,j] = h(b, c, L-1, L-(K-1)+j), j < K-1, written by the blocks past the
// main kernel's p.main_blocks: a call that asks for final_states launches them with its main
// kernel (one launch for both), or alone (fwd_final_states, main_blocks 0) when x has no token.
// Returns whether this block was one of them; every kernel starts with it, and so waits here for
// the kernel before it in the stream (every forward kernel is a programmatic dependent launch).
template <typename T, typename P>
__device__ __forceinline__ bool final_states_blocks(const T* x, const void* seq_idx, const void* initial_states,
                                                    T* final_states, const P& p) {
    wait_for_previous_kernel();
    if (blockIdx.x < p.main_blocks) return false;
    using A = typename AccOf<T>::type;
    const int64 dim = p.dim, seqlen = p.seqlen, n_state = p.width - 1;
    const int64 threads = blockDim.x * blockDim.y, total = p.batch * dim * n_state;
    for (int64 i = (blockIdx.x - p.main_blocks) * threads + threadIdx.y * blockDim.x + threadIdx.x;
         i < total; i += (gridDim.x - p.main_blocks) * threads) {
        const int64 j = i % n_state, c = (i / n_state) % dim, b = i / (n_state * dim);
        const int64 s = seqlen - n_state + j;
        A v = input_at<A>(x, initial_states, p, b, c, s);
        if (seq_idx) {
            const int64 sid = segment_id(seq_idx, p, b, seqlen - 1);
            if (sid < 0 || segment_id(seq_idx, p, b, s) != sid) v = A(0);
        }
        final_states[b * p.final_batch_stride + c * p.final_c_stride + j * p.final_l_stride] = from_acc<T>(v);
    }
    return true;
}
