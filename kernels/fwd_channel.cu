// fwd_channel.cu: the forward for channel-contiguous x (x_c_stride == 1) whose rows split into
// aligned lane vectors, width K <= 16 (the plan's CHANNEL_MAX_WIDTH), in registers.
//
//   fwd_channel<T, K, SEQ, R, BYTES>
//       a warp computes a tile of R time steps x 32 lanes x V = BYTES / sizeof(T) channels,
//       CHANNEL_WARPS warps a block. SEQ says whether seq_idx is given. The plan halves V and
//       doubles R above width 8 (CHANNEL_TILES), so that a lane's K x V taps and window fit
//       its registers.
//
// Lane l owns V adjacent channels, one BYTES-wide vector per time step. A warp stages the
// tile's R rows and the K-1 rows before them in shared memory by cp.async (each a coalesced
// vector per lane) before computing any, then slides a window of K rows down the tile. Tiles
// are numbered channels fastest, then time, then batch row, one per warp, and handed out in
// order, so that the warps in flight sweep x front to back; the tile index is divided by the
// plan's fast divisors p.strip_divisor (strips of 32 V channels) and p.step_divisor (tiles a
// row). Lanes past dim idle. p.out_aligned: out splits into the same lane vectors.
#include "fwd_common.cuh"

// Warps per SM that fwd_channel's register budget (__launch_bounds__) is set for: 7 blocks of
// 4 warps for K <= 4 without seq_idx, 4 blocks otherwise (benchmarks/NOTES.md, "Occupancy and
// tile sizes": fwd_channel).
__host__ __device__ constexpr int channel_warps_per_sm(int K, bool SEQ) { return SEQ || K > 4 ? 16 : 28; }

template <typename T, int K, bool SEQ, int R, int BYTES>
__global__ void __launch_bounds__(32 * CHANNEL_WARPS, channel_warps_per_sm(K, SEQ) / CHANNEL_WARPS)
    fwd_channel(FWD_ARRAYS, const __grid_constant__ FwdChannelParams p) {
    if (final_states_blocks(x, seq_idx, initial_states, final_states, p)) return;
    using A = typename AccOf<T>::type;
    // The parameters this kernel reads, as locals.
    const int64 batch = p.batch, dim = p.dim, seqlen = p.seqlen, x_batch_stride = p.x_batch_stride,
                x_l_stride = p.x_l_stride, weight_c_stride = p.weight_c_stride,
                weight_width_stride = p.weight_width_stride, bias_stride = p.bias_stride,
                init_batch_stride = p.init_batch_stride, init_c_stride = p.init_c_stride,
                init_l_stride = p.init_l_stride, out_batch_stride = p.out_batch_stride,
                out_c_stride = p.out_c_stride, out_l_stride = p.out_l_stride,
                strip_divisor = p.strip_divisor, step_divisor = p.step_divisor;
    const int width = (int)p.width, weight_dtype = (int)p.weight_dtype, bias_dtype = (int)p.bias_dtype,
              init_dtype = (int)p.init_dtype, silu_act = (int)p.silu_act, out_aligned = (int)p.out_aligned;
    using VecT = Vec<T, BYTES>;
    using Raw = typename VecT::Raw;
    constexpr int V = VecT::V;  // channels per lane
    constexpr int W = K - 1;    // rows before the tile
    constexpr int ROWS = W + R;
    const int lane = threadIdx.x & 31;
    __shared__ Raw stage_mem[CHANNEL_WARPS][ROWS * 32];  // per warp: the tile's rows, lane-interleaved
    Raw* const stage = stage_mem[threadIdx.x / 32] + lane;
    const A scale = act_scale<A>(silu_act);
    const bool weight_run = weight_c_stride == K && (K == 1 || weight_width_stride == 1);
    const int64 n_strips = (dim + 32 * V - 1) / (32 * V);
    const int64 steps_per_row = (seqlen + R - 1) / R;
    const int64 n_tiles = batch * steps_per_row * n_strips;

    for (int64 g = grid_warp(); g < n_tiles; g += main_warps(p)) {
        int64 bt, strip, b, step;
        divmod_fast(g, n_strips, strip_divisor, bt, strip);
        divmod_fast(bt, steps_per_row, step_divisor, b, step);
        const int64 t0 = step * R;
        const int64 c0 = strip * (32 * V) + lane * V;
        if (c0 >= dim) continue;  // (nothing below is collective)
        const T* const xb = x + b * x_batch_stride + c0;

        // Stage rows t0 - W .. t0 + R - 1 (stage rows 0 .. ROWS - 1): those from lo to hi - 1
        // are in the row, the others are zero-filled. A lane reads back only its own slots.
        const int lo = (int)max(W - t0, (int64)0), hi = (int)min(seqlen - t0 + W, (int64)ROWS);
        auto stage_rows = [&](bool inside) {
            const T* src = xb + (t0 - W + lo) * x_l_stride;
            #pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                const bool in_row = inside || (r >= lo && r < hi);
                cp_async<BYTES, 128>(stage + 32 * r, in_row ? src : xb, in_row ? BYTES : 0);
                if (in_row) src += x_l_stride;
            }
        };
        if (lo == 0 && hi == ROWS) stage_rows(true);
        else stage_rows(false);
        cp_async_commit();
        // Weights and bias, scaled for the activation: a lane's V K weights (and V biases) in
        // a few wide loads when they are consecutive in memory, else one by one.
        A w[K][V], bias_v[V] = {};
        with_dtype(weight, weight_dtype, [&](auto* wp) {
            const auto* wc = wp + c0 * weight_c_stride;
            if (weight_run && run_aligned<V * K>(wp)) {
                A run[V * K];
                load_run<V * K>(wc, run);
                #pragma unroll
                for (int v = 0; v < V; ++v)
                    #pragma unroll
                    for (int k = 0; k < K; ++k) w[k][v] = run[v * K + k];
            } else {
                #pragma unroll
                for (int v = 0; v < V; ++v, wc += weight_c_stride)
                    #pragma unroll
                    for (int k = 0; k < K; ++k) w[k][v] = A(to_acc(wc[k * weight_width_stride]));
            }
        });
        if (bias) {
            with_dtype(bias, bias_dtype, [&](auto* bp) {
                if (bias_stride == 1 && run_aligned<V>(bp)) {
                    load_run<V>(bp + c0, bias_v);
                } else {
                    #pragma unroll
                    for (int v = 0; v < V; ++v) bias_v[v] = A(to_acc(bp[(c0 + v) * bias_stride]));
                }
            });
        }
        #pragma unroll
        for (int v = 0; v < V; ++v) {
            bias_v[v] *= scale;
            #pragma unroll
            for (int k = 0; k < K; ++k) w[k][v] *= scale;
        }
        int64 ids[SEQ ? ROWS : 1];  // segment ids of the stage rows
        if constexpr (SEQ) {
            #pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                const int64 pos = t0 - W + r;
                ids[r] = pos < seqlen ? segment_id(seq_idx, p, b, pos) : -1;
            }
        }

        cp_async_wait<0>();
        A win[K][V];  // rows r - W .. r, widened, for output row r
        #pragma unroll
        for (int r = 0; r < W; ++r) {
            VecT row;
            row.raw = stage[32 * r];
            widen<T, A, V>(row.e, win[r + 1]);
        }
        if (initial_states && lo > 0) {  // the rows before the row: states, never x (input_at's
                                         // x branch here costs registers and spills)
            #pragma unroll
            for (int r = 0; r < W; ++r)
                #pragma unroll
                for (int v = 0; v < V; ++v)
                    if (r < lo)
                        win[r + 1][v] = load_as<A>(initial_states, init_dtype,
                                                   b * init_batch_stride + (c0 + v) * init_c_stride +
                                                       (width - 1 + t0 - W + r) * init_l_stride);
        }
        T* o = out + b * out_batch_stride + c0 * out_c_stride + t0 * out_l_stride;
        const int n_out = hi - W;  // rows of the tile in the row
        #pragma unroll
        for (int r = W; r < ROWS; ++r, o += out_l_stride) {
            #pragma unroll
            for (int k = 0; k < W; ++k)
                #pragma unroll
                for (int v = 0; v < V; ++v) win[k][v] = win[k + 1][v];
            VecT row;
            row.raw = stage[32 * r];
            widen<T, A, V>(row.e, win[W]);
            if (r - W >= n_out) break;
            A acc[V];
            #pragma unroll
            for (int v = 0; v < V; ++v) {
                acc[v] = bias_v[v];
                #pragma unroll
                for (int k = 0; k < K; ++k) {
                    if constexpr (SEQ) {
                        if (ids[r - W + k] == ids[r]) acc[v] += w[k][v] * win[k][v];
                    } else {
                        acc[v] += w[k][v] * win[k][v];
                    }
                }
                if (SEQ && ids[r] < 0) acc[v] = A(0);  // padding
            }
            VecT res;
            activate_store(acc, silu_act, res.e);
            if (out_aligned) {
                *reinterpret_cast<Raw*>(o) = res.raw;
            } else {
                #pragma unroll
                for (int v = 0; v < V; ++v) o[v * out_c_stride] = res.e[v];
            }
        }
    }
}

