// bwd_mma_cl.cu: the backward on tensor cores for channel-contiguous bfloat16 x, in fwd_mma_cl's
// frame (a block's 32 channels walk a piece of a row in steps of 128 positions).
//
//   bwd_mma_cl<T, KS>
//       T = bfloat16 x and weights, no seq_idx; widths K with K - 1 <= D = 16 (KS - 1) and K <=
//       128 LF (LF = 1 up to KS 9, else 2: the plan takes KS 10 for width 129); x, dout and dx
//       channel-contiguous in 16-byte aligned runs of 8 channels (dim a multiple of 8).
//
// An item is 32 channels of a unit (one piece of p.span positions of a batch row), channel group
// fastest; a block of BWD_CL_WARPS = 4 warps, warp w computing channels 8 w .. 8 w + 7, walks its
// unit in steps of 128 positions (t0 = 0, 128, .. from the unit's start) after WARM = LF steps
// that bring the 128 LF positions before it (zeros before the D positions that z reads). A step:
//  1. x of the step's positions comes by cp.async into one of two staging buffers (warp w copying
//     positions 32 w .. 32 w + 31) and moves, by the warp that copied it, into each channel's x
//     ring (time order, as fwd_mma_cl's) and odd ring (the same one position later: xo[t] =
//     x[t - 1], from the moved fragments by one shuffle; each channel's warp then fills in the
//     first of each warp's 32 positions), so that every pair (x[t], x[t + 1]) is one aligned word
//     of one of the two. dout comes by cp.async into one buffer, each warp copying its own 8
//     channels for the next step as soon as it has read this step's.
//  2. z at the step's positions as fwd_mma_cl computes its outputs (8 blocks of 16 positions the
//     MMA's columns); dz = dout silu'(z) in the C fragments (dbias summed from it), split into a
//     high and a low bfloat16 half (hi + lo = dz to 2^-17 relative) and stored into two dz rings
//     of the x ring's form by one stmatrix.trans (a fragment's 8 columns are 8 ring rows).
//  3. dx at positions t0 - D .. t0 - D + 127: the Toeplitz product of the reversed taps with the
//     dz window, both halves (the reversed taps' words are the forward table's, read backwards
//     with their halves swapped), out through the step's x staging buffer.
//  4. dweight, for the x blocks n = t0 / 16 - 7 .. t0 / 16 and the lag fragments f < LF:
//     C_f[r][q] += sum_k x[16 (n - 8 f) + k - r] dz[16 (n + q) + k], one m16n8k16 MMA a half of
//     dz: element (r, q) has the lag 128 f + 16 q + r (the tap K - 1 - lag), in place, with no
//     diagonals to add up. A is the Toeplitz matrix of x (its words from the two x rings), B the
//     dz blocks n .. n + 7 (one ldmatrix gives both halves), the blocks outside the unit zero
//     (their rows read from 16 zero bytes past the dz ring's slots, which no store reaches): over
//     the unit's steps each of its dz positions meets every lag once. The C_f stay in registers
//     over the item and are written as the item's part (bwd_reduce adds the parts).
// The unit's last steps compute z and dz past its end (the next piece's first D, which the unit's
// dx needs) and the dweight products of its last blocks.
//
// From BWD_CL_DX_FROM k-steps on (one block an SM, so that four warps would leave each scheduler
// one), the block has four more warps, w + 4 computing step 3 for warp w's channels (its tap
// table, its dz rings) while warp w computes step 4, and step 2 split between them (warp w z and
// dz of its first four channels, w + 4 of the last four). The moves end at a barrier of all,
// after which the first warps copy in the next step's x; a barrier of all follows step 2, after
// which they copy in the next step's dout; the first warps' own barrier (1) ends their step (the
// next moves overwrite the x dweight read), the dx warps' own (2) precedes their stores. At an
// item's end each dx warp hands its channels' dbias sums and whether its sums were finite to its
// first warp through the dout buffer.
// The MMAs of z (even and odd k-steps), of dx (dz's halves, up to LF 1) and of dweight (two
// channels at a time, up to LF 1) are kept in two independent chains each.
//
// Bank conflicts: the rings and the x staging buffer are laid out as fwd_mma_cl's (its copies,
// moves and B loads); dout is read and dx written as a whole 16-byte slot a lane and place (the
// staging buffer's rotation keeps each quarter warp's 8 slots in 8 bank groups); the A words of
// dweight are each read by the lanes of one channel, a few words apart (broadcasts). In a unit's
// first and last steps dweight's B rows of blocks outside the unit (the zero bytes) may share a
// bank group with one of their matrix's rows inside it: two ways there.
//
// Non-finite values: an MMA multiplies every input of its window by every row of A, zeros
// included, so a non-finite x, weight, bias or dout makes the sum of z and dz over the item
// non-finite (every x position the dweight products read is zero or inside some z window); a warp
// whose sum is not finite computes its channels' dx, dweight and dbias terms of the item again
// from their own taps (exact_channel_cl).
#include "bwd_common.cuh"
#include "mma_common.cuh"

// From BWD_CL_DX_FROM k-steps on, a block has BWD_CL_WARPS more warps that compute dx (one
// block an SM: the shared memory holds two up to KS 9, one beyond).
__host__ __device__ constexpr bool bwd_cl_dx_warps(int ks) { return ks >= BWD_CL_DX_FROM; }
__host__ __device__ constexpr int bwd_cl_threads(int ks) { return 32 * BWD_CL_WARPS * (bwd_cl_dx_warps(ks) ? 2 : 1); }
__host__ __device__ constexpr int bwd_cl_blocks(int ks) { return ks <= 9 && !bwd_cl_dx_warps(ks) ? 2 : 1; }

// The item's terms of channel c from their own taps (dz_at), for a warp whose sums were not
// finite: dx at positions start .. end - 1 of row b, and its dweight and dbias sums over the dz
// there, written as part `part`. Out of line: finite inputs never call it.
template <typename P>
__device__ __noinline__ void exact_channel_cl(const __nv_bfloat16* x, const void* weight, const void* bias,
                                              const void* initial_states, const __nv_bfloat16* dout,
                                              __nv_bfloat16* dx, float* partials, void* dweight, void* dbias,
                                              const P& p, int64 part, int64 b, int64 c, int64 start, int64 end) {
    const int lane = threadIdx.x & 31, width = (int)p.width;
    auto dz = [&](int64 t) { return dz_at<float>(x, weight, bias, nullptr, initial_states, dout, p, b, c, t); };
    exact_dx(x, weight, bias, initial_states, dout, dx, p, b, c, start, 0, (int)(end - start));
    for (int k = lane; k <= width; k += 32) {  // (k = width: dbias)
        float a = 0.f;
        for (int64 t = start; t < end; ++t)
            a += dz(t) * (k < width ? input_at<float>(x, initial_states, p, b, c, t - (width - 1) + k) : 1.f);
        write_sum(partials, dweight, dbias, p, part, c, k, a);
    }
}

template <typename T, int KS>
__global__ void __launch_bounds__(bwd_cl_threads(KS), bwd_cl_blocks(KS))
    bwd_mma_cl(BWD_ARRAYS, const __grid_constant__ BwdMmaClParams p) {
    wait_for_previous_kernel();
    static_assert(same_type<T, __nv_bfloat16>, "bwd_mma_cl takes bfloat16 x");
    static_assert(BWD_CL_WARPS == 4 && BWD_CL_STEP == 128, "4 warps of 8 channels, steps of 8 columns of 16");
    constexpr int STEP = BWD_CL_STEP, CH = 8 * BWD_CL_WARPS;  // positions a step, channels a block
    constexpr int D = 16 * (KS - 1), TAB = D + 32;  // (TAB: words of a channel's tap table)
    constexpr int LF = D <= 128 ? 1 : 2;  // dweight's lag fragments (128 lags each)
    constexpr int WARM = LF;  // steps before a unit's first (128 LF >= D positions)
    constexpr int PAIR = LF == 1 ? 2 : 1;  // channels dweight's products take at a time
    constexpr bool DXW = bwd_cl_dx_warps(KS);  // dx has warps of its own
    constexpr int RING = STEP * (WARM + 1), RB = 2 * RING + 16;  // positions a ring holds, bytes between rings
    constexpr int ROW = 2 * CH, BUF = STEP * ROW;  // bytes a staged position, a staging buffer
    constexpr int DRAIN = D > STEP - 1 ? D : STEP - 1;  // positions past a unit its steps reach
    const int64 batch = p.batch, dim = p.dim, seqlen = p.seqlen, span = p.span, pieces = p.pieces;
    const int width = (int)p.width;
    const int64 groups = (dim + CH - 1) / CH, n_items = groups * batch * pieces;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    // Rings [x, odd x, dz high, dz low][CH][RB]; two x staging buffers and the dout buffer (128
    // positions of the block's channels each); each warp's tap table and biases at p.taps_at.
    unsigned char* const rings = smem_raw;
    unsigned char* const xstage = smem_raw + 4 * CH * RB;
    unsigned char* const dstage = xstage + 2 * BUF;
    // warp: the block's warp, or with DXW its channel group (warps 4 .. 7 computing dx of warps
    // 0 .. 3's channels, dxw)
    const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) % BWD_CL_WARPS, g = lane >> 2, tg = lane & 3;
    const bool dxw = DXW && threadIdx.x >= 32 * BWD_CL_WARPS;
    // This warp's 8 channels' taps as word pairs, tab[cl][j] = (P[j], P[j + 1]) with P[D + 16 -
    // width + k] = w[k] (zeros around them), then the 8 biases; as fwd_mma_cl's. z's A words:
    // tab[jb + 16 s + {0, -8, 8}]; dx's (the reversed taps Q[15 + d] = w[K - 1 - d] = P[D + 30 -
    // 15 - d]): the same words at D + 29 - (jb + 16 s + {0, -8, 8}), halves swapped.
    unsigned* const tab = reinterpret_cast<unsigned*>(smem_raw + p.taps_at) + warp * (8 * TAB + 8);
    float* const bias_s = reinterpret_cast<float*>(tab + 8 * TAB);
    const int jb = 15 + 2 * tg - g;

    // The 16-byte slot s of position i of a staging buffer, rotated by bits 1-2 and 5-6 of i.
    auto turn = [](int i) { return ((i >> 1) & 3) ^ ((i >> 5) & 3); };
    auto xslot = [&](int buf, int i, int s) { return xstage + buf * BUF + i * ROW + 16 * (s ^ turn(i)); };
    auto dslot = [&](int i, int s) { return dstage + i * ROW + 16 * (s ^ turn(i)); };
    // The byte offset of ring slot s in a channel's ring (16-byte halves of 32 swapped where bit
    // 7 is set), and a slot taken back into the ring. Unit position t lies in slot t + 128 WARM
    // (mod RING); a step's positions t0 + rel in (sbase + rel) wrapped, sbase = (t0 + 128 WARM) %
    // RING.
    auto slot_bytes = [](int s) { return 2 * s ^ ((2 * s >> 3) & 16); };
    auto wrap = [](int s) { return s < 0 ? s + RING : s >= RING ? s - RING : s; };
    auto ring = [&](int which, int ch) { return rings + (which * CH + ch) * RB; };
    const int j8 = lane & 7, m4 = lane >> 3;  // the copies' and moves' (position, piece)
    // The 16 bytes past each dz ring's slots (2 RING .. RB - 1, which no store into the rings
    // reaches): zeros, the B row dweight reads for a dz block outside the unit. Each of the first
    // warps zeroes its channels' once (lane 8 q + j: ring 2 + q, channel 8 warp + j).
    if (!dxw && lane < 16) *reinterpret_cast<uint4*>(ring(2 + m4, 8 * warp + j8) + 2 * RING) = make_uint4(0, 0, 0, 0);

    #pragma unroll 1
    for (int64 item = blockIdx.x; item < n_items; item += gridDim.x) {
        int64 U, grp, b, jp;
        divmod_fast(item, groups, p.group_divisor, U, grp);
        divmod_fast(U, pieces, p.piece_divisor, b, jp);
        const int64 c0 = grp * CH, cw = c0 + 8 * warp;
        const int64 start = jp * span, end = min(seqlen, start + span);
        const int len = (int)(end - start), m1 = (len + 15) >> 4;  // positions, blocks of 16 of the unit
        const int n_copies = WARM + (len + DRAIN + STEP - 1) / STEP;

        // The taps of channels cw + cl, as fwd_mma_cl loads them (lane (cl, k0) takes taps k0, k0 +
        // 4, ..); a dx warp reads its channels' table once the step's first barrier is passed.
        __syncwarp();  // the previous item's readers are done (the dx warps: the item's last barrier)
        if (!dxw) {
            #pragma unroll
            for (int i = lane; i < 2 * TAB; i += 32) reinterpret_cast<uint4*>(tab)[i] = make_uint4(0, 0, 0, 0);
            {
                constexpr int PER_LANE = (D + 1 + 3) / 4;  // (width <= D + 1)
                const int cl = lane >> 2, k0 = lane & 3;
                const bool live = cw + cl < dim;
                const int64 wrow = live ? (cw + cl) * p.weight_c_stride : 0;
                unsigned short w[PER_LANE];
                #pragma unroll
                for (int r = 0; r < PER_LANE; ++r) {
                    const int k = k0 + 4 * r;
                    w[r] = live && k < width ? static_cast<const unsigned short*>(weight)[wrow + k * p.weight_width_stride] : 0;
                }
                __syncwarp();  // the table is zeroed
                unsigned short* const half = reinterpret_cast<unsigned short*>(tab + cl * TAB + D + 16 - width);
                #pragma unroll
                for (int r = 0; r < PER_LANE; ++r) {
                    const int k = k0 + 4 * r;
                    if (k < width) half[2 * k] = half[2 * k - 1] = w[r];
                }
            }
            if (lane < 8) bias_s[lane] = bias && cw + lane < dim ? load_as<float>(bias, (int)p.bias_dtype, (cw + lane) * p.bias_stride) : 0.f;
        }
        __syncwarp();

        // Copy a of x: positions 128 (a - WARM) + 32 warp + 8 r + j8 of the unit (r < 4), this
        // lane's piece m4 (8 channels). Zeros before the D positions z reads, past the row, past
        // the channels, and where the forward sees zeros before the row; copies whose four
        // positions are all in the row (and the D) go unchecked.
        const int lo_x = start >= D ? -D : (int)-start;
        auto copy_x = [&](int a) {
            const int rel0 = STEP * (a - WARM) + 32 * warp + j8;
            const int64 c = c0 + 8 * m4;
            const T* const xa = x + b * p.x_batch_stride + c + (start + rel0) * p.x_l_stride;
            const int64 x_step = 8 * p.x_l_stride;
            auto dst = [&](int r) { return reinterpret_cast<uint4*>(xslot(a & 1, 32 * warp + 8 * r + j8, m4)); };
            if (c < dim && rel0 >= lo_x && start + rel0 + 24 < seqlen) {
                #pragma unroll
                for (int r = 0; r < 4; ++r) cp_async<16, 128>(dst(r), xa + r * x_step, 16);
            } else {
                #pragma unroll 1
                for (int r = 0; r < 4; ++r) {
                    const int rel = rel0 + 8 * r;
                    const int64 pos = start + rel;
                    if (c >= dim || rel < -D || pos >= seqlen || pos < -(width - 1) || (pos < 0 && !initial_states)) {
                        cp_async<16, 128>(dst(r), x, 0);
                    } else if (pos >= 0) {
                        cp_async<16, 128>(dst(r), xa + r * x_step, 16);
                    } else {
                        Vec<T> v;
                        #pragma unroll 1
                        for (int e = 0; e < 8; ++e) v.e[e] = window_input(x, initial_states, p, b, c + e, pos);
                        *dst(r) = v.raw;
                    }
                }
            }
        };
        // The dout of step a (a >= WARM), this warp's channels: positions 128 (a - WARM) + lane +
        // 32 r, zeros past the row and the channels.
        auto copy_dout = [&](int a) {
            const int rel0 = STEP * (a - WARM) + lane;
            const T* const ga = dout + b * p.dout_batch_stride + cw + (start + rel0) * p.dout_l_stride;
            const int64 g_step = 32 * p.dout_l_stride;
            #pragma unroll
            for (int r = 0; r < 4; ++r) {
                const bool live = cw < dim && start + rel0 + 32 * r < seqlen;
                cp_async<16, 128>(dslot(lane + 32 * r, warp), live ? ga + r * g_step : dout, live ? 16 : 0);
            }
        };

        // dweight's C_f; dbias (db[h]: channel zc + h of the z below; with DXW the first warps'
        // db[4 ..] come from the dx warps at the item's end); the sum of z and dz
        float dw[8][LF][4], db[8], sums = 0.f;
        #pragma unroll
        for (int cl = 0; cl < 8; ++cl) {
            db[cl] = 0.f;
            #pragma unroll
            for (int f = 0; f < LF; ++f)
                #pragma unroll
                for (int r = 0; r < 4; ++r) dw[cl][f][r] = 0.f;
        }

        // Two groups committed a step: x of the next step (at the step's start; with DXW once
        // the moves are done, since the dx warps write dx through the other buffer until then),
        // then dout of the next step (empty where there is none). With DXW a step is: the first
        // warps' moves; a barrier of all; z and dz; a barrier of all; the first warps' dweight
        // (their barrier after it) while the dx warps compute dx and store it (their barrier
        // between).
        if (!dxw) {
            copy_x(0);
            cp_async_commit();
            cp_async_commit();  // (step 0 is a warm-up step: no dout)
        }
        #pragma unroll 1
        for (int a = 0; a < n_copies; ++a) {
            const int buf = a & 1, sbase = (STEP * a) % RING;
            if (!dxw) {
                if constexpr (DXW) {
                    cp_async_wait<0>();  // x and dout of this step have landed
                } else {
                    if (a + 1 < n_copies) copy_x(a + 1);
                    cp_async_commit();
                    cp_async_wait<1>();  // x and dout of this step have landed
                }
                __syncwarp();

                // This warp's positions 32 warp + 8 r + j into the rings: matrix m4 of ldmatrix (lanes
                // 8 m4 + j address its rows) = 8 positions x channels 8 m4 .., stored transposed (row j
                // = channel 8 m4 + j); the odd ring gets each lane's rows one position later (lane (g,
                // tg) the row of lane (g - 1, tg), g = 0 the last of the previous 8, r > 0).
                {
                    unsigned prev[4];
                    #pragma unroll
                    for (int r = 0; r < 4; ++r) {
                        const int at = 32 * warp + 8 * r;
                        unsigned w[4], o[4];
                        ldmatrix_x4(w, xslot(buf, at + j8, m4));
                        unsigned char* const row = ring(0, 8 * m4 + j8) + slot_bytes(wrap(sbase + at));
                        stmatrix_x4_trans(w, row);
                        #pragma unroll
                        for (int m = 0; m < 4; ++m) o[m] = __shfl_sync(0xffffffffu, g == 7 && r > 0 ? prev[m] : w[m], (lane + 28) & 31);
                        stmatrix_x4_trans(o, row + CH * RB);
                        #pragma unroll
                        for (int m = 0; m < 4; ++m) prev[m] = w[m];
                    }
                }
            }
            __syncthreads();  // the rings hold the step's positions
            if (!dxw) {
                if constexpr (DXW) {
                    if (a + 1 < n_copies) copy_x(a + 1);
                    cp_async_commit();
                }
                {  // the odd ring's positions t0 + 32 q (q < 4) of this warp's channels: x[t0 + 32 q - 1]
                    const int cl = lane >> 2, q = lane & 3;
                    const unsigned short v = *reinterpret_cast<const unsigned short*>(
                        ring(0, 8 * warp + cl) + slot_bytes(wrap(sbase + 32 * q - 1)));
                    *reinterpret_cast<unsigned short*>(ring(1, 8 * warp + cl) + slot_bytes(wrap(sbase + 32 * q))) = v;
                }
                __syncwarp();
                if (a < WARM) {  // a warm-up step: no z
                    if (a + 1 >= WARM && a + 1 < n_copies) copy_dout(a + 1);
                    cp_async_commit();
                }
            }
            if (a < WARM) continue;

            const int t0 = STEP * (a - WARM);
            // z and dz at the step's positions, place r of lane (g, tg) position i(r) = 32 tg + 16 (r
            // & 1) + 8 (r >> 1) + g (row g + 8 (r >> 1), column 2 tg + (r & 1) of the C fragment).
            // The B fragments of k-steps s, s + 1 (of z's x window and of dx's dz window, both
            // t0 - D + 16 (n + s) + ..) come from one ldmatrix_x4: lane 8 mq + j addresses position
            // t0 - D + 16 (j + s + (mq >> 1)) + 8 (mq & 1) at bfrom[s / 2] in a channel's ring.
            unsigned bfrom[(KS + 1) / 2];
            {
                const int mq = lane >> 3, j = lane & 7;
                #pragma unroll
                for (int s = 0; s < KS; s += 2)
                    bfrom[s / 2] = slot_bytes(wrap(sbase - D + 16 * (j + s + (mq >> 1)) + 8 * (mq & 1)));
            }
            auto place = [&](int r) { return 32 * tg + 16 * (r & 1) + 8 * (r >> 1) + g; };
            // B fragments of k-steps 0 .. KS - 1 from channel ring `from`.
            auto b_fragments = [&](unsigned (&bf)[KS + 1][2], const unsigned char* from) {
                #pragma unroll
                for (int s = 0; s < KS; s += 2) {
                    if (s + 1 < KS) {
                        unsigned w[4];
                        ldmatrix_x4(w, from + bfrom[s / 2]);
                        bf[s][0] = w[0], bf[s][1] = w[1], bf[s + 1][0] = w[2], bf[s + 1][1] = w[3];
                    } else {
                        unsigned w[2];
                        ldmatrix_x2(w, from + bfrom[s / 2]);
                        bf[s][0] = w[0], bf[s][1] = w[1];
                    }
                }
            };
            // With DXW each warp computes z and dz of NZ = 4 of its group's channels: the first
            // warps channels 0-3, the dx warps 4-7 (zc = 4); channel cl = zc + h at h < NZ.
            constexpr int NZ = DXW ? 4 : 8;
            const int zc = dxw ? 4 : 0;
            {
                uint4 dv[4];  // dout of the group's 8 channels at the lane's places (pair q: word q)
                #pragma unroll
                for (int r = 0; r < 4; ++r) {
                    dv[r] = *reinterpret_cast<const uint4*>(dslot(place(r), warp));
                    if (dxw) dv[r].x = dv[r].z, dv[r].y = dv[r].w;  // (channels 4-7 first)
                }
                // dz's rings: lane 8 q + j stores row j of matrix q (high, high + 8, low, low + 8):
                // positions t0 + 16 j + 8 (q & 1) .. of ring 2 + q / 2.
                unsigned char* const dz_row = ring(2 + (lane >> 4), 8 * warp + zc) + slot_bytes(wrap(sbase + 16 * j8 + 8 * (m4 & 1)));
                #pragma unroll
                for (int h = 0; h < NZ; ++h) {
                    const int cl = zc + h;
                    unsigned bf[KS + 1][2];
                    b_fragments(bf, ring(0, 8 * warp + cl));
                    float acc[4], odd[4];  // the even and the odd k-steps: two MMA chains
                    #pragma unroll
                    for (int r = 0; r < 4; ++r) acc[r] = bias_s[cl], odd[r] = 0.f;
                    #pragma unroll
                    for (int s = 0; s < KS; ++s) {
                        const unsigned* const tw = tab + cl * TAB + jb + 16 * s;
                        const unsigned af[4] = {tw[0], tw[-8], tw[8], tw[0]};
                        MmaOp<T>::run(s & 1 ? odd : acc, af, bf[s][0], bf[s][1]);
                    }
                    #pragma unroll
                    for (int r = 0; r < 4; ++r) acc[r] += odd[r];
                    float dz[4];
                    #pragma unroll
                    for (int r = 0; r < 4; ++r) {
                        const unsigned word = h < 4 ? (h < 2 ? dv[r].x : dv[r].y) : (h < 6 ? dv[r].z : dv[r].w);
                        const float d = h & 1 ? high_half(word) : low_half(word);
                        // silu' of every element, then the activation chosen: no branch between
                        // the elements, whose MUFU chains then interleave
                        const float grad = silu_grad(acc[r]);
                        computed_here(grad);
                        dz[r] = p.silu_act ? d * grad : d;
                        sums += acc[r] + dz[r];
                        db[h] += t0 + place(r) < len ? dz[r] : 0.f;
                    }
                    unsigned parts[4];  // the high parts of dz 0, 1 and 2, 3, then their low parts
                    split_pair(dz[0], dz[1], parts[0], parts[2]);
                    split_pair(dz[2], dz[3], parts[1], parts[3]);
                    stmatrix_x4_trans(parts, dz_row + h * RB);
                }
            }
            // This step's dout is read, its dz in the rings (with DXW: every warp's).
            if constexpr (DXW) __syncthreads();
            else __syncwarp();
            if (!dxw) {
                if (a + 1 < n_copies) copy_dout(a + 1);
                cp_async_commit();
            }

            // dx at positions t0 - D + place(r): packed by channel pairs, a 16-byte slot a place.
            if (!DXW || dxw) {
                unsigned packed[4][4];  // [place][pair]
                #pragma unroll
                for (int pr = 0; pr < 4; ++pr) {
                    // dz's high and low halves: two MMA chains up to LF 1 (beyond, the low half's
                    // accumulators would spill)
                    float acc[2][4], low[2][4];
                    #pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int cl = 2 * pr + h;
                        unsigned bh[KS + 1][2], bl[KS + 1][2];
                        b_fragments(bh, ring(2, 8 * warp + cl));
                        b_fragments(bl, ring(3, 8 * warp + cl));
                        #pragma unroll
                        for (int r = 0; r < 4; ++r) acc[h][r] = low[h][r] = 0.f;
                        #pragma unroll
                        for (int s = 0; s < KS; ++s) {
                            const unsigned* const tw = tab + cl * TAB + D + 29 - jb - 16 * s;
                            const unsigned a0 = __byte_perm(tw[0], 0, 0x1032);
                            const unsigned af[4] = {a0, __byte_perm(tw[8], 0, 0x1032), __byte_perm(tw[-8], 0, 0x1032), a0};
                            MmaOp<T>::run(acc[h], af, bh[s][0], bh[s][1]);
                            MmaOp<T>::run(LF == 1 ? low[h] : acc[h], af, bl[s][0], bl[s][1]);
                        }
                    }
                    #pragma unroll
                    for (int r = 0; r < 4; ++r) packed[r][pr] = pack2<T>(acc[0][r] + low[0][r], acc[1][r] + low[1][r]);
                }
                #pragma unroll
                for (int r = 0; r < 4; ++r)
                    *reinterpret_cast<uint4*>(xslot(buf, place(r), warp)) =
                        make_uint4(packed[r][0], packed[r][1], packed[r][2], packed[r][3]);
            }

            // dweight: x blocks n = n0 + ni (ni < 8) of the step, n0 = t0 / 16 - 7. A's words
            // (x[u], x[u + 1]) at u = 16 n0 - 128 f + v + 8 e (e = -1 .. 15), v = 2 tg - g: word
            // e + 1 of aw[f] (a0 of block ni: word 2 ni + 1, a1: 2 ni, a2: 2 ni + 2, a3 = a0), from
            // the x ring (even v) or the odd ring's slot u + 1 (odd v). B: lane 8 mq + j addresses
            // dz positions 16 (n + j) + 8 (mq & 1) of ring 2 + mq / 2, or, where block n + j lies
            // outside the unit (a unit's first and last steps), the ring's zero bytes: column j of B
            // zero.
            if (!dxw) {
                const int v = 2 * tg - g, odd = v & 1, n0 = t0 / 16 - 7;
                // (a_at, b_at: byte offsets from the rings' start, so that each load's address is
                // one register and a constant)
                const unsigned xr = (odd * CH + 8 * warp) * RB, br = ((2 + (lane >> 4)) * CH + 8 * warp) * RB;
                unsigned a_at[LF][17], b_at[8];
                #pragma unroll
                for (int f = 0; f < LF; ++f)
                    #pragma unroll
                    for (int e = 0; e < 17; ++e) a_at[f][e] = xr + slot_bytes(wrap(sbase - 112 - 128 * f + v + odd + 8 * (e - 1)));
                #pragma unroll
                for (int ni = 0; ni < 8; ++ni) b_at[ni] = br + slot_bytes(wrap(sbase - 112 + 16 * (ni + j8) + 8 * (m4 & 1)));
                const bool edge = n0 < 0 || n0 + 15 > m1;  // (a block of the step's B outside the unit)
                if (edge)
                    #pragma unroll
                    for (int ni = 0; ni < 8; ++ni)
                        if (n0 + ni + j8 < 0 || n0 + ni + j8 >= m1) b_at[ni] = br + 2 * RING;  // (the zeros)
                // PAIR channels at a time: two MMA chains a warp, as LF 2 has with its two lag
                // fragments a channel. (Each channel's low half in its own accumulators as well
                // spilled hundreds of bytes.)
                #pragma unroll
                for (int c2 = 0; c2 < 8; c2 += PAIR) {
                    unsigned aw[PAIR][LF][17];
                    #pragma unroll
                    for (int h = 0; h < PAIR; ++h)
                        #pragma unroll
                        for (int f = 0; f < LF; ++f)
                            #pragma unroll
                            for (int e = 0; e < 17; ++e)
                                aw[h][f][e] = *reinterpret_cast<const unsigned*>(rings + a_at[f][e] + (c2 + h) * RB);
                    #pragma unroll
                    for (int ni = 0; ni < 8; ++ni) {
                        unsigned bw[PAIR][4];
                        #pragma unroll
                        for (int h = 0; h < PAIR; ++h) ldmatrix_x4(bw[h], rings + b_at[ni] + (c2 + h) * RB);
                        #pragma unroll
                        for (int f = 0; f < LF; ++f)
                            #pragma unroll
                            for (int h = 0; h < PAIR; ++h) {
                                const unsigned af[4] = {aw[h][f][2 * ni + 1], aw[h][f][2 * ni], aw[h][f][2 * ni + 2],
                                                        aw[h][f][2 * ni + 1]};
                                MmaOp<T>::run(dw[c2 + h][f], af, bw[h][0], bw[h][1]);
                                MmaOp<T>::run(dw[c2 + h][f], af, bw[h][2], bw[h][3]);
                            }
                    }
                }
            }
            if constexpr (!DXW) __syncthreads();  // dx is in the staging buffer
            else if (dxw) named_barrier(2, 32 * BWD_CL_WARPS);
            else named_barrier(1, 32 * BWD_CL_WARPS);  // dweight's x is read (the next moves overwrite it)

            // dx out: this thread's positions t0 - D + 32 warp + 8 r + j8, piece m4, those in the unit.
            if (!DXW || dxw) {
                const int rel0 = t0 - D + 32 * warp + j8;
                const int64 c = c0 + 8 * m4;
                T* const da = dx + b * p.dx_batch_stride + c + (start + rel0) * p.dx_l_stride;
                const int64 dx_step = 8 * p.dx_l_stride;
                #pragma unroll
                for (int r = 0; r < 4; ++r) {
                    const int rel = rel0 + 8 * r;
                    if (c < dim && rel >= 0 && rel < len)
                        *reinterpret_cast<uint4*>(da + r * dx_step) =
                            *reinterpret_cast<const uint4*>(xslot(buf, 32 * warp + 8 * r + j8, m4));
                }
            }
        }
        cp_async_wait<0>();  // (the last, empty groups)
        if (dxw) {  // dbias of channels 4-7 and whether the sums were finite, to the first warp
            #pragma unroll
            for (int h = 0; h < 4; ++h)
                #pragma unroll
                for (int o = 16; o > 0; o >>= 1) db[h] += __shfl_xor_sync(0xffffffffu, db[h], o);
            const bool finite = !__any_sync(0xffffffffu, !isfinite(sums));
            if (lane == 0) {
                *reinterpret_cast<float4*>(dslot(0, warp)) = make_float4(db[0], db[1], db[2], db[3]);
                *reinterpret_cast<float*>(dslot(1, warp)) = finite ? 0.f : __int_as_float(0x7fc00000);
            }
        }
        __syncthreads();  // every dx of the item is out (and the dx warps' sums handed over)

        // The item's sums, part U: C_f's element r has the lag 128 f + place(r). (The dx warps
        // hold none.)
        if (dxw) continue;
        if constexpr (DXW) {  // (channels 4-7's sums come reduced)
            const float4 handed = *reinterpret_cast<const float4*>(dslot(0, warp));
            db[4] = handed.x, db[5] = handed.y, db[6] = handed.z, db[7] = handed.w;
            sums += *reinterpret_cast<const float*>(dslot(1, warp));
        }
        if (__any_sync(0xffffffffu, !isfinite(sums))) {
            #pragma unroll 1
            for (int cl = 0; cl < 8; ++cl)
                if (cw + cl < dim)
                    exact_channel_cl(x, weight, bias, initial_states, dout, dx, partials, dweight, dbias, p, U, b,
                                     cw + cl, start, end);
        } else {
            #pragma unroll
            for (int cl = 0; cl < 8; ++cl) {
                if (!DXW || cl < 4)
                    #pragma unroll
                    for (int o = 16; o > 0; o >>= 1) db[cl] += __shfl_xor_sync(0xffffffffu, db[cl], o);
                if (cw + cl >= dim) continue;
                #pragma unroll
                for (int f = 0; f < LF; ++f)
                    #pragma unroll
                    for (int r = 0; r < 4; ++r) {
                        const int lag = 128 * f + 32 * tg + 16 * (r & 1) + 8 * (r >> 1) + g;
                        if (lag < width) write_sum(partials, dweight, dbias, p, U, cw + cl, width - 1 - lag, dw[cl][f][r]);
                    }
                if (lane == 0) write_sum(partials, dweight, dbias, p, U, cw + cl, width, db[cl]);
            }
        }
    }
}
