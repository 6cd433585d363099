// fwd_mma.cu: the forward on tensor cores: 16-bit x from width 14 (time-contiguous, where
// fwd_mma_time.cu does not serve it) or 16 (channel-contiguous: weights of another dtype, and
// from width 66; fwd_mma_cl.cu serves the rest) to 256; time-contiguous float32 x, and float16 x with weights of another dtype, from
// width 18.
//
//   fwd_mma<T, KS, SPLIT, CLW>
//       widths K with K - 1 <= D = 16 (KS - 1), no seq_idx (fwd_time_wide and fwd_channel_wide
//       serve those); SPLIT: weights of another dtype than x (always with float32 x; with float32
//       and float16 x time-contiguous only, the window split too: see below); CLW: 0 for
//       time-contiguous x, else channel-contiguous x in blocks of CLW warps. A persistent grid: for
//       time-contiguous x each of the MMA_WARPS warps of a block takes its own run of items (spans
//       of p.span outputs of a row), or with p.sweep every n_warps-th item, staging each into one
//       of its two rows of shared memory with cp.async while it computes the other; for
//       channel-contiguous x a block of CLW warps (MMA_CL_SM_WARPS / CLW blocks an SM) takes runs
//       of p.run spans of MMA_CL_CHANNELS channels, warp w computing rows w, w + CLW, .., the next
//       item copied into a staging area while the current one is computed (up to
//       MMA_CL_TWO_ROWS_STEPS with weights of x's dtype, the rows in two buffers where they fit:
//       an item's outputs go out while the next one is computed). Either way a row's
//       window (positions t0 - D ..) lies in shared memory time-contiguous, p.row_len elements a
//       row, and a channel's weights are installed once for each item of another channel.
//
// For one channel, 16 consecutive outputs are a banded Toeplitz matrix of the weights times
// the inputs before them:  out[t0 + o] = sum_m Tw[o][m] x[t0 - D + m],  m < D + 16, with
// Tw[o][m] = w[m - o - (D - K + 1)] inside the band. Eight such blocks 16 steps apart are the
// eight columns n of one m16n8k16 MMA per 16 values of m (k-step s: window segment n + s).
// The MMA sums over k, so k and the rows may be permuted as long as A and B agree: lane
// (g, tg) holds inputs 4 tg .. 4 tg + 3 of segment g + s (one 8-byte shared-memory read, no
// bank conflict), and row i is output 2 (i mod 8) + i / 8, so each lane's results pair up
// into adjacent outputs. The A fragments (the weights) stay in registers; each 128-output
// block's results overwrite the block's first 128 window inputs, which no later block reads
// (output t0 + o lands at window index o).
//
// Products of 16-bit values are exact and the MMA accumulates in float32; weights of another dtype
// (SPLIT) are split into a high and a low 16-bit part (two MMAs), which keeps them to 2^-17
// relative. A float32 window, or a float16 one with split weights (MmaIn), is split the same way
// into two bfloat16 rows after it is staged (a third MMA, the high taps times the low inputs; the
// low times low product, 2^-18 relative, is left out), and its outputs overwrite the staged row.
// Every window slot is written (zeros outside the row), since a zero weight times a stale NaN would
// not be zero; a non-finite input meets the band's zero weights all the same, so outputs that come
// out non-finite are computed again from their own taps. p.x_aligned / p.out_aligned: x / out take
// the layout's 16-byte vectors (time-contiguous rows starting on 16-byte boundaries; or
// channel-contiguous steps whose starts are 16-byte aligned).
#include "fwd_common.cuh"
#include "mma_common.cuh"

// Blocks per SM that fwd_mma's register budget (__launch_bounds__) is set for: the A fragments
// take 4 KS registers (8 KS split) beside about 64 others (80 with the window split).
__host__ __device__ constexpr int mma_blocks_per_sm(int KS, bool split, bool xsplit) {
    const int regs = 4 * KS * (split ? 2 : 1) + (xsplit ? 80 : 64);
    return regs <= 80 ? 6 : regs <= 96 ? 5 : regs <= 128 ? 4 : regs <= 168 ? 3 : 2;
}

// One row's weights as A fragments (high and, with SPLIT, low part per k-step) and its bias.
template <int KS, bool SPLIT>
struct RowWeights {
    unsigned hi[KS][4], lo[SPLIT ? KS : 1][4];
    float bias;
};

// A row's taps pass through the warp's wpad, SIZE floats: wpad[PAD + k] = w[k], zeros around
// them (written once). A lane holds up to N taps of the next row in registers (k = lane + 32 j),
// as loaded: they are converted only when installed, so the loads stay in flight while the
// warp computes the current row.
template <int KS>
struct Taps {
    using Sizes = ToeplitzTaps<KS>;
    static constexpr int D = Sizes::D, PAD = Sizes::PAD, SIZE = Sizes::SIZE, N = Sizes::N;
    static constexpr int BIAS = SIZE - 1;  // wpad[BIAS]: the bias (past every slot the band reads)
    unsigned next[N], bias;

    __device__ __forceinline__ static void zero(float* wpad) {
        for (int i = threadIdx.x & 31; i < SIZE; i += 32) wpad[i] = 0.f;
    }
    // Issues the loads of channel c's taps and bias. Without SPLIT the taps are of x's dtype T.
    template <typename T, bool SPLIT, typename P>
    __device__ __forceinline__ void fetch(const void* weight, const void* bias_p, const P& p, int64 c) {
        const int lane = threadIdx.x & 31, width = (int)p.width;
        const int64 at = c * p.weight_c_stride + lane * p.weight_width_stride, step = 32 * p.weight_width_stride;
        auto load = [&](auto w) {
            #pragma unroll
            for (int j = 0; j < N; ++j) next[j] = lane + 32 * j < width ? raw_bits(w[at + j * step]) : 0u;
        };
        if constexpr (SPLIT) with_dtype(weight, (int)p.weight_dtype, load);
        else load(static_cast<const T*>(weight));
        bias = 0u;
        if (bias_p) with_dtype(bias_p, (int)p.bias_dtype, [&](auto q) { bias = raw_bits(q[c * p.bias_stride]); });
    }
    // Writes the fetched taps into wpad and builds their A fragments.
    template <typename T, bool SPLIT>
    __device__ __forceinline__ void install(RowWeights<KS, SPLIT>& rw, float* wpad, int width, int weight_code,
                                            int bias_code) const {
        const int lane = threadIdx.x & 31;
        __syncwarp();  // the previous row's own_taps has read wpad
        #pragma unroll
        for (int j = 0; j < N; ++j) {
            if (lane + 32 * j >= width) continue;
            if constexpr (SPLIT) wpad[PAD + lane + 32 * j] = bits_as<float>(next[j], weight_code);
            else wpad[PAD + lane + 32 * j] = to_acc(from_bits<T>(next[j]));
        }
        if (lane == 0) wpad[BIAS] = bits_as<float>(bias, bias_code);
        __syncwarp();
        build<typename MmaIn<T, SPLIT>::type>(rw, wpad, width);
    }
    // The A fragments (of 16-bit type T) and the bias of the taps in wpad.
    template <typename T, bool SPLIT>
    __device__ __forceinline__ static void build(RowWeights<KS, SPLIT>& rw, const float* wpad, int width) {
        const int lane = threadIdx.x & 31, g = lane >> 2, tg = lane & 3;
        rw.bias = wpad[BIAS];
        const float* wl = wpad + PAD + 4 * tg - 2 * g - (D - width + 1);  // the band ends at the output
        #pragma unroll
        for (int s = 0; s < KS; ++s) {
            #pragma unroll
            for (int r = 0; r < 4; ++r) {
                const float* q = wl + fragment_offset(s, r);
                const float v0 = q[0], v1 = q[1];
                rw.hi[s][r] = pack2<T>(v0, v1);  // (T: the MMA's operand type)
                if constexpr (SPLIT) rw.lo[s][r] = pack2<T>(v0 - to_acc(from_acc<T>(v0)), v1 - to_acc(from_acc<T>(v1)));
            }
        }
    }
};

// The n_blocks 128-output blocks of one row whose window (positions t0 - D ..) is at `row`
// (a split window: a high and a low bfloat16 row at `split`, `row_len` elements each):
// each block's outputs overwrite its first 128 inputs. Returns whether this lane saw a sum
// that is not finite.
template <typename T, int KS, bool SPLIT, bool SILU>
__device__ __forceinline__ bool compute_row(T* row, const void* split, int row_len, int n_blocks,
                                            const RowWeights<KS, SPLIT>& rw) {
    using M = typename MmaIn<T, SPLIT>::type;
    constexpr bool XS = split_window_of<T, SPLIT>;
    const int lane = threadIdx.x & 31, g = lane >> 2, tg = lane & 3;
    const uint2* in = reinterpret_cast<const uint2*>(XS ? split : row) + 4 * g + tg;
    const int lo_row = row_len / 4;  // (XS) the low row, in words of 4 inputs after the high
    // pairs of outputs: 16-bit pairs as one word, float32 pairs as a float2
    constexpr bool F32 = same_type<T, float>;
    using Pair = typename Select<F32, float2, unsigned>::type;
    Pair* res = reinterpret_cast<Pair*>(row) + 16 * tg + g;
    // CHAINS blocks at a time: their MMA chains are independent, so each hides the others'
    // latency (benchmarks/NOTES.md, "fwd_mma's chains").
    constexpr int CHAINS = KS <= 3 ? 4 : 2;
    static_assert(MMA_SPAN_STEP % (128 * CHAINS) == 0, "tiles hold whole groups of chains");
    float sums = 0.f;  // of every sum: not finite if one of them is not
    #pragma unroll 1
    for (int blk = 0; blk < n_blocks; blk += CHAINS, in += 32 * CHAINS, res += 64 * CHAINS) {
        float acc[CHAINS][4];
        #pragma unroll
        for (int j = 0; j < CHAINS; ++j) {
            #pragma unroll
            for (int r = 0; r < 4; ++r) acc[j][r] = rw.bias;
        }
        #pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
            #pragma unroll
            for (int j = 0; j < CHAINS; ++j) {
                const uint2 bw = in[32 * j + 4 * ks];  // inputs 4 tg .. 4 tg + 3 of segment g + ks
                MmaOp<M>::run(acc[j], rw.hi[ks], bw.x, bw.y);
                if constexpr (SPLIT) MmaOp<M>::run(acc[j], rw.lo[ks], bw.x, bw.y);
                if constexpr (XS) {
                    const uint2 lw = in[lo_row + 32 * j + 4 * ks];
                    MmaOp<M>::run(acc[j], rw.hi[ks], lw.x, lw.y);
                }
            }
        }
        // c0: (row g, column 2 tg), c1: (g, 2 tg + 1), c2: (g + 8, 2 tg), c3: (g + 8, 2 tg + 1):
        // outputs 32 tg + 2 g (c0, c2) and 32 tg + 16 + 2 g (c1, c3) of the block.
        #pragma unroll
        for (int j = 0; j < CHAINS; ++j) {
            // (a sum is not finite if one of its terms is not: one test a row, after it)
            sums += (acc[j][0] + acc[j][1]) + (acc[j][2] + acc[j][3]);
            if constexpr (SILU) {
                #pragma unroll
                for (int r = 0; r < 4; ++r) acc[j][r] = silu_out<T>(acc[j][r]);
            }
            if constexpr (F32) {
                res[64 * j] = make_float2(acc[j][0], acc[j][2]);
                res[64 * j + 8] = make_float2(acc[j][1], acc[j][3]);
            } else {
                res[64 * j] = pack2<T>(acc[j][0], acc[j][2]);
                res[64 * j + 8] = pack2<T>(acc[j][1], acc[j][3]);
            }
        }
    }
    return !isfinite(sums);
}

// Recomputes, from its width taps alone (wpad; inputs from x), each of a row's first n_out
// outputs at `outputs` (output t0 + o at o) that is not finite; this lane takes every 32nd.
// Out of line: it is rarely called.
template <typename T, int KS, typename P>
__device__ __noinline__ void own_taps(T* outputs, int n_out, const float* wpad, float bias, const T* x,
                                      const void* initial_states, const P& p, int64 b, int64 c, int64 t0) {
    const int width = (int)p.width;
    for (int o = threadIdx.x & 31; o < n_out; o += 32) {
        if (isfinite(to_acc(outputs[o]))) continue;
        float a = bias;
        for (int k = 0; k < width; ++k)
            a += wpad[Taps<KS>::PAD + k] * input_at<float>(x, initial_states, p, b, c, t0 + o - (width - 1) + k);
        outputs[o] = from_acc<T>(p.silu_act ? silu(a) : a);
    }
}

// A row's outputs: its window at `row` after compute_row (the activation chosen at run time),
// the non-finite ones computed again.
template <typename T, int KS, bool SPLIT, typename P>
__device__ __forceinline__ void row_outputs(T* row, const void* split, int row_len, int n_out,
                                            const RowWeights<KS, SPLIT>& rw, const float* wpad,
                                            const T* x, const void* initial_states, const P& p, int64 b, int64 c,
                                            int64 t0) {
    const int n_blocks = (n_out + MMA_SPAN_STEP - 1) / MMA_SPAN_STEP * (MMA_SPAN_STEP / 128);
    const bool nonfinite = p.silu_act ? compute_row<T, KS, SPLIT, true>(row, split, row_len, n_blocks, rw)
                                      : compute_row<T, KS, SPLIT, false>(row, split, row_len, n_blocks, rw);
    if (__any_sync(0xffffffffu, nonfinite)) {
        __syncwarp();
        own_taps<T, KS>(row, n_out, wpad, rw.bias, x, initial_states, p, b, c, t0);
    }
    __syncwarp();
}

// Inputs of a row's window: whole groups of chains past the outputs (zeros past the row).
__device__ __forceinline__ int window_inputs(int D, int n_out) {
    return D + (n_out + MMA_SPAN_STEP - 1) / MMA_SPAN_STEP * MMA_SPAN_STEP;
}

// A window of n_in float32 or float16 inputs (a multiple of 4) as two bfloat16 rows at split,
// row_len elements apart: hi = bfloat16(x), lo = bfloat16(x - hi).
template <typename T>
__device__ __forceinline__ void split_window(const T* row, void* split, int row_len, int n_in) {
    uint2* const hi = reinterpret_cast<uint2*>(split);
    uint2* const lo = hi + row_len / 4;
    for (int v = threadIdx.x & 31; v < n_in / 4; v += 32) {
        float f[4];
        if constexpr (same_type<T, float>) {
            const float4 q = reinterpret_cast<const float4*>(row)[v];
            f[0] = q.x, f[1] = q.y, f[2] = q.z, f[3] = q.w;
        } else {
            widen<T, float, 4>(row + 4 * v, f);
        }
        uint2 h, l;
        split_pair(f[0], f[1], h.x, l.x);
        split_pair(f[2], f[3], h.y, l.y);
        hi[v] = h;
        lo[v] = l;
    }
}

// Warps a block and blocks an SM that fwd_mma is compiled for: time-contiguous x takes blocks
// of MMA_WARPS independent warps, channel-contiguous x blocks of CLW warps that share their
// tiles, MMA_CL_SM_WARPS warps an SM.
template <typename T, int KS, bool SPLIT, int CLW>
struct MmaLaunch {
    static constexpr int warps = CLW ? CLW : MMA_WARPS;
    static constexpr int blocks = CLW ? MMA_CL_SM_WARPS / CLW : mma_blocks_per_sm(KS, SPLIT, split_window_of<T, SPLIT>);
};

template <typename T, int KS, bool SPLIT, int CLW>
__global__ void __launch_bounds__(32 * MmaLaunch<T, KS, SPLIT, CLW>::warps, MmaLaunch<T, KS, SPLIT, CLW>::blocks)
    fwd_mma(FWD_ARRAYS, const __grid_constant__ FwdMmaParams p) {
    if (final_states_blocks(x, seq_idx, initial_states, final_states, p)) return;
    constexpr int D = Taps<KS>::D;  // inputs before a row's first output
    constexpr int VN = 16 / sizeof(T);  // elements per 16-byte vector
    constexpr bool XS = split_window_of<T, SPLIT>;
    static_assert(!XS || (SPLIT && CLW == 0), "a split window: time-contiguous x, split weights");
    const int64 batch = p.batch, dim = p.dim, seqlen = p.seqlen, span = p.span, row_len = p.row_len;
    const int width = (int)p.width;
    // The taps' dtypes as bits_as reads them (float64 taps are fetched as float32).
    const int weight_code = p.weight_dtype == F64 ? F32 : (int)p.weight_dtype;
    const int bias_code = p.bias_dtype == F64 ? F32 : (int)p.bias_dtype;
    const bool x_aligned = p.x_aligned != 0, out_aligned = p.out_aligned != 0;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* const rows = reinterpret_cast<T*>(smem_raw);  // the rows, row_len elements each
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    // The zero-padded taps (Taps): the warp's (time-contiguous x), or row r's at r SIZE.
    float* const wpad = reinterpret_cast<float*>(smem_raw + p.weights_at) + warp * Taps<KS>::SIZE;
    constexpr int OWN = CLW ? MMA_CL_CHANNELS / CLW : 1;  // the rows a warp computes
    static_assert(CLW == 0 || MMA_CL_CHANNELS % CLW == 0, "a block's warps share its rows evenly");
    #pragma unroll 1
    for (int j = 0; j < OWN; ++j) Taps<KS>::zero(wpad + j * CLW * Taps<KS>::SIZE);
    const int64 spans = (seqlen + span - 1) / span;
    Taps<KS> taps;
    RowWeights<KS, SPLIT> rw;
    // An item: span sp of row (b, c) (channel-contiguous x: of the channels c ..).
    struct Item {
        int64 b, c, t0;
        int n_out;
        bool new_channel;  // the first item of its channel in the warp's (block's) run
    };

    if constexpr (CLW == 0) {
        // Time-contiguous x: items in channel-major order (c, b, sp). Warp w of the grid takes
        // either a run of consecutive items, so that a channel's taps are installed once for
        // its run, or (p.sweep) the items w, w + n_warps, ...: then the warps at work read
        // neighbouring rows, at the cost of the taps installed for every item. Each item is
        // staged into one of the warp's two rows while it computes the other.
        const int64 n_items = dim * batch * spans, n_warps = main_warps(p);
        const int64 per = p.sweep ? 0 : (n_items + n_warps - 1) / n_warps;  // items a run
        const int64 first = p.sweep ? grid_warp() : grid_warp() * per;
        const int64 end = p.sweep ? n_items : min(first + per, n_items), istep = p.sweep ? n_warps : 1;
        // istep in the digits of (c, b, sp)
        const int64 step_sp = istep % spans, step_cb = istep / spans, step_b = step_cb % batch,
                    step_c = step_cb / batch;
        auto item_at = [&](int64 i) {  // with its channel's taps to install
            int64 cb, sp;
            divmod(i, spans, cb, sp);
            Item it;
            it.c = cb / batch;
            it.b = cb - it.c * batch;
            it.t0 = sp * span;
            it.n_out = (int)min(span, seqlen - it.t0);
            it.new_channel = true;
            return it;
        };
        // The item istep after `it` (past the last item where there is none).
        auto next_of = [&](Item it) {
            it.t0 += step_sp * span;
            const bool carry = it.t0 >= seqlen;  // (sp >= spans)
            if (carry) it.t0 -= spans * span;
            it.b += step_b + carry;
            const bool carry_b = it.b >= batch;
            if (carry_b) it.b -= batch;
            const int64 c = it.c + step_c + carry_b;
            it.new_channel = c != it.c;
            it.c = c;
            it.n_out = (int)min(span, seqlen - it.t0);
            return it;
        };
        T* const bufs = rows + 2 * warp * row_len;
        // a split window: the warp's high and low bfloat16 rows of the window being computed
        void* const split = smem_raw + p.staging_at + warp * row_len * 4;
        // Stages item `it` into bufs + st row_len (always commits one cp.async group).
        auto stage = [&](const Item& it, bool valid, int st) {
            if (valid) {
                const int64 b = it.b, c = it.c, w0 = it.t0 - D;
                const int n_in = window_inputs(D, it.n_out);
                T* const row = bufs + st * row_len;
                const T* xr = x + b * p.x_batch_stride + c * p.x_c_stride;
                // vectors [0, v0): before the row (-w0 <= D)
                const int v0 = w0 < 0 ? (int)((unsigned)-w0 / VN) : 0;
                if (x_aligned && (w0 >= 0 || !initial_states) && w0 + n_in <= seqlen) {
                    // the window in the row but for zeros before it: whole vectors, by a
                    // stepped pointer
                    #pragma unroll 1
                    for (int v = lane; v < v0; v += 32) reinterpret_cast<uint4*>(row)[v] = make_uint4(0, 0, 0, 0);
                    const T* src = xr + w0 + (v0 + lane) * VN;
                    unsigned dst = smem_address(row) + 16 * (v0 + lane);
                    #pragma unroll 4
                    for (int v = v0 + lane; v < n_in / VN; v += 32, src += 32 * VN, dst += 512)
                        cp_async_shared16(dst, src);
                    if (it.new_channel) taps.template fetch<T, SPLIT>(weight, bias, p, c);
                    cp_async_commit();
                    return;
                }
                // [v0, v1): whole vectors of the row (aligned x)
                const int v1 = x_aligned ? (int)min((int64)n_in / VN, (seqlen - w0) / VN) : v0;
                for (int v = lane; v < v0; v += 32) {
                    if (!initial_states) {
                        reinterpret_cast<uint4*>(row)[v] = make_uint4(0, 0, 0, 0);
                    } else {
                        #pragma unroll 1
                        for (int q = 0; q < VN; ++q)
                            row[v * VN + q] = window_input(x, initial_states, p, b, c, w0 + v * VN + q);
                    }
                }
                #pragma unroll 4
                for (int v = v0 + lane; v < v1; v += 32) cp_async<16>(row + v * VN, xr + w0 + v * VN, 16);
                for (int v = v1 + lane; v < n_in / VN; v += 32) {
                    const int64 pos = w0 + (int64)v * VN;
                    if (x_aligned && pos < seqlen) {
                        cp_async<16>(row + v * VN, xr + pos, (int)(seqlen - pos) * (int)sizeof(T));
                    } else {
                        #pragma unroll 1
                        for (int q = 0; q < VN; ++q) row[v * VN + q] = window_input(x, initial_states, p, b, c, pos + q);
                    }
                }
                if (it.new_channel) taps.template fetch<T, SPLIT>(weight, bias, p, c);
            }
            cp_async_commit();
        };
        Item it = item_at(first);
        stage(it, first < end, 0);
        #pragma unroll 1
        for (int64 i = first, st = 0; i < end; i += istep, st ^= 1) {
            if (it.new_channel) taps.template install<T, SPLIT>(rw, wpad, width, weight_code, bias_code);
            const Item next = next_of(it);
            stage(next, i + istep < end, (int)st ^ 1);  // also fetches a new channel's taps
            cp_async_wait<1>();
            __syncwarp();
            T* const row = bufs + st * row_len;
            if constexpr (XS) {
                split_window(row, split, (int)row_len, window_inputs(D, it.n_out));
                __syncwarp();
            }
            row_outputs<T, KS, SPLIT>(row, split, (int)row_len, it.n_out, rw, wpad, x, initial_states, p, it.b, it.c,
                                      it.t0);
            T* const orow = out + it.b * p.out_batch_stride + it.c * p.out_c_stride + it.t0 * p.out_l_stride;
            const int full = out_aligned ? (int)((unsigned)it.n_out / VN) : 0;
            {
                const uint4* from = reinterpret_cast<const uint4*>(row) + lane;
                uint4* to = reinterpret_cast<uint4*>(orow) + lane;
                #pragma unroll 4
                for (int v = lane; v < full; v += 32, from += 32, to += 32) *to = *from;
            }
            if (full * VN < it.n_out) {  // (the rest element by element)
                for (int o = full * VN + lane; o < it.n_out; o += 32) orow[o * p.out_l_stride] = row[o];
            }
            __syncwarp();  // the row is free again
            it = next;
        }
        cp_async_wait<0>();
    } else {
        // Channel-contiguous x: block k takes a run of items of ROWS = 16 channels (row r of the
        // block: channel c0 + r, computed by warp r mod CLW). Warp w moves window positions
        // 16 w .. 16 w + 15, then STEP further, and so on, lane (i, h) copying the 8 channels
        // 8 h .. of position 16 w + i: the next item's window goes (cp.async; zeros past the row,
        // states and unaligned x element by element) into a staging area at byte p.staging_at,
        // position i's 32 bytes at staging + 2 i, their two halves swapped where i / 4 is odd
        // (so 8 consecutive positions of a half lie in 8 distinct bank groups), while the warps
        // compute the current item. Each warp then transposes its own positions into the rows
        // with one ldmatrix.trans (16 positions x 16 channels) and four 4-byte stores a lane,
        // and the outputs back out of the rows the same way. p.row_len = 8 mod 16 makes both
        // free of bank conflicts.
        constexpr int STEP = CLW * 16, ROWS = MMA_CL_CHANNELS;  // positions a pass, rows
        static_assert(ROWS == 16, "two 8x8 matrices of channels per 16 positions");
        T* const staging = reinterpret_cast<T*>(smem_raw + p.staging_at);
        // The 16-byte slot of channels 8 h .. 8 h + 7 at window position i.
        auto slot = [](int i, int h) { return 2 * i + (h ^ ((i >> 2) & 1)); };
        // The work comes in units of p.run consecutive spans of a row (b, group); block k
        // takes the units u = k, k + grid, ... (group fastest: the blocks at work at one time
        // read neighbouring channels of the same steps) and installs the taps once a unit.
        const int64 groups = (dim + ROWS - 1) / ROWS, run = p.run, parts = (spans + run - 1) / run;
        const int64 n_units = groups * batch * parts, grid = p.main_blocks;
        const int64 end = blockIdx.x < n_units ? ((n_units - 1 - blockIdx.x) / grid + 1) * run : 0;  // items
        auto unit_item = [&](int64 u) {  // the first item of unit u
            int64 g, bp;
            divmod(u, groups, bp, g);
            Item it;
            it.b = bp / parts;
            it.c = g * ROWS;
            it.t0 = (bp - it.b * parts) * run * span;
            it.n_out = (int)min(span, seqlen - it.t0);
            it.new_channel = true;
            return it;
        };
        int64 unit = blockIdx.x, in_unit = 0;  // the unit of the item after `it`, and its place there
        auto next_of = [&](Item it) {  // (none past the row's spans)
            if (++in_unit == run) {
                in_unit = 0;
                unit += grid;
                return unit_item(unit);
            }
            it.t0 += span;
            it.n_out = (int)max((int64)0, min(span, seqlen - it.t0));
            it.new_channel = false;
            return it;
        };
        const int i0 = warp * 16 + (lane >> 1), h = lane & 1;
        // Copies item `it`'s window into the staging area: in 16-byte vectors where x takes
        // them for this lane's 8 channels, element by element where it does not and before
        // the row with initial states; zeros past the row.
        auto load = [&](const Item& it, bool valid) {
            if (valid) {
                const int64 w0 = it.t0 - D;
                const int n_in = window_inputs(D, it.n_out);
                const int64 c = it.c + 8 * h;
                int i = i0;
                if (x_aligned && c + VN <= dim) {
                    for (; i < n_in && w0 + i < 0; i += STEP) {  // before the row
                        uint4* const to = reinterpret_cast<uint4*>(staging) + slot(i, h);
                        if (initial_states && w0 + i >= -(width - 1)) {
                            #pragma unroll 1
                            for (int q = 0; q < VN; ++q)
                                staging[8 * slot(i, h) + q] = window_input(x, initial_states, p, it.b, c + q, w0 + i);
                        } else {
                            *to = make_uint4(0, 0, 0, 0);
                        }
                    }
                    const int lim = (int)min((int64)n_in, seqlen - w0);  // positions in the row
                    const int64 step = STEP * p.x_l_stride;
                    const T* src = x + it.b * p.x_batch_stride + c + (w0 + i) * p.x_l_stride;
                    #pragma unroll 4
                    for (; i < lim; i += STEP, src += step) cp_async<16>(staging + 8 * slot(i, h), src, 16);
                    for (; i < n_in; i += STEP) reinterpret_cast<uint4*>(staging)[slot(i, h)] = make_uint4(0, 0, 0, 0);
                } else {
                    for (; i < n_in; i += STEP) {
                        #pragma unroll 1
                        for (int q = 0; q < VN; ++q)
                            staging[8 * slot(i, h) + q] = window_input(x, initial_states, p, it.b, c + q, w0 + i);
                    }
                }
            }
            cp_async_commit();
        };
        // Warp w's positions move between the staging area and the rows in 16 x 16 blocks (16
        // positions, 16 channels): one ldmatrix.trans of four 8x8 matrices q = (a, hq) (a = q / 2:
        // positions 8 a .., hq = q % 2: channels 8 hq ..), lane (g, tg) then holding elements
        // (2 tg, g) and (2 tg + 1, g) of each (mma_common.cuh, ldmatrix_x4_trans).
        const int mq = lane >> 3, mj = lane & 7, g = lane >> 2, tg = lane & 3;
        // In: matrix rows are positions (a staged half each); lane (g, tg) gets positions 2 tg,
        // 2 tg + 1 of channel 8 hq + g, one 4-byte word of its row.
        const T* const in_from = staging + 8 * slot(8 * (mq >> 1) + mj, mq & 1);
        unsigned* const in_to = reinterpret_cast<unsigned*>(rows + g * row_len) + tg;
        const int rows8 = 4 * row_len;  // words of 8 rows
        auto store = [&](const Item& it, int buf) {
            const int n_in = window_inputs(D, it.n_out);
            unsigned* const into = in_to + buf * (ROWS / 2) * row_len;  // (buffer buf)
            #pragma unroll 2
            for (int base = warp * 16; base < n_in; base += STEP) {
                unsigned wd[4];
                ldmatrix_x4_trans(wd, in_from + 16 * base);
                unsigned* const to = into + base / 2;
                to[0] = wd[0];
                to[rows8] = wd[1];
                to[4] = wd[2];
                to[rows8 + 4] = wd[3];
            }
        };
        // Out: matrix rows are channels; lane (g, tg) gets channels 8 hq + 2 tg, 8 hq + 2 tg + 1
        // at position 8 a + g, which it writes into the warp's output block (16 positions of 32
        // bytes, halves swapped as in the staging area) for 16-byte stores.
        const T* const out_from = rows + (8 * (mq & 1) + mj) * row_len + 8 * (mq >> 1);
        uint4* const block = reinterpret_cast<uint4*>(smem_raw + p.out_at) + 32 * warp;
        unsigned* const out_to = reinterpret_cast<unsigned*>(block) + 8 * g + tg;
        const int sw = 4 * ((g >> 2) & 1);  // words: half hq at 4 (hq ^ swapped)
        Item it = unit_item(unit);
        load(it, end > 0);
        if constexpr (!SPLIT && KS <= MMA_CL_TWO_ROWS_STEPS) {
            // This warp's positions of item it's outputs (in rows buffer buf), transposed back
            // through its output block, as in the loop below.
            auto emit = [&](const Item& it, int buf) {
                const bool whole_out = out_aligned && it.c + ROWS <= dim;
                const int i_own = lane >> 1;
                const T* const from = out_from + buf * ROWS * row_len;
                T* ob = out + it.b * p.out_batch_stride + (it.c + 8 * h) * p.out_c_stride +
                        (it.t0 + warp * 16 + i_own) * p.out_l_stride;
                const int64 ob_step = STEP * p.out_l_stride;
                auto put = [&](const Vec<T>& v, T* at, int o) {
                    if (o >= it.n_out) return;
                    if (whole_out) {
                        *reinterpret_cast<uint4*>(at) = v.raw;
                    } else {
                        #pragma unroll
                        for (int q = 0; q < VN; ++q)
                            if (it.c + 8 * h + q < dim) at[q * p.out_c_stride] = v.e[q];
                    }
                };
                #pragma unroll 1
                for (int base = warp * 16; base < it.n_out; base += 2 * STEP, ob += 2 * ob_step) {
                    const bool two = base + STEP < it.n_out;
                    unsigned wd[2][4];
                    ldmatrix_x4_trans(wd[0], from + base);
                    if (two) ldmatrix_x4_trans(wd[1], from + base + STEP);
                    Vec<T> v[2];
                    #pragma unroll
                    for (int k = 0; k < 2; ++k) {
                        if (k == 1 && !two) break;
                        out_to[sw] = wd[k][0];
                        out_to[4 - sw] = wd[k][1];
                        out_to[64 + sw] = wd[k][2];
                        out_to[68 - sw] = wd[k][3];
                        __syncwarp();
                        v[k].raw = block[slot(i_own, h)];
                        __syncwarp();  // the block is read before it is written again
                    }
                    put(v[0], ob, base + i_own);
                    if (two) put(v[1], ob + ob_step, base + STEP + i_own);
                }
            };
            // Warp w computes rows w, w + CLW, ... of item it in rows buffer buf (with one row a
            // warp, its fragments stay; a new channel's first row has its taps fetched already).
            auto compute = [&](const Item& it, int buf) {
                #pragma unroll 1
                for (int j = 0; j < OWN; ++j) {
                    const int r = warp + j * CLW;
                    const int64 c = it.c + r;
                    float* const wr = wpad + j * CLW * Taps<KS>::SIZE;
                    if (c >= dim) break;
                    if (it.new_channel) {
                        if (j > 0) taps.template fetch<T, SPLIT>(weight, bias, p, c);
                        taps.template install<T, SPLIT>(rw, wr, width, weight_code, bias_code);
                    } else if constexpr (OWN > 1) {
                        Taps<KS>::template build<T, SPLIT>(rw, wr, width);
                    }
                    row_outputs<T, KS, SPLIT>(rows + (buf * ROWS + r) * row_len, nullptr, 0, it.n_out, rw, wr, x,
                                              initial_states, p, it.b, c, it.t0);
                }
            };
            // With two buffers of rows (p.two_rows), item i's window goes into buffer i % 2 and
            // an item takes one barrier: after it the item's window is in its buffer and the
            // item before's outputs in the other, which each warp sends out (its own positions)
            // before computing its rows of this item, so that one warp's stores overlap the
            // others' MMAs (a warp's moves of item i + 1 into item i - 1's buffer touch only the
            // positions it has sent out itself). With one buffer, a second barrier after the
            // MMAs, then the outputs. A new channel's taps of the warp's first row are fetched
            // before the window's wait, its moves and the barrier, which hide their loads
            // (fetched after the barrier, the loads stalled every warp at once). Wider filters
            // and split taps keep the order below (this one lost there), in code of its own:
            // with this branch's lambdas in scope, NVRTC compiled it differently.
            const bool two = p.two_rows != 0;
            Item prev = it;
            #pragma unroll 1
            for (int64 i = 0; i < end; ++i) {
                const int buf = two ? (int)(i & 1) : 0;
                if (it.new_channel && it.c + warp < dim) taps.template fetch<T, SPLIT>(weight, bias, p, it.c + warp);
                cp_async_wait<0>();
                __syncwarp();  // (each warp moves only what it copied itself)
                store(it, buf);
                __syncthreads();  // the item's window is in its rows (two: the item before's outputs in theirs)
                const Item next = next_of(it);
                load(next, i + 1 < end && next.n_out > 0);
                if (two && i > 0) emit(prev, buf ^ 1);
                compute(it, buf);
                if (!two) {
                    __syncthreads();  // the item's outputs are in the rows
                    emit(it, 0);
                }
                prev = it;
                it = next;
            }
            if (two && end > 0) {
                __syncthreads();  // the last item's outputs are in their rows
                emit(prev, (int)((end - 1) & 1));
            }
        } else {
            #pragma unroll 1
            for (int64 i = 0; i < end; ++i) {
                cp_async_wait<0>();
                __syncwarp();  // (each warp moves only what it copied itself)
                store(it, 0);
                __syncthreads();  // the item's window is in the rows
                const Item next = next_of(it);
                load(next, i + 1 < end && next.n_out > 0);
                // warp w computes rows w, w + CLW, ... (with one row a warp, its fragments stay)
                #pragma unroll 1
                for (int j = 0; j < OWN; ++j) {
                    const int r = warp + j * CLW;
                    const int64 c = it.c + r;
                    float* const wr = wpad + j * CLW * Taps<KS>::SIZE;
                    if (c >= dim) break;
                    if (it.new_channel) {
                        taps.template fetch<T, SPLIT>(weight, bias, p, c);
                        taps.template install<T, SPLIT>(rw, wr, width, weight_code, bias_code);
                    } else if constexpr (OWN > 1) {
                        Taps<KS>::template build<T, SPLIT>(rw, wr, width);
                    }
                    row_outputs<T, KS, SPLIT>(rows + r * row_len, nullptr, 0, it.n_out, rw, wr, x, initial_states, p, it.b,
                                              c, it.t0);
                }
                __syncthreads();  // the item's outputs are in the rows
                // This warp's positions of the outputs, transposed back through its output block,
                // two passes at a time: lane (i, h) then stores channels 8 h .. 8 h + 7 at positions
                // base + i and base + STEP + i.
                const bool whole_out = out_aligned && it.c + ROWS <= dim;
                const int i_own = lane >> 1;
                T* ob = out + it.b * p.out_batch_stride + (it.c + 8 * h) * p.out_c_stride +
                        (it.t0 + warp * 16 + i_own) * p.out_l_stride;
                const int64 ob_step = STEP * p.out_l_stride;
                auto put = [&](const Vec<T>& v, T* at, int o) {
                    if (o >= it.n_out) return;
                    if (whole_out) {
                        *reinterpret_cast<uint4*>(at) = v.raw;
                    } else {
                        #pragma unroll
                        for (int q = 0; q < VN; ++q)
                            if (it.c + 8 * h + q < dim) at[q * p.out_c_stride] = v.e[q];
                    }
                };
                #pragma unroll 1
                for (int base = warp * 16; base < it.n_out; base += 2 * STEP, ob += 2 * ob_step) {
                    const bool two = base + STEP < it.n_out;
                    unsigned wd[2][4];
                    ldmatrix_x4_trans(wd[0], out_from + base);
                    if (two) ldmatrix_x4_trans(wd[1], out_from + base + STEP);
                    Vec<T> v[2];
                    #pragma unroll
                    for (int k = 0; k < 2; ++k) {
                        if (k == 1 && !two) break;
                        out_to[sw] = wd[k][0];
                        out_to[4 - sw] = wd[k][1];
                        out_to[64 + sw] = wd[k][2];
                        out_to[68 - sw] = wd[k][3];
                        __syncwarp();
                        v[k].raw = block[slot(i_own, h)];
                        __syncwarp();  // the block is read before it is written again
                    }
                    put(v[0], ob, base + i_own);
                    if (two) put(v[1], ob + ob_step, base + STEP + i_own);
                }
                // (the rows' outputs are read before the next store: the barrier after it)
                it = next;
            }
        }
    }
}
