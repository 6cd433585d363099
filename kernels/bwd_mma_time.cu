// bwd_mma_time.cu: the backward on tensor cores for time-contiguous bfloat16 x and weights whose
// x and dout rows start on 8-byte boundaries, widths from the plan's MMA_MIN_WIDTH to 16
// MMA_TIME_MAX_STEPS - 15, no seq_idx (bwd_mma.cu serves the other tensor-core cases).
//
//   bwd_mma_time<T, KS, NV, WARPS>
//       widths K with K - 1 <= D = 16 (KS - 1). Rows are cut into chunks of NV groups of 256
//       positions; warp w takes a run of p.per chunks in channel-major order (a row's chunks
//       first to last, then the channel's next batch row), WARPS warps a block, one wave of
//       mma_time_warps_per_sm(KS) warps an SM. A chunk is held in registers: lane (g, tg) =
//       (lane / 4, lane % 4) holds positions 16 g + 4 tg .. + 3 ("row 0") and 128 on ("row 1") of
//       every group of x and dout (8 bytes a row: a warp's row is 256 contiguous bytes), and of
//       x's group before the chunk. The run's next MMA_TIME_STAGES - 1 chunks are in flight
//       meanwhile: each lane copies its own 8-byte pieces of them by cp.async into the warp's
//       shared memory (zeros past the row) and reads them back at the chunk's start (no
//       barrier: no lane reads another's). The run's first chunk and a row's first with
//       states are loaded directly.
//
// The MMAs (m16n8k16, float32 accumulators) take a group's 16 blocks of 16 positions as the
// rows of A, whose k is a block's 16 positions (k = 2 tg, 2 tg + 1 <-> positions 4 tg, 4 tg + 1
// of the block; k = 2 tg + 8, + 9 <-> 4 tg + 2, + 3), so that a lane's 8-byte row is its two A
// words of that block as loaded; B is the taps' band, its 8 columns n = 2 t + u the outputs
// 4 t + 2 H + u of the block (MMA half H = 0, 1), so that a lane's accumulators of both halves
// are the outputs at its own A positions. For each group j of a chunk:
//  1. z: for d = KS - 1 .. 0, A = the blocks d before each block (lane (g - d) mod 8's rows, the
//     group before's row 1 where g < d: one shuffle a word), B the band of the taps K - 1 + e -
//     o - 16 d (input e of that block, output o).
//  2. dz = dout silu'(z) at the lane's own positions, split into a high and a low bfloat16 half
//     (hi + lo = dz to 2^-17 relative): A operands as they stand.
//  3. dx of group j - 1: the same products over dz's blocks d after each block (the taps K - 1 -
//     16 d - e + o), hi's and lo's into one accumulator. A chunk's last group's dx needs the
//     next chunk's first dz: its halves are carried to the next chunk where that is the row's
//     next (then its j = 0 step computes it), else taken as 0 past the row or computed here
//     from the group after the chunk (a run that ends inside a row).
//  4. dweight: for block lags d < KS, C_d[a][n] = sum over the group's blocks b of x[16 (b - d) +
//     a] dz[16 b + n], A = z's operand of step d and B = dz, each 8 x 8 quarter transposed in
//     registers (movmatrix), summed in registers over the run's chunks of a channel. Every
//     product in C_d[a][n] has the lag 16 d + n - a (positions), the tap K - 1 - 16 d - n + a,
//     so at the channel's last chunk in the run dweight[k] is summed along the diagonals of the
//     C_d in a fixed order (add_diagonals); dbias is the sum of dz. Both are written as the
//     part (b, chunk) of that chunk (zeros for the channel's other chunks; bwd_reduce adds the
//     parts).
//
// Non-finite values: an MMA multiplies every input of its window by every row of A, zeros
// included, so a non-finite input would reach outputs outside its taps (0 inf = NaN), and a
// non-finite dz splits into a NaN low half. A non-finite x, weight or bias makes z non-finite
// where its window reaches (dz too, with the activation; the sum of z is checked without it),
// and a non-finite dout makes dz non-finite. A chunk runs straight through; if any of its sums
// is not finite, the exact path computes its dx again (and the chunk before's last group's,
// left to it), and the channel's dweight and dbias over the run so far, every term from its own
// taps (exact_dx, exact_terms). p.dx_aligned: dx rows time-contiguous and starting on 8-byte
// boundaries. Measurements: benchmarks/NOTES.md, "bwd_mma_time".
#include "bwd_common.cuh"
#include "mma_common.cuh"

// The exact path, for chunks with a non-finite value (positions start .. start + n - 1 of row
// (b, c)), each term from its own taps and dz computed from scratch (dz_at). Out of line: finite
// inputs never call it. exact_dx (bwd_common.cuh): the chunk's dx from `from` on (from < 0: the
// chunk before's end too).
// exact_terms: the chunk's dweight terms added to sums[k] by the lane that holds tap k (k = lane +
// 32 j), and this lane's dbias terms, returned.
template <int N, typename P>
__device__ __noinline__ float exact_terms(const __nv_bfloat16* x, const void* weight, const void* bias,
                                          const void* initial_states, const __nv_bfloat16* dout, const P& p, int64 b,
                                          int64 c, int64 start, int n, float* sums) {
    const int lane = threadIdx.x & 31, width = (int)p.width;
    auto dz = [&](int64 t) { return dz_at<float>(x, weight, bias, nullptr, initial_states, dout, p, b, c, t); };
    #pragma unroll
    for (int j = 0; j < N; ++j) {
        const int k = lane + 32 * j;
        if (k < width) {
            float a = 0.f;
            for (int o = 0; o < n; ++o)
                a += dz(start + o) * input_at<float>(x, initial_states, p, b, c, start + o - (width - 1) + k);
            sums[k] += a;
        }
    }
    float db = 0.f;
    for (int o = lane; o < n; o += 32) db += dz(start + o);
    return db;
}

// The warps an SM bwd_mma_time's register budget is set for, by k-steps (benchmarks/NOTES.md,
// "bwd_mma_time's chunks staged by cp.async").
__host__ __device__ constexpr int mma_time_warps_per_sm(int KS) {
    return KS <= 2 ? MMA_TIME_WARPS_PER_SM : MMA_TIME_WIDE_WARPS_PER_SM;
}

template <typename T, int KS, int NV, int WARPS>
__global__ void __launch_bounds__(32 * WARPS, mma_time_warps_per_sm(KS) / WARPS)
    bwd_mma_time(BWD_ARRAYS, const __grid_constant__ BwdMmaTimeParams p) {
    wait_for_previous_kernel();
    static_assert(same_type<T, __nv_bfloat16>, "bwd_mma_time takes bfloat16 x");
    static_assert(KS >= 2 && KS <= 4, "shifts d < KS inside a group and the one before; width + 1 <= 64 sums");
    using Sizes = ToeplitzTaps<KS>;
    constexpr int PAD = Sizes::PAD, SIZE = Sizes::SIZE, N = Sizes::N;
    constexpr int SPAN = 256 * NV;  // positions a chunk
    const int64 seqlen = p.seqlen, dx_l_stride = p.dx_l_stride;
    const int batch = (int)p.batch, dim = (int)p.dim, width = (int)p.width, dx_aligned = (int)p.dx_aligned,
              silu_act = (int)p.silu_act;
    const int lane = threadIdx.x & 31, g = lane >> 2, tg = lane & 3;
    // The warp's zero-padded taps (ToeplitzTaps: taps at PAD.., written for every channel, zeros
    // around them written once), a lag's C_d (256 floats, cd[16 a + n]) when it is summed, and
    // the B fragments of the bands of z and dx, [d][H][lane] (each lane reads its own only).
    __shared__ float wpad_mem[WARPS][SIZE];
    __shared__ __align__(16) float cd_mem[WARPS][256];
    __shared__ uint2 zb_mem[WARPS][KS][2][32], xb_mem[WARPS][KS][2][32];
    float* const wpad = wpad_mem[threadIdx.x / 32];
    float* const cd = cd_mem[threadIdx.x / 32];
    uint2 (&zb)[KS][2][32] = zb_mem[threadIdx.x / 32];
    uint2 (&xb)[KS][2][32] = xb_mem[threadIdx.x / 32];
    // dz's halves of a chunk's last group, carried to the row's next chunk (ch, cl below): in
    // registers at KS 2, at KS 3 (whose registers are the scarcer) in the warp's cd, as carry[h0,
    // h1, l0, l1][lane] (width 31 4 % faster so, width 16 3 % slower: benchmarks/NOTES.md,
    // "bwd_mma_time's carried dz in shared memory"). cd is free while they wait there: a chunk
    // that leaves them is not its channel's last in the run (whose lags go through cd), and the
    // exact path, which sums into cd, drops them (carried = false).
    constexpr bool CARRY_SHARED = KS >= 3;
    uint2 (&carry)[4][32] = *reinterpret_cast<uint2(*)[4][32]>(cd);
    // The staged chunks, buffer q % STAGES for the run's chunk q, a lane's 8-byte pieces at slot
    // 0 (x's group -1, row 1), 1 + 2 j + r (x's group j, row r), 1 + 2 NV + 2 j + r (dout's).
    constexpr int STAGES = MMA_TIME_STAGES, SLOTS = 4 * NV + 1;
    __shared__ uint2 stage_mem[WARPS][STAGES][SLOTS][32];
    uint2 (&stage)[STAGES][SLOTS][32] = stage_mem[threadIdx.x / 32];
    for (int i = lane; i < SIZE; i += 32) wpad[i] = 0.f;

    // (the plan keeps the call's chunks below 2^31)
    const int per_row = (int)((seqlen + SPAN - 1) / SPAN), n_items = dim * batch * per_row, per = (int)p.per;
    // This lane's outputs in MMA half H: 4 tg + 2 H, + 1 of blocks g and g + 8 (accumulators 0, 1
    // and 2, 3); its B column is output o = 4 (g / 2) + 2 H + g % 2 of each block.
    auto out_of = [&](int H) { return 4 * (g >> 1) + 2 * H + (g & 1); };
    float cacc[KS][2][4] = {};   // C_d, [d][H]
    float dw[N] = {}, db = 0.f;  // this lane's dweight (taps lane + 32 j) and dbias terms
    float bias_c = 0.f;
    int channel = -1;

    // A chunk: row (b, c), positions chunk SPAN ..; a lane's part of it, src: x and dout from its
    // first position (at = chunk SPAN + 16 g + 4 tg; rows r of groups j 256 j + 128 r on), and
    // whether the whole chunk lies in the row.
    struct Chunk {
        int b, c, chunk;
    };
    struct Src {
        const T *x, *d;
        int64 at;
        bool whole;
    };
    auto src_of = [&](const Chunk& q) {
        Src s;
        s.at = (int64)q.chunk * SPAN + 16 * g + 4 * tg;
        s.x = x + q.b * p.x_batch_stride + q.c * p.x_c_stride + s.at;
        s.d = dout + q.b * p.dout_batch_stride + q.c * p.dout_c_stride + s.at;
        s.whole = (int64)q.chunk * SPAN + SPAN <= seqlen;
        return s;
    };
    // The 4 positions at `at` (from pos; zeros past the row's end).
    auto load = [&](const T* at, int64 pos, bool whole) {
        if (whole || pos + 4 <= seqlen) return __ldg(reinterpret_cast<const uint2*>(at));
        unsigned h[4] = {};
        #pragma unroll
        for (int e = 0; e < 4; ++e)
            if (pos + e < seqlen) h[e] = __bfloat16_as_ushort(at[e]);
        return make_uint2(h[0] | h[1] << 16, h[2] | h[3] << 16);
    };
    // x of chunk q's group j, row r, and of the group before it (j = -1, row 1: the blocks within
    // D of the chunk are those read; zeros or the width - 1 states before the row), dout of its
    // group j.
    auto x_of = [&](const Src& s, const Chunk& q, int j, int r) {
        if (j >= 0) return load(s.x + 256 * j + 128 * r, s.at + 256 * j + 128 * r, s.whole);
        if (r == 0) return make_uint2(0u, 0u);
        if (q.chunk > 0) return __ldg(reinterpret_cast<const uint2*>(s.x - 128));
        unsigned h[4] = {};
        if (initial_states) {
            #pragma unroll
            for (int e = 0; e < 4; ++e)
                if (s.at - 128 + e >= 1 - width)
                    h[e] = __bfloat16_as_ushort(
                        __float2bfloat16_rn(input_at<float>(x, initial_states, p, q.b, q.c, s.at - 128 + e)));
        }
        return make_uint2(h[0] | h[1] << 16, h[2] | h[3] << 16);
    };
    auto dout_of = [&](const Src& s, int j, int r) {
        return load(s.d + 256 * j + 128 * r, s.at + 256 * j + 128 * r, s.whole);
    };

    // Rows of a group (cur; prev: the group before) shifted d blocks back (prev's row 1 where
    // they wrap), as A words {row 0 .x, row 1 .x, row 0 .y, row 1 .y}.
    auto back = [&](const uint2 (&prev)[2], const uint2 (&cur)[2], int d, unsigned (&a)[4]) {
        uint2 r0 = cur[0], r1 = cur[1];
        if (d) {  // this lane gives lane (g + d) mod 8 its rows
            const bool wrap = g + d >= 8;
            const uint2 v0 = wrap ? prev[1] : cur[0], v1 = wrap ? cur[0] : cur[1];
            const int src = (lane - 4 * d) & 31;
            r0 = make_uint2(__shfl_sync(0xffffffffu, v0.x, src), __shfl_sync(0xffffffffu, v0.y, src));
            r1 = make_uint2(__shfl_sync(0xffffffffu, v1.x, src), __shfl_sync(0xffffffffu, v1.y, src));
        }
        a[0] = r0.x, a[1] = r1.x, a[2] = r0.y, a[3] = r1.y;
    };
    // The same d blocks ahead (next: the group after; its row 0 where they wrap).
    auto ahead = [&](const uint2 (&cur)[2], const uint2 (&next)[2], int d, unsigned (&a)[4]) {
        uint2 r0 = cur[0], r1 = cur[1];
        if (d) {  // this lane gives lane (g - d) mod 8 its rows
            const bool wrap = g < d;
            const uint2 v0 = wrap ? cur[1] : cur[0], v1 = wrap ? next[0] : cur[1];
            const int src = (lane + 4 * d) & 31;
            r0 = make_uint2(__shfl_sync(0xffffffffu, v0.x, src), __shfl_sync(0xffffffffu, v0.y, src));
            r1 = make_uint2(__shfl_sync(0xffffffffu, v1.x, src), __shfl_sync(0xffffffffu, v1.y, src));
        }
        a[0] = r0.x, a[1] = r1.x, a[2] = r0.y, a[3] = r1.y;
    };
    // z of a group (x rows cur, prev the group before) and, when LAGS, the transposed A operands
    // t of its lag products; then dz = dout silu'(z) (dout rows dv) split into halves (hi, lo).
    // Adds this lane's dz to terms; returns its sum of dz (and of z without the activation).
    auto z_dz = [&](auto silu_flag, auto lags_flag, const uint2 (&prev)[2], const uint2 (&cur)[2],
                    const uint2 (&dv)[2], unsigned (&t)[KS][4], uint2 (&hi)[2], uint2 (&lo)[2], float& terms) {
        constexpr bool SILU = decltype(silu_flag)::value, LAGS = decltype(lags_flag)::value;
        float z[2][4];
        #pragma unroll
        for (int H = 0; H < 2; ++H) z[H][0] = z[H][1] = z[H][2] = z[H][3] = bias_c;
        #pragma unroll
        for (int d = KS - 1; d >= 0; --d) {
            unsigned a[4];
            back(prev, cur, d, a);
            #pragma unroll
            for (int H = 0; H < 2; ++H) {
                const uint2 b = zb[d][H][lane];
                MmaOp<T>::run(z[H], a, b.x, b.y);
            }
            if constexpr (LAGS) {
                t[d][0] = transposed(a[0]), t[d][1] = transposed(a[2]);
                t[d][2] = transposed(a[1]), t[d][3] = transposed(a[3]);
            }
        }
        float sum = 0.f, group = 0.f;
        #pragma unroll
        for (int r = 0; r < 2; ++r) {
            #pragma unroll
            for (int H = 0; H < 2; ++H) {
                const unsigned dd = H ? dv[r].y : dv[r].x;
                float g0 = low_half(dd), g1 = high_half(dd);
                if constexpr (SILU) {
                    g0 *= silu_grad(z[H][2 * r]);
                    g1 *= silu_grad(z[H][2 * r + 1]);
                } else {
                    sum += z[H][2 * r] + z[H][2 * r + 1];
                }
                group += g0 + g1;
                unsigned h, l;
                split_pair(g0, g1, h, l);
                (H ? hi[r].y : hi[r].x) = h;
                (H ? lo[r].y : lo[r].x) = l;
            }
        }
        terms += group;
        return sum + group;
    };

    // The chunk after q in channel-major order (a row's chunks, then the channel's next batch row).
    auto step = [&](Chunk& q) {
        if (++q.chunk == per_row) {
            q.chunk = 0;
            if (++q.b == batch) q.b = 0, ++q.c;
        }
    };

    for (int run = (int)grid_warp(); run < (n_items + per - 1) / per; run += (int)grid_warps()) {
        const int first = run * per, end = min(first + per, n_items);
        Chunk cur;
        cur.chunk = first % per_row;
        cur.b = first / per_row % batch;
        cur.c = first / per_row / batch;
        int chan_first = first;  // the run's first chunk of the channel at hand
        // The run's chunk ahead_q and where it lies (ahead_c): the next one to stage.
        int ahead_q = first + 1;
        Chunk ahead_c;
        ahead_c.chunk = ahead_q % per_row;
        ahead_c.b = ahead_q / per_row % batch;
        ahead_c.c = ahead_q / per_row / batch;
        unsigned staged = 0;  // bit q % STAGES: the run's chunk q is staged
        // Stages chunk ahead_q unless it is a row's first with states (whose group before comes
        // from them): the group before it in the row, or zeros before the row; in a chunk the
        // row ends in, each piece's bytes in the row and zeros past it. One cp.async group a
        // chunk (empty for one not staged), then steps the cursor.
        auto stage_next = [&]() {
            const Chunk& q = ahead_c;
            const bool ok = ahead_q < end && (q.chunk > 0 || !initial_states);
            const int slot = ahead_q % STAGES;
            staged = ok ? staged | 1u << slot : staged & ~(1u << slot);
            if (ok) {
                const Src s = src_of(q);
                uint2 (&buf)[SLOTS][32] = stage[slot];
                cp_async<8>(&buf[0][lane], q.chunk > 0 ? s.x - 128 : x, q.chunk > 0 ? 8 : 0);
                if (s.whole) {
                    #pragma unroll
                    for (int j = 0; j < NV; ++j) {
                        #pragma unroll
                        for (int r = 0; r < 2; ++r) {
                            cp_async<8>(&buf[1 + 2 * j + r][lane], s.x + 256 * j + 128 * r, 8);
                            cp_async<8>(&buf[1 + 2 * NV + 2 * j + r][lane], s.d + 256 * j + 128 * r, 8);
                        }
                    }
                } else {
                    #pragma unroll 1
                    for (int k = 0; k < 2 * NV; ++k) {  // (piece k: group k / 2, row k % 2)
                        const int64 in_row = seqlen - (s.at + 128 * k);  // positions from the piece on
                        const int bytes = in_row >= 4 ? 8 : in_row > 0 ? 2 * (int)in_row : 0;
                        cp_async<8>(&buf[1 + k][lane], bytes ? s.x + 128 * k : x, bytes);
                        cp_async<8>(&buf[1 + 2 * NV + k][lane], bytes ? s.d + 128 * k : dout, bytes);
                    }
                }
            }
            cp_async_commit();
            ++ahead_q;
            step(ahead_c);
        };
        #pragma unroll 1
        for (int k = 0; k < STAGES - 2; ++k) stage_next();
        // x of groups -1 .. NV - 1 (xv[j + 1]) and dout of groups 0 .. NV - 1, rows 0 and 1, of
        // the chunk at hand.
        uint2 xv[NV + 1][2], dv[NV][2];
        uint2 ch[2] = {}, cl[2] = {};  // dz's halves of the chunk before's last group (carried)
        bool carried = false;  // the chunk before is this row's, its last group's dx left to this one
        for (int i = first; i < end; ++i) {
            const int64 start = (int64)cur.chunk * SPAN;
            const int n = (int)min(seqlen - start, (int64)SPAN);  // positions of the chunk in the row
            stage_next();  // (chunk i + STAGES - 1)
            if (staged >> (i % STAGES) & 1) {
                cp_async_wait<STAGES - 1>();  // this lane's copies of chunk i have landed
                const uint2 (&buf)[SLOTS][32] = stage[i % STAGES];
                xv[0][0] = make_uint2(0u, 0u);
                xv[0][1] = buf[0][lane];
                #pragma unroll
                for (int j = 0; j < NV; ++j) {
                    #pragma unroll
                    for (int r = 0; r < 2; ++r) xv[j + 1][r] = buf[1 + 2 * j + r][lane], dv[j][r] = buf[1 + 2 * NV + 2 * j + r][lane];
                }
            } else {  // (checked loads: the run's first chunk, a row's first chunk with states)
                const Src s = src_of(cur);
                #pragma unroll
                for (int j = -1; j < NV; ++j) {
                    #pragma unroll
                    for (int r = 0; r < 2; ++r) xv[j + 1][r] = x_of(s, cur, j, r);
                }
                #pragma unroll
                for (int j = 0; j < NV; ++j) {
                    #pragma unroll
                    for (int r = 0; r < 2; ++r) dv[j][r] = dout_of(s, j, r);
                }
            }
            Chunk nxt = cur;
            step(nxt);
            const bool more = i + 1 < end, follows = more && nxt.chunk > 0;  // nxt: this row's next chunk
            const int c = cur.c;
            if (c != channel) {  // the channel's bands
                channel = c;
                chan_first = i;
                __syncwarp();
                for (int k = lane; k < width; k += 32)
                    wpad[PAD + k] = load_as<float>(weight, (int)p.weight_dtype, c * p.weight_c_stride + k * p.weight_width_stride);
                bias_c = bias ? load_as<float>(bias, (int)p.bias_dtype, c * p.bias_stride) : 0.f;
                __syncwarp();
                #pragma unroll
                for (int d = 0; d < KS; ++d) {
                    #pragma unroll
                    for (int H = 0; H < 2; ++H) {
                        const int o = out_of(H);
                        const float* const wl = wpad + PAD + width - 1 + 4 * tg - o - 16 * d;  // z: tap of input e at wl[e - 4 tg]
                        const float* const wr = wpad + PAD + width - 1 + o - 4 * tg - 16 * d;  // dx: at wr[4 tg - e]
                        zb[d][H][lane] = make_uint2(pack2<T>(wl[0], wl[1]), pack2<T>(wl[2], wl[3]));
                        xb[d][H][lane] = make_uint2(pack2<T>(wr[0], wr[-1]), pack2<T>(wr[-2], wr[-3]));
                    }
                }
            }

            T* const dxr = dx + cur.b * p.dx_batch_stride + c * p.dx_c_stride;
            T* const dxl = dxr + start + 16 * g + 4 * tg;  // (WHOLE: this lane's first position)
            // dx at this lane's 4 positions of a row of a group (from chunk position o0 + 16 g + 4
            // tg): one 8-byte store where the chunk is whole and dx's rows aligned (WHOLE), else
            // checked one by one.
            auto put = [&](auto whole_flag, int o0, unsigned lo, unsigned hi, bool on) {
                if constexpr (decltype(whole_flag)::value) {
                    st_global8(dxl + o0, lo, hi, on);
                } else {
                    const int o = o0 + 16 * g + 4 * tg;
                    const unsigned w[2] = {lo, hi};
                    #pragma unroll
                    for (int e = 0; e < 4; ++e)
                        if (on && o + e < n)
                            dxr[(start + o + e) * dx_l_stride] = __ushort_as_bfloat16((unsigned short)(w[e >> 1] >> (16 * (e & 1))));
                }
            };
            // dx of the group whose dz halves are (h0, l0), the next group's (h1, l1), its rows at
            // chunk position o0 and o0 + 128, stored where `on`.
            auto dx_group = [&](auto whole_flag, const uint2 (&h0)[2], const uint2 (&l0)[2], const uint2 (&h1)[2],
                                const uint2 (&l1)[2], int o0, bool on = true) {
                float acc[2][4] = {};  // (hi's products, then lo's, into one chain)
                #pragma unroll
                for (int d = 0; d < KS; ++d) {
                    unsigned ah[4], al[4];
                    ahead(h0, h1, d, ah);
                    ahead(l0, l1, d, al);
                    #pragma unroll
                    for (int H = 0; H < 2; ++H) {
                        const uint2 b = xb[d][H][lane];
                        MmaOp<T>::run(acc[H], ah, b.x, b.y);
                        MmaOp<T>::run(acc[H], al, b.x, b.y);
                    }
                }
                #pragma unroll
                for (int r = 0; r < 2; ++r)
                    put(whole_flag, o0 + 128 * r,
                        bf16x2_bits(acc[0][2 * r], acc[0][2 * r + 1]), bf16x2_bits(acc[1][2 * r], acc[1][2 * r + 1]), on);
            };

            // The chunk's groups, SILU and WHOLE fixed at compile time, straight through (a chunk
            // with a non-finite value is redone by the exact path after them). Returns the sum of
            // every dz (and z without the activation) computed: not finite if one of them is not.
            float terms = 0.f;  // this lane's dbias terms of the chunk
            auto groups = [&](auto silu_flag, auto whole_flag) {
                float sums = 0.f;
                uint2 dzh[NV][2], dzl[NV][2];
                #pragma unroll
                for (int j = 0; j < NV; ++j) {
                    // 1, 2. z and dz
                    unsigned t[KS][4];
                    sums += z_dz(silu_flag, Flag<true>(), xv[j], xv[j + 1], dv[j], t, dzh[j], dzl[j], terms);
                    // 3. dx of the group before (of the chunk before's last where it was left here:
                    // computed always, stored where so)
                    if (j > 0) dx_group(whole_flag, dzh[j - 1], dzl[j - 1], dzh[j], dzl[j], 256 * (j - 1));
                    else {  // (a whole chunk)
                        if constexpr (CARRY_SHARED) {
                            #pragma unroll
                            for (int r = 0; r < 2; ++r) ch[r] = carry[r][lane], cl[r] = carry[2 + r][lane];
                        }
                        dx_group(whole_flag, ch, cl, dzh[0], dzl[0], -256, carried);
                    }
                    // 4. dweight's lag products
                    #pragma unroll
                    for (int H = 0; H < 2; ++H) {
                        const unsigned bh0 = transposed(H ? dzh[j][0].y : dzh[j][0].x);
                        const unsigned bh1 = transposed(H ? dzh[j][1].y : dzh[j][1].x);
                        const unsigned bl0 = transposed(H ? dzl[j][0].y : dzl[j][0].x);
                        const unsigned bl1 = transposed(H ? dzl[j][1].y : dzl[j][1].x);
                        #pragma unroll
                        for (int d = 0; d < KS; ++d) {
                            MmaOp<T>::run(cacc[d][H], t[d], bh0, bh1);
                            MmaOp<T>::run(cacc[d][H], t[d], bl0, bl1);
                        }
                    }
                }
                // The last group's dx: left to the row's next chunk when it follows, else with the
                // dz past the chunk (0 past the row; else from the group after, loaded here).
                if (follows) {
                    #pragma unroll
                    for (int r = 0; r < 2; ++r) {
                        if constexpr (CARRY_SHARED) carry[r][lane] = dzh[NV - 1][r], carry[2 + r][lane] = dzl[NV - 1][r];
                        else ch[r] = dzh[NV - 1][r], cl[r] = dzl[NV - 1][r];
                    }
                } else {
                    uint2 ah[2] = {}, al[2] = {};
                    if (start + SPAN < seqlen) {
                        uint2 xa[2] = {}, da[2] = {};
                        if (g < KS - 1) {
                            const Src s = src_of(cur);
                            xa[0] = load(s.x + 256 * NV, s.at + 256 * NV, false);
                            da[0] = load(s.d + 256 * NV, s.at + 256 * NV, false);
                        }
                        unsigned t[KS][4];
                        float past = 0.f;
                        sums += z_dz(silu_flag, Flag<false>(), xv[NV], xa, da, t, ah, al, past);
                    }
                    dx_group(whole_flag, dzh[NV - 1], dzl[NV - 1], ah, al, 256 * (NV - 1));
                }
                return sums;
            };
            float sums;
            if (n == SPAN && dx_aligned) {
                sums = silu_act ? groups(Flag<true>(), Flag<true>()) : groups(Flag<false>(), Flag<true>());
            } else {
                sums = silu_act ? groups(Flag<true>(), Flag<false>()) : groups(Flag<false>(), Flag<false>());
            }
            db += terms;
            if (__any_sync(0xffffffffu, !isfinite(sums))) {
                // The exact path: the chunk's dx (and the chunk before's last group's, left to
                // it) again, and the channel's sums over the run so far from their own terms.
                exact_dx(x, weight, bias, initial_states, dout, dx, p, cur.b, c, start, carried ? -256 : 0, n);
                #pragma unroll
                for (int d = 0; d < KS; ++d)
                    #pragma unroll
                    for (int H = 0; H < 2; ++H) cacc[d][H][0] = cacc[d][H][1] = cacc[d][H][2] = cacc[d][H][3] = 0.f;
                for (int k = lane; k < width; k += 32) cd[k] = 0.f;
                db = 0.f;
                for (int q = chan_first; q <= i; ++q) {
                    const int b = q / per_row % batch, chunk = q % per_row;
                    const int64 at = (int64)chunk * SPAN;
                    db += exact_terms<N>(x, weight, bias, initial_states, dout, p, b, c, at, (int)min(seqlen - at, (int64)SPAN), cd);
                }
                #pragma unroll
                for (int j = 0; j < N; ++j)
                    if (lane + 32 * j < width) dw[j] = cd[lane + 32 * j];  // (this lane's own sums)
                carried = false;
            } else {
                carried = follows;
            }

            // The chunk's part of the partials: the channel's sums so far at its last chunk in the
            // run, zeros before (a call of a single part has one chunk a channel).
            const int64 part = (int64)cur.b * per_row + cur.chunk;
            if (!more || nxt.c != c) {
                #pragma unroll
                for (int d = 0; d < KS; ++d) {  // a lag at a time through cd
                    __syncwarp();
                    #pragma unroll
                    for (int H = 0; H < 2; ++H) {
                        // accumulators 0, 1: a = g (position 4 (g / 2) + g % 2), n = 4 tg + 2 H, + 1;
                        // 2, 3: a = g + 8 (2 positions on)
                        const int a0 = 4 * (g >> 1) + (g & 1), n0 = 4 * tg + 2 * H;
                        *reinterpret_cast<float2*>(cd + 16 * a0 + n0) = make_float2(cacc[d][H][0], cacc[d][H][1]);
                        *reinterpret_cast<float2*>(cd + 16 * (a0 + 2) + n0) = make_float2(cacc[d][H][2], cacc[d][H][3]);
                        cacc[d][H][0] = cacc[d][H][1] = cacc[d][H][2] = cacc[d][H][3] = 0.f;
                    }
                    __syncwarp();
                    add_diagonals<KS>(cd, d, width, dw);
                }
                __syncwarp();
                write_warp_sums(partials, dweight, dbias, p, part, c, dw, db);
            } else {  // (width + 1 <= 64 sums)
                float* const zeros = partials + (part * dim + c) * (width + 1) + lane;
                if (lane <= width) zeros[0] = 0.f;
                if (lane + 32 <= width) zeros[32] = 0.f;
            }
            cur = nxt;
        }
    }
}
