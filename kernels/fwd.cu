// fwd.cu: the causal depthwise conv1d forward pass.
//
//   out[b,c,t] = act(bias[c] + sum_k weight[c,k] * h(b,c,t, t-(K-1)+k))
//
// h is the input the output at t may see at position s: x[b,c,s] for s >= 0, initial_states
// for s < 0, zero across a seq_idx boundary; a negative seq_idx marks padding (output 0).
//
// Kernels (all share one signature, FWD_SIGNATURE, so one argument builder serves them):
//   fwd_tc<T, K>       time-contiguous x (x_l_stride == 1). blockIdx.x = tile of
//                      (rows of (b, c)) x (a run of time); threadIdx.y = row in the tile,
//                      threadIdx.x owns N consecutive time steps of that row. The tile and a
//                      K-1 halo are staged in shared memory as floats; each thread reads its
//                      window back with 16-byte loads and computes N outputs in registers.
//   fwd_cl<T, K>       channel-contiguous x (x_c_stride == 1). threadIdx.x owns V adjacent
//                      channels (one 16-byte vector), threadIdx.y a run of TT time steps; the
//                      thread walks its run keeping the last K-1 rows in registers.
//   fwd_general<T>     any strides, any width (run-time K): one thread per output.
//   fwd_final_states<T> final_states[b,c,j] = h(b,c,L-1, L-(K-1)+j): one thread per element.
// Every kernel loops over its tiles with a grid stride, so no grid dimension limits the shape,
// and every offset is 64-bit. x is read-only; out is written exactly once per element.
#include "common.cuh"

#define FWD_SIGNATURE                                                                        \
    const T* __restrict__ x, const void* __restrict__ weight, const void* __restrict__ bias, \
        const void* __restrict__ seq_idx, const void* __restrict__ initial_states,           \
        T* __restrict__ out, T* __restrict__ final_states, int64 batch, int64 dim,           \
        int64 seqlen, int width, int64 x_batch_stride, int64 x_c_stride, int64 x_l_stride,   \
        int64 weight_c_stride, int64 weight_width_stride, int64 bias_stride,                 \
        int64 seq_batch_stride, int64 seq_l_stride, int64 init_batch_stride,                 \
        int64 init_c_stride, int64 init_l_stride, int64 out_batch_stride, int64 out_c_stride, \
        int64 out_l_stride, int64 final_batch_stride, int64 final_c_stride,                   \
        int64 final_l_stride, int weight_dtype, int bias_dtype, int seq_dtype, int init_dtype, \
        int silu_act, int x_vec, int out_vec, int tile_a

// ---------------------------------------------------------------------------------------------
// Shared pieces: h(b, c, t, s) for a single position, and the activation epilogue.

// Segment id of position s (s < 0 belongs to the first segment of the row).
#define SEQ_ID(b, s) \
    load_index(seq_idx, seq_dtype, (b) * seq_batch_stride + ((s) < 0 ? 0 : (s)) * seq_l_stride)

// The input at position s (s >= -(K-1)) of row (b, c), before seq_idx masking.
#define INPUT_AT(A, b, c, s)                                                                   \
    ((s) >= 0 ? to_acc(x[(b) * x_batch_stride + (c) * x_c_stride + (s) * x_l_stride])         \
     : initial_states                                                                          \
         ? load_as<A>(initial_states, init_dtype,                                              \
                      (b) * init_batch_stride + (c) * init_c_stride + (width - 1 + (s)) * init_l_stride) \
         : A(0))

template <typename A>
__device__ __forceinline__ A finish(A acc, bool padding, int silu_act) {
    if (padding) return A(0);
    return silu_act ? silu(acc) : acc;
}

// ---------------------------------------------------------------------------------------------
// fwd_general: one thread per output, any strides, run-time width.
// tile_a = 1 walks channels fastest (for channel-contiguous data), else time fastest.
template <typename T>
__global__ void fwd_general(FWD_SIGNATURE) {
    using A = typename AccOf<T>::type;
    const int64 total = batch * dim * seqlen;
    for (int64 i = blockIdx.x * (int64)blockDim.x + threadIdx.x; i < total;
         i += (int64)gridDim.x * blockDim.x) {
        int64 b, c, t;
        if (tile_a) {
            c = i % dim;
            t = (i / dim) % seqlen;
            b = i / (dim * seqlen);
        } else {
            t = i % seqlen;
            c = (i / seqlen) % dim;
            b = i / (dim * seqlen);
        }
        const int64 sid = seq_idx ? SEQ_ID(b, t) : 0;
        A acc = bias ? load_as<A>(bias, bias_dtype, c * bias_stride) : A(0);
        for (int k = 0; k < width; ++k) {
            const int64 s = t - (width - 1) + k;
            if (seq_idx && SEQ_ID(b, s) != sid) continue;
            acc += load_as<A>(weight, weight_dtype, c * weight_c_stride + k * weight_width_stride) *
                   INPUT_AT(A, b, c, s);
        }
        out[b * out_batch_stride + c * out_c_stride + t * out_l_stride] =
            from_acc<T>(finish(acc, sid < 0, silu_act));
    }
}

// ---------------------------------------------------------------------------------------------
// fwd_final_states: final_states[b,c,j] = h(b, c, L-1, L-(K-1)+j), j < K-1.
template <typename T>
__global__ void fwd_final_states(FWD_SIGNATURE) {
    using A = typename AccOf<T>::type;
    const int64 n_state = width - 1;
    const int64 total = batch * dim * n_state;
    for (int64 i = blockIdx.x * (int64)blockDim.x + threadIdx.x; i < total;
         i += (int64)gridDim.x * blockDim.x) {
        const int64 j = i % n_state, c = (i / n_state) % dim, b = i / (n_state * dim);
        const int64 s = seqlen - n_state + j;
        A v = INPUT_AT(A, b, c, s);
        if (seq_idx) {
            const int64 sid = SEQ_ID(b, seqlen - 1);
            if (sid < 0 || SEQ_ID(b, s) != sid) v = A(0);
        }
        final_states[b * final_batch_stride + c * final_c_stride + j * final_l_stride] =
            from_acc<T>(v);
    }
}

// ---------------------------------------------------------------------------------------------
// Shared-memory helpers for fwd_tc. A row of the tile is padded by 4 slots every 32 so that the
// 16-byte window reads of a quarter warp (threads N elements apart) hit distinct banks.
__device__ __forceinline__ int padded(int e) { return e + ((e >> 5) << 2); }

__device__ __forceinline__ void smem_load4(const float* row, int e, float* v) {
    const float4 q = *reinterpret_cast<const float4*>(row + padded(e));
    v[0] = q.x; v[1] = q.y; v[2] = q.z; v[3] = q.w;
}
__device__ __forceinline__ void smem_load4(const double* row, int e, double* v) {
    const double2 p = *reinterpret_cast<const double2*>(row + padded(e));
    const double2 q = *reinterpret_cast<const double2*>(row + padded(e) + 2);
    v[0] = p.x; v[1] = p.y; v[2] = q.x; v[3] = q.y;
}
__device__ __forceinline__ void smem_load4(const int64* row, int e, int64* v) {
    #pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = row[padded(e) + j];
}

// fwd_tc: time-contiguous tiles. tile_a = threads per row (blockDim.x); blockDim.y rows.
// Two forms: KC == 0 has the exact width K as a template parameter (K <= 17, weights in
// registers); K == 0 is for wide filters: the width is the run-time `width`, and the taps are
// zero-padded at the oldest end to KC chunks of CH = 16, applied chunk by chunk from shared memory.
// Shared memory per row: E = H + tile_a*N (+ KP - H for wide filters) slots of A, then the same
// count of int64 segment ids when seq_idx is given, then KP weights for wide filters.
template <typename T, int K, int KC>
__global__ void __launch_bounds__(128) fwd_tc(FWD_SIGNATURE) {
    using A = typename AccOf<T>::type;
    constexpr int N = 32 / sizeof(T);                  // outputs per thread: two 16-byte vectors
    constexpr bool CHUNKED = KC > 0;
    constexpr int CH = 16;
    constexpr int KP = KC * CH;                        // zero-padded tap count (wide filters)
    const int H = (width - 1 + 3) / 4 * 4;             // halo slots, a multiple of 4
    const int OFF = H - (width - 1);                   // unused leading halo slots
    extern __shared__ __align__(16) unsigned char smem_raw[];

    const int tx = threadIdx.x, ty = threadIdx.y;
    const int tile_len = tile_a * N;
    const int E = H + tile_len + (CHUNKED ? KP - H : 0);
    const int row_slots = padded((E + 31) / 32 * 32);
    A* xs = reinterpret_cast<A*>(smem_raw) + ty * row_slots;
    int64* sq = reinterpret_cast<int64*>(reinterpret_cast<A*>(smem_raw) + blockDim.y * row_slots) +
                ty * row_slots;
    A* wsm = reinterpret_cast<A*>(smem_raw) + blockDim.y * row_slots + ty * KP;
    if (CHUNKED && seq_idx) wsm += blockDim.y * row_slots * (sizeof(int64) / sizeof(A));

    const int64 rows = batch * dim;
    const int64 n_chunks = (seqlen + tile_len - 1) / tile_len;
    const int64 n_tiles = (rows + blockDim.y - 1) / blockDim.y * n_chunks;
    for (int64 tile = blockIdx.x; tile < n_tiles; tile += gridDim.x) {
        const int64 row = tile / n_chunks * blockDim.y + ty;
        const int64 t0 = tile % n_chunks * tile_len;
        const bool row_ok = row < rows;
        const int64 b = row / dim, c = row % dim;
        __syncthreads();  // the previous tile's readers are done with xs
        if (row_ok) {
            const T* xrow = x + b * x_batch_stride + c * x_c_stride;
            // This thread's N inputs, positions t0 + tx*N + i, stored at slot H + tx*N + i.
            const int64 tt = t0 + tx * N;
            A v[N];
            if (x_vec && tt + N <= seqlen) {
                T raw[N];
                const uint4* src = reinterpret_cast<const uint4*>(xrow + tt);
                reinterpret_cast<uint4*>(raw)[0] = src[0];
                reinterpret_cast<uint4*>(raw)[1] = src[1];
                #pragma unroll
                for (int i = 0; i < N; ++i) v[i] = to_acc(raw[i]);
            } else {
                #pragma unroll
                for (int i = 0; i < N; ++i)
                    v[i] = tt + i < seqlen ? to_acc(xrow[(tt + i) * x_l_stride]) : A(0);
            }
            #pragma unroll
            for (int i = 0; i < N; ++i) xs[padded(H + tx * N + i)] = v[i];
            // The halo (and the zero slack past the tile for the chunked path).
            for (int e = tx; e < H; e += tile_a) {
                const int64 s = t0 - H + e;
                xs[padded(e)] = s >= -(width - 1) ? INPUT_AT(A, b, c, s) : A(0);
            }
            for (int e = H + tile_len + tx; e < E; e += tile_a) xs[padded(e)] = A(0);
            if (seq_idx) {
                for (int e = tx; e < E; e += tile_a) {
                    const int64 s = t0 - H + e;
                    sq[padded(e)] = s < seqlen ? SEQ_ID(b, s) : -1;
                }
            }
            if (CHUNKED) {
                for (int u = tx; u < KP; u += tile_a)
                    wsm[u] = u >= OFF && u < OFF + width
                                 ? load_as<A>(weight, weight_dtype,
                                              c * weight_c_stride + (u - OFF) * weight_width_stride)
                                 : A(0);
            }
        }
        __syncthreads();
        if (!row_ok || t0 + tx * N >= seqlen) continue;

        A acc[N];
        const A bias_c = bias ? load_as<A>(bias, bias_dtype, c * bias_stride) : A(0);
        #pragma unroll
        for (int i = 0; i < N; ++i) acc[i] = bias_c;
        int64 sid[N];
        if (seq_idx) {
            #pragma unroll
            for (int i = 0; i < N; i += 4) smem_load4(sq, H + tx * N + i, sid + i);
        }
        if constexpr (!CHUNKED) {
            // Window slots tx*N .. tx*N + N + H - 1; output i, tap k reads slot i + OFF + k.
            constexpr int H = (K - 1 + 3) / 4 * 4, OFF = H - (K - 1);
            A w[K];
            with_dtype(weight, weight_dtype, [&](auto* p) {
                #pragma unroll
                for (int k = 0; k < K; ++k) w[k] = to_acc(p[c * weight_c_stride + k * weight_width_stride]);
            });
            A win[N + H];
            #pragma unroll
            for (int j = 0; j < N + H; j += 4) smem_load4(xs, tx * N + j, win + j);
            if (!seq_idx) {
                #pragma unroll
                for (int i = 0; i < N; ++i)
                    #pragma unroll
                    for (int k = 0; k < K; ++k) acc[i] += w[k] * win[i + OFF + k];
            } else {
                int64 ids[N + H];
                #pragma unroll
                for (int j = 0; j < N + H; j += 4) smem_load4(sq, tx * N + j, ids + j);
                #pragma unroll
                for (int i = 0; i < N; ++i)
                    #pragma unroll
                    for (int k = 0; k < K; ++k)
                        acc[i] += ids[i + OFF + k] == sid[i] ? w[k] * win[i + OFF + k] : A(0);
            }
        } else {
            // out i = sum_u wsm[u] * slot(tx*N + i + u), u < KP, in chunks of CH taps.
            for (int uc = 0; uc < KP; uc += CH) {
                A win[CH + N], wv[CH];
                #pragma unroll
                for (int j = 0; j < CH + N; j += 4) smem_load4(xs, tx * N + uc + j, win + j);
                #pragma unroll
                for (int j = 0; j < CH; ++j) wv[j] = wsm[uc + j];
                if (!seq_idx) {
                    #pragma unroll
                    for (int u = 0; u < CH; ++u)
                        #pragma unroll
                        for (int i = 0; i < N; ++i) acc[i] += wv[u] * win[i + u];
                } else {
                    int64 ids[CH + N];
                    #pragma unroll
                    for (int j = 0; j < CH + N; j += 4) smem_load4(sq, tx * N + uc + j, ids + j);
                    #pragma unroll
                    for (int u = 0; u < CH; ++u)
                        #pragma unroll
                        for (int i = 0; i < N; ++i)
                            acc[i] += ids[i + u] == sid[i] ? wv[u] * win[i + u] : A(0);
                }
            }
        }

        const int64 tt = t0 + tx * N;
        T res[N];
        #pragma unroll
        for (int i = 0; i < N; ++i) res[i] = from_acc<T>(finish(acc[i], seq_idx && sid[i] < 0, silu_act));
        T* orow = out + b * out_batch_stride + c * out_c_stride;
        if (out_vec && tt + N <= seqlen) {
            uint4* dst = reinterpret_cast<uint4*>(orow + tt);
            dst[0] = reinterpret_cast<const uint4*>(res)[0];
            dst[1] = reinterpret_cast<const uint4*>(res)[1];
        } else {
            #pragma unroll
            for (int i = 0; i < N; ++i)
                if (tt + i < seqlen) orow[(tt + i) * out_l_stride] = res[i];
        }
    }
}

// ---------------------------------------------------------------------------------------------
// fwd_cl: channel-contiguous tiles. tile_a = channel vectors per block (blockDim.x);
// blockDim.y runs of TT time steps. Tiles are ordered time-fastest so that neighbouring blocks
// share their halo rows in L2.
template <typename T>
struct Vec {  // one 16-byte vector of V elements of T
    static constexpr int V = 16 / sizeof(T);
    union { uint4 raw; T e[V]; };
};

template <typename T, int K>
__global__ void __launch_bounds__(128) fwd_cl(FWD_SIGNATURE) {
    using A = typename AccOf<T>::type;
    constexpr int V = Vec<T>::V;  // channels per thread
    constexpr int U = 8;          // time steps loaded together
    constexpr int TT = 4 * U;     // time steps per thread
    constexpr int W = K - 1;      // history rows kept in registers
    constexpr int WR = W > 0 ? W : 1;

    const int64 block_c = (int64)blockDim.x * V, block_t = (int64)blockDim.y * TT;
    const int64 n_cblk = (dim + block_c - 1) / block_c, n_tblk = (seqlen + block_t - 1) / block_t;
    const int64 n_tiles = batch * n_cblk * n_tblk;
    for (int64 tile = blockIdx.x; tile < n_tiles; tile += gridDim.x) {
        const int64 b = tile / (n_cblk * n_tblk);
        const int64 c0 = (tile / n_tblk) % n_cblk * block_c + threadIdx.x * V;
        const int64 ts = tile % n_tblk * block_t + threadIdx.y * TT;
        if (c0 >= dim || ts >= seqlen) continue;
        const int nc = c0 + V <= dim ? V : (int)(dim - c0);
        const bool vec_in = x_vec && nc == V, vec_out = out_vec && nc == V;

        A w[K][V], bias_v[V];
        with_dtype(weight, weight_dtype, [&](auto* p) {
            #pragma unroll
            for (int v = 0; v < V; ++v)
                #pragma unroll
                for (int k = 0; k < K; ++k)
                    w[k][v] = to_acc(p[(v < nc ? c0 + v : c0) * weight_c_stride + k * weight_width_stride]);
        });
        #pragma unroll
        for (int v = 0; v < V; ++v)
            bias_v[v] = bias ? load_as<A>(bias, bias_dtype, (v < nc ? c0 + v : c0) * bias_stride) : A(0);
        // rows[0 .. W-1]: history (positions ts+tt-W ..), rows[W ..]: the U new rows; ids alike.
        A rows[W + U][V];
        int64 ids[W + U];
        #pragma unroll
        for (int j = 0; j < W; ++j) {
            const int64 s = ts - W + j;
            #pragma unroll
            for (int v = 0; v < V; ++v) rows[j][v] = v < nc ? INPUT_AT(A, b, c0 + v, s) : A(0);
            ids[j] = seq_idx ? SEQ_ID(b, s) : 0;
        }
        const T* xb = x + b * x_batch_stride + c0 * x_c_stride;
        T* ob = out + b * out_batch_stride + c0 * out_c_stride;
        #pragma unroll 1
        for (int tt = 0; tt < TT && ts + tt < seqlen; tt += U) {
            const int64 t0 = ts + tt;
            const int nu = t0 + U <= seqlen ? U : (int)(seqlen - t0);  // valid new rows
            if (vec_in && nu == U) {
                Vec<T> raw[U];
                #pragma unroll
                for (int u = 0; u < U; ++u)
                    raw[u].raw = *reinterpret_cast<const uint4*>(xb + (t0 + u) * x_l_stride);
                #pragma unroll
                for (int u = 0; u < U; ++u)
                    #pragma unroll
                    for (int v = 0; v < V; ++v) rows[W + u][v] = to_acc(raw[u].e[v]);
            } else {
                #pragma unroll
                for (int u = 0; u < U; ++u)
                    #pragma unroll
                    for (int v = 0; v < V; ++v)
                        rows[W + u][v] = u < nu && v < nc
                                             ? to_acc(xb[(t0 + u) * x_l_stride + v * x_c_stride])
                                             : A(0);
            }
            if (seq_idx) {
                #pragma unroll
                for (int u = 0; u < U; ++u) ids[W + u] = u < nu ? SEQ_ID(b, t0 + u) : -1;
            }
            #pragma unroll
            for (int u = 0; u < U; ++u) {
                Vec<T> res;
                #pragma unroll
                for (int v = 0; v < V; ++v) {
                    A acc = bias_v[v];
                    #pragma unroll
                    for (int k = 0; k < K; ++k)  // row t-(K-1)+k is rows[u + k]
                        if (!seq_idx || ids[u + k] == ids[W + u]) acc += w[k][v] * rows[u + k][v];
                    res.e[v] = from_acc<T>(finish(acc, seq_idx && ids[W + u] < 0, silu_act));
                }
                if (vec_out && u < nu) {
                    *reinterpret_cast<uint4*>(ob + (t0 + u) * out_l_stride) = res.raw;
                } else if (u < nu) {
                    #pragma unroll
                    for (int v = 0; v < V; ++v)
                        if (v < nc) ob[(t0 + u) * out_l_stride + v * out_c_stride] = res.e[v];
                }
            }
            #pragma unroll
            for (int j = 0; j < W; ++j) {  // slide the history by U rows
                #pragma unroll
                for (int v = 0; v < V; ++v) rows[j][v] = rows[j + U][v];
                ids[j] = ids[j + U];
            }
        }
    }
}
