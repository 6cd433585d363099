// fwd_mma_time.cu: the forward on tensor cores for time-contiguous 16-bit x whose rows start on
// 8-byte boundaries, with weights of x's dtype, from the plan's MMA_MIN_WIDTH to 16
// MMA_TIME_MAX_STEPS - 15; no seq_idx (fwd_mma.cu serves the other tensor-core cases).
//
//   fwd_mma_time<T, KS, NV, WARPS>
//       widths K with K - 1 <= D = 16 (KS - 1). Rows are cut into chunks of NV groups of 128
//       positions, one chunk a warp, WARPS warps a block, handed out in order (chunks of a row,
//       then rows: the warps in flight sweep x front to back, as fwd_time's do). Lane (g, tg) =
//       (lane / 4, lane % 4) loads the inputs 16 g + 4 tg .. + 3 of every group of its chunk and
//       of the HL groups before it, one 8-byte load a group (a warp's load: 256 contiguous
//       bytes), all of them issued before any compute; the chunk stays in registers.
//
// fwd_mma.cu has the Toeplitz form and the fragment layout: 16 consecutive outputs are the
// banded Toeplitz matrix of the taps times the D + 16 inputs up to them; eight such blocks 16
// steps apart are the eight columns of one m16n8k16 MMA per k-step s, lane (g, tg)'s B operand
// the inputs 4 tg .. 4 tg + 3 of window segment g + s. For group j of the chunk (outputs start +
// 128 j ..) that is 16-position segment g - d of the group, d = KS - 1 - s: what lane (g - d, tg)
// loaded for group j, or for g < d what lane (g - d + 8, tg) loaded for group j - 1 (d = 8 q + r:
// groups j - q and j - q - 1, lanes 4 r apart), one shuffle of each of its two words. Lane (g,
// tg)'s results are outputs 32 tg + 2 g, + 1 and 32 tg + 16 + 2 g, + 1 of the group, stored as two
// 4-byte pairs (each store instruction writes whole 32-byte sectors).
//
// Products of 16-bit values are exact and the MMA accumulates in float32 from the bias. A
// non-finite input meets the band's zero weights (0 inf = NaN), so a chunk whose sums are not all
// finite has its non-finite outputs computed again from their own taps (own_outputs).
// p.out_aligned: out's rows time-contiguous and starting on 4-byte boundaries. Measurements:
// benchmarks/NOTES.md, "fwd_mma_time: the chunk in registers".
#include "fwd_common.cuh"
#include "mma_common.cuh"

// Warps per SM that fwd_mma_time's register budget (__launch_bounds__) is set for: the chunk
// takes 2 (NV + HL) registers, the A fragments 4 KS (at 28 warps, KS 2 in chunks of 16 spilled
// 68 bytes and ran 5 % slower: benchmarks/NOTES.md, "Register budgets under NVRTC 13").
__host__ __device__ constexpr int mma_time_warps_per_sm(int NV) {
    return NV <= 4 ? 32 : 24;
}

// Element e of the four 16-bit inputs in w, set to v.
template <typename T>
__device__ __forceinline__ void set_input(uint2& w, int e, T v) {
    const unsigned bits = raw_bits(v), shift = 16 * (e & 1);
    unsigned& word = e < 2 ? w.x : w.y;
    word = (word & ~(0xffffu << shift)) | bits << shift;
}

// Recomputes, from their width taps alone (wpad, taps from pad on), the outputs of the chunk at
// start (n of them, in row orow) that are not finite; this lane takes every 32nd. Out of line:
// finite inputs never call it.
template <typename T, typename P>
__device__ __noinline__ void own_outputs(T* orow, int64 start, int n, const float* wpad, int pad, float bias,
                                         const T* x, const void* initial_states, const P& p, int64 b, int64 c) {
    const int width = (int)p.width;
    const int64 out_l_stride = p.out_l_stride;
    for (int o = threadIdx.x & 31; o < n; o += 32) {
        T* const at = orow + (start + o) * out_l_stride;
        if (isfinite(to_acc(*at))) continue;
        float a = bias;
        for (int k = 0; k < width; ++k)
            a += wpad[pad + k] * input_at<float>(x, initial_states, p, b, c, start + o - (width - 1) + k);
        *at = from_acc<T>(p.silu_act ? silu(a) : a);
    }
}

template <typename T, int KS, int NV, int WARPS>
__global__ void __launch_bounds__(32 * WARPS, mma_time_warps_per_sm(NV) / WARPS)
    fwd_mma_time(FWD_ARRAYS, const __grid_constant__ FwdMmaTimeParams p) {
    if (final_states_blocks(x, seq_idx, initial_states, final_states, p)) return;
    using Sizes = ToeplitzTaps<KS>;
    constexpr int D = Sizes::D, PAD = Sizes::PAD, SIZE = Sizes::SIZE, N = Sizes::N;
    constexpr int HL = (D + 127) / 128;  // groups before a chunk that its windows reach
    constexpr int SPAN = 128 * NV;       // positions a chunk
    constexpr int CHAINS = NV < 16 || KS > 2 ? 2 : 4;  // groups computed together
    static_assert(NV % CHAINS == 0, "whole chains");
    const int64 batch = p.batch, dim = p.dim, seqlen = p.seqlen, x_batch_stride = p.x_batch_stride,
                x_c_stride = p.x_c_stride, weight_c_stride = p.weight_c_stride,
                weight_width_stride = p.weight_width_stride, bias_stride = p.bias_stride,
                out_batch_stride = p.out_batch_stride, out_c_stride = p.out_c_stride, out_l_stride = p.out_l_stride,
                chunk_divisor = p.chunk_divisor, dim_divisor = p.dim_divisor;
    const int width = (int)p.width, bias_dtype = (int)p.bias_dtype, silu_act = (int)p.silu_act,
              out_aligned = (int)p.out_aligned;
    const int lane = threadIdx.x & 31, g = lane >> 2, tg = lane & 3;
    // The warp's zero-padded taps (ToeplitzTaps): taps at PAD.., written for every chunk, zeros
    // around them written once.
    __shared__ float wpad_mem[WARPS][SIZE];
    float* const wpad = wpad_mem[threadIdx.x / 32];
    for (int i = lane; i < SIZE; i += 32) wpad[i] = 0.f;
    const int64 per_row = (seqlen + SPAN - 1) / SPAN, n_chunks = batch * dim * per_row;

    for (int64 q = grid_warp(); q < n_chunks; q += main_warps(p)) {
        int64 row, chunk, b, c;
        divmod_fast(q, per_row, chunk_divisor, row, chunk);
        divmod_fast(row, dim, dim_divisor, b, c);
        const int64 start = chunk * SPAN;
        const int n = (int)min(seqlen - start, (int64)SPAN);  // outputs of the chunk in the row
        const T* const xr = x + b * x_batch_stride + c * x_c_stride;

        // in[HL + j]: this lane's four inputs of group j (j = -HL .. NV - 1), then the taps (lane
        // k: taps k, k + 32, ..) and the bias, all loads in flight together.
        uint2 in[HL + NV];
        const int64 first = start - 128 * HL + 16 * g + 4 * tg;  // this lane's first input
        const uint2* const src = reinterpret_cast<const uint2*>(xr + first);
        auto checked = [&](int j) {  // (zeros past the row)
            const int64 pos = first + 128 * j;
            if (pos + 4 <= seqlen) return __ldg(src + 32 * j);
            uint2 w = make_uint2(0u, 0u);
            #pragma unroll
            for (int e = 0; e < 4; ++e)
                if (pos + e < seqlen) set_input(w, e, xr[pos + e]);
            return w;
        };
        static_assert(NV >= HL, "a chunk that does not start the row has its halo in the row");
        if (start > 0) {  // the groups before the chunk
            #pragma unroll
            for (int j = 0; j < HL; ++j) in[j] = __ldg(src + 32 * j);
        } else {  // before the row: zeros, or the width - 1 states
            #pragma unroll
            for (int j = 0; j < HL; ++j) in[j] = make_uint2(0u, 0u);
            if (initial_states) {
                #pragma unroll
                for (int j = 0; j < HL; ++j) {
                    #pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int64 pos = first + 128 * j + e;
                        if (pos >= 1 - width)
                            set_input(in[j], e, from_acc<T>(input_at<float>(x, initial_states, p, b, c, pos)));
                    }
                }
            }
        }
        if (n == SPAN) {  // the chunk's groups
            #pragma unroll
            for (int j = HL; j < HL + NV; ++j) in[j] = __ldg(src + 32 * j);
        } else {
            #pragma unroll
            for (int j = HL; j < HL + NV; ++j) in[j] = checked(j);
        }
        T tap[N];
        #pragma unroll
        for (int i = 0; i < N; ++i) {
            const int k = lane + 32 * i;
            tap[i] = k < width ? static_cast<const T*>(weight)[c * weight_c_stride + k * weight_width_stride] : T();
        }
        const float bias_c = bias ? load_as<float>(bias, bias_dtype, c * bias_stride) : 0.f;

        // The A fragments of the row's taps (fwd_mma.cu: Taps::build).
        __syncwarp();  // the chunk before has built its fragments and recomputed its outputs
        #pragma unroll
        for (int i = 0; i < N; ++i)
            if (lane + 32 * i < width) wpad[PAD + lane + 32 * i] = to_acc(tap[i]);
        __syncwarp();
        unsigned a[KS][4];
        const float* const wl = wpad + PAD + 4 * tg - 2 * g - (D - width + 1);  // the band ends at the output
        #pragma unroll
        for (int s = 0; s < KS; ++s) {
            #pragma unroll
            for (int r = 0; r < 4; ++r) {
                const float* const f = wl + fragment_offset(s, r);
                a[s][r] = pack2<T>(f[0], f[1]);
            }
        }

        T* const orow = out + b * out_batch_stride + c * out_c_stride;
        // Outputs o, o + 1 of the chunk, as one 4-byte pair where they both lie in an aligned row.
        auto put = [&](int o, unsigned w) {
            if (out_aligned && o + 1 < n) {
                *reinterpret_cast<unsigned*>(orow + start + o) = w;
            } else {
                const T* const v = reinterpret_cast<const T*>(&w);
                if (o < n) orow[(start + o) * out_l_stride] = v[0];
                if (o + 1 < n) orow[(start + o + 1) * out_l_stride] = v[1];
            }
        };
        // The chunk's groups, CHAINS at a time (their MMA chains independent, as fwd_mma's), the
        // activation fixed at compile time (SILU) and, for a whole chunk of an aligned row
        // (WHOLE), every store a 4-byte pair without checks.
        float sums = 0.f;  // of every sum: not finite if one of them is not
        auto groups = [&](auto silu_flag, auto whole_flag) {
            constexpr bool SILU = decltype(silu_flag)::value, WHOLE = decltype(whole_flag)::value;
            #pragma unroll
            for (int j0 = 0; j0 < NV; j0 += CHAINS) {
                if (!WHOLE && 128 * j0 >= n) break;  // the groups past the row's end
                float acc[CHAINS][4];
                #pragma unroll
                for (int i = 0; i < CHAINS; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = bias_c;
                #pragma unroll
                for (int s = 0; s < KS; ++s) {
                    const int d = KS - 1 - s, back = d / 8, r = d % 8;
                    #pragma unroll
                    for (int i = 0; i < CHAINS; ++i) {
                        const int j = HL + j0 + i - back;
                        uint2 bw = in[j];
                        if (r) {  // segments g - r of the group, wrapping into the group before
                            const uint2 v = g >= 8 - r ? in[max(j - 1, 0)] : bw;
                            bw.x = __shfl_sync(0xffffffffu, v.x, (lane - 4 * r) & 31);
                            bw.y = __shfl_sync(0xffffffffu, v.y, (lane - 4 * r) & 31);
                        }
                        MmaOp<T>::run(acc[i], a[s], bw.x, bw.y);
                    }
                }
                #pragma unroll
                for (int i = 0; i < CHAINS; ++i) {
                    sums += (acc[i][0] + acc[i][1]) + (acc[i][2] + acc[i][3]);
                    if constexpr (SILU) {
                        #pragma unroll
                        for (int r = 0; r < 4; ++r) acc[i][r] = silu_out<T>(acc[i][r]);
                    }
                    // acc[0], acc[2]: outputs 32 tg + 2 g, + 1 of the group; acc[1], acc[3]: 16 on
                    const int o = 128 * (j0 + i) + 32 * tg + 2 * g;
                    const unsigned w0 = pack2<T>(acc[i][0], acc[i][2]), w1 = pack2<T>(acc[i][1], acc[i][3]);
                    if constexpr (WHOLE) {
                        *reinterpret_cast<unsigned*>(orow + start + o) = w0;
                        *reinterpret_cast<unsigned*>(orow + start + o + 16) = w1;
                    } else {
                        put(o, w0);
                        put(o + 16, w1);
                    }
                }
            }
        };
        if (n == SPAN && out_aligned) {
            if (silu_act) groups(Flag<true>(), Flag<true>());
            else groups(Flag<false>(), Flag<true>());
        } else {
            if (silu_act) groups(Flag<true>(), Flag<false>());
            else groups(Flag<false>(), Flag<false>());
        }
        if (__any_sync(0xffffffffu, !isfinite(sums))) {
            __syncwarp();
            own_outputs(orow, start, n, wpad, PAD, bias_c, x, initial_states, p, b, c);
        }
    }
}
