// varlen.cu: the states of packed sequences, causal_conv1d_varlen_states.
//
//   states[n,c,j] = x[end_n - state_len + j, c]  where that token is in sequence n
//                   (end_n - state_len + j >= start_n), else 0;  start_n = cu_seqlens[n],
//                   end_n = cu_seqlens[n+1]
//
//   varlen_states<T>  one thread per element of states, channels fastest (x's rows and the
//                     [N, state_len, dim] layout of states are channel-contiguous: a warp's
//                     reads and writes are coalesced). Copies: no arithmetic on the values.
//
// VarlenParams comes with the prelude cupyconv generates from cupyconv/_varlen_plan.py: FIELDS
// (n_seqs, dim, state_len, the strides in elements, cu_dtype), then dim_divisor, state_divisor.
#include "common.cuh"

template <typename T>
__global__ void varlen_states(const T* __restrict__ x, const void* __restrict__ cu_seqlens,
                              T* __restrict__ states, const __grid_constant__ VarlenParams p) {
    const int64 dim = p.dim, state_len = p.state_len;
    const int64 total = p.n_seqs * state_len * dim;
    for (int64 i = blockIdx.x * (int64)blockDim.x + threadIdx.x; i < total;
         i += (int64)gridDim.x * blockDim.x) {
        int64 q, c, n, j;
        divmod_fast(i, dim, p.dim_divisor, q, c);
        divmod_fast(q, state_len, p.state_divisor, n, j);
        const int code = (int)p.cu_dtype;
        const int64 start = load_index(cu_seqlens, code, n * p.cu_stride);
        const int64 end = load_index(cu_seqlens, code, (n + 1) * p.cu_stride);
        const int64 s = end - state_len + j;
        states[n * p.states_n_stride + c * p.states_c_stride + j * p.states_l_stride] =
            s >= start ? x[s * p.x_t_stride + c * p.x_c_stride] : from_acc<T>(typename AccOf<T>::type(0));
    }
}
