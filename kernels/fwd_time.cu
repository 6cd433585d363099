// fwd_time.cu: the forward for time-contiguous x (x_l_stride == 1, or rows of one step).
//
//   fwd_time<T, K, SEQ, NV, WARPS>
//       width K <= 17 (the plan's TIME_MAX_WIDTH). Rows are cut into chunks of 32 NV vectors of
//       VN elements (16 bytes each), one chunk per warp, WARPS warps a block, handed out in
//       order (chunks of a row, then rows) so that the warps in flight sweep x front to back.
//       SEQ says whether seq_idx is given, so the common case carries no segment bookkeeping.
//
// Lane l owns the vectors l, l + 32, ... of its chunk, and all of the chunk is requested
// before any of it is computed (every access a coalesced 16-byte vector); lanes 32 - HV .. 31
// also fetch the HV vectors before the chunk. With a one-vector halo (HV = 1) the chunk is held
// in registers and a vector's halo is shuffled from the lane before it; wider halos come from
// the chunk staged in the warp's shared memory by cp.async. Misaligned rows, and a row whose
// end cuts a vector, are staged element by element instead and stored element by element;
// positions before the row are zeros or initial_states. The chunk index is divided by the
// plan's fast divisors (common.cuh: divmod_fast): p.chunk_divisor (chunks per row) and
// p.dim_divisor. p.x_aligned / p.out_aligned: rows of x / out start on 16-byte boundaries.
#include "fwd_common.cuh"

// Warps per SM that fwd_time's register budget (__launch_bounds__) is set for: short chunks
// held in registers need more warps in flight; seq_idx, float64 and widths from 8 in chunks of
// 8 vectors or more need more registers per thread (benchmarks/NOTES.md, "Occupancy and tile
// sizes": fwd_time; "Register budgets under NVRTC 13").
__host__ __device__ constexpr int time_warps_per_sm(int K, bool SEQ, int NV, int bytes) {
    return bytes == 8 ? 16 : SEQ ? 20 : NV <= 2 && K - 1 <= 16 / bytes ? 40 : NV >= 8 && K >= 8 ? 24 : 28;
}

template <typename T, int K, bool SEQ, int NV, int WARPS>
__global__ void __launch_bounds__(32 * WARPS, time_warps_per_sm(K, SEQ, NV, sizeof(T)) / WARPS)
    fwd_time(FWD_ARRAYS, const __grid_constant__ FwdTimeParams p) {
    if (final_states_blocks(x, seq_idx, initial_states, final_states, p)) return;
    using A = typename AccOf<T>::type;
    const int64 batch = p.batch, dim = p.dim, seqlen = p.seqlen, x_batch_stride = p.x_batch_stride,
                x_c_stride = p.x_c_stride, weight_c_stride = p.weight_c_stride,
                weight_width_stride = p.weight_width_stride, bias_stride = p.bias_stride,
                out_batch_stride = p.out_batch_stride, out_c_stride = p.out_c_stride, out_l_stride = p.out_l_stride,
                chunk_divisor = p.chunk_divisor, dim_divisor = p.dim_divisor;
    const int weight_dtype = (int)p.weight_dtype, bias_dtype = (int)p.bias_dtype, silu_act = (int)p.silu_act,
              x_aligned = (int)p.x_aligned, out_aligned = (int)p.out_aligned;
    using Raw = typename Vec<T>::Raw;
    constexpr int VN = Vec<T>::V;               // elements per 16-byte vector
    constexpr int HV = (K - 1 + VN - 1) / VN;   // halo vectors
    constexpr int HE = HV * VN;                 // halo elements (>= K-1)
    constexpr int OFF = HE - (K - 1);           // window slot of tap 0 for output 0
    constexpr int FIRST_WORD = OFF * (int)sizeof(T) / 4;  // first word of the farthest halo vector used
    constexpr int span = 32 * NV * VN;          // elements per chunk
    constexpr bool SMEM = HV > 1;               // the chunk in shared memory, not in registers
    const int lane = threadIdx.x & 31;
    const int64 chunks_per_row = (seqlen + span - 1) / span;
    const int64 n_chunks = batch * dim * chunks_per_row;
    // Per warp: a chunk and the HV vectors before it.
    __shared__ Raw stage_mem[WARPS][HV + 32 * NV];
    Raw* const stage = stage_mem[threadIdx.x / 32];
    T* const stage_e = reinterpret_cast<T*>(stage);

    // u from lane src: the words the taps read (from FIRST_WORD on when `farthest`).
    auto shuffle = [&](const Vec<T>& u, int src, bool farthest) {
        Vec<T> r;
        unsigned* w = reinterpret_cast<unsigned*>(&r.raw);
        const unsigned* s = reinterpret_cast<const unsigned*>(&u.raw);
        #pragma unroll
        for (int q = 0; q < 4; ++q) w[q] = farthest && q < FIRST_WORD ? 0u : __shfl_sync(0xffffffffu, s[q], src);
        return r;
    };
    // The VN outputs from window win (positions t-HE .. t+VN-1 of row (b, c)), activated.
    auto outputs = [&](A (&win)[HE + VN], const A (&w)[K], A bias_c, int64 b, int64 t) {
        int64 ids[SEQ ? HE + VN : 1];
        if constexpr (SEQ) {
            #pragma unroll
            for (int q = OFF; q < HE + VN; ++q) {
                const int64 pos = t - HE + q;
                ids[q] = pos < seqlen ? segment_id(seq_idx, p, b, pos) : -1;
            }
        }
        A acc[VN];
        #pragma unroll
        for (int o = 0; o < VN; ++o) {
            acc[o] = bias_c;
            #pragma unroll
            for (int k = 0; k < K; ++k) {
                if constexpr (SEQ) {
                    if (ids[OFF + o + k] == ids[HE + o]) acc[o] += w[k] * win[OFF + o + k];
                } else {
                    acc[o] += w[k] * win[OFF + o + k];
                }
            }
            if constexpr (SEQ) {
                if (ids[HE + o] < 0) acc[o] = A(0);  // padding
            }
        }
        Vec<T> res;
        activate_store(acc, silu_act, res.e);
        return res;
    };

    for (int64 g = grid_warp(); g < n_chunks; g += main_warps(p)) {
        int64 row, chunk, b, c;
        divmod_fast(g, chunks_per_row, chunk_divisor, row, chunk);
        divmod_fast(row, dim, dim_divisor, b, c);
        const int64 start = chunk * span;
        const int n = (int)min(seqlen - start, (int64)span);  // elements of the chunk in the row
        const T* const xr = x + b * x_batch_stride + c * x_c_stride;
        T* const orow = out + b * out_batch_stride + c * out_c_stride;

        // Whole vectors: every vector is inside the row or after it.
        const bool whole = n == span || seqlen % VN == 0;
        const bool x_vectors = x_aligned && whole, out_vectors = out_aligned && whole;
        const int used = (n + VN - 1) / VN * VN;  // elements of the chunk's vectors that hold any
        __syncwarp();  // the stage's last readers are done
        if (!x_vectors) {  // stage the chunk and its halo element by element
            #pragma unroll 1
            for (int e = lane; e < HE + used; e += 32) {
                const int64 pos = start - HE + e;
                stage_e[e] = pos >= 0 && pos < seqlen ? xr[pos] : T();  // (x_l_stride != 1: one element)
            }
            __syncwarp();
        }
        // x first, then the weights: both loads in flight at once.
        const Raw* const xc = reinterpret_cast<const Raw*>(xr + start);
        const bool has_before = HV > 0 && lane >= 32 - HV && start > 0;
        Vec<T> cur[SMEM ? 1 : NV], before;
        before.raw = Raw();  // zeros before the row (initial_states: when the window is built)
        if constexpr (SMEM) {
            if (x_vectors) {  // cp.async into the stage, zero-filled after the row
                #pragma unroll
                for (int j = 0; j < NV; ++j) {
                    const bool in_row = (32 * j + lane) * VN < n;
                    cp_async<16>(stage + HV + 32 * j + lane, xc + (in_row ? 32 * j + lane : 0), in_row ? 16 : 0);
                }
                if (lane >= 32 - HV) {
                    if (has_before) cp_async<16>(stage + lane - (32 - HV), xc + lane - 32, 16);
                    else stage[lane - (32 - HV)] = Raw();
                }
                cp_async_commit();
            }
        } else if (x_vectors) {
            #pragma unroll
            for (int j = 0; j < NV; ++j) cur[j].raw = (32 * j + lane) * VN < n ? __ldg(xc + 32 * j + lane) : Raw();
            if (has_before) before.raw = __ldg(xc + lane - 32);
        } else {
            #pragma unroll
            for (int j = 0; j < NV; ++j) cur[j].raw = (32 * j + lane) * VN < n ? stage[HV + 32 * j + lane] : Raw();
            if (has_before) before.raw = stage[lane - (32 - HV)];
        }
        // Lane k < K loads tap k, lane K the bias (one load of either dtype), scaled for the
        // activation; every lane gets all of them by shuffles.
        const bool tap = lane < K;
        const void* const param = tap ? weight : bias;
        A mine = A(0);
        if (lane <= K && param)
            mine = load_as<A>(param, tap ? weight_dtype : bias_dtype,
                              tap ? c * weight_c_stride + lane * weight_width_stride : c * bias_stride) *
                   act_scale<A>(silu_act);
        A w[K];
        #pragma unroll
        for (int k = 0; k < K; ++k) w[k] = __shfl_sync(0xffffffffu, mine, k);
        const A bias_c = __shfl_sync(0xffffffffu, mine, K);
        if constexpr (SMEM) {
            cp_async_wait<0>();
            __syncwarp();
        }

        #pragma unroll
        for (int j = 0; j < NV; ++j) {
            if (j > 0 && 32 * j * VN >= n) break;  // the passes past the row's end
            const int i = (32 * j + lane) * VN;  // chunk offset of this vector
            A win[HE + VN];  // positions start + i - HE .. start + i + VN - 1
            #pragma unroll
            for (int h = 1; h <= HV; ++h) {
                Vec<T> v;
                if constexpr (SMEM) {
                    v.raw = stage[HV + 32 * j + lane - h];
                } else {
                    // Lane l's halo is lane (l - 1) mod 32's vector j, or its vector j - 1
                    // (before, for j = 0) for l = 0: each source lane sends the one its reader needs.
                    const Vec<T> src = lane + h < 32 ? cur[j] : j > 0 ? cur[j > 0 ? j - 1 : 0] : before;
                    v = shuffle(src, (lane - h) & 31, h == HV);
                }
                widen<T, A, VN>(v.e, win + (HV - h) * VN);
            }
            Vec<T> center;
            if constexpr (SMEM) center.raw = stage[HV + 32 * j + lane];
            else center = cur[j];
            widen<T, A, VN>(center.e, win + HE);
            if (j == 0 && HE > 0 && initial_states && start == 0 && lane < HV) {  // before the row
                #pragma unroll
                for (int q = OFF; q < HE; ++q) {
                    const int pos = i - HE + q;
                    if (pos < 0) win[q] = input_at<A>(x, initial_states, p, b, c, pos);
                }
            }
            const Vec<T> res = outputs(win, w, bias_c, b, start + i);
            if (out_vectors) {
                if (i < n) reinterpret_cast<Raw*>(orow + start)[32 * j + lane] = res.raw;
            } else if constexpr (!SMEM) {  // the stage is free: store from it below
                stage[HV + 32 * j + lane] = res.raw;
            } else {
                #pragma unroll
                for (int o = 0; o < VN; ++o)
                    if (i + o < n) orow[(start + i + o) * out_l_stride] = res.e[o];
            }
        }
        if (!SMEM && !out_vectors) {  // the staged outputs, element by element
            __syncwarp();
            #pragma unroll 1
            for (int e = lane; e < n; e += 32) orow[(start + e) * out_l_stride] = stage_e[HE + e];
        }
    }
}
