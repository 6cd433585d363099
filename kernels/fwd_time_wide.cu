// fwd_time_wide.cu: the forward for time-contiguous x and any width (run-time; the plan uses
// it above TIME_MAX_WIDTH where tensor cores do not serve).
//
//   fwd_time_wide<T, SEQ>
//       a block of blockDim.x threads per row and blockDim.y rows stages a tile of rows x time
//       plus the K-1 halo in shared memory as A; each thread applies the taps, zero-padded to
//       chunks of TIME_WIDE_CHUNK, to its N = TIME_WIDE_BYTES / sizeof(T) outputs.
//
// Row r of the tile lives in shared memory as E = KP + blockDim.x * N slots of A: slot e holds
// position t0 - H + e, with H = p.halo (K-1 rounded up to 4); the taps are zero-padded at the
// oldest end to KP = p.taps (a multiple of TIME_WIDE_CHUNK), so output o of thread tx is
// sum_u wsm[u] * slot(tx*N + o + u), u < KP. A row is padded by TIME_WIDE_BANK_PAD slots every
// TIME_WIDE_BANK_RUN so that the 16-byte window reads of a quarter warp (threads N slots apart)
// hit distinct banks; p.row_slots is a row's padded length. The plan lays out the block's
// shared memory: the rows' slots first, the rows' taps at byte p.weights_at, the rows' segment
// ids (SEQ) at byte p.ids_at.
#include "fwd_common.cuh"

__device__ __forceinline__ int padded(int e) {
    return e + (int)((unsigned)e / TIME_WIDE_BANK_RUN * TIME_WIDE_BANK_PAD);
}

template <typename S>
__device__ __forceinline__ void smem_load4(const S* row, int e, S* v) {
    #pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = row[padded(e) + j];
}
__device__ __forceinline__ void smem_load4(const float* row, int e, float* v) {
    const float4 q = *reinterpret_cast<const float4*>(row + padded(e));
    v[0] = q.x; v[1] = q.y; v[2] = q.z; v[3] = q.w;
}

__device__ __forceinline__ void load4(const float* p, float* v) {  // 16-byte aligned p
    const float4 q = *reinterpret_cast<const float4*>(p);
    v[0] = q.x; v[1] = q.y; v[2] = q.z; v[3] = q.w;
}
__device__ __forceinline__ void load4(const double* p, double* v) {
    #pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = p[j];
}

// bias + the width taps of the output whose tap 0 is at slot e of row xs (skipping other
// segments when SEQ): the sum without the zero-padded taps. Out of line: it is rarely called.
template <bool SEQ, typename A>
__device__ __noinline__ A own_taps(const A* xs, const A* w, const int64* ids, int e, int width, int64 id,
                                   A bias) {
    A acc = bias;
    for (int k = 0; k < width; ++k)
        if (!SEQ || ids[padded(e + k)] == id) acc += w[k] * xs[padded(e + k)];
    return acc;
}

template <typename T, bool SEQ>
__global__ void __launch_bounds__(TIME_WIDE_THREADS)
    fwd_time_wide(FWD_ARRAYS, const __grid_constant__ FwdTimeWideParams p) {
    if (final_states_blocks(x, seq_idx, initial_states, final_states, p)) return;
    using A = typename AccOf<T>::type;
    constexpr int N = TIME_WIDE_BYTES / sizeof(T);  // outputs per thread
    constexpr int CH = TIME_WIDE_CHUNK;             // taps per chunk
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const int width = (int)p.width, weight_dtype = (int)p.weight_dtype, bias_dtype = (int)p.bias_dtype,
              silu_act = (int)p.silu_act, x_aligned = (int)p.x_aligned, out_aligned = (int)p.out_aligned;
    const int64 batch = p.batch, dim = p.dim, seqlen = p.seqlen, x_batch_stride = p.x_batch_stride,
                x_c_stride = p.x_c_stride, x_l_stride = p.x_l_stride, weight_c_stride = p.weight_c_stride,
                weight_width_stride = p.weight_width_stride, bias_stride = p.bias_stride,
                out_batch_stride = p.out_batch_stride, out_c_stride = p.out_c_stride, out_l_stride = p.out_l_stride;

    const int tx = threadIdx.x, ty = threadIdx.y;
    const int H = (int)p.halo;                        // halo slots
    const int OFF = H - (width - 1);                  // leading zero taps
    const int KP = (int)p.taps;                       // padded taps
    const int threads_per_row = blockDim.x;
    const int tile_len = threads_per_row * N;
    const int E = KP + tile_len;                      // slots per row (H + tile + slack)
    const int row_slots = (int)p.row_slots;
    A* const xs = reinterpret_cast<A*>(smem_raw) + ty * row_slots;
    A* const wsm = reinterpret_cast<A*>(smem_raw + p.weights_at) + ty * KP;
    int64* const sq = reinterpret_cast<int64*>(smem_raw + p.ids_at) + ty * row_slots;

    const int64 rows = batch * dim;
    const int64 n_chunks = (seqlen + tile_len - 1) / tile_len;
    const int64 n_tiles = (rows + blockDim.y - 1) / blockDim.y * n_chunks;
    for (int64 tile = blockIdx.x; tile < n_tiles; tile += p.main_blocks) {
        int64 rg, chunk;
        divmod(tile, n_chunks, rg, chunk);
        const int64 row = rg * blockDim.y + ty;
        const int64 t0 = chunk * tile_len;
        const bool row_ok = row < rows;
        int64 b = 0, c = 0;
        if (row_ok) divmod(row, dim, b, c);
        __syncthreads();  // the previous tile's readers are done
        if (row_ok) {
            const T* xr = x + b * x_batch_stride + c * x_c_stride;
            const int64 tt = t0 + tx * N;  // this thread's N positions go to slots H + tx*N ..
            A v[N];
            if (x_aligned && tt + N <= seqlen) {
                Vec<T> raw[N / Vec<T>::V];
                #pragma unroll
                for (int j = 0; j < N / Vec<T>::V; ++j) raw[j].raw = reinterpret_cast<const uint4*>(xr + tt)[j];
                #pragma unroll
                for (int i = 0; i < N; ++i) v[i] = to_acc(raw[i / Vec<T>::V].e[i % Vec<T>::V]);
            } else {
                #pragma unroll
                for (int i = 0; i < N; ++i) v[i] = tt + i < seqlen ? to_acc(xr[(tt + i) * x_l_stride]) : A(0);
            }
            #pragma unroll
            for (int i = 0; i < N; ++i) xs[padded(H + tx * N + i)] = v[i];
            for (int e = tx; e < H; e += threads_per_row) {  // the halo
                const int64 s = t0 - H + e;
                xs[padded(e)] = s < -(width - 1) ? A(0) : input_at<A>(x, initial_states, p, b, c, s);
            }
            for (int e = H + tile_len + tx; e < E; e += threads_per_row) xs[padded(e)] = A(0);  // slack
            if (SEQ) {
                for (int e = tx; e < E; e += threads_per_row) {
                    const int64 s = t0 - H + e;
                    sq[padded(e)] = s < seqlen ? segment_id(seq_idx, p, b, s) : -1;
                }
            }
            for (int u = tx; u < KP; u += threads_per_row)
                wsm[u] = u >= OFF && u < OFF + width
                             ? load_as<A>(weight, weight_dtype,
                                          c * weight_c_stride + (u - OFF) * weight_width_stride)
                             : A(0);
        }
        __syncthreads();
        const int64 tt = t0 + tx * N;
        if (!row_ok || tt >= seqlen) continue;

        A acc[N];
        const A bias_c = bias ? load_as<A>(bias, bias_dtype, c * bias_stride) : A(0);
        #pragma unroll
        for (int o = 0; o < N; ++o) acc[o] = bias_c;
        int64 sid[SEQ ? N : 1];
        if constexpr (SEQ) {
            #pragma unroll
            for (int o = 0; o < N; o += 4) smem_load4(sq, H + tx * N + o, sid + o);
        }
        for (int uc = 0; uc < KP; uc += CH) {
            A win[CH + N], wv[CH];
            #pragma unroll
            for (int j = 0; j < CH + N; j += 4) smem_load4(xs, tx * N + uc + j, win + j);
            #pragma unroll
            for (int j = 0; j < CH; j += 4) load4(wsm + uc + j, wv + j);
            if constexpr (SEQ) {
                int64 ids[CH + N];
                #pragma unroll
                for (int j = 0; j < CH + N; j += 4) smem_load4(sq, tx * N + uc + j, ids + j);
                #pragma unroll
                for (int u = 0; u < CH; ++u)
                    #pragma unroll
                    for (int o = 0; o < N; ++o)
                        if (ids[o + u] == sid[o]) acc[o] += wv[u] * win[o + u];
            } else {
                #pragma unroll
                for (int u = 0; u < CH; ++u)
                    #pragma unroll
                    for (int o = 0; o < N; ++o) acc[o] += wv[u] * win[o + u];
            }
        }
        // An input that is not finite also meets the zero-padded taps (0 inf = NaN): an output
        // that is not finite is computed again from its own width taps alone.
        bool nonfinite = false;
        #pragma unroll
        for (int o = 0; o < N; ++o) nonfinite |= !isfinite(acc[o]);
        if (nonfinite) {
            #pragma unroll
            for (int o = 0; o < N; ++o)
                if (!isfinite(acc[o]))
                    acc[o] = own_taps<SEQ>(xs, wsm + OFF, sq, tx * N + o + OFF, width, sid[SEQ ? o : 0], bias_c);
        }
        constexpr int VN = Vec<T>::V;
        Vec<T> res[N / VN];
        #pragma unroll
        for (int o = 0; o < N; ++o)
            res[o / VN].e[o % VN] = from_acc<T>(finish(acc[o], SEQ && sid[SEQ ? o : 0] < 0, silu_act));
        T* orow = out + b * out_batch_stride + c * out_c_stride;
        if (out_aligned && tt + N <= seqlen) {
            #pragma unroll
            for (int j = 0; j < N / VN; ++j) reinterpret_cast<uint4*>(orow + tt)[j] = res[j].raw;
        } else {
            #pragma unroll
            for (int o = 0; o < N; ++o)
                if (tt + o < seqlen) orow[(tt + o) * out_l_stride] = res[o / VN].e[o % VN];
        }
    }
}

