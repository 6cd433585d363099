// fwd_mma.cu: the forward for 16-bit x and widths 9 to 256 on tensor cores, on both layouts.
//
//   fwd_mma<T, KS, SPLIT>
//       widths K with K - 1 <= D = 16 (KS - 1), no seq_idx (fwd_time_wide and
//       fwd_channel_wide serve those). A block of MMA_WARPS warps takes a tile of rows
//       (channels) x p.span outputs: MMA_WARPS rows of time-contiguous x, one a warp, each
//       staged by its own warp with cp.async (no block barrier); or MMA_CL_ROWS channels of
//       channel-contiguous x (p.channel_last), staged by the whole block and transposed on the
//       way into shared memory. Either way a row's window (positions t0 - D ..) lies in shared
//       memory time-contiguous, p.row_len elements a row.
//
// For one channel, 16 consecutive outputs are a banded Toeplitz matrix of the weights times
// the inputs before them:  out[t0 + o] = sum_m Tw[o][m] x[t0 - D + m],  m < D + 16, with
// Tw[o][m] = w[m - o - (D - K + 1)] inside the band. Eight such blocks 16 steps apart are the
// eight columns n of one m16n8k16 MMA per 16 values of m (k-step s: window segment n + s).
// The MMA sums over k, so k and the rows may be permuted as long as A and B agree: lane
// (g, tg) holds inputs 4 tg .. 4 tg + 3 of segment g + s (one 8-byte shared-memory read, no
// bank conflict), and row i is output 2 (i mod 8) + i / 8, so each lane's results pair up
// into adjacent outputs. The A fragments (the weights) are built once per row and tile and
// stay in registers; each 128-output block's results overwrite the block's first 128 window
// inputs, which no later block reads (output t0 + o lands at window index o).
//
// Products of 16-bit values are exact and the MMA accumulates in float32; weights of another
// dtype (SPLIT) are split into a high and a low 16-bit part (two MMAs), which keeps them to
// 2^-17 relative. Every window slot is written (zeros outside the row), since a zero weight
// times a stale NaN would not be zero; a non-finite input meets the band's zero weights all
// the same, so outputs that come out non-finite are computed again from their own taps.
// p.x_aligned / p.out_aligned: x / out take the layout's 16-byte vectors (time-contiguous rows
// starting on 16-byte boundaries; or channel-contiguous steps whose starts are 16-byte
// aligned).
#include "fwd_common.cuh"

// Blocks per SM that fwd_mma's register budget (__launch_bounds__) is set for: the A fragments
// take 4 KS registers (8 KS split) beside about 56 others.
__host__ __device__ constexpr int mma_blocks_per_sm(int KS, bool split) {
    const int regs = 4 * KS * (split ? 2 : 1) + 56;
    return regs <= 80 ? 6 : regs <= 96 ? 5 : regs <= 128 ? 4 : regs <= 168 ? 3 : 2;
}

// acc += A B for one m16n8k16 MMA of 16-bit TYPE ("bf16" or "f16") operands, float32 accumulator.
#define MMA_SYNC(TYPE, acc, a, b0, b1)                                                           \
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TYPE "." TYPE                         \
                 ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"                 \
                 : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])                     \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))
template <typename T> struct MmaOp;
template <> struct MmaOp<__nv_bfloat16> {
    static __device__ __forceinline__ void run(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
        MMA_SYNC("bf16", c, a, b0, b1);
    }
};
template <> struct MmaOp<__half> {
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

// One row's weights as A fragments (high and, with SPLIT, low part per k-step) and its bias.
template <int KS, bool SPLIT>
struct RowWeights {
    unsigned hi[KS][4], lo[SPLIT ? KS : 1][4];
    float bias;
};

// Zero-padded taps of a row as floats, per warp: wpad[MMA_TAP_PAD + k] = w[k].
template <int KS>
struct Taps {
    static constexpr int D = 16 * (KS - 1), PAD = D + 15, SIZE = 2 * D + 32;
};

// The weights of channel c, through the warp's wpad (Taps<KS>::SIZE floats).
template <typename T, int KS, bool SPLIT, typename P>
__device__ __forceinline__ void load_row_weights(RowWeights<KS, SPLIT>& rw, float* wpad, const void* weight,
                                                 const void* bias, const P& p, int64 c) {
    constexpr int D = Taps<KS>::D, PAD = Taps<KS>::PAD;
    const int width = (int)p.width, lane = threadIdx.x & 31, g = lane >> 2, tg = lane & 3;
    for (int i = lane; i < Taps<KS>::SIZE; i += 32) {
        const int k = i - PAD;
        wpad[i] = k >= 0 && k < width
                      ? load_as<float>(weight, (int)p.weight_dtype, c * p.weight_c_stride + k * p.weight_width_stride)
                      : 0.f;
    }
    rw.bias = bias ? load_as<float>(bias, (int)p.bias_dtype, c * p.bias_stride) : 0.f;
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
            rw.hi[s][r] = pack2<T>(v0, v1);
            if constexpr (SPLIT) rw.lo[s][r] = pack2<T>(v0 - to_acc(from_acc<T>(v0)), v1 - to_acc(from_acc<T>(v1)));
        }
    }
}

// The n_blocks 128-output blocks of one row whose window (positions t0 - D ..) is at `row`:
// each block's outputs overwrite its first 128 inputs. Returns whether this lane saw a sum
// that is not finite.
template <typename T, int KS, bool SPLIT>
__device__ __forceinline__ bool compute_row(T* row, int n_blocks, const RowWeights<KS, SPLIT>& rw, int silu_act) {
    const int lane = threadIdx.x & 31, g = lane >> 2, tg = lane & 3;
    const uint2* in = reinterpret_cast<const uint2*>(row) + 4 * g + tg;
    unsigned* res = reinterpret_cast<unsigned*>(row) + 16 * tg + g;  // pairs of T
    // CHAINS blocks at a time: their MMA chains are independent, so each hides the others'
    // latency (benchmarks/NOTES.md, "fwd_mma's chains").
    constexpr int CHAINS = KS <= 3 ? 4 : 2;
    static_assert(MMA_SPAN_STEP % (128 * CHAINS) == 0, "tiles hold whole groups of chains");
    bool nonfinite = false;
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
                MmaOp<T>::run(acc[j], rw.hi[ks], bw.x, bw.y);
                if constexpr (SPLIT) MmaOp<T>::run(acc[j], rw.lo[ks], bw.x, bw.y);
            }
        }
        // c0: (row g, column 2 tg), c1: (g, 2 tg + 1), c2: (g + 8, 2 tg), c3: (g + 8, 2 tg + 1):
        // outputs 32 tg + 2 g (c0, c2) and 32 tg + 16 + 2 g (c1, c3) of the block.
        #pragma unroll
        for (int j = 0; j < CHAINS; ++j) {
            // (a sum is not finite if one of its terms is not: one test for four outputs)
            nonfinite |= !isfinite((acc[j][0] + acc[j][1]) + (acc[j][2] + acc[j][3]));
            if (silu_act) {
                #pragma unroll
                for (int r = 0; r < 4; ++r) acc[j][r] = silu(acc[j][r]);
            }
            res[64 * j] = pack2<T>(acc[j][0], acc[j][2]);
            res[64 * j + 8] = pack2<T>(acc[j][1], acc[j][3]);
        }
    }
    return nonfinite;
}

// Recomputes, from its width taps alone (wpad, as load_row_weights left it; inputs from x),
// each of a row's first n_out outputs at `outputs` (output t0 + o at o) that is not finite;
// this lane takes every 32nd. Out of line: it is rarely called.
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

// The input at position pos of row (b, c) for a window slot: x, the initial states, or 0
// (before the states, past the row, past the last channel).
template <typename T, typename P>
__device__ __forceinline__ T window_input(const T* x, const void* initial_states, const P& p, int64 b, int64 c,
                                          int64 pos) {
    if (c >= p.dim || pos >= p.seqlen || pos < -(p.width - 1)) return T();
    return pos >= 0 ? x[b * p.x_batch_stride + c * p.x_c_stride + pos * p.x_l_stride]
                    : from_acc<T>(input_at<float>(x, initial_states, p, b, c, pos));
}

template <typename T, int KS, bool SPLIT>
__global__ void __launch_bounds__(32 * MMA_WARPS, mma_blocks_per_sm(KS, SPLIT))
    fwd_mma(FWD_ARRAYS, const __grid_constant__ FwdMmaParams p) {
    if (final_states_blocks(x, seq_idx, initial_states, final_states, p)) return;
    constexpr int D = Taps<KS>::D;  // inputs before a row's first output
    constexpr int VN = 8;           // elements per 16-byte vector
    const int64 batch = p.batch, dim = p.dim, seqlen = p.seqlen, span = p.span, row_len = p.row_len;
    const int silu_act = (int)p.silu_act;
    const bool channel_last = p.channel_last != 0, x_aligned = p.x_aligned != 0, out_aligned = p.out_aligned != 0;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* const rows = reinterpret_cast<T*>(smem_raw);  // the tile's rows, row_len elements each
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float* const wpad = reinterpret_cast<float*>(smem_raw + p.weights_at) + warp * Taps<KS>::SIZE;
    const int tile_rows = channel_last ? MMA_CL_ROWS : MMA_WARPS;
    const int64 groups = (dim + tile_rows - 1) / tile_rows, spans = (seqlen + span - 1) / span;
    const int64 n_tiles = batch * groups * spans;
    RowWeights<KS, SPLIT> rw;

    #pragma unroll 1
    for (int64 tile = blockIdx.x; tile < n_tiles; tile += p.main_blocks) {
        int64 bg, sp, b, grp;
        divmod(tile, spans, bg, sp);
        divmod(bg, groups, b, grp);
        const int64 t0 = sp * span, w0 = t0 - D, c0 = grp * tile_rows;
        const int n_out = (int)min(span, seqlen - t0);
        // Whole groups of chains; the window past the row is zeros.
        const int n_blocks = (n_out + MMA_SPAN_STEP - 1) / MMA_SPAN_STEP * (MMA_SPAN_STEP / 128);
        const int n_in = D + 128 * n_blocks;
        if (!channel_last) {
            const int64 c = c0 + warp;
            if (c >= dim) continue;
            T* const row = rows + warp * row_len;
            const T* xr = x + b * p.x_batch_stride + c * p.x_c_stride;
            if (x_aligned && w0 >= 0 && w0 + n_in <= seqlen) {
                #pragma unroll 4
                for (int v = lane; v < n_in / VN; v += 32) cp_async<16>(row + v * VN, xr + w0 + v * VN, 16);
            } else {
                #pragma unroll 1
                for (int v = lane; v < n_in / VN; v += 32) {
                    const int64 pos = w0 + (int64)v * VN;
                    if (x_aligned && pos >= 0 && pos < seqlen) {
                        cp_async<16>(row + v * VN, xr + pos, (int)min((int64)VN, seqlen - pos) * (int)sizeof(T));
                    } else {
                        #pragma unroll 1
                        for (int q = 0; q < VN; ++q) row[v * VN + q] = window_input(x, initial_states, p, b, c, pos + q);
                    }
                }
            }
            cp_async_commit();
            load_row_weights<T, KS, SPLIT>(rw, wpad, weight, bias, p, c);  // while the copy flies
            cp_async_wait<0>();
            __syncwarp();
            if (__any_sync(0xffffffffu, compute_row<T, KS, SPLIT>(row, n_blocks, rw, silu_act))) {
                __syncwarp();
                own_taps<T, KS>(row, n_out, wpad, rw.bias, x, initial_states, p, b, c, t0);
            }
            __syncwarp();
            T* const orow = out + b * p.out_batch_stride + c * p.out_c_stride;
            #pragma unroll 2
            for (int v = lane; v * VN < n_out; v += 32) {
                const int64 t = t0 + (int64)v * VN;
                const uint4 val = reinterpret_cast<const uint4*>(row)[v];
                if (out_aligned && t + VN <= seqlen) {
                    *reinterpret_cast<uint4*>(orow + t) = val;
                } else {
                    const T* e = reinterpret_cast<const T*>(&val);
                    #pragma unroll
                    for (int q = 0; q < VN; ++q)
                        if (t + q < seqlen) orow[(t + q) * p.out_l_stride] = e[q];
                }
            }
            __syncwarp();  // the row and wpad are free again
        } else {
            // Lane (i, h) of a warp moves the 8 channels 8 h .. 8 h + 7 of the tile at window
            // position i: two lanes a step of 16 channels (32 bytes). Row r of the tile is
            // channel c0 + r; p.row_len = 4 mod 8 keeps the transposing accesses free of
            // bank conflicts.
            const int i0 = warp * 16 + (lane >> 1), h = lane & 1;
            constexpr int STEP = MMA_WARPS * 16;
            // A step's 8 channels move as one vector where they lie in the row and the tile's
            // channels; element by element before the row (states) or where x is not aligned.
            const bool vectors = x_aligned && c0 + 8 * h + VN <= dim;
            const T* xb = x + b * p.x_batch_stride + c0 + 8 * h;
            #pragma unroll 1
            for (int i = i0; i < n_in; i += 4 * STEP) {  // four loads in flight, then their stores
                Vec<T> v[4];
                #pragma unroll
                for (int u = 0; u < 4; ++u) {
                    const int64 pos = w0 + i + u * STEP;
                    v[u].raw = make_uint4(0, 0, 0, 0);
                    if (vectors && pos >= 0 && pos < seqlen && i + u * STEP < n_in)
                        v[u].raw = __ldg(reinterpret_cast<const uint4*>(xb + pos * p.x_l_stride));
                }
                #pragma unroll
                for (int u = 0; u < 4; ++u) {
                    const int iu = i + u * STEP;
                    const int64 pos = w0 + iu;
                    if (iu >= n_in) break;
                    if (vectors && (pos >= 0 || pos < -(p.width - 1) || !initial_states)) {
                        #pragma unroll
                        for (int q = 0; q < VN; ++q) rows[(8 * h + q) * row_len + iu] = v[u].e[q];
                    } else {
                        #pragma unroll 1
                        for (int q = 0; q < VN; ++q)
                            rows[(8 * h + q) * row_len + iu] = window_input(x, initial_states, p, b, c0 + 8 * h + q, pos);
                    }
                }
            }
            __syncthreads();
            #pragma unroll 1
            for (int r = warp; r < MMA_CL_ROWS && c0 + r < dim; r += MMA_WARPS) {
                T* const row = rows + r * row_len;
                load_row_weights<T, KS, SPLIT>(rw, wpad, weight, bias, p, c0 + r);
                if (__any_sync(0xffffffffu, compute_row<T, KS, SPLIT>(row, n_blocks, rw, silu_act))) {
                    __syncwarp();
                    own_taps<T, KS>(row, n_out, wpad, rw.bias, x, initial_states, p, b, c0 + r, t0);
                }
                __syncwarp();  // wpad is free again
            }
            __syncthreads();
            T* const ob = out + b * p.out_batch_stride + (c0 + 8 * h) * p.out_c_stride;
            const bool whole_out = out_aligned && c0 + 8 * h + VN <= dim;
            #pragma unroll 2
            for (int i = i0; i < n_out; i += STEP) {
                Vec<T> v;
                #pragma unroll
                for (int q = 0; q < VN; ++q) v.e[q] = rows[(8 * h + q) * row_len + i];
                if (whole_out) {
                    *reinterpret_cast<uint4*>(ob + (t0 + i) * p.out_l_stride) = v.raw;
                } else {
                    #pragma unroll
                    for (int q = 0; q < VN; ++q)
                        if (c0 + 8 * h + q < dim) ob[q * p.out_c_stride + (t0 + i) * p.out_l_stride] = v.e[q];
                }
            }
            __syncthreads();  // the rows are free again
        }
    }
}
