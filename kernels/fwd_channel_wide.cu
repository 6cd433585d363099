// fwd_channel_wide.cu: the forward for channel-contiguous x and any width (run-time; the plan
// uses it above CHANNEL_NARROW_WIDTH where fwd_channel and fwd_mma do not serve), without
// seq_idx.
//
//   fwd_channel_wide<T>
//       a block of CHANNEL_WIDE_WARPS warps computes a tile of 32 V channels x p.steps time
//       steps, V = 8 / sizeof(A): a lane's channels are 8 bytes of accumulators.
//
// The block stages the tile's p.steps + K - 1 input rows (zeros or initial_states before the
// row, zeros past it; float32 and float64 x by cp.async) and the tile's taps, scaled for the
// activation, in shared memory as A, a lane's V values as one 8-byte slot (the plan places the taps at byte p.weights_at); then
// each warp computes p.steps / CHANNEL_WIDE_WARPS steps of the tile, R = CHANNEL_WIDE_RUN
// outputs of each of its lane's channels at a time: a tap is one shared load of V taps for R V
// FMAs, and the inputs slide through a ring of R registers that the loop over the taps, unrolled
// R at a time, indexes at compile time (the last width % R taps in a predicated tail). Lanes
// read consecutive slots: no bank conflicts.
#include "fwd_common.cuh"

template <typename T>
__global__ void __launch_bounds__(32 * CHANNEL_WIDE_WARPS)
    fwd_channel_wide(FWD_ARRAYS, const __grid_constant__ FwdChannelWideParams p) {
    if (final_states_blocks(x, seq_idx, initial_states, final_states, p)) return;
    using A = typename AccOf<T>::type;
    constexpr int V = 8 / sizeof(A);  // channels a lane
    constexpr int R = CHANNEL_WIDE_RUN;
    constexpr int WARPS = CHANNEL_WIDE_WARPS;
    using Slot = Vec<A, 8>;                   // a lane's V accumulators
    using In = Vec<T, V * sizeof(T)>;         // a lane's V elements of x or out
    const int64 batch = p.batch, dim = p.dim, seqlen = p.seqlen, x_batch_stride = p.x_batch_stride,
                x_l_stride = p.x_l_stride, weight_c_stride = p.weight_c_stride,
                weight_width_stride = p.weight_width_stride, bias_stride = p.bias_stride,
                out_batch_stride = p.out_batch_stride, out_c_stride = p.out_c_stride, out_l_stride = p.out_l_stride;
    const int width = (int)p.width, weight_dtype = (int)p.weight_dtype, bias_dtype = (int)p.bias_dtype,
              silu_act = (int)p.silu_act, steps = (int)p.steps, x_aligned = (int)p.x_aligned,
              out_aligned = (int)p.out_aligned;
    const int rows = steps + width - 1;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    typename Slot::Raw* const xs = reinterpret_cast<typename Slot::Raw*>(smem_raw);  // [rows][32]
    typename Slot::Raw* const ws = reinterpret_cast<typename Slot::Raw*>(smem_raw + p.weights_at);  // [width][32]
    const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
    const A scale = act_scale<A>(silu_act);
    const int64 strips = (dim + 32 * V - 1) / (32 * V), chunks = (seqlen + steps - 1) / steps;
    const int64 n_tiles = batch * chunks * strips;
    for (int64 tile = blockIdx.x; tile < n_tiles; tile += p.main_blocks) {
        int64 bc, strip, b, chunk;
        divmod(tile, strips, bc, strip);
        divmod(bc, chunks, b, chunk);
        const int64 c0 = strip * (32 * V) + lane * V, t0 = chunk * steps;  // the lane's first channel
        const bool whole = c0 + V <= dim;  // all of the lane's V channels exist
        __syncthreads();                   // the previous tile's readers are done
        // Row r: position t0 - (K - 1) + r.
        const T* const xb = x + b * x_batch_stride + c0;
        #pragma unroll 4
        for (int r = warp; r < rows; r += WARPS) {
            const int64 pos = t0 - (width - 1) + r;
            if constexpr (same_type<T, A>) {  // whole slots of x by cp.async, zeros past the row
                if (x_aligned && whole && pos >= 0) {
                    const bool in_row = pos < seqlen;
                    cp_async<8>(xs + r * 32 + lane, in_row ? xb + pos * x_l_stride : xb, in_row ? 8 : 0);
                    continue;
                }
            }
            Slot v;
            if (x_aligned && whole && pos >= 0 && pos < seqlen) {
                In in;
                in.raw = *reinterpret_cast<const typename In::Raw*>(xb + pos * x_l_stride);
                widen<T, A, V>(in.e, v.e);
            } else {
                #pragma unroll
                for (int j = 0; j < V; ++j)
                    v.e[j] = c0 + j < dim && pos < seqlen ? input_at<A>(x, initial_states, p, b, c0 + j, pos) : A(0);
            }
            xs[r * 32 + lane] = v.raw;
        }
        cp_async_commit();
        for (int k = warp; k < width; k += WARPS) {
            Slot w;
            #pragma unroll
            for (int j = 0; j < V; ++j)
                w.e[j] = c0 + j < dim ? scale * load_as<A>(weight, weight_dtype,
                                                            (c0 + j) * weight_c_stride + k * weight_width_stride)
                                      : A(0);
            ws[k * 32 + lane] = w.raw;
        }
        A bias_v[V];
        #pragma unroll
        for (int j = 0; j < V; ++j)
            bias_v[j] = bias && c0 + j < dim ? scale * load_as<A>(bias, bias_dtype, (c0 + j) * bias_stride) : A(0);
        cp_async_wait<0>();
        __syncthreads();
        if (c0 >= dim) continue;  // (nothing below is collective)

        const int per_warp = steps / WARPS;
        #pragma unroll 1
        for (int o = warp * per_warp; o < (warp + 1) * per_warp && t0 + o < seqlen; o += R) {
            // Output o + r reads rows o + r + k, k < width; win[(r + j) % R] holds row o + k0 + j
            // + r at tap k0 + j.
            const typename Slot::Raw* const xr = xs + o * 32 + lane;
            A acc[R][V], win[R][V];
            #pragma unroll
            for (int r = 0; r < R; ++r) {
                #pragma unroll
                for (int j = 0; j < V; ++j) acc[r][j] = bias_v[j];
                if (r < R - 1) {
                    Slot s;
                    s.raw = xr[r * 32];
                    #pragma unroll
                    for (int j = 0; j < V; ++j) win[r][j] = s.e[j];
                }
            }
            auto tap = [&](int k, int j) {  // tap k = k0 + j, j < R known at compile time
                Slot s, w;
                s.raw = xr[(k + R - 1) * 32];
                w.raw = ws[k * 32 + lane];
                #pragma unroll
                for (int v = 0; v < V; ++v) win[(j + R - 1) % R][v] = s.e[v];
                #pragma unroll
                for (int r = 0; r < R; ++r)
                    #pragma unroll
                    for (int v = 0; v < V; ++v) acc[r][v] += w.e[v] * win[(r + j) % R][v];
            };
            int k0 = 0;
            #pragma unroll 1
            for (; k0 + R <= width; k0 += R) {
                #pragma unroll
                for (int j = 0; j < R; ++j) tap(k0 + j, j);
            }
            #pragma unroll
            for (int j = 0; j < R - 1; ++j)
                if (k0 + j < width) tap(k0 + j, j);

            T* dst = out + b * out_batch_stride + c0 * out_c_stride + (t0 + o) * out_l_stride;
            #pragma unroll
            for (int r = 0; r < R; ++r, dst += out_l_stride) {
                if (t0 + o + r >= seqlen) break;
                In res;
                activate_store(acc[r], silu_act, res.e);
                if (out_aligned && whole) {
                    *reinterpret_cast<typename In::Raw*>(dst) = res.raw;
                } else {
                    #pragma unroll
                    for (int j = 0; j < V; ++j)
                        if (c0 + j < dim) dst[j * out_c_stride] = res.e[j];
                }
            }
        }
    }
}
