// bwd_mma.cu: the backward for bfloat16 x and weights on tensor cores.
//
//   bwd_mma<T, KS, CL>
//       T = bfloat16; widths K with K - 1 <= D = 16 (KS - 1), no seq_idx.
//       CL = 0, time-contiguous x: a persistent grid of blocks of BWD_MMA_WARPS independent
//       warps; warp w takes a run of p.per items (spans of p.span positions of a row, a
//       multiple of 256) in channel-major order, the spans of a row last to first, and stages
//       the next item (x and dout, cp.async) into one of its two buffers while it computes the
//       current one. A channel's fragments are built once a run.
//       CL = 1, channel-contiguous x, dout and dx (16-byte aligned runs of 8 channels): blocks
//       of BWD_MMA_CL_WARPS warps, one channel each, take runs of items of that many
//       neighbouring channels (channel groups, then batch rows, the spans of a row last to
//       first). The block stages an item's x and dout as rows of positions x channels (32-byte
//       runs, cp.async into p.stage_at) while it computes the item before, moves them into the
//       warps' rows (each warp then computes its channel's row as above), and writes dx back
//       from the warps' rows as 16-byte runs of 8 channels.
//
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
//     16 blocks at a time, summed over a channel's items (in registers up to BWD_MMA_LAGS
//     lags, else in shared memory, BWD_MMA_PASS_LAGS lags computed at a time). Every product
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

__device__ __forceinline__ float low_half(unsigned w) { return __uint_as_float(w << 16); }
// a and b rounded to bfloat16, a in the low half.
__device__ __forceinline__ unsigned bf16x2_bits(float a, float b) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(b), "f"(a));
    return r;
}
__device__ __forceinline__ float high_half(unsigned w) { return __uint_as_float(w & 0xffff0000u); }
// 4-byte shared-memory accesses at an address as smem_address gives it.
__device__ __forceinline__ void st_shared32(unsigned at, unsigned v) {
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(at), "r"(v) : "memory");
}
// A 16-byte global store (v4 even where the compiler cannot see the address's alignment).
__device__ __forceinline__ void st_global16(void* at, uint4 v) {
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(at), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}
__device__ __forceinline__ unsigned ld_shared32(unsigned at) {
    unsigned v;
    asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(at) : "memory");
    return v;
}

// The A fragments of a banded Toeplitz matrix whose band starts `shift` inputs into the window
// (fragment_offset), lane l's four words of k-step s at frag[32 s + l].
template <int KS>
__device__ __forceinline__ void build_fragments(const float* pad, int shift, uint4* frag) {
    const int lane = threadIdx.x & 31, g = lane >> 2, tg = lane & 3;
    const float* wl = pad + ToeplitzTaps<KS>::PAD + 4 * tg - 2 * g - shift;
    #pragma unroll
    for (int s = 0; s < KS; ++s) {
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

// dz at position p of the item (hi + lo).
__device__ __forceinline__ float dz_of(const bf16* dzh, const bf16* dzl, int p) {
    return __bfloat162float(dzh[p]) + __bfloat162float(dzl[p]);
}

// How many block lags bwd_mma's C_d accumulators hold: all KS of them up to BWD_MMA_LAGS (kept in
// registers over the items of a channel), else BWD_MMA_PASS_LAGS a pass (then added to the sums
// in shared memory).
__host__ __device__ constexpr int mma_lags(int KS) { return KS <= BWD_MMA_LAGS ? KS : BWD_MMA_PASS_LAGS; }

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

// Adds a lag's C_d accumulators to cd (each lane to its own entries).
__device__ __forceinline__ void add_lag(float* cd, const float (&acc)[2][4]) {
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
        float2* const at = lane_entry(cd, h);
        const float2 a = at[0], b = at[64];
        at[0] = make_float2(a.x + acc[h][0], a.y + acc[h][1]);
        at[64] = make_float2(b.x + acc[h][2], b.y + acc[h][3]);
    }
}

// Adds the diagonals of lag d's C_d (cd, written by the whole warp) to this lane's dweight sums
// dw[j] (taps k = lane + 32 j): C_d[a][e] belongs to tap k = K - 1 - 16 d - e + a.
template <int KS>
__device__ __forceinline__ void add_diagonals(const float* cd, int d, int width, float (&dw)[ToeplitzTaps<KS>::N]) {
    const int lane = threadIdx.x & 31;
    #pragma unroll
    for (int j = 0; j < ToeplitzTaps<KS>::N; ++j) {
        const int k = lane + 32 * j, e = width - 1 - k - 16 * d;  // e - a
        if (k < width && e > -16 && e < 16) {
            float sum = 0.f;
            for (int a = max(0, -e); a < min(16, 16 - e); ++a) sum += cd[e + 17 * a];
            dw[j] += sum;
        }
    }
}

// cacc[l] += C_{d0 + l} over positions 0 .. S - 1 (16 blocks of 16 an MMA step; x at xs, from D
// before position 0; dz's halves at dzh, dzl).
template <int KS, int LP>
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
            if (d0 + l < KS) {
                unsigned a[4];
                ldmatrix_x4_trans(a, xs + D + q0 - 16 * (d0 + l) + row_at);
                #pragma unroll
                for (int h = 0; h < 2; ++h) {
                    MmaOp<bf16>::run(cacc[l][h], a, bh[h], bh[2 + h]);
                    MmaOp<bf16>::run(cacc[l][h], a, bl[h], bl[2 + h]);
                }
            }
        }
    }
}

// The exact path of an item whose dz window has a non-finite value: z again from its own taps
// wherever dz (hi or lo) is not finite among the n_fix positions this item computed (dout read
// again from dr, the row at the span), dz stored back with lo = 0 where it is not finite; then dx (n_out positions, to dxr, dx_step apart) and the item's
// dweight terms (added to dw: taps k = lane + 32 j) and dbias terms (added to db, this lane's
// positions) from their own taps. Out of line: it is rarely called.
template <int KS, typename P>
__device__ __noinline__ void bwd_mma_exact(const bf16* xs, const bf16* dr, bf16* dzh, bf16* dzl, const float* pad,
                                           const float* rev, float bias_c, int n_fix, int n_out, bf16* dxr,
                                           int64 dx_step, const P& p, float* dw, float& db) {
    constexpr int D = ToeplitzTaps<KS>::D, PAD = ToeplitzTaps<KS>::PAD, N = ToeplitzTaps<KS>::N;
    const int lane = threadIdx.x & 31, width = (int)p.width;
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

template <typename T, int KS, int CL>
__global__ void __launch_bounds__(CL ? 32 * BWD_MMA_CL_WARPS : 32 * BWD_MMA_WARPS, 16 / (CL ? BWD_MMA_CL_WARPS : BWD_MMA_WARPS))
    bwd_mma(BWD_ARRAYS, const __grid_constant__ BwdMmaParams p) {
    static_assert(same_type<T, bf16>, "bwd_mma takes bfloat16 x");
    constexpr int D = ToeplitzTaps<KS>::D, PAD = ToeplitzTaps<KS>::PAD, N = ToeplitzTaps<KS>::N;
    constexpr int LP = mma_lags(KS), HOLD = KS <= BWD_MMA_LAGS;  // HOLD: C_d kept over items
    constexpr int TB = (D + 127) / 128;  // blocks of dz past the span a run's first item computes
    constexpr int CW = BWD_MMA_CL_WARPS, RUNS = CW / 8;  // CL: channels a block (one a warp), 16-byte runs a row
    static_assert(CW % 8 == 0, "channel-last rows are whole 16-byte runs of 8 channels");
    constexpr int ROWS = 32 * CW / RUNS;  // CL: rows the block's threads take at once
    const int64 batch = p.batch, dim = p.dim, seqlen = p.seqlen;
    const int width = (int)p.width, S = (int)p.span, DL = S + 128 * TB;
    const bool x_aligned = p.x_aligned != 0, dout_aligned = p.dout_aligned != 0, dx_aligned = p.dx_aligned != 0;
    const int lane = threadIdx.x & 31, g = lane >> 2, tg = lane & 3, warp = threadIdx.x >> 5;
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
    float* const cd = reinterpret_cast<float*>(mine + p.cd_at);    // KS x 256: the C_d (not HOLD)
    // CL: the block's staging area, D + DL rows of x then DL rows of dout, CW channels a row
    uint4* const stage_x = reinterpret_cast<uint4*>(smem_raw + p.stage_at);
    uint4* const stage_dout = stage_x + RUNS * (D + DL);
    for (int i = lane; i < 2 * ToeplitzTaps<KS>::SIZE; i += 32) pad[i] = 0.f;
    if constexpr (!HOLD) {
        for (int i = lane; i < 256 * KS; i += 32) cd[i] = 0.f;
    }

    // Items: spans sp of rows (c, b), channel-major, the spans of a row last to first, so that
    // an item's dz past its span (the next span's first D) is the one before's first D. CL: c
    // is a group of CW channels, the warp's channel CW c + warp.
    const int64 spans = (seqlen + S - 1) / S, n_items = (CL ? (dim + CW - 1) / CW : dim) * batch * spans;
    const int64 first = (CL ? (int64)blockIdx.x : grid_warp()) * p.per, end = min(first + p.per, n_items);
    if (first >= end) return;
    struct Item {
        int64 c, b, sp;
        __device__ void next(int64 batch, int64 spans) {
            if (sp > 0) { --sp; return; }
            sp = spans - 1;
            if (++b == batch) { b = 0; ++c; }
        }
    };
    Item item;
    {
        int64 cb, r;
        divmod(first, spans, cb, r);
        divmod(cb, batch, item.c, item.b);
        item.sp = spans - 1 - r;
    }
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
        T* const xs = buf ? x1 : x0;
        T* const ds = buf ? dout1 : dout0;
        const T* const xr = x + it.b * p.x_batch_stride + it.c * p.x_c_stride;
        const T* const dr = dout + it.b * p.dout_batch_stride + it.c * p.dout_c_stride;
        const int xv = x_rows / 8, dv = dout_rows / 8;
        if (x_aligned && dout_aligned && t0 >= D && t0 + 8 * dv <= seqlen) {  // inside the row
            const uint4* src = reinterpret_cast<const uint4*>(xr + t0 - D) + lane;
            unsigned dst = smem_address(xs) + 16 * lane;
            for (int v = lane; v < xv; v += 32, src += 32, dst += 512) cp_async_shared16(dst, src);
            src = reinterpret_cast<const uint4*>(dr + t0) + lane;
            dst = smem_address(ds) + 16 * lane;
            for (int v = lane; v < dv; v += 32, src += 32, dst += 512) cp_async_shared16(dst, src);
            cp_async_commit();
            return;
        }
        for (int v = lane; v < xv; v += 32) {
            const int64 pos = t0 - D + 8 * v;
            if (x_aligned && pos >= 0 && pos + 8 <= seqlen) {
                cp_async<16>(xs + 8 * v, xr + pos, 16);
            } else {
                #pragma unroll
                for (int e = 0; e < 8; ++e) {
                    const int64 s = pos + e;
                    xs[8 * v + e] = s >= seqlen || s < -(width - 1)
                                        ? T()
                                        : from_acc<T>(input_at<float>(x, initial_states, p, it.b, it.c, s));
                }
            }
        }
        for (int v = lane; v < dv; v += 32) {
            const int64 pos = t0 + 8 * v;
            if (dout_aligned && pos + 8 <= seqlen) {
                cp_async<16>(ds + 8 * v, dr + pos, 16);
            } else {
                #pragma unroll
                for (int e = 0; e < 8; ++e) ds[8 * v + e] = pos + e < seqlen ? dr[(pos + e) * p.dout_l_stride] : T();
            }
        }
        cp_async_commit();
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

    Item cur = item, nxt = item;
    const bool first_tail = cur.sp < spans - 1;  // the run starts inside a row: its dz past the span
    stage(cur, 0, first_tail);
    int64 channel = -1;
    float bias_c = 0.f;
    float cacc[LP][2][4] = {};
    float dw[N] = {}, db = 0.f;  // this lane's dweight (taps lane + 32 j) and dbias terms
    bool carried_nonfinite = false;
    for (int64 i = first; i < end; ++i) {
        const int buf = (int)((i - first) & 1);
        const bool tail = i == first && first_tail;  // dz past the span computed here
        if (i + 1 < end) nxt.next(batch, spans);
        if constexpr (CL) {
            cp_async_wait<0>();
            __syncthreads();  // the item's staged rows are in; the warps' rows are free
            unstage(buf, D + S + (tail ? 128 * TB : 0), S + (tail ? 128 * TB : 0));
            __syncthreads();  // the staging area is free
            if (i + 1 < end) stage(nxt, 0, false);
        } else if (i + 1 < end) {
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
                #pragma unroll
                for (int j = 0; j < N; ++j) {
                    const int k = lane + 32 * j;
                    if (k < width) {
                        const float w = load_as<float>(weight, (int)p.weight_dtype,
                                                       c * p.weight_c_stride + k * p.weight_width_stride);
                        pad[PAD + k] = w;
                        rev[PAD + width - 1 - k] = w;
                    }
                }
                bias_c = bias ? load_as<float>(bias, (int)p.bias_dtype, c * p.bias_stride) : 0.f;
                __syncwarp();
                build_fragments<KS>(pad, D - width + 1, zf);
                build_fragments<KS>(rev, 0, xf);
            }
            if (last_span) {  // dz past the row: 0
                for (int q = S + lane; q < S + D; q += 32) dzh[q] = dzl[q] = T();
            }
            __syncwarp();  // the item's stage, the fragments and the carried dz are in

            // 1. dz at 0 .. S - 1 (and the TB blocks past the span for a run's first item): z
            // from the tensor cores (also without the activation: a non-finite z means a
            // non-finite x, weight or bias), dz = dout silu'(z) split into hi and lo (0 past the
            // row, where dout is staged as 0), and the span's dbias terms.
            bool nonfinite = carried_nonfinite;
            // this lane's dbias terms of the span, and the sum of its dz past the span: either
            // is non-finite when a dz is (or a finite dz bfloat16 cannot hold: its sum
            // overflows too)
            float item_db = 0.f, past = 0.f;
            auto dz_blocks = [&](int blk, auto j_count, auto silu_flag, auto span_flag) {
                constexpr int J = decltype(j_count)::value;
                constexpr bool SILU = decltype(silu_flag)::value, SPAN = decltype(span_flag)::value;
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
                        const unsigned hi = bf16x2_bits(g0, g1);
                        reinterpret_cast<unsigned*>(dzh)[q >> 1] = hi;
                        reinterpret_cast<unsigned*>(dzl)[q >> 1] = bf16x2_bits(g0 - low_half(hi), g1 - high_half(hi));
                    }
                }
            };
            auto all_dz = [&](auto silu_flag) {
                #pragma unroll 1
                for (int blk = 0; blk < S / 128; blk += 2) dz_blocks(blk, Count<2>(), silu_flag, Flag<true>());
                if (tail) {
                    #pragma unroll 1
                    for (int blk = S / 128; blk < S / 128 + TB; ++blk) dz_blocks(blk, Count<1>(), silu_flag, Flag<false>());
                }
            };
            if (p.silu_act) all_dz(Flag<true>());
            else all_dz(Flag<false>());
            nonfinite = __any_sync(0xffffffffu, nonfinite || !isfinite(item_db + past));
            __syncwarp();

            if (nonfinite) {
                const int n_fix = min(lim, tail ? DL : S);
                const T* const dr = dout + cur.b * p.dout_batch_stride + c * p.dout_c_stride + t0 * p.dout_l_stride;
                bwd_mma_exact<KS>(xs, dr, dzh, dzl, pad, rev, bias_c, n_fix, n_out, dxr, dx_step, p, dw, db);
            } else {
                db += item_db;
                // 2. dx at 0 .. n_out - 1: pairs of positions, stored whole where the span is in
                // the row and dx's rows are aligned (CL: into the warp's row, always), else one
                // by one.
                auto dx_blocks = [&](auto whole_flag) {
                    constexpr bool WHOLE = decltype(whole_flag)::value;
                    const int lane_at = 32 * tg + 2 * g;  // + 128 block + 16 h
                    unsigned* const pairs = reinterpret_cast<unsigned*>(dxr + lane_at);
                    #pragma unroll 1
                    for (int blk = 0; blk < S / 128; blk += 2) {
                        float acc[2][4] = {}, acc_lo[2][4] = {};  // two chains a block: hi and lo
                        toeplitz<KS, 2>(acc, xf, dzh + 128 * blk);
                        toeplitz<KS, 2>(acc_lo, xf, dzl + 128 * blk);
                        #pragma unroll
                        for (int j = 0; j < 2; ++j) {
                            #pragma unroll
                            for (int h = 0; h < 2; ++h) {
                                const float a0 = acc[j][h] + acc_lo[j][h], a1 = acc[j][2 + h] + acc_lo[j][2 + h];
                                if constexpr (WHOLE) {
                                    pairs[64 * (blk + j) + 8 * h] = bf16x2_bits(a0, a1);
                                } else {
                                    const int q = 128 * (blk + j) + lane_at + 16 * h;
                                    if (q < n_out) dxr[q * p.dx_l_stride] = from_acc<T>(a0);
                                    if (q + 1 < n_out) dxr[(q + 1) * p.dx_l_stride] = from_acc<T>(a1);
                                }
                            }
                        }
                    }
                };
                if (CL || (dx_aligned && n_out == S)) dx_blocks(Flag<true>());
                else dx_blocks(Flag<false>());
                // 3. the dweight terms: the C_d over the span (kept over the channel's items,
                // or a pass of LP lags at a time summed up now).
                if constexpr (HOLD) {
                    lag_products<KS, LP>(cacc, 0, S, xs, dzh, dzl);
                } else {
                    #pragma unroll 1
                    for (int d0 = 0; d0 < KS; d0 += LP) {
                        float pass[LP][2][4] = {};
                        lag_products<KS, LP>(pass, d0, S, xs, dzh, dzl);
                        #pragma unroll
                        for (int l = 0; l < LP; ++l)
                            if (d0 + l < KS) add_lag(cd + 256 * (d0 + l), pass[l]);
                    }
                }
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
            const bool flush = i + 1 == end || nxt.c != cur.c;
            const int64 part = cur.b * spans + cur.sp;
            if (flush) {
                if constexpr (!HOLD) {
                    __syncwarp();
                    #pragma unroll 1
                    for (int d = 0; d < KS; ++d) add_diagonals<KS>(cd + 256 * d, d, width, dw);
                    __syncwarp();
                    for (int i = lane; i < 256 * KS; i += 32) cd[i] = 0.f;
                } else {  // a lag at a time through the item's x buffer, done with now
                    float* const lag_at = reinterpret_cast<float*>(buf ? x1 : x0);
                    #pragma unroll
                    for (int l = 0; l < LP; ++l) {
                        dump_lag(lag_at, cacc[l]);
                        __syncwarp();
                        add_diagonals<KS>(lag_at, l, width, dw);
                        __syncwarp();
                        #pragma unroll
                        for (int h = 0; h < 2; ++h)
                            #pragma unroll
                            for (int r = 0; r < 4; ++r) cacc[l][h][r] = 0.f;
                    }
                }
                #pragma unroll
                for (int o = 16; o > 0; o >>= 1) db += __shfl_xor_sync(0xffffffffu, db, o);
                #pragma unroll
                for (int j = 0; j < N; ++j) {
                    if (lane + 32 * j < width) write_sum(partials, dweight, dbias, p, part, c, lane + 32 * j, dw[j]);
                    dw[j] = 0.f;
                }
                if (lane == 0) write_sum(partials, dweight, dbias, p, part, c, width, db);
                db = 0.f;
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
        cur = nxt;
        __syncwarp();  // the buffer's readers are done before it is staged again
    }
}
