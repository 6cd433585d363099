// fwd.cu: the causal depthwise conv1d forward pass.
//
//   out[b,c,t] = act(bias[c] + sum_k weight[c,k] * h(b,c,t, t-(K-1)+k))
//
// h is the input the output at t may see at position s: x[b,c,s] for s >= 0, initial_states
// for s < 0, zero across a seq_idx boundary; a negative seq_idx marks padding (output 0).
//
// Kernels (all take one FwdParams struct, so one argument builder serves them; SEQ
// says whether seq_idx is given, so the common case carries no segment bookkeeping):
//   fwd_tc<T, K, SEQ>   time-contiguous x (x_l_stride == 1), width K <= 17. A warp owns a span
//                       of a row; each lane holds up to four 16-byte vectors of it, lane-
//                       interleaved so that every access is coalesced, and takes the K-1
//                       inputs before each vector from its neighbour lane by shuffles. No
//                       shared memory, no barrier.
//   fwd_wide<T, SEQ>    time-contiguous x, any width (run-time; used above 17). A block stages a
//                       tile of (rows) x (time) plus the K-1 halo in shared memory as A; each
//                       thread applies the taps, zero-padded to chunks of 16, to its N outputs.
//   fwd_cl<T, K, SEQ>   channel-contiguous x (x_c_stride == 1), width K <= 8. threadIdx.x owns
//                       V adjacent channels (one 8- or 16-byte vector), threadIdx.y a run of TT time
//                       steps, walked U rows at a time with the last K-1 rows kept in registers.
//   fwd_general<T>      any strides, any width: one thread per output.
//   fwd_final_states<T> final_states[b,c,j] = h(b,c,L-1, L-(K-1)+j): one thread per element.
// Every kernel loops over its work with a grid stride, so no grid dimension limits the shape,
// and every offset is 64-bit. x is read-only; out is written exactly once per element.
#include "common.cuh"

// The arguments of every forward kernel: the seven array pointers (null for absent inputs),
// then every size, stride, dtype code and flag by value in one struct of 8-byte fields
// (cupyconv/_dispatch.py: FWD_FIELDS has the same fields in the same order).
struct FwdParams {
    int64 batch, dim, seqlen, width;
    int64 x_batch_stride, x_c_stride, x_l_stride;
    int64 weight_c_stride, weight_width_stride, bias_stride;
    int64 seq_batch_stride, seq_l_stride;
    int64 init_batch_stride, init_c_stride, init_l_stride;
    int64 out_batch_stride, out_c_stride, out_l_stride;
    int64 final_batch_stride, final_c_stride, final_l_stride;
    int64 weight_dtype, bias_dtype, seq_dtype, init_dtype;
    int64 silu_act, x_vec, out_vec, tile_a;  // tile_a: a launch-shape parameter of each kernel
};

#define FWD_SIGNATURE                                                                        \
    const T* __restrict__ x, const void* __restrict__ weight, const void* __restrict__ bias, \
        const void* __restrict__ seq_idx, const void* __restrict__ initial_states,           \
        T* __restrict__ out, T* __restrict__ final_states, const __grid_constant__ FwdParams p

// Unpacks p into locals of the same names, so kernel bodies read like the math.
#define FWD_UNPACK                                                                              \
    const int64 batch = p.batch, dim = p.dim, seqlen = p.seqlen;                                \
    const int width = (int)p.width;                                                             \
    const int64 x_batch_stride = p.x_batch_stride, x_c_stride = p.x_c_stride,                   \
                x_l_stride = p.x_l_stride;                                                      \
    const int64 weight_c_stride = p.weight_c_stride, weight_width_stride = p.weight_width_stride; \
    const int64 bias_stride = p.bias_stride;                                                    \
    const int64 seq_batch_stride = p.seq_batch_stride, seq_l_stride = p.seq_l_stride;           \
    const int64 init_batch_stride = p.init_batch_stride, init_c_stride = p.init_c_stride,       \
                init_l_stride = p.init_l_stride;                                                \
    const int64 out_batch_stride = p.out_batch_stride, out_c_stride = p.out_c_stride,           \
                out_l_stride = p.out_l_stride;                                                  \
    const int64 final_batch_stride = p.final_batch_stride, final_c_stride = p.final_c_stride,   \
                final_l_stride = p.final_l_stride;                                              \
    const int weight_dtype = (int)p.weight_dtype, bias_dtype = (int)p.bias_dtype,               \
              seq_dtype = (int)p.seq_dtype, init_dtype = (int)p.init_dtype;                     \
    const int silu_act = (int)p.silu_act, x_vec = (int)p.x_vec, out_vec = (int)p.out_vec,       \
              tile_a = (int)p.tile_a;                                                           \
    (void)x_vec; (void)out_vec; (void)tile_a;                                                   \
    (void)final_batch_stride; (void)final_c_stride; (void)final_l_stride

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
    FWD_UNPACK;
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
    FWD_UNPACK;
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
// Helpers shared by the fast kernels.

// q = a / d, r = a % d for non-negative a, d; 32-bit arithmetic when both fit.
__device__ __forceinline__ void divmod(int64 a, int64 d, int64& q, int64& r) {
    if (((a | d) >> 31) == 0) {
        const unsigned ua = (unsigned)a, ud = (unsigned)d;
        q = ua / ud;
        r = ua - (unsigned)q * ud;
    } else {
        q = a / d;
        r = a - q * d;
    }
}

template <int BYTES> struct RawOf;
template <> struct RawOf<8> { using type = uint2; };
template <> struct RawOf<16> { using type = uint4; };

template <typename T, int BYTES = 16>
struct Vec {  // one vector of V elements of T, loaded and stored as one BYTES-wide access
    static constexpr int V = BYTES / sizeof(T);
    using Raw = typename RawOf<BYTES>::type;
    union { Raw raw; T e[V]; };
};

// ---------------------------------------------------------------------------------------------
// fwd_tc: time-contiguous rows, width K <= 17, everything in registers.
// A warp owns a span of 32 * tile_a vectors (VN elements each) of one row: vector j of lane l
// holds positions base + (32 j + l) VN .., so every load and store instruction of the warp is
// one contiguous 512-byte access. The K-1 inputs before a vector are the tail of the vector
// h = 1..HV places earlier, taken from lane l-h with a shuffle (from the previous column of
// lane l-h+32 for the first lanes, from memory before the span).
template <typename T, int K, bool SEQ>
__global__ void __launch_bounds__(256, SEQ || K > 4 || sizeof(T) == 8 ? 1 : 4) fwd_tc(FWD_SIGNATURE) {
    FWD_UNPACK;
    using A = typename AccOf<T>::type;
    constexpr int VN = Vec<T>::V;               // elements per 16-byte vector
    constexpr int MAXV = 4;                     // vectors per lane (tile_a <= MAXV at run time)
    constexpr int HV = (K - 1 + VN - 1) / VN;   // halo vectors
    constexpr int HE = HV * VN;                 // halo elements (>= K-1)
    constexpr int OFF = HE - (K - 1);           // window slot of tap 0 for output 0
    const int lane = threadIdx.x & 31;
    const int nv = tile_a;
    const int64 span = 32LL * nv * VN;
    const int64 spans = (seqlen + span - 1) / span;
    const int64 n_warps = batch * dim * spans;
    const int64 grid_warps = (int64)gridDim.x * (blockDim.x / 32);
    for (int64 wi = blockIdx.x * (int64)(blockDim.x / 32) + threadIdx.x / 32; wi < n_warps;
         wi += grid_warps) {
        int64 row, sp, b, c;
        divmod(wi, spans, row, sp);
        divmod(row, dim, b, c);
        const T* xr = x + b * x_batch_stride + c * x_c_stride;
        T* orow = out + b * out_batch_stride + c * out_c_stride;
        const int64 base = sp * span;

        Vec<T> cur[MAXV];
        #pragma unroll
        for (int j = 0; j < MAXV; ++j) {
            if (j >= nv) break;
            const int64 t = base + (32LL * j + lane) * VN;
            if (x_vec && t + VN <= seqlen) {
                cur[j].raw = *reinterpret_cast<const uint4*>(xr + t);
            } else {
                #pragma unroll
                for (int e = 0; e < VN; ++e)
                    cur[j].e[e] = t + e < seqlen ? xr[(t + e) * x_l_stride] : from_acc<T>(A(0));
            }
        }
        A w[K];
        with_dtype(weight, weight_dtype, [&](auto* p) {
            #pragma unroll
            for (int k = 0; k < K; ++k) w[k] = to_acc(p[c * weight_c_stride + k * weight_width_stride]);
        });
        const A bias_c = bias ? load_as<A>(bias, bias_dtype, c * bias_stride) : A(0);

        #pragma unroll
        for (int j = 0; j < MAXV; ++j) {
            if (j >= nv) break;
            const int64 t = base + (32LL * j + lane) * VN;
            A win[HE + VN];  // positions t-HE .. t+VN-1
            #pragma unroll
            for (int h = 1; h <= HV; ++h) {
                // Lane s serves lane s+h: its own column j, or column j-1 across the wrap.
                const uint4 give = lane + h < 32 || j == 0 ? cur[j].raw : cur[j > 0 ? j - 1 : 0].raw;
                const int from = (lane - h) & 31;
                Vec<T> got;
                got.raw.x = __shfl_sync(0xffffffffu, give.x, from);
                got.raw.y = __shfl_sync(0xffffffffu, give.y, from);
                got.raw.z = __shfl_sync(0xffffffffu, give.z, from);
                got.raw.w = __shfl_sync(0xffffffffu, give.w, from);
                const int64 th = t - h * VN;  // first position of halo vector h
                if (j == 0 && lane < h) {      // before the span: from memory
                    if (x_vec && th >= 0) {
                        got.raw = *reinterpret_cast<const uint4*>(xr + th);
                    } else {
                        #pragma unroll
                        for (int e = 0; e < VN; ++e)
                            got.e[e] = from_acc<T>(th + e >= 0 ? to_acc(xr[(th + e) * x_l_stride]) : A(0));
                    }
                }
                #pragma unroll
                for (int e = 0; e < VN; ++e) win[HE - h * VN + e] = to_acc(got.e[e]);
                if (th < 0) {  // positions before the row: initial_states (or zeros)
                    #pragma unroll
                    for (int e = 0; e < VN; ++e) {
                        const int64 s = th + e;
                        if (s < 0) win[HE - h * VN + e] = s < -(K - 1) ? A(0) : INPUT_AT(A, b, c, s);
                    }
                }
            }
            #pragma unroll
            for (int e = 0; e < VN; ++e) win[HE + e] = to_acc(cur[j].e[e]);
            int64 ids[SEQ ? HE + VN : 1];
            if constexpr (SEQ) {
                #pragma unroll
                for (int q = 0; q < HE + VN; ++q) {
                    const int64 s = t - HE + q;
                    ids[q] = s < seqlen ? SEQ_ID(b, s) : -1;
                }
            }
            Vec<T> res;
            #pragma unroll
            for (int o = 0; o < VN; ++o) {
                A acc = bias_c;
                #pragma unroll
                for (int k = 0; k < K; ++k) {
                    if constexpr (SEQ) {
                        if (ids[OFF + o + k] == ids[HE + o]) acc += w[k] * win[OFF + o + k];
                    } else {
                        acc += w[k] * win[OFF + o + k];
                    }
                }
                res.e[o] = from_acc<T>(finish(acc, SEQ && ids[SEQ ? HE + o : 0] < 0, silu_act));
            }
            if (out_vec && t + VN <= seqlen) {
                *reinterpret_cast<uint4*>(orow + t) = res.raw;
            } else {
                #pragma unroll
                for (int o = 0; o < VN; ++o)
                    if (t + o < seqlen) orow[(t + o) * out_l_stride] = res.e[o];
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// fwd_wide: time-contiguous tiles for wide filters. tile_a = threads per row (blockDim.x);
// blockDim.y rows per block. Row r of the tile lives in shared memory as E = KP + tile_a*N
// slots of A: slot e holds position t0 - H + e, H = K-1 rounded up to 4; the taps are
// zero-padded at the oldest end to KP = a multiple of CH slots, so output o of thread tx is
// sum_u wsm[u] * slot(tx*N + o + u), u < KP. Segment ids follow in a second array when SEQ.
// A row is padded by 4 slots every 32 so that the 16-byte window reads of a quarter warp
// (threads N slots apart) hit distinct banks.
__device__ __forceinline__ int padded(int e) { return e + ((e >> 5) << 2); }

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

template <typename T, bool SEQ>
__global__ void __launch_bounds__(128) fwd_wide(FWD_SIGNATURE) {
    FWD_UNPACK;
    using A = typename AccOf<T>::type;
    constexpr int N = 32 / sizeof(T);  // outputs per thread
    constexpr int CH = 16;             // taps per chunk
    extern __shared__ __align__(16) unsigned char smem_raw[];

    const int tx = threadIdx.x, ty = threadIdx.y;
    const int H = (width - 1 + 3) / 4 * 4;            // halo slots
    const int OFF = H - (width - 1);                  // leading zero taps
    const int KP = (H + 1 + CH - 1) / CH * CH;        // padded taps
    const int tile_len = tile_a * N;
    const int E = KP + tile_len;                      // slots per row (H + tile + slack)
    const int row_slots = padded((E + 31) / 32 * 32);
    A* const xs_all = reinterpret_cast<A*>(smem_raw);
    A* const xs = xs_all + ty * row_slots;
    A* const wsm = xs_all + blockDim.y * row_slots + ty * KP;
    int64* const sq = reinterpret_cast<int64*>(xs_all + blockDim.y * (row_slots + KP)) + ty * row_slots;

    const int64 rows = batch * dim;
    const int64 n_chunks = (seqlen + tile_len - 1) / tile_len;
    const int64 n_tiles = (rows + blockDim.y - 1) / blockDim.y * n_chunks;
    for (int64 tile = blockIdx.x; tile < n_tiles; tile += gridDim.x) {
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
            if (x_vec && tt + N <= seqlen) {
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
            for (int e = tx; e < H; e += tile_a) {  // the halo
                const int64 s = t0 - H + e;
                xs[padded(e)] = s < -(width - 1) ? A(0) : INPUT_AT(A, b, c, s);
            }
            for (int e = H + tile_len + tx; e < E; e += tile_a) xs[padded(e)] = A(0);  // slack
            if (SEQ) {
                for (int e = tx; e < E; e += tile_a) {
                    const int64 s = t0 - H + e;
                    sq[padded(e)] = s < seqlen ? SEQ_ID(b, s) : -1;
                }
            }
            for (int u = tx; u < KP; u += tile_a)
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
        constexpr int VN = Vec<T>::V;
        Vec<T> res[N / VN];
        #pragma unroll
        for (int o = 0; o < N; ++o)
            res[o / VN].e[o % VN] = from_acc<T>(finish(acc[o], SEQ && sid[SEQ ? o : 0] < 0, silu_act));
        T* orow = out + b * out_batch_stride + c * out_c_stride;
        if (out_vec && tt + N <= seqlen) {
            #pragma unroll
            for (int j = 0; j < N / VN; ++j) reinterpret_cast<uint4*>(orow + tt)[j] = res[j].raw;
        } else {
            #pragma unroll
            for (int o = 0; o < N; ++o)
                if (tt + o < seqlen) orow[(tt + o) * out_l_stride] = res[o / VN].e[o % VN];
        }
    }
}

// ---------------------------------------------------------------------------------------------
// fwd_cl: channel-contiguous tiles. tile_a = channel vectors per block (blockDim.x);
// blockDim.y runs of TT time steps. Tiles are ordered time-fastest so that neighbouring blocks
// share their halo rows in L2. Rows are kept as raw 16-byte vectors and converted at use.
template <typename T, int K, bool SEQ>
__global__ void __launch_bounds__(128, SEQ || K > 4 || sizeof(T) != 2 ? 1 : 6) fwd_cl(FWD_SIGNATURE) {
    FWD_UNPACK;
    using A = typename AccOf<T>::type;
    constexpr int BYTES = sizeof(T) == 2 ? 8 : 16;  // 4 half channels keep the registers low
    using VecT = Vec<T, BYTES>;
    using Raw = typename VecT::Raw;
    constexpr int V = VecT::V;    // channels per thread
    constexpr int U = 8;          // time steps loaded together
    constexpr int TT = 32;        // time steps per thread
    constexpr int W = K - 1;      // history rows kept in registers

    const int64 block_c = (int64)blockDim.x * V, block_t = (int64)blockDim.y * TT;
    const int64 n_cblk = (dim + block_c - 1) / block_c, n_tblk = (seqlen + block_t - 1) / block_t;
    const int64 n_tiles = batch * n_cblk * n_tblk;
    for (int64 tile = blockIdx.x; tile < n_tiles; tile += gridDim.x) {
        int64 bc, tblk, b, cblk;
        divmod(tile, n_tblk, bc, tblk);
        divmod(bc, n_cblk, b, cblk);
        const int64 c0 = cblk * block_c + threadIdx.x * V;
        const int64 ts = tblk * block_t + threadIdx.y * TT;
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
        // rows[0 .. W-1]: history (positions t0-W .. t0-1), rows[W ..]: the U new rows.
        VecT rows[W + U];
        int64 ids[SEQ ? W + U : 1];
        #pragma unroll
        for (int j = 0; j < W; ++j) {
            const int64 s = ts - W + j;
            #pragma unroll
            for (int v = 0; v < V; ++v)
                rows[j].e[v] = from_acc<T>(v < nc ? INPUT_AT(A, b, c0 + v, s) : A(0));
            if constexpr (SEQ) ids[j] = SEQ_ID(b, s);
        }
        const T* xb = x + b * x_batch_stride + c0 * x_c_stride;
        T* ob = out + b * out_batch_stride + c0 * out_c_stride;
        #pragma unroll 1
        for (int tt = 0; tt < TT && ts + tt < seqlen; tt += U) {
            const int64 t0 = ts + tt;
            const int nu = t0 + U <= seqlen ? U : (int)(seqlen - t0);  // valid new rows
            if (vec_in && nu == U) {
                #pragma unroll
                for (int u = 0; u < U; ++u)
                    rows[W + u].raw = *reinterpret_cast<const Raw*>(xb + (t0 + u) * x_l_stride);
            } else {
                #pragma unroll
                for (int u = 0; u < U; ++u)
                    #pragma unroll
                    for (int v = 0; v < V; ++v)
                        rows[W + u].e[v] = u < nu && v < nc ? xb[(t0 + u) * x_l_stride + v * x_c_stride]
                                                            : from_acc<T>(A(0));
            }
            if constexpr (SEQ) {
                #pragma unroll
                for (int u = 0; u < U; ++u) ids[W + u] = u < nu ? SEQ_ID(b, t0 + u) : -1;
            }
            #pragma unroll
            for (int u = 0; u < U; ++u) {
                VecT res;
                #pragma unroll
                for (int v = 0; v < V; ++v) {
                    A acc = bias_v[v];
                    #pragma unroll
                    for (int k = 0; k < K; ++k) {  // row t-(K-1)+k is rows[u + k]
                        if constexpr (SEQ) {
                            if (ids[u + k] == ids[W + u]) acc += w[k][v] * to_acc(rows[u + k].e[v]);
                        } else {
                            acc += w[k][v] * to_acc(rows[u + k].e[v]);
                        }
                    }
                    res.e[v] = from_acc<T>(finish(acc, SEQ && ids[SEQ ? W + u : 0] < 0, silu_act));
                }
                if (vec_out && u < nu) {
                    *reinterpret_cast<Raw*>(ob + (t0 + u) * out_l_stride) = res.raw;
                } else if (u < nu) {
                    #pragma unroll
                    for (int v = 0; v < V; ++v)
                        if (v < nc) ob[(t0 + u) * out_l_stride + v * out_c_stride] = res.e[v];
                }
            }
            #pragma unroll
            for (int j = 0; j < W; ++j) {  // slide the history by U rows
                rows[j] = rows[j + U];
                if constexpr (SEQ) ids[j] = ids[j + U];
            }
        }
    }
}
