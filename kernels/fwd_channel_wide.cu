// fwd_channel_wide.cu: the forward for channel-contiguous x and any width (run-time; the plan
// uses it above CHANNEL_MAX_WIDTH), without seq_idx.
//
//   fwd_channel_wide<T>
//       a block of CHANNEL_WIDE_WARPS warps computes a tile of CHANNEL_WIDE_CHANNELS channels x
//       CHANNEL_WIDE_STEPS time steps.
//
// The block stages the tile's TT + K - 1 input rows (zeros or initial_states before the row,
// zeros past it) and the tile's weights in shared memory as A (the plan places the weights at
// byte p.weights_at), then lane l of warp w computes channel l over time steps w RW ..
// (w + 1) RW of the tile, R at a time: each tap is read once per R outputs and the inputs
// slide through R registers. Lanes read adjacent channels: no bank conflict.
#include "fwd_common.cuh"

template <typename T>
__global__ void __launch_bounds__(32 * CHANNEL_WIDE_WARPS)
    fwd_channel_wide(FWD_ARRAYS, const __grid_constant__ FwdChannelWideParams p) {
    if (final_states_blocks(x, seq_idx, initial_states, final_states, p)) return;
    using A = typename AccOf<T>::type;
    const int64 batch = p.batch, dim = p.dim, seqlen = p.seqlen, weight_c_stride = p.weight_c_stride,
                weight_width_stride = p.weight_width_stride, bias_stride = p.bias_stride,
                out_batch_stride = p.out_batch_stride, out_c_stride = p.out_c_stride, out_l_stride = p.out_l_stride;
    const int width = (int)p.width, weight_dtype = (int)p.weight_dtype, bias_dtype = (int)p.bias_dtype,
              silu_act = (int)p.silu_act;
    constexpr int CW = CHANNEL_WIDE_CHANNELS;                 // channels per tile
    constexpr int TT = CHANNEL_WIDE_STEPS;                    // time steps per tile
    constexpr int RW = TT / CHANNEL_WIDE_WARPS;               // time steps per warp
    constexpr int R = 8;                                      // outputs per pass
    const int rows = TT + width - 1;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    A* const xs = reinterpret_cast<A*>(smem_raw);                   // [rows][CW]
    A* const ws = reinterpret_cast<A*>(smem_raw + p.weights_at);    // [width][CW]
    const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
    const int64 strips = (dim + CW - 1) / CW, chunks = (seqlen + TT - 1) / TT;
    const int64 n_tiles = batch * chunks * strips;
    for (int64 tile = blockIdx.x; tile < n_tiles; tile += p.main_blocks) {
        int64 bc, strip, b, chunk;
        divmod(tile, strips, bc, strip);
        divmod(bc, chunks, b, chunk);
        const int64 c0 = strip * CW, t0 = chunk * TT;
        __syncthreads();  // the previous tile's readers are done
        for (int i = threadIdx.x; i < rows * CW; i += blockDim.x) {
            const int r = i / CW, ch = i % CW;
            const int64 c = c0 + ch, pos = t0 - (width - 1) + r;
            xs[i] = c < dim && pos < seqlen ? input_at<A>(x, initial_states, p, b, c, pos) : A(0);
        }
        for (int i = threadIdx.x; i < width * CW; i += blockDim.x) {
            const int k = i / CW;
            const int64 c = c0 + i % CW;
            ws[i] = c < dim ? load_as<A>(weight, weight_dtype, c * weight_c_stride + k * weight_width_stride) : A(0);
        }
        __syncthreads();
        const int64 c = c0 + lane;
        const A bias_c = bias && c < dim ? load_as<A>(bias, bias_dtype, c * bias_stride) : A(0);
        T* const ocol = out + b * out_batch_stride + c * out_c_stride;
        #pragma unroll 1
        for (int o = warp * RW; o < (warp + 1) * RW && t0 + o < seqlen; o += R) {
            // Output o + r of the tile reads rows o + r + k (k < width).
            const A* xr = xs + o * CW + lane;
            A acc[R], win[R];
            #pragma unroll
            for (int r = 0; r < R; ++r) {
                acc[r] = bias_c;
                win[r] = xr[r * CW];
            }
            #pragma unroll 4
            for (int k = 0; k < width; ++k) {
                const A wk = ws[k * CW + lane];
                #pragma unroll
                for (int r = 0; r < R; ++r) acc[r] += wk * win[r];
                #pragma unroll
                for (int r = 0; r + 1 < R; ++r) win[r] = win[r + 1];
                if (k + 1 < width) win[R - 1] = xr[(R + k) * CW];
            }
            if (c < dim) {
                #pragma unroll
                for (int r = 0; r < R; ++r)
                    if (t0 + o + r < seqlen)
                        ocol[(t0 + o + r) * out_l_stride] = from_acc<T>(finish(acc[r], false, silu_act));
            }
        }
    }
}

