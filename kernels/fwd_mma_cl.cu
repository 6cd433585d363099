// fwd_mma_cl.cu: the forward on tensor cores for channel-contiguous 16-bit x (fwd_mma's banded
// Toeplitz products), without time-contiguous rows.
//
//   fwd_mma_cl<T, KS>
//       widths K with K - 1 <= D = 16 (KS - 1), no seq_idx, weights of x's dtype.
//
// A row is cut into pieces of p.span steps; a unit is one piece of one batch row (unit U: row
// U / p.pieces, piece U % p.pieces), and eight consecutive units are the eight columns n of an
// m16n8k16 MMA. A block of W warps (MMA_CL_FEW_WARPS = 4; MMA_CL_WARPS = 8 from KS
// MMA_CL_MORE_WARPS) takes items (MMA_CL_GROUP = 32 channels, 8 units), channel group fastest,
// and walks its units' pieces together in steps of MMA_CL_STEP = 16 positions:
// out[t0 + o] = sum_m Tw[o][m] x[t0 - D + m] for the 16 outputs t0 + o of every column, KS MMAs
// of 16 inputs each (k-step s: positions t0 - D + 16 s ..), warp w computing channels CPW w ..
// CPW w + CPW - 1 of the 32 (CPW = 32 / W).
//
// Per step, the 16 positions of the 8 units and 32 channels (64 bytes a unit and position) come
// by cp.async into a staging buffer, are moved by the warp that copied them (positions w, w + W,
// ..) into the ring with one ldmatrix (8 units x 8 channels a matrix, a unit's 16 bytes a row)
// and one stmatrix.trans (a channel's 8 units a row), and the block computes from the ring:
// channel c's ring holds the last RB blocks of 16 positions, a position's 8 units in one 16-byte
// row, so one ldmatrix.trans gives each lane the B fragment of two k-steps directly (lane (g,
// tg): positions 2 tg, 2 tg + 1 of unit g). The outputs, packed by channel pairs into a 16-byte
// vector of 8 channels for each of a lane's four (position, unit) places, go back through the
// staging buffer just read and out in 64-byte runs by the threads that copied them in. In blocks
// of 4 warps a step has two block barriers (the ring holds the step's window; the outputs are in
// the buffer), two staging buffers (the next step's copy in flight) and RB = KS ring blocks. In
// blocks of 8, one (ONE): the outputs wait in their buffer until the next step's barrier, the
// copy two steps ahead is in flight (three buffers), and the ring has RB = KS + 1 blocks (the
// next step's moves fill one no warp still computing this step reads). Channels' rings lie 16 RB
// + 1 rows apart (8 neighbouring channels at one position meet 8 bank groups), the staging
// buffer's 16-byte pieces are swizzled, and the outputs' 8-byte halves are swapped at
// positions with bit 1 set (a warp's 8-byte output store then takes two shared-memory
// wavefronts, not four: benchmarks/NOTES.md, "fwd_mma_cl's shared memory under ncu").
//
// Every ring row is written (zeros before the states and past the row or the channels), since a
// zero weight times a stale NaN would not be zero; a non-finite input meets the band's zero
// weights all the same, so the outputs of a step that come out non-finite are computed again
// from their own taps. p.x_aligned / p.out_aligned: every step of x / out starts on a 16-byte
// boundary (else those pieces go element by element).
#include "fwd_common.cuh"
#include "mma_common.cuh"

// The outputs of v (channels c .., position pos of row b) that are not finite, computed again
// from their own taps. Out of line: it is rarely called.
template <typename T, typename P>
__device__ __noinline__ void own_taps_cl(Vec<T>& v, const T* x, const void* weight, const void* bias,
                                         const void* initial_states, const P& p, int64 b, int64 c, int64 pos) {
    for (int e = 0; e < Vec<T>::V && c + e < p.dim; ++e)
        if (!isfinite(to_acc(v.e[e]))) v.e[e] = from_acc<T>(own_output(x, weight, bias, initial_states, p, b, c + e, pos));
}

// From KS MMA_CL_MORE_WARPS: MMA_CL_WARPS warps a block and one block barrier a step (else
// MMA_CL_FEW_WARPS and two; the plan's mma_cl_one_barrier, mma_cl_block_warps).
__host__ __device__ constexpr bool fwd_mma_cl_one_barrier(int ks) { return ks >= MMA_CL_MORE_WARPS; }
__host__ __device__ constexpr int fwd_mma_cl_warps(int ks) { return fwd_mma_cl_one_barrier(ks) ? MMA_CL_WARPS : MMA_CL_FEW_WARPS; }

// Register budgets, 4 warps a block: at KS 2 and 3 that of 4 blocks an SM (128 registers; KS 2
// takes 110, no spills; the plan's one-round pieces run about 2.4 blocks an SM, and the budget of
// 6, 80 registers, spilled in the copy loop: 3-7 % slower; KS 3 at 96 spills and runs slower), at
// KS 4 that of 3, the blocks the shared memory holds there (benchmarks/NOTES.md, "fwd_mma_cl's
// register budget at KS 2", "fwd_mma_cl", "bwd_mma_time's chunks staged by cp.async"). 8 warps a
// block: that of 2 blocks (128 registers, no spills; 80, for 3 blocks, spill in the step loop at
// KS 5), the blocks the shared memory holds from KS 5.
__host__ __device__ constexpr int fwd_mma_cl_blocks(int ks) {
    return fwd_mma_cl_one_barrier(ks) ? 2 : ks <= 3 ? 4 : 3;
}

template <typename T, int KS>
__global__ void __launch_bounds__(32 * fwd_mma_cl_warps(KS), fwd_mma_cl_blocks(KS)) fwd_mma_cl(FWD_ARRAYS, const __grid_constant__ FwdMmaClParams p) {
    if (final_states_blocks(x, seq_idx, initial_states, final_states, p)) return;
    constexpr int W = fwd_mma_cl_warps(KS), CH = MMA_CL_GROUP, CPW = CH / W;  // warps; channels a block, a warp
    constexpr int RP = MMA_CL_STEP / W;  // positions of a step each thread copies in, moves and out
    static_assert(CH == 32 && (W == 4 || W == 8) && MMA_CL_STEP == 16, "4 or 8 warps of 8 or 4 channels, steps of one k-step");
    using Sizes = ToeplitzTaps<KS>;
    constexpr int D = Sizes::D, TAB = D + 32;  // (TAB: words of a channel's tap table)
    constexpr bool ONE = fwd_mma_cl_one_barrier(KS);
    constexpr int RB = KS + ONE, RING = 16 * RB, NBUF = 2 + ONE;  // ring blocks, rows a channel; staging buffers
    constexpr int BUF = MMA_CL_STEP * 8 * CH * 2;  // bytes of a staging buffer (16-bit x)
    constexpr int VN = 8;  // elements of a 16-byte piece
    const int64 batch = p.batch, dim = p.dim, seqlen = p.seqlen, span = p.span, pieces = p.pieces;
    const int width = (int)p.width;
    const int64 units = batch * pieces, groups = (dim + CH - 1) / CH;
    const int64 n_items = groups * ((units + 7) / 8);
    const bool x_aligned = p.x_aligned != 0, out_aligned = p.out_aligned != 0;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    uint4* const ring = reinterpret_cast<uint4*>(smem_raw);  // [CH][RING + 1] rows of 8 units
    unsigned char* const staging = smem_raw + CH * (RING + 1) * 16;  // NBUF buffers of 16 x 8 x 64 bytes
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tg = lane & 3;
    // This warp's CPW channels' taps as word pairs, tab[cl][j] = (P[j], P[j + 1]) with P[D + 16 -
    // width + k] = w[k] (the last tap at D + 15, zeros around them), then the CPW biases. A lane
    // reads words 15 + 2 tg - g + 16 s + {0, -8, 8}: 0 .. D + 29 of TAB, whatever the width.
    unsigned* const tab = reinterpret_cast<unsigned*>(smem_raw + p.taps_at) + warp * (CPW * TAB + CPW);
    float* const bias_s = reinterpret_cast<float*>(tab + CPW * TAB);

    // The 16-byte piece (position i of a step, unit u, channels 8 m ..) of a staging buffer: units
    // of odd positions swapped in pairs, pieces of a 64-byte row rotated by (u >> 1) & 3.
    auto piece = [&](int buf, int i, int u, int m) {
        return reinterpret_cast<uint4*>(staging + buf * BUF) + ((i * 8 + (u ^ (i & 1))) * 4 + (m ^ ((u >> 1) & 3)));
    };
    // This thread's unit and 16-byte piece of channels in the copies in and out: u, m.
    const int cu = lane >> 2, cm = lane & 3;
    // Ring row of channel ch for ring slot s (< RING): channels RING + 1 rows apart, so that the 8
    // channels a transposing store writes at one slot lie in 8 distinct bank groups.
    auto ring_row = [&](int ch, int s) { return ring + ch * (RING + 1) + s; };
    const int jb = 15 + 2 * tg - g;  // this lane's A words: tab[jb + 16 s + {0, -8, 8}]
    const int n_steps = KS - 1 + (int)(span / 16);

    #pragma unroll 1
    for (int64 item = blockIdx.x; item < n_items; item += p.main_blocks) {  // (blocks past: final states)
        int64 q, grp;
        divmod_fast(item, groups, p.group_divisor, q, grp);
        const int64 c0 = grp * CH;
        // This thread's unit: row b, positions start .. end - 1.
        const int64 U = q * 8 + cu;
        const bool unit_ok = U < units;
        int64 b = 0, jp = 0;
        divmod_fast(unit_ok ? U : 0, pieces, p.piece_divisor, b, jp);
        const int64 start = jp * span, end = unit_ok ? min(seqlen, start + span) : 0;
        const int64 cc = c0 + 8 * cm;  // this thread's channels cc .. cc + 7
        const bool whole_in = x_aligned && cc + VN <= dim, whole_out = out_aligned && cc + VN <= dim;
        const T* const xs = x + b * p.x_batch_stride + cc;
        T* const os = out + b * p.out_batch_stride + cc * p.out_c_stride;

        // The taps of channels c0 + CPW warp + cl: the table zeroed, then each weight (of x's
        // dtype, its bits as they are) written into the two words that hold it, P[E + k] = the
        // low half of word E + k and the high half of word E + k - 1 (E = D + 16 - width). Lane
        // (cl, k0) = (lane / LPC, lane % LPC) takes taps k0, k0 + LPC, ..: all its loads in flight.
        __syncwarp();  // the previous item's readers are done
        const int64 cw = c0 + CPW * warp;
        #pragma unroll
        for (int i = lane; i < CPW * TAB / 4; i += 32) reinterpret_cast<uint4*>(tab)[i] = make_uint4(0, 0, 0, 0);
        {
            constexpr int LPC = 32 / CPW, PER_LANE = (D + 1 + LPC - 1) / LPC;  // lanes a channel (width <= D + 1)
            const int cl = lane / LPC, k0 = lane % LPC;
            const bool live = cw + cl < dim;
            const unsigned short* const wrow =
                static_cast<const unsigned short*>(weight) + (live ? (cw + cl) * p.weight_c_stride : 0);
            unsigned short w[PER_LANE];
            #pragma unroll
            for (int r = 0; r < PER_LANE; ++r) {
                const int k = k0 + LPC * r;
                w[r] = live && k < width ? wrow[k * p.weight_width_stride] : 0;
            }
            __syncwarp();  // the table is zeroed
            unsigned short* const half = reinterpret_cast<unsigned short*>(tab + cl * TAB + D + 16 - width);
            #pragma unroll
            for (int r = 0; r < PER_LANE; ++r) {
                const int k = k0 + LPC * r;
                if (k < width) half[2 * k] = half[2 * k - 1] = w[r];
            }
        }
        if (lane < CPW) bias_s[lane] = bias && cw + lane < dim ? load_as<float>(bias, (int)p.bias_dtype, (cw + lane) * p.bias_stride) : 0.f;
        __syncwarp();

        // Step a copies positions (a - KS + 1) 16 + i of each piece (the first KS - 1 steps: the D
        // before it); this thread copies i = warp + W r, pieces PSTEP apart. Steps whose RP
        // positions lie inside the unit's span (or the D before it) and the row go unchecked.
        constexpr int PSTEP = 32 * W;  // 16-byte pieces from a thread's position to its next
        const bool fast_in = whole_in && unit_ok;
        const T* xa = xs + (start - D + warp) * p.x_l_stride;  // this thread's first position of the next step
        const int64 x_step = W * p.x_l_stride;
        // (positions relative to start in int: the piece's length, and where x begins, -D at most)
        const int len = (int)(end - start), lo = start >= D ? -D : (int)-start;
        auto copy_in = [&](int a) {
            uint4* const dst = piece(a % NBUF, warp, cu, cm);
            const int rel = (a - KS + 1) * 16 + warp;
            const int64 t0 = start + rel;
            if (fast_in && rel >= lo && rel + (16 - W) < len) {
                #pragma unroll
                for (int r = 0; r < RP; ++r) cp_async<16, 128>(dst + PSTEP * r, xa + r * x_step, 16);
            } else {
                #pragma unroll 1
                for (int r = 0; r < RP; ++r) {
                    const int64 pos = t0 + W * r;
                    const bool live = pos < end || (pos < seqlen && pos < start);  // (the D before a piece)
                    if (fast_in && pos >= 0) {
                        cp_async<16, 128>(dst + PSTEP * r, live ? xa + r * x_step : x, live ? 16 : 0);
                    } else if (!unit_ok || !live || pos < -(width - 1) || cc >= dim || (pos < 0 && !initial_states)) {
                        cp_async<16, 128>(dst + PSTEP * r, x, 0);
                    } else {
                        Vec<T> v;
                        #pragma unroll 1
                        for (int e = 0; e < VN; ++e) v.e[e] = window_input(x, initial_states, p, b, cc + e, pos);
                        dst[PSTEP * r] = v.raw;
                    }
                }
            }
            xa += RP * x_step;
            cp_async_commit();
        };

        T* oa = os + (start + warp) * p.out_l_stride;  // this thread's first output of the next step
        const int64 o_step = W * p.out_l_stride;
        // This thread's pieces of step a's outputs out of buffer buf: positions i = warp + W r of
        // its unit and channels (bit 1 of those positions is warp's, and where it is set the
        // halves come swapped).
        auto copy_out = [&](int a, int buf, bool redo) {
            const uint4* const from = piece(buf, warp, cu, cm);
            auto output = [&](int r) {
                const uint4 v = from[PSTEP * r];
                return warp & 2 ? make_uint4(v.z, v.w, v.x, v.y) : v;
            };
            const int rel = (a - KS + 1) * 16 + warp;
            const int64 t0 = start + rel;
            if (!redo && whole_out && rel + (16 - W) < len) {
                #pragma unroll
                for (int r = 0; r < RP; ++r) *reinterpret_cast<uint4*>(oa + r * o_step) = output(r);
            } else {
                #pragma unroll 1
                for (int r = 0; r < RP; ++r) {
                    const int64 pos = t0 + W * r;
                    if (pos >= end || cc >= dim) continue;
                    Vec<T> v;
                    v.raw = output(r);
                    if (redo) own_taps_cl(v, x, weight, bias, initial_states, p, b, cc, pos);
                    T* const o = oa + r * o_step;
                    if (whole_out) {
                        *reinterpret_cast<uint4*>(o) = v.raw;
                    } else {
                        #pragma unroll 1
                        for (int e = 0; e < VN && cc + e < dim; ++e) o[e * p.out_c_stride] = v.e[e];
                    }
                }
            }
            oa += RP * o_step;
        };

        // ONE: step a's outputs wait in their buffer until step a + 1's barrier (all warps' outputs
        // written, and its OR says whether one was not finite), and the copy two steps ahead goes
        // into the buffer just copied out. Else the next step's copy goes out at the step's start
        // into the buffer whose outputs went out at the end of the step before.
        copy_in(0);
        if (ONE && 1 < n_steps) copy_in(1);
        // Ring block blk_in takes the step's positions; k-step s of the outputs reads block blk_in
        // + 1 + ONE + s (mod RB), the oldest first.
        int blk_in = 0, buf = 0, out_buf = -1;  // (out_buf: ONE's buffer of outputs to copy out)
        float last = 0.f;  // (ONE) the sum of the last computed step's pre-activations
        #pragma unroll 1
        for (int a = 0; a < n_steps; ++a, blk_in = blk_in + 1 == RB ? 0 : blk_in + 1, buf = buf + 1 == NBUF ? 0 : buf + 1) {
            if (!ONE && a + 1 < n_steps) copy_in(a + 1);
            if (a + 1 < n_steps) cp_async_wait<1>();
            else cp_async_wait<0>();
            __syncwarp();  // the pieces the other lanes copied have landed
            // This warp's positions i = warp + W r into ring block blk_in: matrix m (lanes 8 m + j
            // address its rows) = units j, channels 8 m ..; stored transposed, row j = channel 8 m
            // + j.
            {
                const int m = lane >> 3, j = lane & 7;
                uint4* const to = ring_row(8 * m + j, blk_in * 16 + warp);
                #pragma unroll
                for (int r = 0; r < RP; ++r) {
                    unsigned w[4];
                    ldmatrix_x4(w, piece(buf, warp + W * r, j, m));
                    stmatrix_x4_trans(w, to + W * r);
                }
            }
            if constexpr (ONE) {  // the ring holds the step's window; the last step's outputs are in their buffer
                const bool redo = __syncthreads_or(!isfinite(last));
                if (out_buf >= 0) copy_out(a - 1, out_buf, redo);
                out_buf = -1;
                if (a + 2 < n_steps) copy_in(a + 2);  // (into the buffer just copied out)
            } else {
                __syncthreads();  // the ring holds the step's window
            }
            if (a < KS - 1) continue;

            // The 16 outputs of each column at positions (a - KS + 1) 16 .. of its piece. The B
            // fragments of k-steps s, s + 1 come from one ldmatrix_x4_trans: lane 8 mq + j addresses
            // position 8 (mq & 1) + j of block blk_in + 1 + ONE + s + (mq >> 1), in channel CPW warp + cl at
            // bfrom[s / 2] + cl (RING + 1).
            unsigned bfrom[(KS + 1) / 2];
            {
                const int mq = lane >> 3, j = lane & 7;
                #pragma unroll
                for (int s = 0; s < KS; s += 2) {
                    int blk = blk_in + 1 + ONE + s + (mq >> 1);
                    blk = blk >= RB ? blk - RB : blk;
                    blk = blk >= RB ? blk - RB : blk;
                    bfrom[s / 2] = smem_address(ring_row(CPW * warp, blk * 16 + 8 * (mq & 1) + j));
                }
            }
            // Returns the sum of the step's pre-activations (not finite if one of them is not).
            auto compute = [&](auto silu_flag) {
                constexpr bool SILU = decltype(silu_flag)::value;
                float sums = 0.f;
                #pragma unroll 1
                for (int half = 0; half < CPW / 4; ++half) {  // channel pairs 2 half, 2 half + 1 (a loop: fewer registers)
                    unsigned packed[4][2];  // [place r][pair p2]: (position g + 8 (r >> 1), unit 2 tg + (r & 1))
                    #pragma unroll
                    for (int p2 = 0; p2 < 2; ++p2) {
                        const int pr = 2 * half + p2;
                        float acc[2][4];
                        #pragma unroll
                        for (int h = 0; h < 2; ++h) {
                            const int cl = 2 * pr + h;
                            unsigned bf[KS + 1][2];  // (B fragments of k-steps s: bf[s][0], bf[s][1])
                            #pragma unroll
                            for (int s = 0; s < KS; s += 2) {
                                const unsigned row = bfrom[s / 2] + cl * (RING + 1) * 16;
                                if (s + 1 < KS) {
                                    unsigned w[4];
                                    ldmatrix_x4_trans(w, row);
                                    bf[s][0] = w[0], bf[s][1] = w[1], bf[s + 1][0] = w[2], bf[s + 1][1] = w[3];
                                } else {
                                    unsigned w[2];
                                    ldmatrix_x2_trans(w, row);
                                    bf[s][0] = w[0], bf[s][1] = w[1];
                                }
                            }
                            const float bv = bias_s[cl];
                            #pragma unroll
                            for (int r = 0; r < 4; ++r) acc[h][r] = bv;
                            const unsigned* const tw = tab + cl * TAB + jb;
                            #pragma unroll
                            for (int s = 0; s < KS; ++s) {
                                const unsigned a0 = tw[16 * s], a1 = tw[16 * s - 8], a2 = tw[16 * s + 8];
                                const unsigned af[4] = {a0, a1, a2, a0};
                                MmaOp<T>::run(acc[h], af, bf[s][0], bf[s][1]);
                            }
                        }
                        #pragma unroll
                        for (int r = 0; r < 4; ++r) {
                            sums += acc[0][r] + acc[1][r];
                            if constexpr (SILU) {
                                acc[0][r] = silu_out<T>(acc[0][r]);
                                acc[1][r] = silu_out<T>(acc[1][r]);
                            }
                            packed[r][p2] = pack2<T>(acc[0][r], acc[1][r]);
                        }
                    }
                    // Channels 4 q .. 4 q + 3 of the block (q = CPW / 4 warp + half): 8-byte half q & 1
                    // of 16-byte piece q / 2, spelled out for each CPW so that the piece stays out of
                    // the loop (halves swapped where bit 1 of the position is set: two lanes a bank,
                    // not four)
                    const int qm = CPW == 8 ? warp : warp >> 1, qh = (CPW == 8 ? half : warp & 1) ^ ((g >> 1) & 1);
                    #pragma unroll
                    for (int r = 0; r < 4; ++r)
                        reinterpret_cast<uint2*>(piece(buf, g + 8 * (r >> 1), 2 * tg + (r & 1), qm))[qh] =
                            make_uint2(packed[r][0], packed[r][1]);
                }
                return sums;
            };
            const float sums = p.silu_act ? compute(Flag<true>()) : compute(Flag<false>());
            if constexpr (ONE) {
                last = sums;
                out_buf = buf;
            } else {
                copy_out(a, buf, __syncthreads_or(!isfinite(sums)));  // (the outputs are in the buffer)
            }
        }
        if constexpr (ONE) {
            const bool redo = __syncthreads_or(!isfinite(last));  // the last step's outputs are in their buffer
            if (out_buf >= 0) copy_out(n_steps - 1, out_buf, redo);
        }
    }
}
