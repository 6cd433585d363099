// fwd_mma.cu: the forward for time-contiguous 16-bit x and widths 18 to 129 on tensor cores.
//
//   fwd_mma<T, KS>
//       widths K with K - 1 <= D = 16 (KS - 1), no seq_idx (fwd_time_wide serves those): a
//       warp computes tiles of MMA_BLOCKS x 128 outputs of a row as banded Toeplitz products
//       (m16n8k16 MMAs), MMA_WARPS warps a block, tiles handed out grid-stride.
//
// For one channel, 16 consecutive outputs are a banded Toeplitz matrix of the weights times
// the inputs before them:  out[t0 + o] = sum_m Tw[o][m] x[t0 - D + m],  m < D + 16, with
// Tw[o][m] = w[m - o - (D - K + 1)] inside the band. Eight such blocks 16 steps apart are the
// eight columns n of one m16n8k16 MMA per 16 values of m (k-step s: window segment n + s).
// The MMA sums over k, so k and the rows may be permuted as long as A and B agree: lane
// (g, tg) holds inputs 4 tg .. 4 tg + 3 of segment g + s (one 8-byte shared-memory read, no
// bank conflict), and row i is output 2 (i mod 8) + i / 8, so each lane's results pair up
// into adjacent outputs. A tile is NB = MMA_BLOCKS such 128-output blocks of a row; tiles are handed out
// grid-stride (Digits), and a tile's window of D + 128 NB inputs is staged by cp.async one
// tile ahead together with its row's parameters, from which the A fragments are built.
// Products of 16-bit values are exact and the MMA accumulates in float32; weights of another
// dtype are split into a high and a low 16-bit part (two MMAs), which keeps them to 2^-17
// relative. Every window slot is written (zeros outside the row), since a zero weight times a
// stale NaN would not be zero. p.x_aligned / p.out_aligned: rows of x / out start on
// 16-byte boundaries.
#include "fwd_common.cuh"

// Blocks per SM that fwd_mma's register budget (__launch_bounds__) is set for (benchmarks/
// NOTES.md, "Occupancy and tile sizes": fwd_mma).
__host__ __device__ constexpr int mma_blocks_per_sm(int KS) { return KS <= 6 ? 5 : 4; }

// acc += A B for one m16n8k16 MMA of 16-bit TYPE ("bf16" or "f16") operands, float32 accumulator.
#define MMA_SYNC(TYPE, acc, a, b0, b1)                                                           \
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TYPE "." TYPE                         \
                 ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"                 \
                 : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])                     \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))
template <typename T> struct MmaOp;
template <> struct MmaOp<__nv_bfloat16> {
    static constexpr int code = BF16;
    static __device__ __forceinline__ void run(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
        MMA_SYNC("bf16", c, a, b0, b1);
    }
};
template <> struct MmaOp<__half> {
    static constexpr int code = F16;
    static __device__ __forceinline__ void run(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
        MMA_SYNC("f16", c, a, b0, b1);
    }
};

// Two values as one 32-bit word of T (the first in the low half).
template <typename T>
__device__ __forceinline__ unsigned pack2(float lo, float hi) {
    T v[2] = {from_acc<T>(lo), from_acc<T>(hi)};
    return *reinterpret_cast<unsigned*>(v);
}

// Recomputes, from its width taps alone, each of a tile's SPAN outputs (in order at `outputs`)
// that is not finite; this lane takes every 32nd. Output o's taps are window[o .. o + width)
// with weights w (float). Out of line: it is rarely called.
template <typename T, int SPAN>
__device__ __noinline__ void own_taps(T* outputs, const T* window, const float* w, int width,
                                      float bias, int silu_act) {
    for (int o = threadIdx.x & 31; o < SPAN; o += 32) {
        if (isfinite(to_acc(outputs[o]))) continue;
        float a = bias;
        for (int k = 0; k < width; ++k) a += w[k] * to_acc(window[o + k]);
        outputs[o] = from_acc<T>(silu_act ? silu(a) : a);
    }
}

template <typename T, int KS>
__global__ void __launch_bounds__(32 * MMA_WARPS, mma_blocks_per_sm(KS))
    fwd_mma(FWD_ARRAYS, const __grid_constant__ FwdMmaParams p) {
    if (final_states_blocks(x, seq_idx, initial_states, final_states, p)) return;
    const int64 batch = p.batch, dim = p.dim, seqlen = p.seqlen, x_batch_stride = p.x_batch_stride,
                x_c_stride = p.x_c_stride, x_l_stride = p.x_l_stride, weight_c_stride = p.weight_c_stride,
                weight_width_stride = p.weight_width_stride, bias_stride = p.bias_stride,
                out_batch_stride = p.out_batch_stride, out_c_stride = p.out_c_stride, out_l_stride = p.out_l_stride;
    const int width = (int)p.width, weight_dtype = (int)p.weight_dtype, bias_dtype = (int)p.bias_dtype,
              silu_act = (int)p.silu_act, x_aligned = (int)p.x_aligned, out_aligned = (int)p.out_aligned;
    constexpr int D = 16 * (KS - 1);          // inputs before a block's first output
    constexpr int NB = MMA_BLOCKS;            // 128-output blocks per tile
    constexpr int SPAN = 128 * NB;            // outputs per tile
    constexpr int VN = 8;                     // elements per 16-byte vector
    constexpr int WV = (D + SPAN) / VN;       // window vectors
    constexpr int KMAX = D + 1;               // most taps
    constexpr int PW = (KMAX + 2) / 2;        // parameter words of a stage, in 16-byte units
    constexpr int PAD = D + 15;               // wpad[PAD + k] = w[k]: zeros for k < 0, k >= K
    constexpr int WPAD = (2 * D + 32) / 4;    // wpad in 16-byte units
    // Per warp: 2 stages of a window and its row's raw parameters (KMAX taps, the bias); the
    // row's weights as zero-padded floats; the tile's SPAN outputs of T. The A fragments
    // (KS k-steps, high and low part) stay in registers. (Static: the plan reads its size back
    // from the compiled kernel.)
    constexpr int WARP_VECS = 2 * (WV + PW) + WPAD + SPAN * 2 / 16;
    __shared__ uint4 stage_mem[MMA_WARPS][WARP_VECS];
    uint4* const stages = stage_mem[threadIdx.x / 32];
    auto params_of = [&](int st) {  // the parameter words of stage st
        return reinterpret_cast<unsigned long long*>(stages + st * (WV + PW) + WV);
    };
    float* const wpad = reinterpret_cast<float*>(stages + 2 * (WV + PW));
    unsigned* const obuf = reinterpret_cast<unsigned*>(stages + 2 * (WV + PW) + WPAD);  // pairs of T
    const int lane = threadIdx.x & 31, g = lane >> 2, tg = lane & 3;
    const int64 tiles_per_row = (seqlen + SPAN - 1) / SPAN;
    const int64 n_tiles = batch * dim * tiles_per_row, n_warps = main_warps(p);
    // A tile as digits (b, c, sp): tile sp of row (b, c).
    const Digits stride = to_digits(n_warps, tiles_per_row, dim);
    Digits issued = to_digits(grid_warp(), tiles_per_row, dim), computed = issued;
    int64 g_issued = grid_warp();

    // Stages the window of the tile at `u` (positions start - D ..) and its row's parameters
    // (word k < width: tap k, word KMAX: the bias) into stage st when `valid`; always commits
    // one group.
    auto issue = [&](const Digits& u, int st, bool valid) {
        if (valid) {
            const int64 b = u.hi, c = u.mid;
            unsigned long long* pw = params_of(st);
            for (int k = lane; k < width; k += 32)
                stage_param(pw + k, weight, weight_dtype, c * weight_c_stride + k * weight_width_stride);
            if (lane == 0 && bias) stage_param(pw + KMAX, bias, bias_dtype, c * bias_stride);
            const T* xr = x + b * x_batch_stride + c * x_c_stride;
            const int64 w0 = u.lo * SPAN - D;
            uint4* s = stages + st * (WV + PW);
            #pragma unroll 1
            for (int v = lane; v < WV; v += 32) {
                const int64 pos = w0 + (int64)v * VN;
                if (x_aligned && pos >= 0 && pos < seqlen) {
                    cp_async<16>(s + v, xr + pos, (int)min((int64)VN, seqlen - pos) * (int)sizeof(T));
                } else if (pos >= seqlen || pos + VN <= -(int64)(width - 1) || (pos < 0 && !initial_states)) {
                    s[v] = make_uint4(0, 0, 0, 0);
                } else {  // element by element: misaligned rows, states before the row
                    T* e = reinterpret_cast<T*>(s + v);
                    #pragma unroll 1
                    for (int q = 0; q < VN; ++q) {
                        const int64 pq = pos + q;
                        e[q] = pq >= seqlen || pq < -(int64)(width - 1) ? T()
                               : pq >= 0 ? xr[pq * x_l_stride]
                               : from_acc<T>(input_at<float>(x, initial_states, p, b, c, pq));
                    }
                }
            }
        }
        cp_async_commit();
    };

    const bool split = weight_dtype != MmaOp<T>::code;
    float bias_c = 0.f;
    unsigned ahi[KS][4], alo[KS][4];  // the row's A fragments: high and low part per k-step
    // The A fragments of the row whose parameters are staged in stage st.
    auto load_row = [&](int64 c, int st) {
        const unsigned long long* pw = params_of(st);
        for (int i = lane; i < 4 * WPAD; i += 32) {
            const int k = i - PAD;
            wpad[i] = k >= 0 && k < width ? staged_param<float>(pw + k, weight, weight_dtype,
                                                                c * weight_c_stride + k * weight_width_stride)
                                          : 0.f;
        }
        bias_c = bias ? staged_param<float>(pw + KMAX, bias, bias_dtype, c * bias_stride) : 0.f;
        __syncwarp();
        // Element (row i, k) of k-step s: output o = 2 (i mod 8) + i / 8, input e of the
        // segment (k = 2 tg + h: e = 4 tg + h; k = 2 tg + 8 + h: e = 4 tg + 2 + h).
        const float* wl = wpad + PAD + 4 * tg - 2 * g - (D - width + 1);  // + 16 s + e' - o'
        #pragma unroll
        for (int s = 0; s < KS; ++s) {
            #pragma unroll
            for (int r = 0; r < 4; ++r) {  // a0: (g, k lo), a1: (g+8, k lo), a2: (g, k hi), a3: (g+8, k hi)
                const float* q = wl + 16 * s + 2 * (r >> 1) - (r & 1);
                const float v0 = q[0], v1 = q[1];
                ahi[s][r] = pack2<T>(v0, v1);
                if (split) alo[s][r] = pack2<T>(v0 - to_acc(from_acc<T>(v0)), v1 - to_acc(from_acc<T>(v1)));
            }
        }
        __syncwarp();  // wpad is free again
    };
    auto compute = [&](const Digits& u, int st) {
        const int64 start = u.lo * SPAN;
        load_row(u.mid, st);
        bool nonfinite = false;
        const uint2* s = reinterpret_cast<const uint2*>(stages + st * (WV + PW)) + 4 * g + tg;
        // CHAINS blocks at a time: their MMA chains are independent, so each hides the others'
        // latency. Four measured faster up to KS = 3 (widths up to 33), slower at KS = 5
        // (benchmarks/NOTES.md, "fwd_mma's chains").
        constexpr int CHAINS = KS <= 3 ? 4 : 2;
        static_assert(NB % CHAINS == 0, "MMA_BLOCKS is a multiple of the chains");
        #pragma unroll 1
        for (int blk = 0; blk < NB && start + blk * 128 < seqlen; blk += CHAINS, s += 32 * CHAINS) {
            float acc[CHAINS][4] = {};
            #pragma unroll
            for (int ks = 0; ks < KS; ++ks) {
                #pragma unroll
                for (int j = 0; j < CHAINS; ++j) {
                    const uint2 bw = s[32 * j + 4 * ks];  // inputs 4 tg .. 4 tg + 3 of segment g + ks
                    MmaOp<T>::run(acc[j], ahi[ks], bw.x, bw.y);
                    if (split) MmaOp<T>::run(acc[j], alo[ks], bw.x, bw.y);
                }
            }
            // c0: (row g, column 2 tg), c1: (g, 2 tg + 1), c2: (g + 8, 2 tg), c3: (g + 8, 2 tg + 1):
            // outputs 32 tg + 2 g (c0, c2) and 32 tg + 16 + 2 g (c1, c3) of the block.
            #pragma unroll
            for (int j = 0; j < CHAINS; ++j) {
                #pragma unroll
                for (int r = 0; r < 4; ++r) acc[j][r] += bias_c;
                // (a sum is not finite if one of its terms is not: one test for four outputs)
                nonfinite |= !isfinite((acc[j][0] + acc[j][1]) + (acc[j][2] + acc[j][3]));
                if (silu_act) {
                    #pragma unroll
                    for (int r = 0; r < 4; ++r) acc[j][r] = silu(acc[j][r]);
                }
                obuf[(blk + j) * 64 + 16 * tg + g] = pack2<T>(acc[j][0], acc[j][2]);
                obuf[(blk + j) * 64 + 16 * tg + 8 + g] = pack2<T>(acc[j][1], acc[j][3]);
            }
        }
        __syncwarp();
        // A non-finite input also meets the band's zero weights (0 inf = NaN): where the warp
        // saw a sum that is not finite, those outputs are computed again from their own taps.
        if (__any_sync(0xffffffffu, nonfinite)) {
            const T* window = reinterpret_cast<const T*>(stages + st * (WV + PW)) + D - width + 1;
            own_taps<T, SPAN>(reinterpret_cast<T*>(obuf), window, wpad + PAD, width, bias_c, silu_act);
            __syncwarp();
        }
        T* const orow = out + u.hi * out_batch_stride + u.mid * out_c_stride;
        #pragma unroll
        for (int j = 0; j < SPAN / VN / 32; ++j) {
            const int64 t = start + (32 * j + lane) * VN;
            const uint4 v = reinterpret_cast<const uint4*>(obuf)[32 * j + lane];
            if (out_aligned && t + VN <= seqlen) {
                *reinterpret_cast<uint4*>(orow + t) = v;
            } else if (t < seqlen) {
                const T* e = reinterpret_cast<const T*>(&v);
                #pragma unroll
                for (int q = 0; q < VN; ++q)
                    if (t + q < seqlen) orow[(t + q) * out_l_stride] = e[q];
            }
        }
    };

    auto issue_next = [&](int st) {
        const bool valid = g_issued < n_tiles;
        issue(issued, st, valid);
        if (valid) {
            advance(issued, stride, tiles_per_row, dim);
            g_issued += n_warps;
        }
    };
    issue_next(0);
    int st = 0;
    for (int64 t = grid_warp(); t < n_tiles; t += n_warps) {
        issue_next(st ^ 1);
        cp_async_wait<1>();
        __syncwarp();
        compute(computed, st);
        advance(computed, stride, tiles_per_row, dim);
        __syncwarp();  // stage st and obuf are free again
        st ^= 1;
    }
}
