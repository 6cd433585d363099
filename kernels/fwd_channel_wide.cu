// fwd_channel_wide.cu: the forward for channel-contiguous x and any width (run-time; the plan
// uses it above CHANNEL_NARROW_WIDTH where fwd_channel and fwd_mma do not serve), without
// seq_idx.
//
//   fwd_channel_wide<T>
//       a block of CHANNEL_WIDE_WARPS warps computes tiles of 32 V channels x p.steps time
//       steps, V = 8 / sizeof(A): a lane's channels are 8 bytes of accumulators.
//
// A tile's p.steps + K - 1 input rows (zeros or initial_states before the row, zeros past it)
// and its K taps sit in shared memory as A, a lane's V values as one 8-byte slot: rows of 32
// slots, the taps' rows after the inputs' (byte p.weights_at of a buffer of p.buffer_bytes).
// float32 and float64 x and taps of x's accumulation dtype are copied by cp.async, the rest
// through registers. With p.buffers = 2 the block copies its next tile into the other buffer
// while it computes this one. Each warp computes p.steps / CHANNEL_WIDE_WARPS steps of the
// tile, R = CHANNEL_WIDE_RUN outputs of each of its lane's channels at a time: a tap is one
// shared load of V taps for R V FMAs, and the inputs slide through a ring of R registers that
// the loop over the taps, unrolled R at a time, indexes at compile time (the last width % R
// taps in a predicated tail). Lanes read consecutive slots: no bank conflicts. Tiles are
// numbered channels fastest, so that the blocks at work read neighbouring channels.
#include "fwd_common.cuh"

template <typename T>
__global__ void __launch_bounds__(32 * CHANNEL_WIDE_WARPS)
    fwd_channel_wide(FWD_ARRAYS, const __grid_constant__ FwdChannelWideParams p) {
    if (final_states_blocks(x, seq_idx, initial_states, final_states, p)) return;
    using A = typename AccOf<T>::type;
    constexpr int V = 8 / sizeof(A);  // channels a lane
    constexpr int R = CHANNEL_WIDE_RUN;
    constexpr int WARPS = CHANNEL_WIDE_WARPS;
    constexpr int ACC_CODE = same_type<A, float> ? F32 : F64;
    using Slot = Vec<A, 8>;            // a lane's V accumulators
    using Raw = typename Slot::Raw;
    using In = Vec<T, V * sizeof(T)>;  // a lane's V elements of x or out
    const int64 batch = p.batch, dim = p.dim, seqlen = p.seqlen, x_batch_stride = p.x_batch_stride,
                x_l_stride = p.x_l_stride, weight_c_stride = p.weight_c_stride,
                weight_width_stride = p.weight_width_stride, bias_stride = p.bias_stride,
                out_batch_stride = p.out_batch_stride, out_c_stride = p.out_c_stride, out_l_stride = p.out_l_stride;
    const int width = (int)p.width, weight_dtype = (int)p.weight_dtype, bias_dtype = (int)p.bias_dtype,
              silu_act = (int)p.silu_act, steps = (int)p.steps, x_aligned = (int)p.x_aligned,
              out_aligned = (int)p.out_aligned, two = p.buffers == 2;
    const int rows = steps + width - 1;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
    const int64 strips = (dim + 32 * V - 1) / (32 * V), chunks = (seqlen + steps - 1) / steps;
    const int64 n_tiles = batch * chunks * strips;
    struct Tile {
        int64 b, c0, t0;  // batch row, the lane's first channel, first step
    };
    auto tile_at = [&](int64 tile) {
        int64 bc, strip, b, chunk;
        divmod(tile, strips, bc, strip);
        divmod(bc, chunks, b, chunk);
        return Tile{b, strip * (32 * V) + lane * V, chunk * steps};
    };
    auto buffer = [&](int buf) { return reinterpret_cast<Raw*>(smem_raw + buf * p.buffer_bytes); };

    // Copies (or starts copying) tile t's rows and taps into buffer buf.
    auto stage = [&](const Tile& t, int buf) {
        Raw* const xs = buffer(buf) + lane;
        Raw* const ws = reinterpret_cast<Raw*>(reinterpret_cast<unsigned char*>(buffer(buf)) + p.weights_at) + lane;
        const bool whole = t.c0 + V <= dim;  // all of the lane's V channels exist
        const T* const xb = x + t.b * x_batch_stride + t.c0;
        #pragma unroll 4
        for (int r = warp; r < rows; r += WARPS) {  // row r: position t0 - (K - 1) + r
            const int64 pos = t.t0 - (width - 1) + r;
            if constexpr (same_type<T, A>) {
                if (x_aligned && whole && pos >= 0) {  // zeros past the row
                    const bool in_row = pos < seqlen;
                    cp_async<8>(xs + r * 32, in_row ? xb + pos * x_l_stride : xb, in_row ? 8 : 0);
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
                    v.e[j] = t.c0 + j < dim && pos < seqlen ? input_at<A>(x, initial_states, p, t.b, t.c0 + j, pos)
                                                            : A(0);
            }
            xs[r * 32] = v.raw;
        }
        for (int k = warp; k < width; k += WARPS) {
            if (weight_dtype == ACC_CODE) {
                const A* const wk = static_cast<const A*>(weight) + k * weight_width_stride;
                #pragma unroll
                for (int j = 0; j < V; ++j) {
                    const bool in_dim = t.c0 + j < dim;
                    cp_async<sizeof(A)>(reinterpret_cast<A*>(ws + k * 32) + j,
                                        wk + (in_dim ? (t.c0 + j) * weight_c_stride : 0), in_dim ? sizeof(A) : 0);
                }
            } else {
                Slot w;
                #pragma unroll
                for (int j = 0; j < V; ++j)
                    w.e[j] = t.c0 + j < dim ? load_as<A>(weight, weight_dtype,
                                                         (t.c0 + j) * weight_c_stride + k * weight_width_stride)
                                            : A(0);
                ws[k * 32] = w.raw;
            }
        }
    };

    int buf = 0;
    if (blockIdx.x < n_tiles) stage(tile_at(blockIdx.x), 0);
    cp_async_commit();
    for (int64 tile = blockIdx.x; tile < n_tiles; tile += p.main_blocks) {
        const Tile t = tile_at(tile);
        const int64 next = tile + p.main_blocks;
        if (two && next < n_tiles) stage(tile_at(next), buf ^ 1);
        cp_async_commit();
        A bias_v[V];
        #pragma unroll
        for (int j = 0; j < V; ++j)
            bias_v[j] = bias && t.c0 + j < dim ? load_as<A>(bias, bias_dtype, (t.c0 + j) * bias_stride) : A(0);
        if (two) cp_async_wait<1>();
        else cp_async_wait<0>();
        __syncthreads();  // the tile's rows and taps are in buffer buf

        const Raw* const xs = buffer(buf) + lane;
        const Raw* const ws = reinterpret_cast<const Raw*>(reinterpret_cast<unsigned char*>(buffer(buf)) + p.weights_at) + lane;
        const int per_warp = steps / WARPS;
        #pragma unroll 1
        for (int o = warp * per_warp; t.c0 < dim && o < (warp + 1) * per_warp && t.t0 + o < seqlen; o += R) {
            // Output o + r reads rows o + r + k, k < width; win[(r + j) % R] holds row o + k0 + j
            // + r at tap k0 + j.
            const Raw* const xr = xs + o * 32;
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
                w.raw = ws[k * 32];
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

            const bool whole = t.c0 + V <= dim;
            T* dst = out + t.b * out_batch_stride + t.c0 * out_c_stride + (t.t0 + o) * out_l_stride;
            #pragma unroll
            for (int r = 0; r < R; ++r, dst += out_l_stride) {
                if (t.t0 + o + r >= seqlen) break;
                In res;
                #pragma unroll
                for (int j = 0; j < V; ++j) res.e[j] = from_acc<T>(finish(acc[r][j], false, silu_act));
                if (out_aligned && whole) {
                    *reinterpret_cast<typename In::Raw*>(dst) = res.raw;
                } else {
                    #pragma unroll
                    for (int j = 0; j < V; ++j)
                        if (t.c0 + j < dim) dst[j * out_c_stride] = res.e[j];
                }
            }
        }
        __syncthreads();  // buffer buf is read
        if (two) buf ^= 1;
        else if (next < n_tiles) stage(tile_at(next), 0);
    }
}
