// fwd_general.cu: the forward for any strides and any width, and the final states.
//
//   fwd_general<T>       any strides, run-time width: a thread computes a run of GENERAL_RUN
//                        consecutive outputs of one row.
//   fwd_final_states<T>  final_states[b,c,j] = h(b,c,L-1, L-(K-1)+j) when x has no token
//                        (with tokens the main kernel's extra blocks write them:
//                        final_states_blocks, fwd_common.cuh).
// Both loop over their work grid-stride, so no grid dimension limits the shape; every offset
// is 64-bit.
#include "fwd_common.cuh"

// fwd_general: each tap is loaded once per run, and the inputs slide through a window of
// GENERAL_RUN registers (one new input per tap). p.channels_fastest numbers the runs channels
// fastest (for channel-contiguous data: a warp's loads are coalesced), else time fastest.
template <typename T>
__global__ void fwd_general(FWD_ARRAYS, const __grid_constant__ FwdGeneralParams p) {
    if (final_states_blocks(x, seq_idx, initial_states, final_states, p)) return;
    using A = typename AccOf<T>::type;
    const int64 batch = p.batch, dim = p.dim, seqlen = p.seqlen, weight_c_stride = p.weight_c_stride,
                weight_width_stride = p.weight_width_stride, bias_stride = p.bias_stride;
    const int width = (int)p.width, weight_dtype = (int)p.weight_dtype, bias_dtype = (int)p.bias_dtype,
              silu_act = (int)p.silu_act, channels_fastest = (int)p.channels_fastest;
    constexpr int R = GENERAL_RUN;
    const int64 n_runs = (seqlen + R - 1) / R;
    const int64 total = batch * dim * n_runs;
    for (int64 i = blockIdx.x * (int64)blockDim.x + threadIdx.x; i < total;
         i += p.main_blocks * (int64)blockDim.x) {
        int64 b, c, run;
        if (channels_fastest) {
            c = i % dim;
            run = (i / dim) % n_runs;
            b = i / (dim * n_runs);
        } else {
            run = i % n_runs;
            c = (i / n_runs) % dim;
            b = i / (dim * n_runs);
        }
        const int64 t0 = run * R;
        // Input (and segment id) at position s of the row: zero past the end.
        auto input = [&](int64 s) { return s < seqlen ? input_at<A>(x, initial_states, p, b, c, s) : A(0); };
        auto seg = [&](int64 s) { return s < seqlen ? segment_id(seq_idx, p, b, s) : (int64)-1; };
        A acc[R], win[R];
        int64 sid[R], ids[R];
        const A bias_c = bias ? load_as<A>(bias, bias_dtype, c * bias_stride) : A(0);
        #pragma unroll
        for (int r = 0; r < R; ++r) {  // window of tap 0: positions t0 + r - (K-1)
            acc[r] = bias_c;
            win[r] = input(t0 + r - (width - 1));
            if (seq_idx) {
                sid[r] = seg(t0 + r);
                ids[r] = seg(t0 + r - (width - 1));
            }
        }
        #pragma unroll 1
        for (int k = 0; k < width; ++k) {
            const A wk = load_as<A>(weight, weight_dtype, c * weight_c_stride + k * weight_width_stride);
            #pragma unroll
            for (int r = 0; r < R; ++r)
                if (!seq_idx || ids[r] == sid[r]) acc[r] += wk * win[r];
            const int64 s_next = t0 + R - (width - 1) + k;  // enters the window for tap k + 1
            #pragma unroll
            for (int r = 0; r + 1 < R; ++r) {
                win[r] = win[r + 1];
                if (seq_idx) ids[r] = ids[r + 1];
            }
            if (k + 1 < width) {
                win[R - 1] = input(s_next);
                if (seq_idx) ids[R - 1] = seg(s_next);
            }
        }
        T* const orow = out + b * p.out_batch_stride + c * p.out_c_stride;
        #pragma unroll
        for (int r = 0; r < R; ++r)
            if (t0 + r < seqlen)
                orow[(t0 + r) * p.out_l_stride] = from_acc<T>(finish(acc[r], seq_idx && sid[r] < 0, silu_act));
    }
}

// fwd_final_states: the final states alone (x without tokens), main_blocks 0.
template <typename T>
__global__ void fwd_final_states(FWD_ARRAYS, const __grid_constant__ FwdFinalParams p) {
    final_states_blocks(x, seq_idx, initial_states, final_states, p);
}
