// bwd_mma.cu: the backward for time-contiguous bfloat16 x and weights on tensor cores.
//
//   bwd_mma<T, KS>
//       T = bfloat16; widths K with K - 1 <= D = 16 (KS - 1), no seq_idx. A persistent grid of BWD_MMA_WARPS
//       independent warps a block; warp w of the grid takes a run of p.per items (spans of
//       p.span positions of a row) in channel-major order (c, b, span), so a channel's
//       fragments are built once per run, and stages the next item (x and dout, cp.async) into
//       one of its two buffers while it computes the current one.
//
// An item, positions t0 .. t0 + S - 1 of row (b, c) (S = p.span, a multiple of 256), in the
// warp's shared memory (offsets and lengths from the plan; NZ = p.z_blocks 128-position blocks
// cover S + D):
//  1. z at t0 .. t0 + 128 NZ - 1 as fwd_mma computes outputs: for 16 consecutive outputs, the
//     banded Toeplitz matrix of the taps times the D + 16 inputs up to them, eight such blocks
//     the eight columns of one m16n8k16 MMA per k-step (fwd_mma.cu has the fragment layout).
//     dz = dout silu'(z) (dout without the activation), 0 past the row, is kept as a high and a
//     low bfloat16 half (hi + lo = dz to 2^-17 relative).
//  2. dx[s] = sum_j w[K-1-j] dz[s+j] for s < S: the same Toeplitz product over the dz window,
//     the taps reversed and the band starting at the output, on hi and lo.
//  3. dweight: for block lags d < KS, C_d[a][e] = sum_i x[t0 + 16 (i - d) + a] dz[t0 + 16 i + e]
//     over the item's 16-position blocks i: an MMA of the staged rows read by ldmatrix.trans,
//     summed over 16 blocks at a time. Every product in C_d[a][e] has the lag 16 d + e - a, the
//     tap k = K - 1 - 16 d - e + a, so dweight[k] is a sum along a diagonal of the C_d, added
//     in a fixed order; dbias is the sum of dz. Both are written as part (b, span) of the
//     partials (bwd_reduce adds them).
//
// Non-finite values: an MMA multiplies every input of its window by every row of A, zeros
// included, so a non-finite input would reach outputs outside its taps (0 inf = NaN), and a
// non-finite dz splits into a NaN low half. When an item's dz window has a non-finite value
// (or a finite one that bfloat16 cannot hold), z is computed again from its own taps wherever
// dz is not finite, and the item's dx, dweight and dbias are then computed from their own taps
// (bwd_mma_exact); a dx or dweight that comes out of the MMAs non-finite (non-finite weights)
// is computed again the same way. p.x_aligned / p.dout_aligned: rows time-contiguous and
// 16-byte aligned (else staged element by element); p.dx_aligned: dx rows time-contiguous and
// 4-byte aligned (else written element by element).
#include "bwd_common.cuh"
#include "mma_common.cuh"

using bf16 = __nv_bfloat16;

// Padded taps: pad[PAD + k] = w[k] (z's band) and rev[PAD + j] = w[K-1-j] (dx's), SIZE floats
// each, zeros around the taps.
template <int KS>
struct MmaTaps {
    static constexpr int D = 16 * (KS - 1), PAD = D + 15, SIZE = 2 * D + 32, N = (D + 32) / 32;
};

template <int N> struct Count { static constexpr int value = N; };

__device__ __forceinline__ float low_half(unsigned w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float high_half(unsigned w) { return __uint_as_float(w & 0xffff0000u); }

// The A fragments of a banded Toeplitz matrix, element (o, e) of k-step s = pad[PAD + 16 s + e -
// o - shift] (fwd_mma's row and k order), lane l's four words of k-step s at frag[32 s + l].
template <int KS>
__device__ __forceinline__ void build_fragments(const float* pad, int shift, uint4* frag) {
    const int lane = threadIdx.x & 31, g = lane >> 2, tg = lane & 3;
    const float* wl = pad + MmaTaps<KS>::PAD + 4 * tg - 2 * g - shift;
    #pragma unroll
    for (int s = 0; s < KS; ++s) {
        unsigned a[4];
        #pragma unroll
        for (int r = 0; r < 4; ++r) {
            const float* q = wl + 16 * s + 2 * (r >> 1) - (r & 1);
            a[r] = pack2<bf16>(q[0], q[1]);
        }
        frag[32 * s + lane] = make_uint4(a[0], a[1], a[2], a[3]);
    }
}

// acc[j] += the Toeplitz product of `frag` with the window at win + 128 j (J blocks of 128
// outputs), and with the window at lo + 128 j too when LO.
template <int KS, int J, bool LO>
__device__ __forceinline__ void toeplitz(float (&acc)[J][4], const uint4* frag, const bf16* win, const bf16* lo) {
    const int lane = threadIdx.x & 31, g = lane >> 2, tg = lane & 3;
    const uint2* in = reinterpret_cast<const uint2*>(win) + 4 * g + tg;
    const uint2* in_lo = reinterpret_cast<const uint2*>(lo) + 4 * g + tg;
    #pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
        const uint4 f = frag[32 * ks + lane];
        const unsigned a[4] = {f.x, f.y, f.z, f.w};
        #pragma unroll
        for (int j = 0; j < J; ++j) {
            const uint2 bw = in[32 * j + 4 * ks];
            MmaOp<bf16>::run(acc[j], a, bw.x, bw.y);
            if constexpr (LO) {
                const uint2 bl = in_lo[32 * j + 4 * ks];
                MmaOp<bf16>::run(acc[j], a, bl.x, bl.y);
            }
        }
    }
}

// dz at position p of the item (hi + lo).
__device__ __forceinline__ float dz_of(const bf16* dzh, const bf16* dzl, int p) {
    return __bfloat162float(dzh[p]) + __bfloat162float(dzl[p]);
}

// The exact path of an item whose dz window (positions 0 .. n_dz - 1) has a non-finite value
// or whose MMA results came out non-finite: with fix_dz, z again from its own taps wherever
// dz is not finite (hi or lo not finite), dz stored back with lo = 0 where it is not finite;
// then, as asked, dx (n_out positions, written to dxr) and the item's dweight / dbias sums
// (dw: this lane's taps k = lane + 32 j; db: the warp's sum) from their own taps. Out of line:
// it is rarely called.
template <int KS, typename P>
__device__ __noinline__ void bwd_mma_exact(bool fix_dz, bool do_dx, bool do_dw, const bf16* xs, const bf16* ds,
                                           bf16* dzh, bf16* dzl, const float* pad, const float* rev,
                                           float bias_c, int n_dz, int n_out, bf16* dxr, const P& p,
                                           float* dw, float& db) {
    constexpr int D = MmaTaps<KS>::D, PAD = MmaTaps<KS>::PAD, N = MmaTaps<KS>::N;
    const int lane = threadIdx.x & 31, width = (int)p.width;
    if (fix_dz) {
        for (int q = lane; q < n_dz; q += 32) {
            const float h = __bfloat162float(dzh[q]), l = __bfloat162float(dzl[q]);
            if (isfinite(h) && isfinite(l)) continue;
            float g = __bfloat162float(ds[q]);
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
    if (do_dx) {
        for (int o = lane; o < n_out; o += 32) {
            float a = 0.f;
            for (int j = 0; j < width; ++j) a += rev[PAD + j] * dz_of(dzh, dzl, o + j);
            dxr[o * p.dx_l_stride] = __float2bfloat16_rn(a);
        }
    }
    if (do_dw) {
        #pragma unroll
        for (int j = 0; j < N; ++j) {
            const int k = lane + 32 * j;
            float a = 0.f;
            if (k < width)
                for (int q = 0; q < n_out; ++q) a += __bfloat162float(xs[D + q - (width - 1) + k]) * dz_of(dzh, dzl, q);
            dw[j] = a;
        }
        float s = 0.f;
        for (int q = lane; q < n_out; q += 32) s += dz_of(dzh, dzl, q);
        #pragma unroll
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        db = s;
    }
    __syncwarp();
}

template <typename T, int KS>
__global__ void __launch_bounds__(32 * BWD_MMA_WARPS) bwd_mma(BWD_ARRAYS, const __grid_constant__ BwdMmaParams p) {
    static_assert(same_type<T, bf16>, "bwd_mma takes bfloat16 x");
    constexpr int D = MmaTaps<KS>::D, PAD = MmaTaps<KS>::PAD, N = MmaTaps<KS>::N;
    constexpr int LP = BWD_MMA_LAGS;  // block lags a pass of step 3 accumulates
    const int64 batch = p.batch, dim = p.dim, seqlen = p.seqlen;
    const int width = (int)p.width, S = (int)p.span, NZ = (int)p.z_blocks, XL = D + 128 * NZ, DL = 128 * NZ;
    const bool x_aligned = p.x_aligned != 0, dout_aligned = p.dout_aligned != 0, dx_aligned = p.dx_aligned != 0;
    const int lane = threadIdx.x & 31, g = lane >> 2, tg = lane & 3;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    unsigned char* const mine = smem_raw + (threadIdx.x >> 5) * p.warp_bytes;
    T* const xs0 = reinterpret_cast<T*>(mine);                // two buffers of XL: x at t0 - D ..
    T* const ds0 = reinterpret_cast<T*>(mine + p.dout_at);    // two buffers of DL: dout at t0 ..
    T* const dzh = reinterpret_cast<T*>(mine + p.dzh_at);     // DL: dz's high half at t0 ..
    T* const dzl = reinterpret_cast<T*>(mine + p.dzl_at);     // DL: its low half
    uint4* const zf = reinterpret_cast<uint4*>(mine + p.frag_at);  // 32 KS: z's fragments
    uint4* const xf = zf + 32 * KS;                                 // 32 KS: dx's
    float* const pad = reinterpret_cast<float*>(mine + p.pad_at);  // SIZE: the taps, z's band
    float* const rev = pad + MmaTaps<KS>::SIZE;                     // SIZE: reversed, dx's band
    float* const cd = reinterpret_cast<float*>(mine + p.cd_at);    // LP x 256: C_d of a pass
    for (int i = lane; i < 2 * MmaTaps<KS>::SIZE; i += 32) pad[i] = 0.f;

    const int64 spans = (seqlen + S - 1) / S, n_items = dim * batch * spans;
    const int64 first = grid_warp() * p.per, end = min(first + p.per, n_items);
    if (first >= end) return;

    // Stages item i (channel-major) into buffer `buf`.
    auto stage = [&](int64 i, int buf) {
        int64 cb, sp, c, b;
        divmod(i, spans, cb, sp);
        divmod(cb, batch, c, b);
        const int64 t0 = sp * S;
        T* const xs = xs0 + buf * XL;
        T* const ds = ds0 + buf * DL;
        const T* const xr = x + b * p.x_batch_stride + c * p.x_c_stride;
        const T* const dr = dout + b * p.dout_batch_stride + c * p.dout_c_stride;
        for (int v = lane; v < XL / 8; v += 32) {
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
        for (int v = lane; v < DL / 8; v += 32) {
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

    stage(first, 0);
    int64 channel = -1;
    float bias_c = 0.f;
    for (int64 i = first; i < end; ++i) {
        const int buf = (int)((i - first) & 1);
        if (i + 1 < end) {
            stage(i + 1, buf ^ 1);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        int64 cb, sp, c, b;
        divmod(i, spans, cb, sp);
        divmod(cb, batch, c, b);
        const int64 t0 = sp * S;
        const int lim = (int)min(seqlen - t0, (int64)DL);  // positions of the row in the dz window
        const int n_out = min(lim, S);
        const T* const xs = xs0 + buf * XL;
        const T* const ds = ds0 + buf * DL;
        if (c != channel) {  // the channel's taps and fragments
            channel = c;
            __syncwarp();
            #pragma unroll
            for (int j = 0; j < N; ++j) {
                const int k = lane + 32 * j;
                if (k < width) {
                    const float w = load_as<float>(weight, (int)p.weight_dtype, c * p.weight_c_stride + k * p.weight_width_stride);
                    pad[PAD + k] = w;
                    rev[PAD + width - 1 - k] = w;
                }
            }
            bias_c = bias ? load_as<float>(bias, (int)p.bias_dtype, c * p.bias_stride) : 0.f;
            __syncwarp();
            build_fragments<KS>(pad, D - width + 1, zf);
            build_fragments<KS>(rev, 0, xf);
        }
        __syncwarp();  // the item's stage (and the fragments) are in

        // 1. dz at 0 .. DL - 1 (hi, lo), dbias over 0 .. S - 1.
        float db = 0.f;
        bool nonfinite = false;
        auto dz_blocks = [&](int blk, auto j_count, auto silu_flag) {
            constexpr int J = decltype(j_count)::value;
            constexpr bool SILU = decltype(silu_flag)::value;
            float acc[J][4];
            #pragma unroll
            for (int j = 0; j < J; ++j) {
                #pragma unroll
                for (int r = 0; r < 4; ++r) acc[j][r] = bias_c;
            }
            if constexpr (SILU) toeplitz<KS, J, false>(acc, zf, xs + 128 * blk, nullptr);
            #pragma unroll
            for (int j = 0; j < J; ++j) {
                // c0, c2: positions p0, p0 + 1; c1, c3: p0 + 16, p0 + 17
                const int p0 = 128 * (blk + j) + 32 * tg + 2 * g;
                #pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int q = p0 + 16 * h;
                    const unsigned d2 = reinterpret_cast<const unsigned*>(ds)[q >> 1];
                    float g0 = low_half(d2), g1 = high_half(d2);
                    if constexpr (SILU) {
                        g0 *= silu_grad(acc[j][h]);
                        g1 *= silu_grad(acc[j][2 + h]);
                    }
                    if (q >= lim) g0 = 0.f;
                    if (q + 1 >= lim) g1 = 0.f;
                    if (q < S) db += g0 + g1;
                    const unsigned hi = pack2<T>(g0, g1);
                    const float l0 = g0 - low_half(hi), l1 = g1 - high_half(hi);
                    nonfinite |= !isfinite(l0 + l1);
                    reinterpret_cast<unsigned*>(dzh)[q >> 1] = hi;
                    reinterpret_cast<unsigned*>(dzl)[q >> 1] = pack2<T>(l0, l1);
                }
            }
        };
        auto all_dz = [&](auto silu_flag) {
            int blk = 0;
            #pragma unroll 1
            for (; blk + 2 <= NZ; blk += 2) dz_blocks(blk, Count<2>(), silu_flag);
            if (blk < NZ) dz_blocks(blk, Count<1>(), silu_flag);
        };
        if (p.silu_act) all_dz(Flag<true>());
        else all_dz(Flag<false>());
        nonfinite = __any_sync(0xffffffffu, nonfinite);
        __syncwarp();

        T* const dxr = dx + b * p.dx_batch_stride + c * p.dx_c_stride + t0 * p.dx_l_stride;
        float dw[N];
        if (nonfinite) {
            bwd_mma_exact<KS>(true, true, true, xs, ds, dzh, dzl, pad, rev, bias_c, lim, n_out, dxr, p, dw, db);
        } else {
            // 2. dx at 0 .. n_out - 1.
            bool bad_dx = false;
            #pragma unroll 1
            for (int blk = 0; blk < S / 128; blk += 2) {
                float acc[2][4] = {};
                toeplitz<KS, 2, true>(acc, xf, dzh + 128 * blk, dzl + 128 * blk);
                #pragma unroll
                for (int j = 0; j < 2; ++j) {
                    bad_dx |= !isfinite((acc[j][0] + acc[j][1]) + (acc[j][2] + acc[j][3]));
                    #pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int q = 128 * (blk + j) + 32 * tg + 2 * g + 16 * h;
                        if (dx_aligned && q + 1 < n_out) {
                            *reinterpret_cast<unsigned*>(dxr + q) = pack2<T>(acc[j][h], acc[j][2 + h]);
                        } else {
                            if (q < n_out) dxr[q * p.dx_l_stride] = from_acc<T>(acc[j][h]);
                            if (q + 1 < n_out) dxr[(q + 1) * p.dx_l_stride] = from_acc<T>(acc[j][2 + h]);
                        }
                    }
                }
            }
            // 3. dweight: LP lags a pass, 256 positions (16 blocks of 16) an MMA step.
            #pragma unroll
            for (int j = 0; j < N; ++j) dw[j] = 0.f;
            const int mq = lane >> 3, mr = lane & 7;  // this lane's ldmatrix row: matrix mq, row mr
            const int row_at = 16 * (mr + 8 * (mq >> 1)) + 8 * (mq & 1);
            #pragma unroll 1
            for (int d0 = 0; d0 < KS; d0 += LP) {
                float cacc[LP][2][4] = {};
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
                                MmaOp<T>::run(cacc[l][h], a, bh[h], bh[2 + h]);
                                MmaOp<T>::run(cacc[l][h], a, bl[h], bl[2 + h]);
                            }
                        }
                    }
                }
                // C_d[a][e] of lag d0 + l at cd[256 l + 16 a + e]: c0 (g, 8 h + 2 tg), c1 (g, + 1),
                // c2 (g + 8, 8 h + 2 tg), c3 (g + 8, + 1)
                #pragma unroll
                for (int l = 0; l < LP; ++l) {
                    #pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        float* const at = cd + 256 * l + 16 * g + 8 * h + 2 * tg;
                        *reinterpret_cast<float2*>(at) = make_float2(cacc[l][h][0], cacc[l][h][1]);
                        *reinterpret_cast<float2*>(at + 128) = make_float2(cacc[l][h][2], cacc[l][h][3]);
                    }
                }
                __syncwarp();
                #pragma unroll
                for (int j = 0; j < N; ++j) {
                    const int k = lane + 32 * j, lag = width - 1 - k;  // lag = 16 d + e - a
                    if (k < width) {
                        #pragma unroll
                        for (int l = 0; l < LP; ++l) {
                            const int e = lag - 16 * (d0 + l);  // e - a
                            if (d0 + l < KS && e > -16 && e < 16) {
                                const float* diag = cd + 256 * l + e;
                                for (int a = max(0, -e); a < min(16, 16 - e); ++a) dw[j] += diag[17 * a];
                            }
                        }
                    }
                }
                __syncwarp();
            }
            #pragma unroll
            for (int o = 16; o > 0; o >>= 1) db += __shfl_xor_sync(0xffffffffu, db, o);
            bool bad_dw = !isfinite(db);
            #pragma unroll
            for (int j = 0; j < N; ++j) bad_dw |= !isfinite(dw[j]);
            bad_dx = __any_sync(0xffffffffu, bad_dx);
            bad_dw = __any_sync(0xffffffffu, bad_dw);
            if (bad_dx || bad_dw)
                bwd_mma_exact<KS>(false, bad_dx, bad_dw, xs, ds, dzh, dzl, pad, rev, bias_c, lim, n_out, dxr, p,
                                  dw, db);
        }
        float* const part = partials + ((b * spans + sp) * dim + c) * (width + 1);
        #pragma unroll
        for (int j = 0; j < N; ++j)
            if (lane + 32 * j < width) part[lane + 32 * j] = dw[j];
        if (lane == 0) part[width] = db;
        __syncwarp();  // the buffer's readers are done before it is staged again
    }
}
