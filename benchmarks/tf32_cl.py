"""The channel-last forward on tensor cores in TF32, measured alone: whether m16n8k8 TF32 MMAs,
whose operands are one 32-bit element a register, serve channel-contiguous x without the
transposes that 16-bit operand pairs need.

    python benchmarks/tf32_cl.py [--quick] [--dtypes float32] [--widths 64] [--configs ...]

A block takes 64 bytes of channels (16 float32 or 32 bfloat16) of one batch row and a piece of
``span`` positions, and walks it in steps of TT outputs. Each step's window (the 16 KB positions
before it, KB = ceil((K - 1) / 16), and its TT) comes by 4-byte ``cp.async`` (16 consecutive
lanes read a position's 64 bytes) into a staging buffer laid out so that the MMAs' reads meet 32
banks: position i, word q (a float32 channel or a pair of 16-bit ones) at (i / 16) BS + 17 q + i
% 16, BS = 292 (= 4 mod 32). Each warp takes its channels one after another: 8 segments of 16
outputs are the MMA's 8 columns, B[k][n] = x[16 n + 8 s + k] of the window, A the channel's
Toeplitz band (tap 8 s + k - m - OFF) from a table of the taps. float32 x and taps split into
TF32 high parts (the top 19 bits) and the rest, three products a k-step (high high, high low, low
high), which keeps float32's accuracy; bfloat16 x and taps are exact in TF32: one product.
Outputs (bias, SiLU) go through shared memory (rows rotated by bits of the position so that both
the fragment writes and the row reads meet 32 banks) to coalesced stores. Variants: SEP (the
three products' accumulators apart), PAIR (two channels a warp at once).

``psplit_cl`` (float32 x alone) does the same on bfloat16 m16n8k16 MMAs: x and the taps split
into bfloat16 high and low parts (three products, 2^-17 relative, the library's float32 split),
each x pair split once a step: each warp turns its channels' words of the staged window into
bfloat16 high and low parts in place, laid out so that a lane's B registers are one 8-byte load
of each (the library's ``fwd_split_cl`` is this
kernel in the library's frame).

Printed: the MMA rate of m16n8k8 TF32 chains; each instance's largest error against float64 on
small shapes; then, by dtype and width, the copy of x's bytes, cupyconv's forward and this kernel
(copy/time) on (8, 5120, 2048).
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench.py, from any directory
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's cupyconv

KERNEL = r"""
// (The CPU emulator, tests/emulation.py, has no TF32 MMA: there the tf32 kernels are not run.)
__device__ __forceinline__ void mma_tf32(float (&d)[4], unsigned a0, unsigned a1, unsigned a2,
                                         unsigned a3, unsigned b0, unsigned b1) {
#ifndef CPC_ARCH
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}
__device__ __forceinline__ unsigned tf32_high(float v) { return __float_as_uint(v) & 0xffffe000u; }

// CHAINS independent accumulators a warp, N MMAs each.
template <int CHAINS>
__global__ void tf32_rate(float* out, int n) {
    float acc[CHAINS][4] = {};
    const unsigned a = threadIdx.x * 0x3f800001u, b = threadIdx.x ^ 0x3c000000u;
    for (int i = 0; i < n; ++i) {
        #pragma unroll
        for (int c = 0; c < CHAINS; ++c) mma_tf32(acc[c], a, a + c, a ^ c, a, b, b + c);
    }
    float s = 0.f;
    #pragma unroll
    for (int c = 0; c < CHAINS; ++c) s += acc[c][0] + acc[c][1] + acc[c][2] + acc[c][3];
    if (s == 1.2345f) out[threadIdx.x] = s;
}

// The output tile's rotation of position p's row (CH words): both the fragment writes (lanes
// (g, tg): positions 32 tg + g + 8 h + 16 j, one channel) and the row reads meet 32 banks.
template <int CH>
__device__ __forceinline__ int rotation(int p) {
    if constexpr (CH == 16) return ((p >> 1) & 3) | (((p >> 5) & 3) << 2);
    else return (p & 7) | (((p >> 5) & 3) << 3);
}

// Channels c_first .. c_first + P - 1's outputs of the step (bias, SiLU) from their accumulators
// (lane (g, tg): positions 16 (2 tg + (r & 1)) + g + 8 (r >> 1) of each 128) into the output
// tile.
template <int CH, typename B, int P, int NT, int NA>
__device__ __forceinline__ void tile_outputs(const float (&acc)[P][NT][NA][4], float* outs,
                                             const B* bias, int c0, int c_first, int dim, int lane,
                                             int silu) {
    const int g = lane >> 2, tg = lane & 3;
    #pragma unroll
    for (int j = 0; j < P; ++j) {
        const int c = c_first + j;
        const float bv = bias && c0 + c < dim ? (float)bias[c0 + c] : 0.f;
        #pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            #pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int p = 128 * nt + 16 * (2 * tg + (r & 1)) + g + 8 * (r >> 1);
                float v = acc[j][nt][0][r];
                #pragma unroll
                for (int a = 1; a < NA; ++a) v += acc[j][nt][a][r];
                v += bv;
                if (silu) v = __fdividef(v, 1.f + __expf(-v));
                outs[CH * p + ((c + rotation<CH>(p)) & (CH - 1))] = v;
            }
        }
    }
}

// The output tile's positions t0 .. (before t_end) out to the block's channels of x's row ob: a
// thread keeps its channel and steps its pointer THREADS / CH positions at a time (whole steps
// unchecked).
template <int CH, int TT, int THREADS, typename T>
__device__ __forceinline__ void store_outputs(T* ob, const float* outs, int t0, int t_end, int c0,
                                              int dim, int tid) {
    constexpr int ROWS = THREADS / CH;
    static_assert(THREADS % CH == 0 && TT % ROWS == 0 && (ROWS & (ROWS - 1)) == 0, "rows");
    const int c = tid & (CH - 1), p0 = (tid / CH) & (ROWS - 1);
    if (c0 + c >= dim) return;
    T* dst = ob + (long long)(t0 + p0) * dim + c;
    const long long stride = (long long)ROWS * dim;
    auto value = [&](int p) { return (T)outs[CH * p + ((c + rotation<CH>(p)) & (CH - 1))]; };
    if (t0 + TT <= t_end) {
        #pragma unroll
        for (int k = 0; k < TT / ROWS; ++k) dst[k * stride] = value(p0 + ROWS * k);
    } else {
        #pragma unroll
        for (int k = 0; k < TT / ROWS; ++k)
            if (t0 + p0 + ROWS * k < t_end) dst[k * stride] = value(p0 + ROWS * k);
    }
}

// A block's item: batch row b, channels c0 .. c0 + CH - 1, positions t_begin .. t_end - 1 in
// n_steps steps of TT (items numbered channel group fastest, then piece, then row).
struct Piece {
    int b, c0, t_begin, t_end, n_steps;
};
template <int CH, int TT>
__device__ __forceinline__ Piece piece_of(int seqlen, int dim, int span) {
    const int groups = (dim + CH - 1) / CH, pieces = (seqlen + span - 1) / span;
    const int item = blockIdx.x, t_begin = item / groups % pieces * span;
    const int t_end = min(seqlen, t_begin + span);
    const int n_steps = (t_end - t_begin + TT - 1) / TT;
    return Piece{item / groups / pieces, item % groups * CH, t_begin, t_end, n_steps};
}

// The steps of piece pc: step i's window (16 KB positions before it and its TT) copied by 4-byte
// cp.async into stage buffer i % 2 (position i, word q at (i / 16) BS + QS q + i % 16; a word is
// PER channels) while step i - 1 is computed; compute(buffer) puts the step's outputs into the
// output tile, which then goes out.
// ALIAS (outs null): compute leaves the step's outputs in its window's words (output position
// p at window position 16 KB + p, a word PER channels as x's), and the next step's copy goes
// out after the step's first barrier, when no thread still reads that buffer's outputs of two
// steps before.
template <int CH, int TT, int WARPS, int KB, int BS, int QS, int PER, typename T, typename Compute>
__device__ __forceinline__ void walk_piece(const T* x, T* out, const Piece& pc, int seqlen,
                                           int dim, float* stage, const float* outs,
                                           Compute compute) {
    constexpr int NBLK = KB + TT / 16, STAGE = NBLK * BS;
    const int tid = threadIdx.x;
    const T* const xb = x + (long long)pc.b * seqlen * dim + pc.c0;
    // A thread keeps its word q and steps through the window ROWS positions at a time; windows
    // inside the row go unchecked.
    constexpr int ROWS = 2 * WARPS, ITERS = (NBLK * 16 + ROWS - 1) / ROWS;
    static_assert((ROWS & (ROWS - 1)) == 0, "rows");
    const int q = tid & 15, p0 = (tid >> 4) & (ROWS - 1);
    const bool q_live = pc.c0 + PER * q < dim;
    const long long stride = (long long)ROWS * dim;
    auto copy = [&](int step) {
        float* const st = stage + (step & 1) * STAGE + QS * q;
        const int ws = pc.t_begin + step * TT - 16 * KB;
        const T* const src = xb + (long long)(ws + p0) * dim + PER * q;
        auto at = [&](int k) { const int p = p0 + ROWS * k; return st + (p >> 4) * BS + (p & 15); };
        constexpr bool EVEN = ITERS * ROWS == NBLK * 16;
        if (q_live && ws >= 0 && ws + NBLK * 16 <= seqlen) {
            #pragma unroll
            for (int k = 0; k < ITERS; ++k)
                if (EVEN || p0 + ROWS * k < NBLK * 16) cp_async<4, 128>(at(k), src + k * stride, 4);
        } else {
            #pragma unroll
            for (int k = 0; k < ITERS; ++k) {
                const int t = ws + p0 + ROWS * k;
                const bool live = q_live && t >= 0 && t < seqlen;
                if (EVEN || p0 + ROWS * k < NBLK * 16)
                    cp_async<4, 128>(at(k), live ? src + k * stride : x, live ? 4 : 0);
            }
        }
        cp_async_commit();
    };
    copy(0);
    T* const ob = out + (long long)pc.b * seqlen * dim + pc.c0;
    for (int step = 0; step < pc.n_steps; ++step) {
        float* const st = stage + (step & 1) * STAGE;
        const int t0 = pc.t_begin + step * TT;
        if (outs) {
            if (step + 1 < pc.n_steps) copy(step + 1);
            else cp_async_commit();
            cp_async_wait<1>();
            __syncthreads();
        } else {
            cp_async_wait<0>();
            __syncthreads();
            if (step + 1 < pc.n_steps) copy(step + 1);
        }
        compute(st);
        __syncthreads();
        if (outs) {
            store_outputs<CH, TT, 32 * WARPS>(ob, outs, t0, pc.t_end, pc.c0, dim, tid);
        } else {  // a thread's word q (PER channels) at positions p0 + ROWS k, as copied in
            if (q_live) {
                #pragma unroll
                for (int k = 0; k < TT / ROWS; ++k) {
                    const int p = p0 + ROWS * k;
                    const float* const word = st + (KB + (p >> 4)) * BS + QS * q + (p & 15);
                    T* const dst = ob + (long long)(t0 + p) * dim + PER * q;
                    if (t0 + p >= pc.t_end) continue;
                    if constexpr (PER == 1) *dst = (T)*word;
                    else *reinterpret_cast<unsigned*>(dst) = __float_as_uint(*word);
                }
            }
        }
    }
}

// T = float: three products a k-step (x and the taps split); T = __nv_bfloat16 with bfloat16
// taps: one (both exact in TF32). A staged word is one float32 channel or two 16-bit ones.
// SEP: the three products into accumulators of their own (three chains, summed at the end);
// PAIR: a warp computes two of its channels at once (twice the chains).
template <typename T, int K, int TT, int WARPS, int SEP, int PAIR>
__global__ void __launch_bounds__(32 * WARPS)
    tf32_cl(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ bias,
            T* __restrict__ out, int seqlen, int dim, int span, int silu) {
    constexpr bool SPLIT = sizeof(T) == 4;
    constexpr int CH = 64 / sizeof(T), PER = 4 / sizeof(T);  // channels a block, a word
    constexpr int KB = (K - 1 + 15) / 16, OFF = 16 * KB - (K - 1), KS = 2 * KB + 2;
    constexpr int NT = TT / 128, NBLK = KB + TT / 16, BS = 292, TW = 8 * KS + 16;
    constexpr int STAGE = NBLK * BS;
    constexpr int P = PAIR ? 2 : 1, NA = SEP && SPLIT ? 3 : 1;  // channels at once, accumulators
    static_assert(TT % 128 == 0 && CH % (WARPS * P) == 0, "tiles");
    extern __shared__ __align__(16) unsigned char smem_raw[];
    float* const sm = reinterpret_cast<float*>(smem_raw);
    float2* const taps = reinterpret_cast<float2*>(sm);  // [CH][TW]: the taps' (high, low) parts
    float* const stage = sm + 2 * CH * TW;               // [2][STAGE] words
    float* const outs = stage + 2 * STAGE;               // [TT][CH], rows rotated
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, tg = lane & 3;
    const Piece pc = piece_of<CH, TT>(seqlen, dim, span);
    const int c0 = pc.c0;
    for (int e = tid; e < CH * TW; e += 32 * WARPS) {
        const int c = e / TW, j = e % TW - 15 - OFF;
        const bool in = c0 + c < dim && j >= 0 && j < K;
        const float v = in ? (float)w[(long long)(c0 + c) * K + j] : 0.f;
        const float h = __uint_as_float(tf32_high(v));
        taps[e] = make_float2(SPLIT ? h : v, SPLIT ? v - h : 0.f);
    }
    // The offsets in a channel's table of the four A registers of k-step s (rows g, g + 8;
    // columns tg, tg + 4): tap 8 s + k - m - OFF.
    auto frag_at = [](int s, int q) { return 8 * s + (q & 1 ? -8 : 0) + (q & 2 ? 4 : 0); };
    auto compute = [&](const float* buf) {
        const unsigned* const st = reinterpret_cast<const unsigned*>(buf);
        #pragma unroll 1
        for (int ci = 0; ci < CH / WARPS; ci += P) {
            const int c_first = warp * (CH / WARPS) + ci;
            float acc[P][NT][NA][4] = {};
            #pragma unroll
            for (int s = 0; s < KS; ++s) {
                #pragma unroll
                for (int j = 0; j < P; ++j) {
                    const int c = c_first + j;
                    const float2* const tp = taps + c * TW + tg - g + 15;
                    const unsigned* const xs = st + 17 * (c / PER) + tg;
                    const bool odd = c % PER;  // (16-bit x: the word's high half)
                    auto value = [&](unsigned word) {
                        return SPLIT ? word : odd ? word & 0xffff0000u : word << 16;
                    };
                    const float2 w0 = tp[frag_at(s, 0)], w1 = tp[frag_at(s, 1)],
                                 w2 = tp[frag_at(s, 2)], w3 = tp[frag_at(s, 3)];
                    const unsigned h0 = __float_as_uint(w0.x), h1 = __float_as_uint(w1.x),
                                   h2 = __float_as_uint(w2.x), h3 = __float_as_uint(w3.x);
                    #pragma unroll
                    for (int nt = 0; nt < NT; ++nt) {
                        const unsigned* const src = xs + (8 * nt + g + (s >> 1)) * BS + 8 * (s & 1);
                        const unsigned v0 = value(src[0]), v1 = value(src[4]);
                        if constexpr (SPLIT) {
                            const unsigned l0 = __float_as_uint(w0.y), l1 = __float_as_uint(w1.y),
                                           l2 = __float_as_uint(w2.y), l3 = __float_as_uint(w3.y);
                            const unsigned bh0 = v0 & 0xffffe000u, bh1 = v1 & 0xffffe000u;
                            const float r0 = __uint_as_float(v0) - __uint_as_float(bh0),
                                        r1 = __uint_as_float(v1) - __uint_as_float(bh1);
                            const unsigned bl0 = __float_as_uint(r0), bl1 = __float_as_uint(r1);
                            mma_tf32(acc[j][nt][0], h0, h1, h2, h3, bh0, bh1);
                            mma_tf32(acc[j][nt][NA > 1 ? 1 : 0], h0, h1, h2, h3, bl0, bl1);
                            mma_tf32(acc[j][nt][NA > 1 ? 2 : 0], l0, l1, l2, l3, bh0, bh1);
                        } else {
                            mma_tf32(acc[j][nt][0], h0, h1, h2, h3, v0, v1);
                        }
                    }
                }
            }
            tile_outputs<CH>(acc, outs, bias, c0, c_first, dim, lane, silu);
        }
    };
    walk_piece<CH, TT, WARPS, KB, BS, 17, PER>(x, out, pc, seqlen, dim, stage, outs, compute);
}

// ptx.cuh's bfloat16 MMA with the A registers one by one.
__device__ __forceinline__ void mma_bf16(float (&d)[4], unsigned a0, unsigned a1, unsigned a2,
                                         unsigned a3, unsigned b0, unsigned b1) {
    const unsigned a[4] = {a0, a1, a2, a3};
    mma_bf16(d, a, b0, b1);
}

// Two floats as bfloat16 pairs: the high parts (rounded) and the rest, rounded again.
__device__ __forceinline__ void split2(float2 v, unsigned& hi, unsigned& lo) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(v.x, v.y);
    hi = *reinterpret_cast<const unsigned*>(&h);
    const __nv_bfloat162 l = __floats2bfloat162_rn(v.x - __uint_as_float(hi << 16),
                                                   v.y - __uint_as_float(hi & 0xffff0000u));
    lo = *reinterpret_cast<const unsigned*>(&l);
}

// Taps j and j + 1 of channel c (zeros outside the filter and past the channels).
template <int K>
__device__ __forceinline__ float2 tap_pair(const float* w, int c, int j, int dim) {
    auto tap = [&](int k) { return c < dim && k >= 0 && k < K ? w[(long long)c * K + k] : 0.f; };
    return make_float2(tap(j), tap(j + 1));
}

// float32 x on bfloat16 m16n8k16 MMAs, x and the taps split into bfloat16 high and low parts
// (three products a k-step: high high, high low, low high; 2^-17 relative, the library's float32
// split), each x pair split once a step: each warp turns its channels' words of the staged window
// into bfloat16 parts in place before its MMAs (word 2 t of a position block: the high parts of
// positions 2 t, 2 t + 1; word 2 t + 1: of 2 t + 8, 2 t + 9; words 2 t + 8, 2 t + 9 their low
// parts), so that a lane's B registers are one 8-byte load for the high parts and one for the
// low ones, already packed. A comes from tables of high and low tap pairs; DUP: entry j holds
// the pairs at j and j - 8, so that an A quad is two 8-byte loads. SEP: the three products'
// accumulators apart (three chains of KS MMAs instead of one of 3 KS). ALIAS: no output tile;
// each channel's outputs go into its own words of the window once its MMAs are done
// (walk_piece's ALIAS), 8 or 16 KB less shared memory a block.
template <int K, int TT, int WARPS, int DUP, int SEP, int ALIAS>
__global__ void __launch_bounds__(32 * WARPS)
    psplit_cl(const float* __restrict__ x, const float* __restrict__ w,
              const float* __restrict__ bias, float* __restrict__ out, int seqlen, int dim,
              int span, int silu) {
    constexpr int CH = 16, WORDS = DUP ? 2 : 1;
    constexpr int KB = (K - 1 + 15) / 16, OFF = 16 * KB - (K - 1), KS = KB + 1;
    constexpr int NT = TT / 128, NBLK = KB + TT / 16, BS = 296, TW = 16 * KB + 48, E0 = 32;
    constexpr int STAGE = NBLK * BS, PER_WARP = CH / WARPS;
    static_assert(TT % 128 == 0 && CH % WARPS == 0, "tiles");
    extern __shared__ __align__(16) unsigned char smem_raw[];
    float* const sm = reinterpret_cast<float*>(smem_raw);
    unsigned* const th = reinterpret_cast<unsigned*>(sm);  // [CH][TW][WORDS]: high parts
    unsigned* const tl = th + CH * TW * WORDS;              // low parts
    float* const stage = sm + 2 * CH * TW * WORDS;          // [2][STAGE]
    float* const outs = stage + 2 * STAGE;                  // [TT][CH], rows rotated
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, tg = lane & 3;
    const Piece pc = piece_of<CH, TT>(seqlen, dim, span);
    const int c0 = pc.c0;
    for (int e = tid; e < CH * TW; e += 32 * WARPS)
        #pragma unroll
        for (int d = 0; d < WORDS; ++d)
            split2(tap_pair<K>(w, c0 + e / TW, e % TW - E0 - 8 * d, dim), th[WORDS * e + d],
                   tl[WORDS * e + d]);
    auto compute = [&](const float* cst) {
        float* const st = const_cast<float*>(cst);
        // This warp's channels' words, split in place (lanes: t, then blocks, then channels).
        #pragma unroll
        for (int i = 0; i < (PER_WARP * NBLK * 4 + 31) / 32; ++i) {
            const int e = lane + 32 * i, t = e & 3, b = (e >> 2) % NBLK;
            const int c = warp * PER_WARP + (e >> 2) / NBLK;
            if (e < PER_WARP * NBLK * 4) {
                float* const wp = st + b * BS + 18 * c + 2 * t;
                unsigned h0, l0, h1, l1;
                split2(*reinterpret_cast<const float2*>(wp), h0, l0);
                split2(*reinterpret_cast<const float2*>(wp + 8), h1, l1);
                *reinterpret_cast<uint2*>(wp) = make_uint2(h0, h1);
                *reinterpret_cast<uint2*>(wp + 8) = make_uint2(l0, l1);
            }
        }
        __syncwarp();
        #pragma unroll 1
        for (int ci = 0; ci < PER_WARP; ++ci) {
            const int c = warp * PER_WARP + ci;
            constexpr int NA = SEP ? 3 : 1;
            float acc[1][NT][NA][4] = {};
            #pragma unroll
            for (int s = 0; s < KS; ++s) {
                const int at = c * TW + E0 + 16 * s + 2 * tg - g - OFF;
                unsigned ah[4], al[4];
                if constexpr (DUP) {
                    const uint2 h01 = reinterpret_cast<const uint2*>(th)[at];
                    const uint2 h23 = reinterpret_cast<const uint2*>(th)[at + 8];
                    const uint2 l01 = reinterpret_cast<const uint2*>(tl)[at];
                    const uint2 l23 = reinterpret_cast<const uint2*>(tl)[at + 8];
                    ah[0] = h01.x, ah[1] = h01.y, ah[2] = h23.x, ah[3] = h23.y;
                    al[0] = l01.x, al[1] = l01.y, al[2] = l23.x, al[3] = l23.y;
                } else {
                    ah[0] = th[at], ah[1] = th[at - 8], ah[2] = th[at + 8], ah[3] = ah[0];
                    al[0] = tl[at], al[1] = tl[at - 8], al[2] = tl[at + 8], al[3] = al[0];
                }
                #pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    const float* const src = st + (8 * nt + g + s) * BS + 18 * c + 2 * tg;
                    const uint2 bh = *reinterpret_cast<const uint2*>(src);
                    const uint2 bl = *reinterpret_cast<const uint2*>(src + 8);
                    float(&d)[NA][4] = acc[0][nt];
                    mma_bf16(d[0], ah[0], ah[1], ah[2], ah[3], bh.x, bh.y);
                    mma_bf16(d[SEP ? 1 : 0], ah[0], ah[1], ah[2], ah[3], bl.x, bl.y);
                    mma_bf16(d[SEP ? 2 : 0], al[0], al[1], al[2], al[3], bh.x, bh.y);
                }
            }
            if constexpr (ALIAS) {
                const float bv = bias && c0 + c < dim ? bias[c0 + c] : 0.f;
                #pragma unroll
                for (int nt = 0; nt < NT; ++nt)
                    #pragma unroll
                    for (int r = 0; r < 4; ++r) {
                        float v = acc[0][nt][0][r] + bv;
                        #pragma unroll
                        for (int a = 1; a < NA; ++a) v += acc[0][nt][a][r];
                        if (silu) v = __fdividef(v, 1.f + __expf(-v));
                        // position 128 nt + 16 (2 tg + (r & 1)) + g + 8 (r >> 1) of the step
                        st[(KB + 8 * nt + 2 * tg + (r & 1)) * BS + 18 * c + g + 8 * (r >> 1)] = v;
                    }
            } else {
                tile_outputs<CH>(acc, outs, bias, c0, c, dim, lane, silu);
            }
        }
    };
    walk_piece<CH, TT, WARPS, KB, BS, 18, 1>(x, out, pc, seqlen, dim, stage,
                                             ALIAS ? nullptr : outs, compute);
}
"""

WIDTHS = (16, 31, 64, 128, 256)
# (TT, WARPS, SEP, PAIR): one accumulator a tile (the first version), then the products'
# accumulators apart, with two channels a warp at once where a warp has two.
CONFIGS = (
    (128, 8, 0, 0), (256, 8, 0, 0), (128, 16, 0, 0), (256, 16, 0, 0),
    (128, 8, 1, 1), (256, 8, 1, 1), (128, 4, 1, 1), (256, 4, 1, 1),
    (128, 16, 1, 0), (256, 16, 1, 0),
)  # fmt: skip
# psplit_cl (float32 alone): (TT, WARPS, DUP, SEP, ALIAS).
PSPLIT = (
    (128, 8, 1, 0, 0), (128, 8, 0, 1, 0), (256, 8, 1, 1, 0), (256, 8, 0, 1, 0),
    (128, 8, 0, 1, 1), (256, 8, 0, 1, 1), (256, 8, 0, 0, 1),
)  # fmt: skip
TYPES = {"float32": "float", "bfloat16": "__nv_bfloat16"}


def instances(dtype: str, width: int) -> list[tuple[str, tuple[int, ...]]]:
    """(kernel, config) of every instance built for ``dtype`` at ``width``."""
    split = [("psplit", c) for c in PSPLIT] if dtype == "float32" else []
    return [("tf32", c) for c in CONFIGS] + split


def instance_name(dtype: str, width: int, kernel: str, config: tuple[int, ...]) -> str:
    values = ", ".join(map(str, config))
    if kernel == "tf32":
        return f"tf32_cl<{TYPES[dtype]}, {width}, {values}>"
    return f"psplit_cl<{width}, {values}>"


NAMES = [instance_name(d, k, *i) for d in TYPES for k in WIDTHS for i in instances(d, k)] + [
    f"tf32_rate<{c}>" for c in (4, 8)
]


def smem_bytes(kernel: str, width: int, config: tuple[int, ...], itemsize: int) -> int:
    """The kernel's shared memory: tap table, two stages, the output tile (but for psplit_cl's
    ALIAS)."""
    kb = -(-(width - 1) // 16)
    tt = config[0]
    ch = 64 // itemsize
    if kernel == "psplit":  # (ALIAS, config[4]: no output tile)
        return (
            2 * ch * (16 * kb + 48) * 4 * (1 + config[2])
            + 2 * (kb + tt // 16) * 296 * 4
            + (1 - config[4]) * tt * ch * 4
        )
    return ch * (8 * (2 * kb + 2) + 16) * 8 + 2 * (kb + tt // 16) * 292 * 4 + tt * ch * 4


def source(emulated: bool = False) -> str:
    """The program: the kernels' own cp.async and MMA helpers (kernels/ptx.cuh), then these
    kernels; ``emulated``: for the CPU emulator (tests/emulation.py), which has its own
    ptx.cuh."""
    from cupyconv._compile import Source

    helpers = '#include "ptx.cuh"\n' if emulated else Source("ptx.cuh", "").text
    return "#include <cuda_bf16.h>\n" + helpers + KERNEL


def compile_check() -> tuple[bool, str]:
    """(whether NVRTC compiled every instance for sm_90, its log), with CuPy's options (no GPU
    needed)."""
    import bench

    return bench.nvrtc_check(source(), "tf32_cl.cu", NAMES, "sm_90")


def main(argv: list[str] | None = None) -> None:
    import cupy as cp
    import numpy as np
    import torch
    from bench import copy_provider, event_loop, interleaved, stand_alone_module, time_fn

    import cupyconv
    from cupyconv import reference
    from cupyconv.testing import tolerance

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the (8, 5120, 2048) shape alone")
    parser.add_argument("--dtypes", default=",".join(TYPES), help="comma-separated")
    parser.add_argument("--widths", default=",".join(map(str, WIDTHS)), help="comma-separated")
    parser.add_argument(
        "--configs",
        default=None,
        help="tf32:TT:WARPS:SEP:PAIR or psplit:TT:WARPS:DUP:SEP:ALIAS (float32), "
        "comma-separated (default all)",
    )
    parser.add_argument("--no-check", action="store_true", help="skip the rate and the checks")
    parser.add_argument(
        "--carveout",
        type=int,
        default=None,
        help="these kernels' preferred shared-memory carveout in percent (cupyconv's kernels take "
        "the least that holds their resident blocks; default: the driver's choice)",
    )
    args = parser.parse_args(argv)
    dtypes = args.dtypes.split(",")
    widths = [int(v) for v in args.widths.split(",")]
    picked = args.configs and [
        (c.split(":")[0], tuple(int(v) for v in c.split(":")[1:])) for c in args.configs.split(",")
    ]

    def configs(dtype, width):
        every = instances(dtype, width)
        return [c for c in picked if c in every] if picked else every

    names = [instance_name(d, k, *c) for d in dtypes for k in widths for c in configs(d, k)]
    mod, sms = stand_alone_module(source(), names + [f"tf32_rate<{c}>" for c in (4, 8)])

    def label(instance):
        kernel, config = instance
        more = ("dup", "sep", "alias") if kernel == "psplit" else ("sep", "pair")
        fields = ("TT", "warps") + more
        return f"{kernel} " + " ".join(f"{k} {v}" for k, v in zip(fields, config))

    def run_kernel(dtype, width, instance, x, w, bias, out, span):
        batch, seqlen, dim = x.shape
        kernel, config = instance
        f = mod.get_function(instance_name(dtype, width, kernel, config))
        smem = smem_bytes(kernel, width, config, x.element_size())
        f.max_dynamic_shared_size_bytes = smem
        if args.carveout is not None:
            f.preferred_shared_memory_carveout = args.carveout
        items = batch * -(-dim // (64 // x.element_size())) * -(-seqlen // span)
        xa, wa, ba, oa = (cp.from_dlpack(t) for t in (x, w, bias, out))
        a = (xa, wa, ba, oa, cp.int32(seqlen), cp.int32(dim), cp.int32(span), cp.int32(1))
        return lambda: f((items,), (32 * config[1],), a, shared_mem=smem)

    if not args.no_check:
        sink = cp.zeros(1024, dtype=cp.float32)
        for chains in (4, 8):
            f = mod.get_function(f"tf32_rate<{chains}>")
            n = 4096
            for warps_sm in (8, 16, 32):
                grid, args_ = (sms * warps_sm // 4,), (sink, cp.int32(n))
                t = time_fn(
                    lambda f=f, grid=grid, a=args_: f(grid, (128,), a), repeats=3, target_ms=10
                )
                rate = sms * warps_sm * n * chains * 2 * 16 * 8 * 8 / t["us_median"] / 1e6
                print(
                    f"tf32 m16n8k8: {chains} chains a warp, {warps_sm} warps an SM: "
                    f"{rate:.0f} TFLOP/s"
                )

        # Correctness on small shapes (rows and channels not multiples of the tiles) against
        # float64.
        rng = np.random.default_rng(0)
        for dtype in dtypes:
            tdt = getattr(torch, dtype)
            rtol, atol = tolerance(dtype)
            for width in widths:
                for shape in ((2, 600, 40), (1, 1000, 24), (1, 200, 38)):  # (16-bit rows: even)
                    x, w, bias = (
                        torch.tensor(a, device="cuda").to(tdt)
                        for a in (
                            rng.standard_normal(shape),
                            rng.standard_normal((shape[2], width)) / np.sqrt(width),
                            rng.standard_normal(shape[2]),
                        )
                    )
                    want = reference.causal_conv1d_fn(
                        *(a.cpu().double().numpy() for a in (x.transpose(1, 2), w, bias)),
                        activation="silu",
                    ).transpose(0, 2, 1)  # (batch, seqlen, dim), as x
                    for config in configs(dtype, width):
                        out = torch.full_like(x, float("nan"))
                        run_kernel(dtype, width, config, x, w, bias, out, 512)()
                        err = np.abs(out.cpu().double().numpy() - want)
                        bad = ~(err <= atol + rtol * np.abs(want))
                        print(
                            f"check {dtype} w{width} {shape} {label(config)}: "
                            f"max err {np.nanmax(err):.2e}"
                            + (f"  FAILS at {int(bad.sum())} elements" if bad.any() else ""),
                            flush=True,
                        )

    shapes = [(8, 5120, 2048)] + ([] if args.quick else [(1, 4096, 16384)])
    for dtype in dtypes:
        tdt = getattr(torch, dtype)
        for batch, dim, seqlen in shapes:
            x = torch.randn(batch, seqlen, dim, device="cuda", dtype=tdt)
            for width in widths:
                w = (torch.randn(dim, width, device="cuda") / width**0.5).to(tdt)
                bias = torch.randn(dim, device="cuda").to(tdt)
                xt = x.transpose(1, 2)  # (batch, dim, seqlen), channel-last strides
                ours = cupyconv.causal_conv1d_fn(xt, w, bias, activation="silu")
                loops = {"copy": event_loop(copy_provider(x)[0], target_ms=10)}
                loops["cupyconv"] = event_loop(
                    functools.partial(cupyconv.causal_conv1d_fn, xt, w, bias, activation="silu"),
                    target_ms=10,
                )
                outs = {}
                for config in configs(dtype, width):
                    for span in (1024, 2048):
                        smem = smem_bytes(config[0], width, config[1], x.element_size())
                        if span > seqlen or smem > 227 * 1024:
                            continue
                        out = torch.empty_like(x)
                        call = run_kernel(dtype, width, config, x, w, bias, out, span)
                        call()
                        outs[(config, span)] = out
                        loops[(config, span)] = event_loop(call, target_ms=10)
                times = interleaved(loops, 3)
                copy = times["copy"]["us_median"]
                print(
                    f"({batch}, {dim}, {seqlen}) {dtype} channel-last w{width}: copy {copy:.1f} us"
                )
                ref = ours.transpose(1, 2).float()
                for key, t in times.items():
                    if key == "copy":
                        continue
                    us = t["us_median"]
                    name = key if isinstance(key, str) else f"{label(key[0])} span {key[1]}"
                    line = f"  {name:40s} {us:8.1f} us  copy/time {copy / us:.3f}"
                    if not isinstance(key, str):
                        diff = (outs[key].float() - ref).abs().max().item()
                        smem = smem_bytes(key[0][0], width, key[0][1], x.element_size())
                        smem += 1024
                        line += f"  max diff to cupyconv {diff:.1e}  {227 * 1024 // smem} blocks/SM"
                    print(line, flush=True)


if __name__ == "__main__":
    main()
