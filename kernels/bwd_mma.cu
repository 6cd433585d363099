// bwd_mma.cu: the backward for bfloat16 x and weights on tensor cores.
//
//   bwd_mma<T, KS, CL>
//       T = bfloat16; widths K with K - 1 <= D = 16 (KS - 1), KS <= BWD_MMA_LAGS, no seq_idx.
//       CL = 0, time-contiguous x: a persistent grid of blocks of BWD_MMA_WARPS independent
//       warps; warp w takes a run of p.per items (spans of p.span positions of a row, a
//       multiple of 256) in channel-major order, the spans of a row last to first, and stages
//       the next item (x and dout, cp.async) into one of its two buffers while it computes the
//       current one. A channel's fragments are built once a run.
//       CL = 1, channel-contiguous x, dout and dx (16-byte aligned runs of 8 channels): blocks
//       of BWD_MMA_CL_WARPS warps, one channel each, take items of that many neighbouring
//       channels (a channel group: its batch rows, the spans of a row last to first) in runs:
//       block k takes the whole groups k, k + grid, .. below p.whole (a multiple of the grid),
//       so that the blocks at work read neighbouring groups at the same steps (whole 128-byte
//       lines between them), then one run of p.per items of the rest. The block stages an
//       item's x and dout as rows of positions x channels (32-byte runs, cp.async into
//       p.stage_at) while it computes the item before, moves them into the warps' rows (each
//       warp then computes its channel's row as above), and writes dx back from the warps' rows
//       as 16-byte runs of 8 channels.
//   bwd_mma_block<T, KS>
//       T = bfloat16, time-contiguous x, any KS (widths up to 256), no seq_idx: a persistent
//       grid of blocks of W = BWD_MMA_BLOCK_WARPS warps that share a channel. A block's item is
//       W consecutive spans of a row (warp w the w-th), staged by the whole block into one
//       buffer (the x before a span is the span before's end: one halo a block), with the
//       channel's fragments built once for the block. Steps 1 and 2 below are each warp's on
//       its span (the dz past a span is the next warp's, in the same buffer); in step 3 warp w
//       sums Q = KS / W lags of its own, d = w, w + W, ..., over all W spans, and the last
//       KS % W lags over its own span, held in registers over the channel's items: no warp
//       holds more than Q + W - 1 lags however wide the filter, and each does KS lags' work.

// An item, positions t0 .. t0 + S - 1 of row (b, c), in the warp's shared memory (the plan's
// _mma_layout):
//  1. z at the span's positions as fwd_mma computes outputs: for 16 consecutive outputs, the
//     banded Toeplitz matrix of the taps times the D + 16 inputs up to them, eight such blocks
//     the eight columns of one m16n8k16 MMA per k-step (fwd_mma.cu has the fragment layout).
//     dz = dout silu'(z) (dout without the activation; 0 past the row, where dout is staged as
//     0) is kept as a high half, written over dout, and a low bfloat16 half (hi + lo = dz to
//     2^-17 relative). dx needs dz at the D positions after the span too: the next span's
//     first D, computed by the item before (the spans go last to first) and carried over; the
//     row's last span has zeros there, and a run's first item computes them itself.
//  2. dx[s] = sum_j w[K-1-j] dz[s+j] for s < S: the same Toeplitz product over the dz window,
//     the taps reversed and the band starting at the output, on hi and on lo.
//  3. dweight: for block lags d < KS, C_d[a][e] = sum_i x[t0 + 16 (i - d) + a] dz[t0 + 16 i + e]
//     over the span's 16-position blocks i: MMAs of the staged rows read by ldmatrix.trans,
//     16 blocks at a time, summed in registers over a channel's items. Every product
//     in C_d[a][e] has the lag 16 d + e - a, the tap k = K - 1 - 16 d - e + a, so at the
//     channel's last item in the run dweight[k] is summed along the diagonals of the C_d, in a
//     fixed order; dbias is the sum of dz. Both are written as the part (b, span) of that item
//     (zeros for the channel's other items; bwd_reduce adds the parts).
//
// Non-finite values: an MMA multiplies every input of its window by every row of A, zeros
// included, so a non-finite input would reach outputs outside its taps (0 inf = NaN), and a
// non-finite dz splits into a NaN low half. A non-finite x, weight or bias makes z non-finite
// where its window reaches (dz too, with the activation; the sum of z is checked without it),
// and a non-finite dz makes the item's sum of dz non-finite: then z is computed again from its
// own taps wherever dz is not finite, and the item's dx, dweight and dbias terms from their own
// taps (bwd_mma_exact). (A finite dz beyond bfloat16's largest value, ~3.4e38, rounds to inf in
// the high half: its dx is not finite either way.) p.x_aligned / p.dout_aligned: rows
// time-contiguous and 16-byte aligned (else staged element by element); p.dx_aligned: dx rows
// time-contiguous and 4-byte aligned (else written element by element).
#include "bwd_common.cuh"
#include "mma_common.cuh"

using bf16 = __nv_bfloat16;

template <int N> struct Count { static constexpr int value = N; };

// The A fragments of a banded Toeplitz matrix whose band starts `shift` inputs into the window
// (fragment_offset), lane l's four words of k-step s at frag[32 s + l]: k-steps first, first +
// step, ... (a block's warps share the work).
template <int KS>
__device__ __forceinline__ void build_fragments(const float* pad, int shift, uint4* frag, int first = 0, int step = 1) {
    const int lane = threadIdx.x & 31, g = lane >> 2, tg = lane & 3;
    const float* wl = pad + ToeplitzTaps<KS>::PAD + 4 * tg - 2 * g - shift;
    #pragma unroll
    for (int s = 0; s < KS; ++s) {
        if (s % step != first) continue;
        unsigned a[4];
        #pragma unroll
        for (int r = 0; r < 4; ++r) {
            const float* q = wl + fragment_offset(s, r);
            a[r] = pack2<bf16>(q[0], q[1]);
        }
        frag[32 * s + lane] = make_uint4(a[0], a[1], a[2], a[3]);
    }
}

// acc[j] += the Toeplitz product of `frag` with the window at win + 128 j (J blocks of 128
// outputs).
template <int KS, int J>
__device__ __forceinline__ void toeplitz(float (&acc)[J][4], const uint4* frag, const bf16* win) {
    const int lane = threadIdx.x & 31, g = lane >> 2, tg = lane & 3;
    const uint2* in = reinterpret_cast<const uint2*>(win) + 4 * g + tg;
    #pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
        const uint4 f = frag[32 * ks + lane];
        const unsigned a[4] = {f.x, f.y, f.z, f.w};
        #pragma unroll
        for (int j = 0; j < J; ++j) {
            const uint2 bw = in[32 * j + 4 * ks];
            MmaOp<bf16>::run(acc[j], a, bw.x, bw.y);
        }
    }
}

// toeplitz over two windows (dz's high and low halves) with the same fragments, each loaded once.
// (toeplitz over an array of windows compiled to a schedule 2 % slower at width 64.)
template <int KS, int J>
__device__ __forceinline__ void toeplitz2(float (&acc)[J][4], float (&acc_lo)[J][4], const uint4* frag, const bf16* win,
                                          const bf16* win_lo) {
    const int lane = threadIdx.x & 31, g = lane >> 2, tg = lane & 3;
    const uint2* in = reinterpret_cast<const uint2*>(win) + 4 * g + tg;
    const uint2* in_lo = reinterpret_cast<const uint2*>(win_lo) + 4 * g + tg;
    #pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
        const uint4 f = frag[32 * ks + lane];
        const unsigned a[4] = {f.x, f.y, f.z, f.w};
        #pragma unroll
        for (int j = 0; j < J; ++j) {
            const uint2 bw = in[32 * j + 4 * ks], bl = in_lo[32 * j + 4 * ks];
            MmaOp<bf16>::run(acc[j], a, bw.x, bw.y);
            MmaOp<bf16>::run(acc_lo[j], a, bl.x, bl.y);
        }
    }
}

// dz at position p of the item (hi + lo).
__device__ __forceinline__ float dz_of(const bf16* dzh, const bf16* dzl, int p) {
    return __bfloat162float(dzh[p]) + __bfloat162float(dzl[p]);
}

// Step 1 for J blocks of 128 positions from block blk of a span: z from the tensor cores (x's
// window at xs, from D before the span), dz = dout silu'(z) (dout staged at dzh) split into
// its high half (over dout) and low half (dzl); dz's sums into item_db (SPAN: the span's
// dbias terms) or past (the dz past the span; without SILU z's sum too: a non-finite z means a
// non-finite x, weight or bias). Either sum is non-finite when a dz is (or a finite dz
// bfloat16 cannot hold: its sum overflows too).
template <int KS, int J, bool SILU, bool SPAN>
__device__ __forceinline__ void dz_blocks(int blk, const uint4* zf, const bf16* xs, bf16* dzh, bf16* dzl, float bias_c,
                                          float& item_db, float& past) {
    const int lane = threadIdx.x & 31, g = lane >> 2, tg = lane & 3;
    float acc[J][4];
    #pragma unroll
    for (int j = 0; j < J; ++j) {
        #pragma unroll
        for (int r = 0; r < 4; ++r) acc[j][r] = bias_c;
    }
    toeplitz<KS, J>(acc, zf, xs + 128 * blk);
    #pragma unroll
    for (int j = 0; j < J; ++j) {
        if constexpr (!SILU) past += (acc[j][0] + acc[j][1]) + (acc[j][2] + acc[j][3]);  // z
        // c0, c2: positions q, q + 1 (q = p0 + 16 h: c1, c3 for h = 1)
        const int p0 = 128 * (blk + j) + 32 * tg + 2 * g;
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int q = p0 + 16 * h;
            const unsigned d2 = reinterpret_cast<const unsigned*>(dzh)[q >> 1];  // dout
            float g0 = low_half(d2), g1 = high_half(d2);
            if constexpr (SILU) {
                g0 *= silu_grad(acc[j][h]);
                g1 *= silu_grad(acc[j][2 + h]);
            }
            if constexpr (SPAN) item_db += g0 + g1;
            else past += g0 + g1;
            unsigned hi, lo;
            split_pair(g0, g1, hi, lo);
            reinterpret_cast<unsigned*>(dzh)[q >> 1] = hi;
            reinterpret_cast<unsigned*>(dzl)[q >> 1] = lo;
        }
    }
}

// Step 1 over a span of S positions and, when `tail`, the TB blocks of 128 past it.
template <int KS>
__device__ __forceinline__ void span_dz(int S, bool tail, bool silu, const uint4* zf, const bf16* xs, bf16* dzh,
                                        bf16* dzl, float bias_c, float& item_db, float& past) {
    constexpr int TB = (ToeplitzTaps<KS>::D + 127) / 128;
    auto all = [&](auto silu_flag) {
        constexpr bool SILU = decltype(silu_flag)::value;
        #pragma unroll 1
        for (int blk = 0; blk < S / 128; blk += 2)
            dz_blocks<KS, 2, SILU, true>(blk, zf, xs, dzh, dzl, bias_c, item_db, past);
        if (tail) {
            #pragma unroll 1
            for (int blk = S / 128; blk < S / 128 + TB; ++blk)
                dz_blocks<KS, 1, SILU, false>(blk, zf, xs, dzh, dzl, bias_c, item_db, past);
        }
    };
    if (silu) all(Flag<true>());
    else all(Flag<false>());
}

// Step 2: dx at the span's positions 0 .. n_out - 1 from the dz window at dzh, dzl (hi and lo,
// the span and D past it): pairs of positions, stored whole (WHOLE: n_out = S, dxr's rows
// contiguous and 4-byte aligned) or one by one, dx_step apart.
template <int KS>
__device__ __forceinline__ void span_dx(int S, int n_out, bool whole, const uint4* xf, const bf16* dzh, const bf16* dzl,
                                        bf16* dxr, int64 dx_step) {
    const int lane = threadIdx.x & 31, g = lane >> 2, tg = lane & 3;
    auto blocks = [&](auto whole_flag) {
        constexpr bool WHOLE = decltype(whole_flag)::value;
        const int lane_at = 32 * tg + 2 * g;  // + 128 block + 16 h
        unsigned* const pairs = reinterpret_cast<unsigned*>(dxr + lane_at);
        #pragma unroll 1
        for (int blk = 0; blk < S / 128; blk += 2) {
            float acc[2][4] = {}, acc_lo[2][4] = {};  // two chains a block: hi and lo
            toeplitz2<KS, 2>(acc, acc_lo, xf, dzh + 128 * blk, dzl + 128 * blk);
            #pragma unroll
            for (int j = 0; j < 2; ++j) {
                #pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const float a0 = acc[j][h] + acc_lo[j][h], a1 = acc[j][2 + h] + acc_lo[j][2 + h];
                    if constexpr (WHOLE) {
                        pairs[64 * (blk + j) + 8 * h] = bf16x2_bits(a0, a1);
                    } else {
                        const int q = 128 * (blk + j) + lane_at + 16 * h;
                        if (q < n_out) dxr[q * dx_step] = __float2bfloat16_rn(a0);
                        if (q + 1 < n_out) dxr[(q + 1) * dx_step] = __float2bfloat16_rn(a1);
                    }
                }
            }
        }
    };
    if (whole) blocks(Flag<true>());
    else blocks(Flag<false>());
}

// This lane's entries of one lag's C_d (256 floats, cd[16 a + e]): accumulator half h holds
// c0 (a = g, e = 8 h + 2 tg), c1 (g, e + 1), c2 (g + 8, e), c3 (g + 8, e + 1), as two float2
// at lane_entry(cd, h) and 128 floats further.
__device__ __forceinline__ float2* lane_entry(float* cd, int h) {
    const int lane = threadIdx.x & 31;
    return reinterpret_cast<float2*>(cd + 16 * (lane >> 2) + 8 * h + 2 * (lane & 3));
}

// Writes a lag's C_d accumulators to cd.
__device__ __forceinline__ void dump_lag(float* cd, const float (&acc)[2][4]) {
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
        float2* const at = lane_entry(cd, h);
        at[0] = make_float2(acc[h][0], acc[h][1]);
        at[64] = make_float2(acc[h][2], acc[h][3]);
    }
}

// Adds the LP lags' C_d (lags d0, d0 + STEP, ...; those below KS) to dw through cd (a warp's 256
// floats, written and read by the whole warp), and zeroes them.
template <int KS, int LP, int STEP>
__device__ __forceinline__ void flush_lags(float (&cacc)[LP][2][4], int d0, float* cd, int width,
                                           float (&dw)[ToeplitzTaps<KS>::N]) {
    #pragma unroll
    for (int l = 0; l < LP; ++l) {
        if (d0 + STEP * l < KS) {
            __syncwarp();
            dump_lag(cd, cacc[l]);
            __syncwarp();
            add_diagonals<KS>(cd, d0 + STEP * l, width, dw);
        }
        #pragma unroll
        for (int h = 0; h < 2; ++h)
            #pragma unroll
            for (int r = 0; r < 4; ++r) cacc[l][h][r] = 0.f;
    }
    __syncwarp();
}

// Step 3: cacc[l] += C_{d0 + STEP l} over positions 0 .. S - 1 (16 blocks of 16 an MMA step; x at
// xs, from D before position 0; dz's halves at dzh, dzl), for the lags below KS.
template <int KS, int LP, int STEP>
__device__ __forceinline__ void lag_products(float (&cacc)[LP][2][4], int d0, int S, const bf16* xs, const bf16* dzh,
                                             const bf16* dzl) {
    constexpr int D = ToeplitzTaps<KS>::D;
    const int lane = threadIdx.x & 31, mq = lane >> 3, mr = lane & 7;  // ldmatrix: matrix mq, row mr
    const int row_at = 16 * (mr + 8 * (mq >> 1)) + 8 * (mq & 1);
    #pragma unroll 1
    for (int q0 = 0; q0 < S; q0 += 256) {
        unsigned bh[4], bl[4];
        ldmatrix_x4_trans(bh, dzh + q0 + row_at);
        ldmatrix_x4_trans(bl, dzl + q0 + row_at);
        #pragma unroll
        for (int l = 0; l < LP; ++l) {
            if (d0 + STEP * l < KS) {
                unsigned a[4];
                ldmatrix_x4_trans(a, xs + D + q0 - 16 * (d0 + STEP * l) + row_at);
                #pragma unroll
                for (int h = 0; h < 2; ++h) {
                    MmaOp<bf16>::run(cacc[l][h], a, bh[h], bh[2 + h]);
                    MmaOp<bf16>::run(cacc[l][h], a, bl[h], bl[2 + h]);
                }
            }
        }
    }
}

// Stages time-contiguous rows for an item (channel c of batch row b): x at positions t0 - D ..
// (x_rows of them) into xs and dout at t0 .. (dout_rows) into ds, by threads first, first +
// step, ... of the caller's: whole 16-byte vectors by cp.async where the rows are aligned and
// the item inside the row, else vector by vector (elements by input_at before the row, zeros
// past it; dout zeros past the row). Commits the copies as one group.
template <typename T, int D, typename P>
__device__ __forceinline__ void stage_time_rows(T* xs, T* ds, const T* x, const void* initial_states, const T* dout,
                                                const P& p, int64 b, int64 c, int64 t0, int x_rows, int dout_rows,
                                                int first, int step) {
    const int64 seqlen = p.seqlen;
    const int width = (int)p.width;
    const T* const xr = x + b * p.x_batch_stride + c * p.x_c_stride;
    const T* const dr = dout + b * p.dout_batch_stride + c * p.dout_c_stride;
    const int xv = x_rows / 8, dv = dout_rows / 8;
    const bool x_aligned = p.x_aligned != 0, dout_aligned = p.dout_aligned != 0;
    if (x_aligned && dout_aligned && t0 >= D && t0 + 8 * dv <= seqlen) {  // inside the row
        const uint4* src = reinterpret_cast<const uint4*>(xr + t0 - D) + first;
        unsigned dst = smem_address(xs) + 16 * first;
        for (int v = first; v < xv; v += step, src += step, dst += 16 * step) cp_async_shared16(dst, src);
        src = reinterpret_cast<const uint4*>(dr + t0) + first;
        dst = smem_address(ds) + 16 * first;
        for (int v = first; v < dv; v += step, src += step, dst += 16 * step) cp_async_shared16(dst, src);
        cp_async_commit();
        return;
    }
    for (int v = first; v < xv; v += step) {
        const int64 pos = t0 - D + 8 * v;
        if (x_aligned && pos >= 0 && pos + 8 <= seqlen) {
            cp_async<16>(xs + 8 * v, xr + pos, 16);
        } else {
            #pragma unroll
            for (int e = 0; e < 8; ++e) {
                const int64 s = pos + e;
                xs[8 * v + e] = s >= seqlen || s < -(width - 1)
                                    ? T()
                                    : from_acc<T>(input_at<float>(x, initial_states, p, b, c, s));
            }
        }
    }
    for (int v = first; v < dv; v += step) {
        const int64 pos = t0 + 8 * v;
        if (dout_aligned && pos + 8 <= seqlen) {
            cp_async<16>(ds + 8 * v, dr + pos, 16);
        } else {
            #pragma unroll
            for (int e = 0; e < 8; ++e) ds[8 * v + e] = pos + e < seqlen ? dr[(pos + e) * p.dout_l_stride] : T();
        }
    }
    cp_async_commit();
}

// Items of a persistent grid: spans sp of rows (c, b), channel-major, the spans of a row last
// to first, so that an item's dz past its span (the next span's first D) is the one before's
// first D.
struct Item {
    int64 c, b, sp;
    __device__ Item(int64 index, int64 batch, int64 spans) {
        int64 cb, r;
        divmod(index, spans, cb, r);
        divmod(cb, batch, c, b);
        sp = spans - 1 - r;
    }
    __device__ void next(int64 batch, int64 spans) {
        if (sp > 0) { --sp; return; }
        sp = spans - 1;
        if (++b == batch) { b = 0; ++c; }
    }
};

// The exact path of a span whose dz window has a non-finite value, in two parts.
// fix_dz: z again from its own taps wherever dz (hi or lo) is not finite among the first n_fix
// of the n_all positions the span's warp computed, those in the row (dout read again from dr,
// the row at the span; x's window at xs), dz stored back with lo = 0 where it is not finite;
// the positions past the row get dz = 0 (their z may have caught a non-finite input through
// the band's zeros, and their dout, staged as 0, times it is NaN).
template <int KS, typename P>
__device__ __noinline__ void fix_dz(const bf16* xs, const bf16* dr, bf16* dzh, bf16* dzl, const float* pad,
                                    float bias_c, int n_fix, int n_all, const P& p) {
    constexpr int D = ToeplitzTaps<KS>::D, PAD = ToeplitzTaps<KS>::PAD;
    const int lane = threadIdx.x & 31, width = (int)p.width;
    for (int q = max(n_fix, 0) + lane; q < n_all; q += 32) dzh[q] = dzl[q] = bf16();
    for (int q = lane; q < n_fix; q += 32) {
        if (isfinite(__bfloat162float(dzh[q])) && isfinite(__bfloat162float(dzl[q]))) continue;
        float g = __bfloat162float(dr[q * p.dout_l_stride]);  // (q is inside the row)
        if (p.silu_act) {
            float z = bias_c;
            for (int k = 0; k < width; ++k) z += pad[PAD + k] * __bfloat162float(xs[D + q - (width - 1) + k]);
            g *= silu_grad(z);
        }
        const bf16 hi = __float2bfloat16_rn(g);
        const float rest = g - __bfloat162float(hi);
        dzh[q] = hi;
        dzl[q] = __float2bfloat16_rn(isfinite(rest) ? rest : 0.f);
    }
    __syncwarp();
}
// exact_terms: the span's dx (n_out positions, to dxr, dx_step apart), dweight terms (added to
// dw: taps k = lane + 32 j) and dbias terms (added to db, this lane's positions) from their own
// taps.
template <int KS, typename P>
__device__ __noinline__ void exact_terms(const bf16* xs, const bf16* dzh, const bf16* dzl, const float* rev, int n_out,
                                         bf16* dxr, int64 dx_step, const P& p, float* dw, float& db) {
    constexpr int D = ToeplitzTaps<KS>::D, PAD = ToeplitzTaps<KS>::PAD, N = ToeplitzTaps<KS>::N;
    const int lane = threadIdx.x & 31, width = (int)p.width;
    for (int o = lane; o < n_out; o += 32) {
        float a = 0.f;
        for (int j = 0; j < width; ++j) a += rev[PAD + j] * dz_of(dzh, dzl, o + j);
        dxr[o * dx_step] = __float2bfloat16_rn(a);
        db += dz_of(dzh, dzl, o);
    }
    #pragma unroll
    for (int j = 0; j < N; ++j) {
        const int k = lane + 32 * j;
        if (k < width) {
            float a = 0.f;
            for (int q = 0; q < n_out; ++q) a += __bfloat162float(xs[D + q - (width - 1) + k]) * dz_of(dzh, dzl, q);
            dw[j] += a;
        }
    }
    __syncwarp();
}

// Loads channel c's taps into pad (from PAD on) and, reversed, into rev, by threads first,
// first + step, ...; returns its bias.
template <typename P>
__device__ __forceinline__ float load_taps(const void* weight, const void* bias, const P& p, int64 c, int pad_at,
                                           float* pad, float* rev, int first, int step) {
    const int width = (int)p.width;
    for (int k = first; k < width; k += step) {
        const float w = load_as<float>(weight, (int)p.weight_dtype, c * p.weight_c_stride + k * p.weight_width_stride);
        pad[pad_at + k] = w;
        rev[pad_at + width - 1 - k] = w;
    }
    return bias ? load_as<float>(bias, (int)p.bias_dtype, c * p.bias_stride) : 0.f;
}

template <typename T, int KS, int CL>
__global__ void __launch_bounds__(CL ? 32 * BWD_MMA_CL_WARPS : 32 * BWD_MMA_WARPS, 16 / (CL ? BWD_MMA_CL_WARPS : BWD_MMA_WARPS))
    bwd_mma(BWD_ARRAYS, const __grid_constant__ BwdMmaParams p) {
    wait_for_previous_kernel();
    static_assert(same_type<T, bf16>, "bwd_mma takes bfloat16 x");
    static_assert(KS <= BWD_MMA_LAGS, "bwd_mma holds every lag's C_d (bwd_mma_block takes more)");
    constexpr int D = ToeplitzTaps<KS>::D, PAD = ToeplitzTaps<KS>::PAD, N = ToeplitzTaps<KS>::N;
    constexpr int TB = (D + 127) / 128;  // blocks of dz past the span a run's first item computes
    constexpr int CW = BWD_MMA_CL_WARPS, RUNS = CW / 8;  // CL: channels a block (one a warp), 16-byte runs a row
    static_assert(CW % 8 == 0, "channel-last rows are whole 16-byte runs of 8 channels");
    constexpr int ROWS = 32 * CW / RUNS;  // CL: rows the block's threads take at once
    const int64 batch = p.batch, dim = p.dim, seqlen = p.seqlen;
    const int width = (int)p.width, S = (int)p.span, DL = S + 128 * TB;
    const bool dx_aligned = p.dx_aligned != 0;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    unsigned char* const mine = smem_raw + warp * p.warp_bytes;
    // Buffer b: x at t0 - D .. and, right after it, dout at t0 .. (then dz's high half in its
    // place); buffer 0 also holds the TB blocks past the span a run's first item needs.
    T* const x0 = reinterpret_cast<T*>(mine), *const x1 = reinterpret_cast<T*>(mine + p.x1_at);
    T* const dout0 = reinterpret_cast<T*>(mine + p.dout_at), *const dout1 = reinterpret_cast<T*>(mine + p.dout1_at);
    T* const dzl = reinterpret_cast<T*>(mine + p.dzl_at);     // DL: dz's low half
    uint4* const zf = reinterpret_cast<uint4*>(mine + p.frag_at);  // 32 KS: z's fragments
    uint4* const xf = zf + 32 * KS;                                 // 32 KS: dx's
    float* const pad = reinterpret_cast<float*>(mine + p.pad_at);  // SIZE: the taps, z's band
    float* const rev = pad + ToeplitzTaps<KS>::SIZE;                     // SIZE: reversed, dx's band
    // CL: the block's staging area, D + DL rows of x then DL rows of dout, CW channels a row
    uint4* const stage_x = reinterpret_cast<uint4*>(smem_raw + p.stage_at);
    uint4* const stage_dout = stage_x + RUNS * (D + DL);
    for (int i = lane; i < 2 * ToeplitzTaps<KS>::SIZE; i += 32) pad[i] = 0.f;

    // Items (CL: c is a group of CW channels, the warp's channel CW c + warp) in runs [i, end)
    // of the Item order: run u < p.whole is the whole of group u, later runs p.per items each
    // from there on; warp w (CL: block w) takes runs w, w + grid, .. (time-contiguous: one run).
    const int64 spans = (seqlen + S - 1) / S, group_items = batch * spans;
    const int64 n_items = (CL ? (dim + CW - 1) / CW : dim) * group_items, whole = p.whole;
    const int64 n_runs = whole + (n_items - whole * group_items + p.per - 1) / p.per;
    auto run_of = [&](int64 u, int64& lo, int64& hi) {
        lo = u < whole ? u * group_items : whole * group_items + (u - whole) * p.per;
        hi = min(lo + (u < whole ? group_items : p.per), n_items);
    };
    int64 run = CL ? (int64)blockIdx.x : grid_warp(), i, end;
    if (run >= n_runs) return;
    run_of(run, i, end);
    auto channel_of = [&](const Item& it) { return CL ? CW * it.c + warp : it.c; };
    // Stages item `it` into buffer `buf` (CL: into the block's staging area): x from D before
    // the span, dout from the span, each over the span and, when `tail`, TB more blocks.
    auto stage = [&](const Item& it, int buf, bool tail) {
        const int64 t0 = it.sp * S;
        const int x_rows = D + S + (tail ? 128 * TB : 0), dout_rows = S + (tail ? 128 * TB : 0);
        if constexpr (CL) {  // 16-byte runs of 8 channels, zeros past the channels
            // thread t: run h = t % RUNS of rows t / RUNS, + ROWS, ...
            const int h = threadIdx.x % RUNS, r0 = threadIdx.x / RUNS;
            const int64 c0 = CW * it.c + 8 * h;
            const bool in = c0 < dim;
            auto rows = [&](uint4* dst, const T* src, int64 l_stride, int64 pos0, int n, bool is_x) {
                dst += RUNS * r0 + h;
                src += c0 + (pos0 + r0) * l_stride;
                const int64 step = ROWS * l_stride;
                if (in && pos0 >= 0 && pos0 + n <= seqlen) {  // inside the row: no checks
                    for (int r = r0; r < n; r += ROWS, dst += RUNS * ROWS, src += step) cp_async<16>(dst, src, 16);
                    return;
                }
                for (int r = r0; r < n; r += ROWS, dst += RUNS * ROWS, src += step) {
                    const int64 pos = pos0 + r;
                    if (in && pos >= 0 && pos < seqlen) {
                        cp_async<16>(dst, src, 16);
                    } else if (!in || !is_x || pos >= seqlen || pos < -(width - 1) || !initial_states) {
                        *dst = make_uint4(0, 0, 0, 0);
                    } else {  // x before the row: initial_states
                        unsigned w[4];
                        #pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const float lo = input_at<float>(x, initial_states, p, it.b, c0 + 2 * e, pos);
                            const float hi = input_at<float>(x, initial_states, p, it.b, c0 + 2 * e + 1, pos);
                            w[e] = pack2<bf16>(lo, hi);
                        }
                        *dst = make_uint4(w[0], w[1], w[2], w[3]);
                    }
                }
            };
            rows(stage_x, x + it.b * p.x_batch_stride, p.x_l_stride, t0 - D, x_rows, true);
            rows(stage_dout, dout + it.b * p.dout_batch_stride, p.dout_l_stride, t0, dout_rows, false);
            cp_async_commit();
            return;
        }
        stage_time_rows<T, D>(buf ? x1 : x0, buf ? dout1 : dout0, x, initial_states, dout, p, it.b, it.c, t0, x_rows,
                              dout_rows, lane, 32);
    };
    // CL: the staged rows into buffer `buf` of the warps, x_rows of x and dout_rows of dout
    // (both even). Thread t: rows 2 j and 2 j + 1 of run h = t % RUNS (j = t / RUNS, + ROWS,
    // ...), the pair of positions of channel e to warp 8 h + e.
    auto unstage = [&](int buf, int x_rows, int dout_rows) {
        const int h = threadIdx.x % RUNS;
        const unsigned wb = (unsigned)p.warp_bytes, first_row = smem_address(smem_raw) + 8 * h * wb;
        auto rows = [&](const uint4* src, unsigned row_at, int n) {
            for (int j = threadIdx.x / RUNS; 2 * j < n; j += ROWS) {
                const uint4 a = src[RUNS * 2 * j + h], b = src[RUNS * (2 * j + 1) + h];
                const unsigned ra[4] = {a.x, a.y, a.z, a.w}, rb[4] = {b.x, b.y, b.z, b.w};
                const unsigned at = row_at + 4 * j;
                #pragma unroll
                for (int e = 0; e < 8; ++e)
                    st_shared32(at + e * wb, __byte_perm(ra[e >> 1], rb[e >> 1], e & 1 ? 0x7632 : 0x5410));
            }
        };
        rows(stage_x, first_row + (unsigned)(buf ? p.x1_at : 0), x_rows);
        rows(stage_dout, first_row + (unsigned)(buf ? p.dout1_at : p.dout_at), dout_rows);
    };

    // A run that starts inside a row computes the dz past its first span (in buffer 0).
    Item cur(i, batch, spans), nxt = cur;
    bool starts = true;  // cur is its run's first item
    int buf = 0;
    stage(cur, 0, cur.sp < spans - 1);
    int64 channel = -1;
    float bias_c = 0.f;
    float cacc[KS][2][4] = {};
    float dw[N] = {}, db = 0.f;  // this lane's dweight (taps lane + 32 j) and dbias terms
    bool carried_nonfinite = false;
    for (;;) {
        const bool tail = starts && cur.sp < spans - 1;  // dz past the span computed here
        // The next item: the run's, or (CL) the first of the block's next run.
        bool more = i + 1 < end, next_starts = false;
        int64 next_i = i + 1, next_end = end;
        if (more) {
            nxt.next(batch, spans);
        } else if (CL && run + gridDim.x < n_runs) {
            run += gridDim.x;
            run_of(run, next_i, next_end);
            nxt = Item(next_i, batch, spans);
            more = next_starts = true;
        }
        if constexpr (CL) {
            cp_async_wait<0>();
            __syncthreads();  // the item's staged rows are in; the warps' rows are free
            unstage(buf, D + S + (tail ? 128 * TB : 0), S + (tail ? 128 * TB : 0));
            __syncthreads();  // the staging area is free
            if (more) stage(nxt, 0, next_starts && nxt.sp < spans - 1);
        } else if (more) {
            stage(nxt, buf ^ 1, false);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        const int64 t0 = cur.sp * S, c = channel_of(cur);
        const bool last_span = cur.sp == spans - 1;
        const int lim = (int)min(seqlen - t0, (int64)DL);  // positions of the row in the dz window
        const int n_out = min(lim, S);
        const T* const xs = buf ? x1 : x0;
        T* const dzh = buf ? dout1 : dout0;  // dout until step 1 turns it into dz's high half
        // CL: dx goes to the other buffer's x row (free until the next item's rows come in)
        T* const dxr = CL ? (buf ? x0 : x1) : dx + cur.b * p.dx_batch_stride + c * p.dx_c_stride + t0 * p.dx_l_stride;
        const int64 dx_step = CL ? 1 : p.dx_l_stride;
        if (c < dim) {  // (CL: the block's last group can have fewer channels)
            if (c != channel) {  // the channel's taps and fragments
                channel = c;
                __syncwarp();
                bias_c = load_taps(weight, bias, p, c, PAD, pad, rev, lane, 32);
                __syncwarp();
                build_fragments<KS>(pad, D - width + 1, zf);
                build_fragments<KS>(rev, 0, xf);
            }
            if (last_span) {  // dz past the row: 0
                for (int q = S + lane; q < S + D; q += 32) dzh[q] = dzl[q] = T();
            }
            __syncwarp();  // the item's stage, the fragments and the carried dz are in

            // 1. dz at 0 .. S - 1 (and the TB blocks past the span for a run's first item), and
            // the span's dbias terms.
            float item_db = 0.f, past = 0.f;
            span_dz<KS>(S, tail, p.silu_act != 0, zf, xs, dzh, dzl, bias_c, item_db, past);
            const bool nonfinite = __any_sync(0xffffffffu, carried_nonfinite || !isfinite(item_db + past));
            __syncwarp();

            if (nonfinite) {
                const T* const dr = dout + cur.b * p.dout_batch_stride + c * p.dout_c_stride + t0 * p.dout_l_stride;
                fix_dz<KS>(xs, dr, dzh, dzl, pad, bias_c, min(lim, tail ? DL : S), tail ? DL : S, p);
                exact_terms<KS>(xs, dzh, dzl, rev, n_out, dxr, dx_step, p, dw, db);
            } else {
                db += item_db;
                // 2. dx at 0 .. n_out - 1 (CL: into the warp's row, always whole)
                span_dx<KS>(S, n_out, CL || (dx_aligned && n_out == S), xf, dzh, dzl, dxr, dx_step);
                // 3. the dweight terms: the C_d over the span, kept over the channel's items.
                lag_products<KS, KS, 1>(cacc, 0, S, xs, dzh, dzl);
            }
            carried_nonfinite = nonfinite;
            __syncwarp();  // dz's readers are done
            // dz at 0 .. D - 1 is the next item's dz past its span (when it is the span before;
            // the next item's buffer holds dout at 0 .. S - 1 only).
            T* const next_dzh = buf ? dout0 : dout1;
            for (int q = lane; q < D; q += 32) {
                next_dzh[S + q] = dzh[q];
                dzl[S + q] = dzl[q];
            }
            // The item's part of the partials: the channel's sums so far at its last item in the
            // run, zeros before (a call of a single part has one item a channel).
            const int64 part = cur.b * spans + cur.sp;
            if (!more || nxt.c != cur.c) {
                // a lag at a time through the item's x buffer, done with now
                flush_lags<KS, KS, 1>(cacc, 0, reinterpret_cast<float*>(buf ? x1 : x0), width, dw);
                write_warp_sums(partials, dweight, dbias, p, part, c, dw, db);
            } else {
                for (int k = lane; k <= width; k += 32) partials[(part * dim + c) * (width + 1) + k] = 0.f;
            }
        }
        if constexpr (CL) {  // dx from the warps' rows (the other buffer's x), 16-byte runs
            // thread t: positions 2 j and 2 j + 1 of run h = t % RUNS (j = t / RUNS, + ROWS, ...)
            __syncthreads();
            const int h = threadIdx.x % RUNS;
            const int64 c0 = CW * cur.c + 8 * h;
            if (c0 < dim) {
                const unsigned wb = (unsigned)p.warp_bytes;
                const unsigned row_at = smem_address(smem_raw) + 8 * h * wb + (unsigned)(buf ? 0 : p.x1_at);
                T* out = dx + cur.b * p.dx_batch_stride + t0 * p.dx_l_stride + c0;
                for (int j = threadIdx.x / RUNS; 2 * j < n_out; j += ROWS) {
                    unsigned w[8];
                    #pragma unroll
                    for (int e = 0; e < 8; ++e) w[e] = ld_shared32(row_at + 4 * j + e * wb);
                    uint4 lo, hi;  // positions 2 j and 2 j + 1
                    lo.x = __byte_perm(w[0], w[1], 0x5410), hi.x = __byte_perm(w[0], w[1], 0x7632);
                    lo.y = __byte_perm(w[2], w[3], 0x5410), hi.y = __byte_perm(w[2], w[3], 0x7632);
                    lo.z = __byte_perm(w[4], w[5], 0x5410), hi.z = __byte_perm(w[4], w[5], 0x7632);
                    lo.w = __byte_perm(w[6], w[7], 0x5410), hi.w = __byte_perm(w[6], w[7], 0x7632);
                    st_global16(out + 2 * j * p.dx_l_stride, lo);
                    if (2 * j + 1 < n_out) st_global16(out + (2 * j + 1) * p.dx_l_stride, hi);
                }
            }
        }
        if (!more) break;
        cur = nxt, i = next_i, end = next_end, starts = next_starts;
        buf = starts ? 0 : buf ^ 1;  // (a run's first item in buffer 0, which has room for the dz past it)
        if (starts) carried_nonfinite = false;  // (its dz past the span is its own, or zeros)
        __syncwarp();  // the buffer's readers are done before it is staged again
    }
}

template <typename T, int KS>
__global__ void __launch_bounds__(32 * BWD_MMA_BLOCK_WARPS, 16 / BWD_MMA_BLOCK_WARPS)
    bwd_mma_block(BWD_ARRAYS, const __grid_constant__ BwdMmaBlockParams p) {
    wait_for_previous_kernel();
    static_assert(same_type<T, bf16>, "bwd_mma_block takes bfloat16 x");
    constexpr int D = ToeplitzTaps<KS>::D, PAD = ToeplitzTaps<KS>::PAD, N = ToeplitzTaps<KS>::N;
    // Lags: warp w sums Q of its own, w + W l, over the block's spans, and every warp the last R
    // over its own span, so that each does KS lags' worth of a span.
    constexpr int W = BWD_MMA_BLOCK_WARPS, Q = KS / W, R = KS % W;
    constexpr int TB = (D + 127) / 128;  // blocks of dz past the block's span a run's first item computes
    constexpr int SCRATCH = 32 * N + 32 > 256 ? 32 * N + 32 : 256;  // floats a warp: a C_d, or dw and db
    const int64 batch = p.batch, dim = p.dim, seqlen = p.seqlen;
    const int width = (int)p.width, S = (int)p.span, BS = W * S;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, ws = warp * S;  // the warp's span
    extern __shared__ __align__(16) unsigned char smem_raw[];
    // Buffer b: x at t0 - D .. t0 + BS (buffer 0: and TB blocks more), dout at t0 .. (then dz's
    // high half in its place) and dz's low half, each BS + D long (buffer 0: BS + 128 TB).
    auto xb = [&](int b) { return reinterpret_cast<T*>(smem_raw + (b ? p.x1_at : 0)); };
    auto dzhb = [&](int b) { return reinterpret_cast<T*>(smem_raw + (b ? p.dout1_at : p.dout0_at)); };
    auto dzlb = [&](int b) { return reinterpret_cast<T*>(smem_raw + (b ? p.dzl1_at : p.dzl0_at)); };
    uint4* const zf = reinterpret_cast<uint4*>(smem_raw + p.frag_at);  // 32 KS: z's fragments
    uint4* const xf = zf + 32 * KS;                                      // 32 KS: dx's
    float* const pad = reinterpret_cast<float*>(smem_raw + p.pad_at);   // SIZE: the taps, z's band
    float* const rev = pad + ToeplitzTaps<KS>::SIZE;                    // SIZE: reversed, dx's band
    float* const sums = reinterpret_cast<float*>(smem_raw + p.scratch_at);  // W x SCRATCH
    int* const flags = reinterpret_cast<int*>(smem_raw + p.flags_at);           // W: span's dz not finite
    for (int i = threadIdx.x; i < 2 * ToeplitzTaps<KS>::SIZE; i += 32 * W) pad[i] = 0.f;

    // Items: block spans sp (BS positions) of rows (c, b).
    const int64 spans = (seqlen + BS - 1) / BS, n_items = dim * batch * spans;
    const int64 first = (int64)blockIdx.x * p.per, end = min(first + p.per, n_items);
    if (first >= end) return;
    auto stage = [&](const Item& it, int buf, bool tail) {
        const int more = tail ? 128 * TB : 0;
        stage_time_rows<T, D>(xb(buf), dzhb(buf), x, initial_states, dout, p, it.b, it.c, it.sp * BS, D + BS + more,
                              BS + more, threadIdx.x, 32 * W);
    };

    Item cur(first, batch, spans), nxt = cur;
    const bool first_tail = cur.sp < spans - 1;  // the run starts inside a row: its dz past the block's span
    stage(cur, 0, first_tail);
    int64 channel = -1;
    float bias_c = 0.f;
    float own[Q > 0 ? Q : 1][2][4] = {}, rest[R > 0 ? R : 1][2][4] = {};
    float dw[N] = {}, db = 0.f;  // this lane's dweight (taps lane + 32 j) and dbias terms
    bool carried_nonfinite = false;  // the dz past the block's span came from a span whose dz was not finite
    for (int64 i = first; i < end; ++i) {
        const int buf = (int)((i - first) & 1);
        const bool tail = i == first && first_tail;
        if (i + 1 < end) nxt.next(batch, spans);
        cp_async_wait<0>();
        __syncthreads();  // the item's rows are in; the item before is done with the other buffer
        if (i + 1 < end) stage(nxt, buf ^ 1, false);
        const int64 t0 = cur.sp * BS, tw = t0 + ws, c = cur.c;
        const T* const xs = xb(buf);
        T* const dzh = dzhb(buf);  // dout until step 1 turns it into dz's high half
        T* const dzl = dzlb(buf);
        if (c != channel) {  // the channel's taps and fragments
            channel = c;
            bias_c = load_taps(weight, bias, p, c, PAD, pad, rev, threadIdx.x, 32 * W);
            __syncthreads();
            build_fragments<KS>(pad, D - width + 1, zf, warp, W);
            build_fragments<KS>(rev, 0, xf, warp, W);
            __syncthreads();
        }
        if (cur.sp == spans - 1) {  // dz past the row: 0
            for (int q = threadIdx.x; q < D; q += 32 * W) dzh[BS + q] = dzl[BS + q] = T();
        }

        // 1. dz over the warp's span (the last warp of a run's first item: and TB blocks past the
        // block's span), its dbias terms and whether a dz is not finite.
        const bool own_tail = tail && warp == W - 1;
        float item_db = 0.f, past = 0.f;
        if (tw < seqlen) {
            span_dz<KS>(S, own_tail, p.silu_act != 0, zf, xs + ws, dzh + ws, dzl + ws, bias_c, item_db, past);
        } else {  // a span past the row: dout is staged as 0, and so is dz
            for (int q = lane; q < S / 2; q += 32) reinterpret_cast<unsigned*>(dzl + ws)[q] = 0u;
        }
        const bool nonfinite = __any_sync(0xffffffffu, !isfinite(item_db + past));
        if (lane == 0) flags[warp] = nonfinite;
        __syncthreads();  // the block's dz and flags are in
        unsigned bad = 0;
        #pragma unroll
        for (int v = 0; v < W; ++v) bad |= (flags[v] != 0) << v;
        // Spans whose dz window (the span and the D past it) has a non-finite value take the
        // exact path: dz fixed where it is not finite (a barrier before anyone reads it), then
        // dx, dweight and dbias from their own taps; step 3 leaves them out.
        const bool last_bad = tail ? (bad >> (W - 1)) & 1 : carried_nonfinite;
        const unsigned exact = bad | (bad >> 1) | (unsigned)last_bad << (W - 1);
        if (bad) {
            if ((bad >> warp) & 1) {
                const int n_all = S + (own_tail ? 128 * TB : 0);
                const int n_fix = (int)max((int64)0, min(seqlen - tw, (int64)n_all));
                const T* const dr = dout + cur.b * p.dout_batch_stride + c * p.dout_c_stride + tw * p.dout_l_stride;
                fix_dz<KS>(xs + ws, dr, dzh + ws, dzl + ws, pad, bias_c, n_fix, n_all, p);
            }
            __syncthreads();
        }
        // dz at 0 .. D - 1 is the next item's dz past its block span when the next item is the
        // block span before (its buffer holds dout at 0 .. BS - 1 only).
        const bool carry = i + 1 < end && nxt.c == c && nxt.b == cur.b;
        if (carry) {
            for (int q = threadIdx.x; q < D; q += 32 * W) {
                dzhb(buf ^ 1)[BS + q] = dzh[q];
                dzlb(buf ^ 1)[BS + q] = dzl[q];
            }
        }
        carried_nonfinite = carry && (bad & 1);

        // 2. dx over the warp's span.
        const int n_out = (int)max((int64)0, min(seqlen - tw, (int64)S));
        T* const dxr = dx + cur.b * p.dx_batch_stride + c * p.dx_c_stride + tw * p.dx_l_stride;
        if ((exact >> warp) & 1) {
            exact_terms<KS>(xs + ws, dzh + ws, dzl + ws, rev, n_out, dxr, p.dx_l_stride, p, dw, db);
        } else {
            db += item_db;
            if (n_out > 0)
                span_dx<KS>(S, n_out, p.dx_aligned && n_out == S, xf, dzh + ws, dzl + ws, dxr, p.dx_l_stride);
        }
        // 3. the warp's own lags over the block's spans, the last R over its span (the spans in
        // the row, off the exact path).
        if constexpr (Q > 0) {
            #pragma unroll 1
            for (int v = 0; v < W; ++v) {
                if (!((exact >> v) & 1) && t0 + v * S < seqlen)
                    lag_products<KS, Q, W>(own, warp, S, xs + v * S, dzh + v * S, dzl + v * S);
            }
        }
        if constexpr (R > 0) {
            if (!((exact >> warp) & 1) && tw < seqlen) lag_products<KS, R, 1>(rest, Q * W, S, xs + ws, dzh + ws, dzl + ws);
        }

        // The item's part of the partials: the channel's sums so far at its last item in the
        // run (the warps' sums added in warp order), zeros before.
        const int64 part = cur.b * spans + cur.sp;
        if (i + 1 == end || nxt.c != c) {
            float* const mine = sums + warp * SCRATCH;
            if constexpr (Q > 0) flush_lags<KS, Q, W>(own, warp, mine, width, dw);
            if constexpr (R > 0) flush_lags<KS, R, 1>(rest, Q * W, mine, width, dw);
            #pragma unroll
            for (int o = 16; o > 0; o >>= 1) db += __shfl_xor_sync(0xffffffffu, db, o);
            #pragma unroll
            for (int j = 0; j < N; ++j) mine[lane + 32 * j] = dw[j], dw[j] = 0.f;
            if (lane == 0) mine[32 * N] = db;
            db = 0.f;
            __syncthreads();
            for (int k = threadIdx.x; k <= width; k += 32 * W) {
                const int at = k < width ? k : 32 * N;
                float sum = 0.f;
                #pragma unroll
                for (int v = 0; v < W; ++v) sum += sums[v * SCRATCH + at];
                write_sum(partials, dweight, dbias, p, part, c, k, sum);
            }
        } else {
            for (int k = threadIdx.x; k <= width; k += 32 * W) partials[(part * dim + c) * (width + 1) + k] = 0.f;
        }
        cur = nxt;
    }
}
