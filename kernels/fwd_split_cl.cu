// fwd_split_cl.cu: the forward on tensor cores for channel-contiguous float32 x, x and the taps
// split into bfloat16 high and low parts (three products a k-step: high high, high low, low
// high; 2^-17 relative, fwd_mma's float32 split), without transposes.
//
//   fwd_split_cl<float, KS>
//       widths K with K - 1 <= 16 (KS - 1), float32 x, no seq_idx, initial states of x's dtype.
//
// The block's shared memory (the plan's split_cl_shared_memory): the tap tables (p.tap_row words a
// channel), then the two staging buffers (from p.stage_at). A block of SPLIT_CL_WARPS warps takes
// items: SPLIT_CL_CHANNELS = 16 channels (one 64-byte run a position) of one piece of p.span
// positions of one batch row (channel group fastest, then piece, then row), and walks it in steps
// of TT = SPLIT_CL_STEP outputs. Step i's window, the 16 (KS - 1) positions before its TT outputs
// and those, comes by 4-byte cp.async (16 lanes a position's 64 bytes) into staging buffer i % 2
// while step i - 1 is computed and its outputs go out: position i, channel q at (i / 16)
// SPLIT_CL_STAGE_BLOCK + 18 q + i % 16, so that both the copies' writes and the MMAs' 8-byte reads
// meet 32 banks. Warp w computes channels CPW w .. CPW w + CPW - 1. It first splits its channels'
// words of the window in place (within a channel's 16 positions of a block: word 2 t the high parts
// of positions 2 t and 2 t + 1, word 2 t + 1 those of 2 t + 8 and 2 t + 9, words 2 t + 8 and 2 t +
// 9 their low parts), so that a lane's B registers for an m16n8k16 MMA (column n: the block of 16
// positions 8 nt + n + s of the step, rows 2 tg, 2 tg + 1, 2 tg + 8, 2 tg + 9) are one 8-byte load
// of high parts and one of low parts. A, the channel's Toeplitz band for k-step s, comes from
// tables of the taps' high and low parts in pairs (tap j, j + 1). An MMA's 8 columns are 8 blocks
// of 16 outputs; the three products' sums run apart (three chains) and meet in the output stage,
// which adds the bias, applies SiLU and writes each output into its channel's own word of the
// window at its position (output p at window position 16 (KS - 1) + p: no output tile, so that more
// blocks fit an SM); after the step's second barrier each thread stores the words it copied in.
//
// Every window word is written (zeros before the states, past the row or the channels), since a
// zero weight times a stale NaN would not be zero; a non-finite input meets the band's zero
// weights all the same, so the outputs of a step that come out non-finite are computed again
// from their own taps.
#include "fwd_common.cuh"
#include "mma_common.cuh"

// own_output out of line, for the outputs the MMAs gave as non-finite: it is rarely called.
template <typename P>
__device__ __noinline__ float own_taps_split(const float* x, const void* weight, const void* bias,
                                             const void* initial_states, const P& p, int64 b, int64 c,
                                             int64 pos) {
    return own_output(x, weight, bias, initial_states, p, b, c, pos);
}

template <typename T, int KS>
__global__ void __launch_bounds__(32 * SPLIT_CL_WARPS, SPLIT_CL_BLOCKS) fwd_split_cl(FWD_ARRAYS, const __grid_constant__ FwdSplitClParams p) {
    if (final_states_blocks(x, seq_idx, initial_states, final_states, p)) return;
    constexpr int W = SPLIT_CL_WARPS, CH = SPLIT_CL_CHANNELS, CPW = CH / W, THREADS = 32 * W, TT = SPLIT_CL_STEP;
    constexpr int KB = KS - 1, NT = TT / 128, NBLK = KB + TT / 16;  // window blocks of 16 positions
    constexpr int E0 = 32, STAGE = NBLK * SPLIT_CL_STAGE_BLOCK;  // (E0: a table's first tap pair)
    constexpr int ROWS = THREADS / 16, ITERS = (16 * NBLK + ROWS - 1) / ROWS;  // copy: positions an iteration
    static_assert(same_type<T, float> && CH == 16 && CH % W == 0 && TT % 128 == 0 && (ROWS & (ROWS - 1)) == 0 && TT % ROWS == 0, "tiles");
    const int64 batch = p.batch, dim = p.dim, seqlen = p.seqlen, span = p.span;
    const int width = (int)p.width, off = 16 * KB - (width - 1), tw = (int)p.tap_row;
    const int64 groups = (dim + CH - 1) / CH, pieces = (seqlen + span - 1) / span;
    const int64 n_items = batch * groups * pieces;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    unsigned* const th = reinterpret_cast<unsigned*>(smem_raw);  // [CH][tw] the taps' high parts
    unsigned* const tl = th + CH * tw;                          // low parts
    float* const stage = reinterpret_cast<float*>(smem_raw + p.stage_at);  // [2][STAGE]
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, tg = lane & 3;
    // Copies and stores: this thread's channel and first position (ROWS positions apart).
    const int q = tid & 15, p0 = (tid >> 4) & (ROWS - 1);
    const float* const states = static_cast<const float*>(initial_states);
    // Whether a warp met a non-finite sum, by step parity (set in the step's compute, read after
    // its second barrier, cleared by thread 0 a step ahead).
    __shared__ int redo[2];
    int par = 0;
    if (tid == 0) redo[0] = redo[1] = 0;

    #pragma unroll 1
    for (int64 item = blockIdx.x; item < n_items; item += p.main_blocks) {
        const int64 c0 = item % groups * CH, b = item / groups / pieces;
        const int64 t_begin = item / groups % pieces * span, t_end = min(seqlen, t_begin + span);
        const int n_steps = (int)((t_end - t_begin + TT - 1) / TT);
        // (The previous item's tables were last read before its last step's second barrier.)
        for (int e = tid; e < CH * tw; e += THREADS) {  // table entry E0 + i: taps i - off, i - off + 1
            const int64 c = c0 + e / tw;
            const int j = e % tw - E0 - off;
            float v[2];
            #pragma unroll
            for (int h = 0; h < 2; ++h)
                v[h] = c < dim && j + h >= 0 && j + h < width
                           ? load_as<float>(weight, (int)p.weight_dtype, c * p.weight_c_stride + (j + h) * p.weight_width_stride)
                           : 0.f;
            split_pair(v[0], v[1], th[e], tl[e]);
        }
        float biases[CPW];  // this warp's channels' biases, for the item's steps
        #pragma unroll
        for (int ci = 0; ci < CPW; ++ci) {
            const int64 c = c0 + warp * CPW + ci;
            biases[ci] = bias && c < dim ? load_as<float>(bias, (int)p.bias_dtype, c * p.bias_stride) : 0.f;
        }
        const bool q_live = c0 + q < dim;
        const float* const xq = x + b * p.x_batch_stride + c0 + q;
        const int64 rows_stride = ROWS * p.x_l_stride;
        // Step i's window into buffer i % 2; windows inside the row go unchecked.
        auto copy = [&](int step) {
            float* const st = stage + (step & 1) * STAGE + 18 * q;
            const int64 ws = t_begin + (int64)step * TT - 16 * KB;
            auto at = [&](int k) {
                const int i = p0 + ROWS * k;
                return st + (i >> 4) * SPLIT_CL_STAGE_BLOCK + (i & 15);
            };
            constexpr bool EVEN = ITERS * ROWS == 16 * NBLK;
            if (q_live && ws >= 0 && ws + 16 * NBLK <= seqlen) {
                const float* src = xq + (ws + p0) * p.x_l_stride;
                #pragma unroll
                for (int k = 0; k < ITERS; ++k, src += rows_stride)
                    if (EVEN || p0 + ROWS * k < 16 * NBLK) cp_async<4, 128>(at(k), src, 4);
            } else {
                #pragma unroll
                for (int k = 0; k < ITERS; ++k) {
                    const int64 t = ws + p0 + ROWS * k;
                    const bool in_x = q_live && t >= 0 && t < seqlen;
                    const bool in_states = q_live && t < 0 && t >= -(width - 1) && states;
                    const float* src = x;  // (a zero-byte copy: the word becomes 0)
                    if (in_x) src = xq + t * p.x_l_stride;
                    else if (in_states)
                        src = states + b * p.init_batch_stride + (c0 + q) * p.init_c_stride + (width - 1 + t) * p.init_l_stride;
                    if (EVEN || p0 + ROWS * k < 16 * NBLK) cp_async<4, 128>(at(k), src, in_x || in_states ? 4 : 0);
                }
            }
            cp_async_commit();
        };
        __syncthreads();  // the previous item's last outputs are out of its buffers
        copy(0);
        #pragma unroll 1
        for (int step = 0; step < n_steps; ++step) {
            cp_async_wait<0>();
            __syncthreads();  // the window is in; the previous step's outputs are out of the other buffer
            if (step + 1 < n_steps) copy(step + 1);
            float* const st = stage + (step & 1) * STAGE;
            // This warp's channels' words split in place (lanes: t, then blocks, then channels).
            #pragma unroll
            for (int i = 0; i < (CPW * NBLK * 4 + 31) / 32; ++i) {
                const int e = lane + 32 * i, t = e & 3, blk = (e >> 2) % NBLK;
                const int c = warp * CPW + (e >> 2) / NBLK;
                if (e < CPW * NBLK * 4) {
                    float* const wp = st + blk * SPLIT_CL_STAGE_BLOCK + 18 * c + 2 * t;
                    const float2 a = *reinterpret_cast<const float2*>(wp), z = *reinterpret_cast<const float2*>(wp + 8);
                    unsigned h0, l0, h1, l1;
                    split_pair(a.x, a.y, h0, l0);
                    split_pair(z.x, z.y, h1, l1);
                    *reinterpret_cast<uint2*>(wp) = make_uint2(h0, h1);
                    *reinterpret_cast<uint2*>(wp + 8) = make_uint2(l0, l1);
                }
            }
            __syncwarp();
            const int64 t0 = t_begin + (int64)step * TT;
            #pragma unroll 1
            for (int ci = 0; ci < CPW; ++ci) {
                const int c = warp * CPW + ci;
                float acc[NT][3][4] = {};
                #pragma unroll
                for (int s = 0; s < KS; ++s) {
                    // A (rows g, g + 8; columns 2 tg, 2 tg + 1 and + 8): the pairs at j, j - 8, j + 8, j.
                    const int j = c * tw + E0 + 16 * s + 2 * tg - g;
                    const unsigned ah[4] = {th[j], th[j - 8], th[j + 8], th[j]};
                    const unsigned al[4] = {tl[j], tl[j - 8], tl[j + 8], tl[j]};
                    #pragma unroll
                    for (int nt = 0; nt < NT; ++nt) {
                        const float* const src = st + (8 * nt + g + s) * SPLIT_CL_STAGE_BLOCK + 18 * c + 2 * tg;
                        const uint2 bh = *reinterpret_cast<const uint2*>(src), bl = *reinterpret_cast<const uint2*>(src + 8);
                        mma_bf16(acc[nt][0], ah, bh.x, bh.y);
                        mma_bf16(acc[nt][1], ah, bl.x, bl.y);
                        mma_bf16(acc[nt][2], al, bh.x, bh.y);
                    }
                }
                // Lane (g, tg)'s outputs: positions 128 nt + 16 (2 tg + (r & 1)) + g + 8 (r >> 1),
                // into the channel's words of the window's blocks KB + 8 nt + 2 tg + (r & 1), once
                // every lane's B loads of them are done.
                __syncwarp();
                float bv = biases[0];  // (biases[ci] without a dynamic index: the loop is not unrolled)
                #pragma unroll
                for (int k = 1; k < CPW; ++k) bv = ci == k ? biases[k] : bv;
                bool bad = false;
                #pragma unroll
                for (int nt = 0; nt < NT; ++nt)
                    #pragma unroll
                    for (int r = 0; r < 4; ++r) {
                        const int pos = 128 * nt + 16 * (2 * tg + (r & 1)) + g + 8 * (r >> 1);
                        const float v = acc[nt][0][r] + acc[nt][1][r] + acc[nt][2][r] + bv;
                        bad |= !isfinite(v);
                        st[(KB + (pos >> 4)) * SPLIT_CL_STAGE_BLOCK + 18 * c + (pos & 15)] = p.silu_act ? silu(v) : v;
                    }
                if (__any_sync(0xffffffffu, bad) && lane == 0) redo[par] = 1;
            }
            __syncthreads();  // the step's outputs are in the window
            // Out: each thread keeps its channel q and steps ROWS positions at a time. In a step
            // with non-finite sums, those outputs are computed again from their own taps (an
            // output is non-finite exactly where its sum was: SiLU keeps finite sums finite).
            const bool again = redo[par];
            if (q_live) {
                const int64 stride = ROWS * p.out_l_stride;
                float* const dst = out + b * p.out_batch_stride + (c0 + q) * p.out_c_stride + (t0 + p0) * p.out_l_stride;
                const float* const word = st + KB * SPLIT_CL_STAGE_BLOCK + 18 * q;
                auto value = [&](int pos) { return word[(pos >> 4) * SPLIT_CL_STAGE_BLOCK + (pos & 15)]; };
                if (t0 + TT <= t_end && !again) {
                    #pragma unroll
                    for (int k = 0; k < TT / ROWS; ++k) dst[k * stride] = value(p0 + ROWS * k);
                } else {
                    #pragma unroll 1
                    for (int k = 0; k < TT / ROWS && t0 + p0 + ROWS * k < t_end; ++k) {
                        float v = value(p0 + ROWS * k);
                        if (!isfinite(v)) v = own_taps_split(x, weight, bias, initial_states, p, b, c0 + q, t0 + p0 + ROWS * k);
                        dst[k * stride] = v;
                    }
                }
            }
            if (tid == 0) redo[par ^ 1] = 0;  // (last read before this step's first barrier)
            par ^= 1;
        }
    }
}
