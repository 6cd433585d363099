// update.cu: the decode update, causal_conv1d_update.
//
//   out[b,c,i] = act(bias[c] + sum_k weight[c,k] * h(b,c, i-(K-1)+k)),   i < seqlen
//
// h(b,c,s) is x[b,c,s] for s >= 0 and the row's history for s < 0: the K-1 inputs before the
// new tokens, read from conv_state row r = conv_state_indices[b] (or b) before anything is
// written. Sliding mode: state[r,c,state_len-(K-1)+j]; afterwards the row holds the last
// state_len entries of concat(state row, x row). Circular mode (cache_seqlens): with p =
// cache_seqlens[b] mod state_len, history j is at (p-(K-1)+j) mod state_len and token i is
// written at (p+i) mod state_len. A negative r is a padding row: out 0, no state touched.
//
//   conv_update<T, K>  one thread per (batch row, channel), channels fastest: a warp's reads
//                      and writes of x, out and a channel-contiguous state are coalesced (a
//                      time-contiguous state row is read and written whole by one thread, and
//                      a warp's rows are neighbours). K = 1..UPDATE_WINDOW: the taps and a
//                      window of K inputs in registers; K = 0: any width, inputs re-read (L1).
//
// Each thread first computes every output from the unchanged state, then writes its own state
// row: rows never share a thread, so the in-place update needs no synchronisation (two batch
// rows with the same conv_state_indices entry are the caller's error). The state has its own
// dtype (a float32 state with bfloat16 x: computed in float32, stored in float32): history is
// read and converted, state entries that move are copied bit for bit, and new tokens are
// rounded once to the state's dtype.
//
// The parameter struct UpdateParams and UPDATE_WINDOW come with the prelude cupyconv generates
// from cupyconv/_update_plan.py: FIELDS (batch, dim, seqlen, width, state_len, the arrays'
// strides in elements, their dtype codes, silu_act), then dim_divisor.
#include "common.cuh"

// The element i of the float array p (dtype `code`) set to the value of v, rounded once.
template <typename T>
__device__ __forceinline__ void store_rounded(void* p, int code, int64 i, T v) {
    if constexpr (same_type<T, double>) {
        switch (code) {
            case F32: static_cast<float*>(p)[i] = (float)v; break;
            case F16: static_cast<__half*>(p)[i] = __double2half(v); break;
            case BF16: static_cast<__nv_bfloat16*>(p)[i] = __double2bfloat16(v); break;
            default: static_cast<double*>(p)[i] = v; break;
        }
    } else {
        store_as<float>(p, code, i, to_acc(v));  // exact in float: one rounding
    }
}

// Element src of the float array p (dtype `code`) copied to element dst, bit for bit.
__device__ __forceinline__ void copy_element(void* p, int code, int64 dst, int64 src) {
    switch (code) {
        case F32: static_cast<float*>(p)[dst] = static_cast<const float*>(p)[src]; break;
        case F64: static_cast<double*>(p)[dst] = static_cast<const double*>(p)[src]; break;
        default: static_cast<unsigned short*>(p)[dst] = static_cast<const unsigned short*>(p)[src]; break;
    }
}

template <typename T, int K>
__global__ void conv_update(const T* __restrict__ x, const void* __restrict__ weight,
                            const void* __restrict__ bias, void* __restrict__ conv_state,
                            const void* __restrict__ cache_seqlens,
                            const void* __restrict__ conv_state_indices, T* __restrict__ out,
                            const __grid_constant__ UpdateParams p) {
    using A = typename AccOf<T>::type;
    const int64 dim = p.dim, seqlen = p.seqlen, state_len = p.state_len;
    const int width = K ? K : (int)p.width, state_dtype = (int)p.state_dtype;
    const int64 total = p.batch * dim;
    for (int64 i = blockIdx.x * (int64)blockDim.x + threadIdx.x; i < total;
         i += (int64)gridDim.x * blockDim.x) {
        int64 b, c;
        divmod_fast(i, dim, p.dim_divisor, b, c);
        T* const orow = out + b * p.out_batch_stride + c * p.out_c_stride;
        const int64 r = conv_state_indices
                            ? load_index(conv_state_indices, (int)p.idx_dtype, b * p.idx_stride)
                            : b;
        if (r < 0) {  // padding row
            for (int64 t = 0; t < seqlen; ++t) orow[t * p.out_l_stride] = from_acc<T>(A(0));
            continue;
        }
        const T* const xrow = x + b * p.x_batch_stride + c * p.x_c_stride;
        const int64 srow = r * p.state_batch_stride + c * p.state_c_stride, sl = p.state_l_stride;
        // Where history entry j (0 <= j < K-1) sits in the state row: at start + j, wrapped.
        int64 start = state_len - (width - 1), head = 0;
        if (cache_seqlens) {
            head = load_index(cache_seqlens, (int)p.lens_dtype, b * p.lens_stride) % state_len;
            if (head < 0) head += state_len;
            start = head - (width - 1);
            if (start < 0) start += state_len;
        }
        auto history = [&](int j) {
            int64 s = start + j;
            if (s >= state_len) s -= state_len;
            return load_as<A>(conv_state, state_dtype, srow + s * sl);
        };
        const A bias_c = bias ? load_as<A>(bias, (int)p.bias_dtype, c * p.bias_stride) : A(0);
        auto weight_at = [&](int k) {
            return load_as<A>(weight, (int)p.weight_dtype, c * p.weight_c_stride + k * p.weight_width_stride);
        };
        auto finish = [&](A acc) { return from_acc<T>(p.silu_act ? silu(acc) : acc); };
        if constexpr (K > 0) {
            A w[K], win[K];
            #pragma unroll
            for (int k = 0; k < K; ++k) w[k] = weight_at(k);
            #pragma unroll
            for (int j = 0; j + 1 < K; ++j) win[j] = history(j);
            for (int64 t = 0; t < seqlen; ++t) {
                win[K - 1] = A(to_acc(xrow[t * p.x_l_stride]));
                A acc = bias_c;
                #pragma unroll
                for (int k = 0; k < K; ++k) acc += w[k] * win[k];
                orow[t * p.out_l_stride] = finish(acc);
                #pragma unroll
                for (int k = 0; k + 1 < K; ++k) win[k] = win[k + 1];
            }
        } else {
            for (int64 t = 0; t < seqlen; ++t) {
                A acc = bias_c;
                for (int k = 0; k < width; ++k) {
                    const int64 s = t - (width - 1) + k;
                    const A v = s >= 0 ? A(to_acc(xrow[s * p.x_l_stride])) : history((int)(s + width - 1));
                    acc += weight_at(k) * v;
                }
                orow[t * p.out_l_stride] = finish(acc);
            }
        }
        if (state_len == 0) continue;
        if (cache_seqlens) {  // the last min(seqlen, state_len) tokens, in their slots
            int64 t = seqlen > state_len ? seqlen - state_len : 0;
            int64 s = (head + t) % state_len;
            for (; t < seqlen; ++t) {
                store_rounded<T>(conv_state, state_dtype, srow + s * sl, xrow[t * p.x_l_stride]);
                if (++s == state_len) s = 0;
            }
        } else {  // slide left by seqlen: ascending, each entry is read before it is overwritten
            for (int64 j = 0; j < state_len; ++j) {
                const int64 from = j + seqlen;
                if (from < state_len)
                    copy_element(conv_state, state_dtype, srow + j * sl, srow + from * sl);
                else
                    store_rounded<T>(conv_state, state_dtype, srow + j * sl, xrow[(from - state_len) * p.x_l_stride]);
            }
        }
    }
}
