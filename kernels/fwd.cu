// fwd.cu: the causal depthwise conv1d forward pass.
//
//   out[b,c,t] = act(bias[c] + sum_k weight[c,k] * h(b,c,t, t-(K-1)+k))
//
// h is the input the output at t may see at position s: x[b,c,s] for s >= 0, initial_states
// for s < 0, zero across a seq_idx boundary; a negative seq_idx marks padding (output 0).
//
// Kernels (all take one FwdParams struct, so one argument builder serves them; SEQ
// says whether seq_idx is given, so the common case carries no segment bookkeeping):
//   fwd_tc<T, K, SEQ, NV>
//                       time-contiguous x (x_l_stride == 1), width K <= 17. A warp computes a
//                       chunk of 32 NV 16-byte vectors of a row, held in registers with halos
//                       shuffled from the lane before (one-vector halos), else staged.
//   fwd_mma<T, KS>      time-contiguous 16-bit x, widths 18 to 16 (KS - 1) + 1 <= 129, no
//                       seq_idx: banded Toeplitz products on tensor cores (m16n8k16 MMAs).
//   fwd_wide<T, SEQ>    time-contiguous x, any width (run-time; used above 17). A block stages a
//                       tile of (rows) x (time) plus the K-1 halo in shared memory as A; each
//                       thread applies the taps, zero-padded to chunks of 16, to its N outputs.
//   fwd_cl<T, K, SEQ, R>
//                       channel-contiguous x (x_c_stride == 1) in aligned lane vectors, width
//                       K <= 8. A warp computes a tile of R time steps x 32 channel vectors.
//   fwd_cl_wide<T>      channel-contiguous x, any width (run-time; used above 8), no seq_idx: a
//                       block stages a tile of time x 32 channels (and their weights) in
//                       shared memory; lanes compute adjacent channels, 8 outputs at a time.
//   fwd_general<T>      any strides, any width: a run of 8 outputs per thread.
//   fwd_final_states<T> final_states[b,c,j] = h(b,c,L-1, L-(K-1)+j): one thread per element.
// Every kernel loops over its work grid-stride, so no grid dimension limits the shape, and
// every offset is 64-bit. x is read-only; out is written exactly once per element.
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
    int64 div_a, div_b;  // fast divisors (common.cuh: divmod_fast) of a kernel's work index
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
    const int64 div_a = p.div_a, div_b = p.div_b;                                               \
    (void)x_vec; (void)out_vec; (void)tile_a; (void)div_a; (void)div_b;                         \
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
// fwd_general: any strides, run-time width. A thread computes a run of R consecutive outputs
// of one row: each tap is loaded once per run, and the inputs slide through a window of R
// registers (one new input per tap). tile_a = 1 numbers the runs channels fastest (for
// channel-contiguous data: a warp's loads are coalesced), else time fastest.
template <typename T>
__global__ void fwd_general(FWD_SIGNATURE) {
    FWD_UNPACK;
    using A = typename AccOf<T>::type;
    constexpr int R = 8;
    const int64 n_runs = (seqlen + R - 1) / R;
    const int64 total = batch * dim * n_runs;
    for (int64 i = blockIdx.x * (int64)blockDim.x + threadIdx.x; i < total;
         i += (int64)gridDim.x * blockDim.x) {
        int64 b, c, run;
        if (tile_a) {
            c = i % dim;
            run = (i / dim) % n_runs;
            b = i / (dim * n_runs);
        } else {
            run = i % n_runs;
            c = (i / n_runs) % dim;
            b = i / (dim * n_runs);
        }
        const int64 t0 = run * R;
        // Input (and segment id) at position s of the row: zero past the end.
        auto input = [&](int64 s) { return s < seqlen ? INPUT_AT(A, b, c, s) : A(0); };
        auto seg = [&](int64 s) { return s < seqlen ? SEQ_ID(b, s) : (int64)-1; };
        A acc[R], win[R];
        int64 sid[R], ids[R];
        const A bias_c = bias ? load_as<A>(bias, bias_dtype, c * bias_stride) : A(0);
        #pragma unroll
        for (int r = 0; r < R; ++r) {  // window of tap 0: positions t0 + r - (K-1)
            acc[r] = bias_c;
            win[r] = input(t0 + r - (width - 1));
            if (seq_idx) {
                sid[r] = seg(t0 + r);
                ids[r] = seg(t0 + r - (width - 1));
            }
        }
        #pragma unroll 1
        for (int k = 0; k < width; ++k) {
            const A wk = load_as<A>(weight, weight_dtype, c * weight_c_stride + k * weight_width_stride);
            #pragma unroll
            for (int r = 0; r < R; ++r)
                if (!seq_idx || ids[r] == sid[r]) acc[r] += wk * win[r];
            const int64 s_next = t0 + R - (width - 1) + k;  // enters the window for tap k + 1
            #pragma unroll
            for (int r = 0; r + 1 < R; ++r) {
                win[r] = win[r + 1];
                if (seq_idx) ids[r] = ids[r + 1];
            }
            if (k + 1 < width) {
                win[R - 1] = input(s_next);
                if (seq_idx) ids[R - 1] = seg(s_next);
            }
        }
        T* const orow = out + b * out_batch_stride + c * out_c_stride;
        #pragma unroll
        for (int r = 0; r < R; ++r)
            if (t0 + r < seqlen)
                orow[(t0 + r) * out_l_stride] = from_acc<T>(finish(acc[r], seq_idx && sid[r] < 0, silu_act));
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

// Warps per block of fwd_tc (by its vectors per lane) and fwd_cl, which size their per-warp
// shared memory statically (cupyconv/_dispatch.py: TC_BLOCK_WARPS, STAGED_THREADS). A block
// holds its registers until its last warp is done: fwd_tc's long chunks run one warp a block
// (its short ones four, since an SM holds at most 32 blocks).
__host__ __device__ constexpr int tc_block_warps(int NV) { return NV > 2 ? 1 : 4; }
constexpr int CL_BLOCK_WARPS = 4;

template <typename T, int BYTES = 16>
struct Vec {  // one vector of V elements of T, loaded and stored as one BYTES-wide access
    static constexpr int V = BYTES / sizeof(T);
    using Raw = typename RawOf<BYTES>::type;
    union { Raw raw; T e[V]; };
};

// ---------------------------------------------------------------------------------------------
// fwd_tc: time-contiguous rows, width K <= 17. Rows are cut into chunks of 32 NV vectors of VN
// elements (16 bytes each), one chunk per warp, handed out in order so that the warps in
// flight sweep x front to back. Lane l owns the vectors l, l + 32, ... of its chunk, and all
// of the chunk is requested before any of it is computed (every access a coalesced 16-byte
// vector); lanes 32 - HV .. 31 also fetch the HV vectors before the chunk. With a one-vector
// halo (HV = 1) the chunk is held in registers and a vector's halo is shuffled from the lane
// before it; wider halos come from the chunk staged in the warp's shared memory by cp.async.
// Misaligned rows, and a row whose end cuts a vector, are staged element by element instead
// and stored element by element; positions before the row are zeros or initial_states.
// Warps per SM that fwd_tc's register budget is set for: short chunks held in registers need
// more warps in flight; seq_idx and float64 need more registers per thread.
__host__ __device__ constexpr int tc_warps(int K, bool SEQ, int NV, int bytes) {
    return bytes == 8 ? 16 : SEQ ? 20 : NV <= 2 && K - 1 <= 16 / bytes ? 40 : 28;
}

template <typename T, int K, bool SEQ, int NV>
__global__ void __launch_bounds__(32 * tc_block_warps(NV),
                                  tc_warps(K, SEQ, NV, sizeof(T)) / tc_block_warps(NV))
    fwd_tc(FWD_SIGNATURE) {
    FWD_UNPACK;
    using A = typename AccOf<T>::type;
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
    __shared__ Raw stage_mem[tc_block_warps(NV)][HV + 32 * NV];
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
                const int64 p = t - HE + q;
                ids[q] = p < seqlen ? SEQ_ID(b, p) : -1;
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

    for (int64 g = grid_warp(); g < n_chunks; g += grid_warps()) {
        int64 row, chunk, b, c;
        divmod_fast(g, chunks_per_row, div_a, row, chunk);
        divmod_fast(row, dim, div_b, b, c);
        const int64 start = chunk * span;
        const int n = (int)min(seqlen - start, (int64)span);  // elements of the chunk in the row
        const T* const xr = x + b * x_batch_stride + c * x_c_stride;
        T* const orow = out + b * out_batch_stride + c * out_c_stride;

        // Whole vectors: every vector is inside the row or after it.
        const bool whole = n == span || seqlen % VN == 0;
        const bool x_vectors = x_vec && whole, out_vectors = out_vec && whole;
        const int used = (n + VN - 1) / VN * VN;  // elements of the chunk's vectors that hold any
        __syncwarp();  // the stage's last readers are done
        if (!x_vectors) {  // stage the chunk and its halo element by element
            #pragma unroll 1
            for (int e = lane; e < HE + used; e += 32) {
                const int64 p = start - HE + e;
                stage_e[e] = p >= 0 && p < seqlen ? xr[p] : T();  // (x_l_stride != 1: one element)
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
                    const int p = i - HE + q;
                    if (p < 0) win[q] = INPUT_AT(A, b, c, p);
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
// fwd_cl: channel-contiguous x (x_c_stride == 1) whose rows are aligned to the lane vectors and
// whose dim is a multiple of V, width K <= 8, in registers. A warp computes a tile of R time
// steps x 32 V channels: lane l owns V adjacent channels, one 8- or 16-byte vector per time
// step. It stages the tile's R rows and the K-1 rows before them in shared memory by cp.async
// (each a coalesced vector per lane) before computing any, then slides a window of K rows
// down the tile. Tiles are numbered channels fastest, then time, then batch row, one per warp,
// and handed out in order, so that the warps in flight sweep x front to back. Lanes past dim
// idle.
template <typename T, int K, bool SEQ, int R>
__global__ void __launch_bounds__(32 * CL_BLOCK_WARPS, (SEQ || K > 4 ? 16 : 28) / CL_BLOCK_WARPS)
    fwd_cl(FWD_SIGNATURE) {
    FWD_UNPACK;
    using A = typename AccOf<T>::type;
    constexpr int BYTES = sizeof(T) == 2 ? 8 : 16;  // 4 half channels keep the registers low
    using VecT = Vec<T, BYTES>;
    using Raw = typename VecT::Raw;
    constexpr int V = VecT::V;  // channels per lane
    constexpr int W = K - 1;    // rows before the tile
    constexpr int ROWS = W + R;
    const int lane = threadIdx.x & 31;
    __shared__ Raw stage_mem[CL_BLOCK_WARPS][ROWS * 32];  // per warp: the tile's rows, lane-interleaved
    Raw* const stage = stage_mem[threadIdx.x / 32] + lane;
    const A scale = act_scale<A>(silu_act);
    const bool weight_run = weight_c_stride == K && (K == 1 || weight_width_stride == 1);
    const int64 n_strips = (dim + 32 * V - 1) / (32 * V);
    const int64 steps_per_row = (seqlen + R - 1) / R;
    const int64 n_tiles = batch * steps_per_row * n_strips;

    for (int64 g = grid_warp(); g < n_tiles; g += grid_warps()) {
        int64 bt, strip, b, step;
        divmod_fast(g, n_strips, div_a, bt, strip);
        divmod_fast(bt, steps_per_row, div_b, b, step);
        const int64 t0 = step * R;
        const int64 c0 = strip * (32 * V) + lane * V;
        if (c0 >= dim) continue;  // (nothing below is collective)
        const T* const xb = x + b * x_batch_stride + c0;

        // Stage rows t0 - W .. t0 + R - 1 (stage rows 0 .. ROWS - 1): those from lo to hi - 1
        // are in the row, the others are zero-filled. A lane reads back only its own slots.
        const int lo = (int)max(W - t0, (int64)0), hi = (int)min(seqlen - t0 + W, (int64)ROWS);
        auto stage_rows = [&](bool inside) {
            const T* src = xb + (t0 - W + lo) * x_l_stride;
            #pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                const bool in_row = inside || (r >= lo && r < hi);
                cp_async<BYTES>(stage + 32 * r, in_row ? src : xb, in_row ? BYTES : 0);
                if (in_row) src += x_l_stride;
            }
        };
        if (lo == 0 && hi == ROWS) stage_rows(true);
        else stage_rows(false);
        cp_async_commit();
        // Weights and bias, scaled for the activation: a lane's V K weights (and V biases) in
        // a few wide loads when they are consecutive in memory, else one by one.
        A w[K][V], bias_v[V] = {};
        with_dtype(weight, weight_dtype, [&](auto* wp) {
            const auto* wc = wp + c0 * weight_c_stride;
            if (weight_run && run_aligned<V * K>(wp)) {
                A run[V * K];
                load_run<V * K>(wc, run);
                #pragma unroll
                for (int v = 0; v < V; ++v)
                    #pragma unroll
                    for (int k = 0; k < K; ++k) w[k][v] = run[v * K + k];
            } else {
                #pragma unroll
                for (int v = 0; v < V; ++v, wc += weight_c_stride)
                    #pragma unroll
                    for (int k = 0; k < K; ++k) w[k][v] = A(to_acc(wc[k * weight_width_stride]));
            }
        });
        if (bias) {
            with_dtype(bias, bias_dtype, [&](auto* bp) {
                if (bias_stride == 1 && run_aligned<V>(bp)) {
                    load_run<V>(bp + c0, bias_v);
                } else {
                    #pragma unroll
                    for (int v = 0; v < V; ++v) bias_v[v] = A(to_acc(bp[(c0 + v) * bias_stride]));
                }
            });
        }
        #pragma unroll
        for (int v = 0; v < V; ++v) {
            bias_v[v] *= scale;
            #pragma unroll
            for (int k = 0; k < K; ++k) w[k][v] *= scale;
        }
        int64 ids[SEQ ? ROWS : 1];  // segment ids of the stage rows
        if constexpr (SEQ) {
            #pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                const int64 p = t0 - W + r;
                ids[r] = p < seqlen ? SEQ_ID(b, p) : -1;
            }
        }

        cp_async_wait<0>();
        A win[K][V];  // rows r - W .. r, widened, for output row r
        #pragma unroll
        for (int r = 0; r < W; ++r) {
            VecT row;
            row.raw = stage[32 * r];
            widen<T, A, V>(row.e, win[r + 1]);
        }
        if (initial_states && lo > 0) {  // the rows before the row: states, never x (INPUT_AT's
                                         // x branch here costs registers and spills)
            #pragma unroll
            for (int r = 0; r < W; ++r)
                #pragma unroll
                for (int v = 0; v < V; ++v)
                    if (r < lo)
                        win[r + 1][v] = load_as<A>(initial_states, init_dtype,
                                                   b * init_batch_stride + (c0 + v) * init_c_stride +
                                                       (width - 1 + t0 - W + r) * init_l_stride);
        }
        T* o = out + b * out_batch_stride + c0 * out_c_stride + t0 * out_l_stride;
        const int n_out = hi - W;  // rows of the tile in the row
        #pragma unroll
        for (int r = W; r < ROWS; ++r, o += out_l_stride) {
            #pragma unroll
            for (int k = 0; k < W; ++k)
                #pragma unroll
                for (int v = 0; v < V; ++v) win[k][v] = win[k + 1][v];
            VecT row;
            row.raw = stage[32 * r];
            widen<T, A, V>(row.e, win[W]);
            if (r - W >= n_out) break;
            A acc[V];
            #pragma unroll
            for (int v = 0; v < V; ++v) {
                acc[v] = bias_v[v];
                #pragma unroll
                for (int k = 0; k < K; ++k) {
                    if constexpr (SEQ) {
                        if (ids[r - W + k] == ids[r]) acc[v] += w[k][v] * win[k][v];
                    } else {
                        acc[v] += w[k][v] * win[k][v];
                    }
                }
                if (SEQ && ids[r] < 0) acc[v] = A(0);  // padding
            }
            VecT res;
            activate_store(acc, silu_act, res.e);
            if (out_vec) {
                *reinterpret_cast<Raw*>(o) = res.raw;
            } else {
                #pragma unroll
                for (int v = 0; v < V; ++v) o[v * out_c_stride] = res.e[v];
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// fwd_cl_wide: channel-contiguous x, any width (run-time; used above 8), no seq_idx. A block
// computes a tile of 32 channels x TT time steps: it stages the tile's TT + K - 1 input rows
// (zeros or initial_states before the row, zeros past it) and the 32 channels' weights in
// shared memory as A, then lane l of warp w computes channel l over time steps
// w RW .. (w + 1) RW of the tile, R at a time: each tap is read once per R outputs and the
// inputs slide through R registers. Lanes read adjacent channels: no bank conflict.
template <typename T>
__global__ void __launch_bounds__(128) fwd_cl_wide(FWD_SIGNATURE) {
    FWD_UNPACK;
    using A = typename AccOf<T>::type;
    constexpr int CW = 32;              // channels per tile
    constexpr int R = 8;                // outputs per pass
    const int RW = tile_a / 4;          // time steps per warp (tile_a = TT, 4 warps)
    const int rows = tile_a + width - 1;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    A* const xs = reinterpret_cast<A*>(smem_raw);  // [rows][CW]
    A* const ws = xs + rows * CW;                  // [width][CW]
    const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
    const int64 strips = (dim + CW - 1) / CW, chunks = (seqlen + tile_a - 1) / tile_a;
    const int64 n_tiles = batch * chunks * strips;
    for (int64 tile = blockIdx.x; tile < n_tiles; tile += gridDim.x) {
        int64 bc, strip, b, chunk;
        divmod(tile, strips, bc, strip);
        divmod(bc, chunks, b, chunk);
        const int64 c0 = strip * CW, t0 = chunk * tile_a;
        __syncthreads();  // the previous tile's readers are done
        for (int i = threadIdx.x; i < rows * CW; i += blockDim.x) {
            const int r = i / CW, ch = i % CW;
            const int64 c = c0 + ch, p = t0 - (width - 1) + r;
            xs[i] = c < dim && p < seqlen ? INPUT_AT(A, b, c, p) : A(0);
        }
        for (int i = threadIdx.x; i < width * CW; i += blockDim.x) {
            const int k = i / CW;
            const int64 c = c0 + i % CW;
            ws[i] = c < dim ? load_as<A>(weight, weight_dtype, c * weight_c_stride + k * weight_width_stride) : A(0);
        }
        __syncthreads();
        const int64 c = c0 + lane;
        const A bias_c = bias && c < dim ? load_as<A>(bias, bias_dtype, c * bias_stride) : A(0);
        T* const ocol = out + b * out_batch_stride + c * out_c_stride;
        #pragma unroll 1
        for (int o = warp * RW; o < (warp + 1) * RW && t0 + o < seqlen; o += R) {
            // Output o + r of the tile reads rows o + r + k (k < width).
            const A* xr = xs + o * CW + lane;
            A acc[R], win[R];
            #pragma unroll
            for (int r = 0; r < R; ++r) {
                acc[r] = bias_c;
                win[r] = xr[r * CW];
            }
            #pragma unroll 4
            for (int k = 0; k < width; ++k) {
                const A wk = ws[k * CW + lane];
                #pragma unroll
                for (int r = 0; r < R; ++r) acc[r] += wk * win[r];
                #pragma unroll
                for (int r = 0; r + 1 < R; ++r) win[r] = win[r + 1];
                if (k + 1 < width) win[R - 1] = xr[(R + k) * CW];
            }
            if (c < dim) {
                #pragma unroll
                for (int r = 0; r < R; ++r)
                    if (t0 + o + r < seqlen)
                        ocol[(t0 + o + r) * out_l_stride] = from_acc<T>(finish(acc[r], false, silu_act));
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// fwd_mma: time-contiguous 16-bit x, widths K with K - 1 <= D = 16 (KS - 1), on tensor cores.
// For one channel, 16 consecutive outputs are a banded Toeplitz matrix of the weights times
// the inputs before them:  out[t0 + o] = sum_m Tw[o][m] x[t0 - D + m],  m < D + 16, with
// Tw[o][m] = w[m - o - (D - K + 1)] inside the band. Eight such blocks 16 steps apart are the
// eight columns n of one m16n8k16 MMA per 16 values of m (k-step s: window segment n + s).
// The MMA sums over k, so k and the rows may be permuted as long as A and B agree: lane
// (g, tg) holds inputs 4 tg .. 4 tg + 3 of segment g + s (one 8-byte shared-memory read, no
// bank conflict), and row i is output 2 (i mod 8) + i / 8, so each lane's results pair up
// into adjacent outputs. A tile is NB such 128-output blocks of a row; tiles are handed out
// grid-stride (Digits), and a tile's window of D + 128 NB inputs is staged by cp.async one
// tile ahead together with its row's parameters, from which the A fragments are built.
// Products of 16-bit values are exact and the MMA accumulates in float32; weights of another
// dtype are split into a high and a low 16-bit part (two MMAs), which keeps them to 2^-17
// relative. Every window slot is written (zeros outside the row), since a zero weight times a
// stale NaN would not be zero. No seq_idx: fwd_wide serves those.
// acc += A B for one m16n8k16 MMA of 16-bit TYPE ("bf16" or "f16") operands, float32 accumulator.
#define MMA_SYNC(TYPE, acc, a, b0, b1)                                                           \
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TYPE "." TYPE                         \
                 ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"                 \
                 : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])                     \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))
template <typename T> struct MmaOp;
template <> struct MmaOp<__nv_bfloat16> {
    static constexpr int code = BF16;
    static __device__ __forceinline__ void run(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
        MMA_SYNC("bf16", c, a, b0, b1);
    }
};
template <> struct MmaOp<__half> {
    static constexpr int code = F16;
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

template <typename T, int KS>
__global__ void __launch_bounds__(128, KS <= 6 ? 5 : 4) fwd_mma(FWD_SIGNATURE) {
    FWD_UNPACK;
    constexpr int D = 16 * (KS - 1);          // inputs before a block's first output
    constexpr int NB = 8;                     // 128-output blocks per tile
    constexpr int SPAN = 128 * NB;            // outputs per tile
    constexpr int VN = 8;                     // elements per 16-byte vector
    constexpr int WV = (D + SPAN) / VN;       // window vectors
    constexpr int KMAX = D + 1;               // most taps
    constexpr int PW = (KMAX + 2) / 2;        // parameter words of a stage, in 16-byte units
    constexpr int PAD = D + 15;               // wpad[PAD + k] = w[k]: zeros for k < 0, k >= K
    constexpr int WPAD = (2 * D + 32) / 4;    // wpad in 16-byte units
    extern __shared__ uint4 stage_mem[];
    // Per warp: 2 stages of a window and its row's raw parameters (KMAX taps, the bias); the
    // row's weights as zero-padded floats; the tile's SPAN outputs of T. The A fragments
    // (KS k-steps, high and low part) stay in registers.
    constexpr int WARP_VECS = 2 * (WV + PW) + WPAD + SPAN * 2 / 16;
    uint4* const stages = stage_mem + (threadIdx.x / 32) * WARP_VECS;
    auto params_of = [&](int st) {  // the parameter words of stage st
        return reinterpret_cast<unsigned long long*>(stages + st * (WV + PW) + WV);
    };
    float* const wpad = reinterpret_cast<float*>(stages + 2 * (WV + PW));
    unsigned* const obuf = reinterpret_cast<unsigned*>(stages + 2 * (WV + PW) + WPAD);  // pairs of T
    const int lane = threadIdx.x & 31, g = lane >> 2, tg = lane & 3;
    const int64 tiles_per_row = (seqlen + SPAN - 1) / SPAN;
    const int64 n_tiles = batch * dim * tiles_per_row, n_warps = grid_warps();
    // A tile as digits (b, c, sp): tile sp of row (b, c).
    const Digits stride = to_digits(n_warps, tiles_per_row, dim);
    Digits issued = to_digits(grid_warp(), tiles_per_row, dim), computed = issued;
    int64 g_issued = grid_warp();

    // Stages the window of the tile at `u` (positions start - D ..) and its row's parameters
    // (word k < width: tap k, word KMAX: the bias) into stage st when `valid`; always commits
    // one group.
    auto issue = [&](const Digits& u, int st, bool valid) {
        if (valid) {
            const int64 b = u.hi, c = u.mid;
            unsigned long long* pw = params_of(st);
            for (int k = lane; k < width; k += 32)
                stage_param(pw + k, weight, weight_dtype, c * weight_c_stride + k * weight_width_stride);
            if (lane == 0 && bias) stage_param(pw + KMAX, bias, bias_dtype, c * bias_stride);
            const T* xr = x + b * x_batch_stride + c * x_c_stride;
            const int64 w0 = u.lo * SPAN - D;
            uint4* s = stages + st * (WV + PW);
            #pragma unroll 1
            for (int v = lane; v < WV; v += 32) {
                const int64 p = w0 + (int64)v * VN;
                if (x_vec && p >= 0 && p < seqlen) {
                    cp_async<16>(s + v, xr + p, (int)min((int64)VN, seqlen - p) * (int)sizeof(T));
                } else if (p >= seqlen || p + VN <= -(int64)(width - 1) || (p < 0 && !initial_states)) {
                    s[v] = make_uint4(0, 0, 0, 0);
                } else {  // element by element: misaligned rows, states before the row
                    T* e = reinterpret_cast<T*>(s + v);
                    #pragma unroll 1
                    for (int q = 0; q < VN; ++q) {
                        const int64 pq = p + q;
                        e[q] = pq >= seqlen || pq < -(int64)(width - 1) ? T()
                               : pq >= 0 ? xr[pq * x_l_stride]
                               : from_acc<T>(INPUT_AT(float, b, c, pq));
                    }
                }
            }
        }
        cp_async_commit();
    };

    const bool split = weight_dtype != MmaOp<T>::code;
    float bias_c = 0.f;
    unsigned ahi[KS][4], alo[KS][4];  // the row's A fragments: high and low part per k-step
    // The A fragments of the row whose parameters are staged in stage st.
    auto load_row = [&](int64 c, int st) {
        const unsigned long long* pw = params_of(st);
        for (int i = lane; i < 4 * WPAD; i += 32) {
            const int k = i - PAD;
            wpad[i] = k >= 0 && k < width ? staged_param<float>(pw + k, weight, weight_dtype,
                                                                c * weight_c_stride + k * weight_width_stride)
                                          : 0.f;
        }
        bias_c = bias ? staged_param<float>(pw + KMAX, bias, bias_dtype, c * bias_stride) : 0.f;
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
                ahi[s][r] = pack2<T>(v0, v1);
                if (split) alo[s][r] = pack2<T>(v0 - to_acc(from_acc<T>(v0)), v1 - to_acc(from_acc<T>(v1)));
            }
        }
        __syncwarp();  // wpad is free again
    };
    auto compute = [&](const Digits& u, int st) {
        const int64 start = u.lo * SPAN;
        load_row(u.mid, st);
        const uint2* s = reinterpret_cast<const uint2*>(stages + st * (WV + PW)) + 4 * g + tg;
        // Two blocks at a time: their MMA chains are independent, so one hides the other's latency.
        #pragma unroll 1
        for (int blk = 0; blk < NB && start + blk * 128 < seqlen; blk += 2, s += 64) {
            float acc[2][4] = {};
            #pragma unroll
            for (int ks = 0; ks < KS; ++ks) {
                #pragma unroll
                for (int j = 0; j < 2; ++j) {
                    const uint2 bw = s[32 * j + 4 * ks];  // inputs 4 tg .. 4 tg + 3 of segment g + ks
                    MmaOp<T>::run(acc[j], ahi[ks], bw.x, bw.y);
                    if (split) MmaOp<T>::run(acc[j], alo[ks], bw.x, bw.y);
                }
            }
            // c0: (row g, column 2 tg), c1: (g, 2 tg + 1), c2: (g + 8, 2 tg), c3: (g + 8, 2 tg + 1):
            // outputs 32 tg + 2 g (c0, c2) and 32 tg + 16 + 2 g (c1, c3) of the block.
            #pragma unroll
            for (int j = 0; j < 2; ++j) {
                #pragma unroll
                for (int r = 0; r < 4; ++r) {
                    acc[j][r] += bias_c;
                    if (silu_act) acc[j][r] = silu(acc[j][r]);
                }
                obuf[(blk + j) * 64 + 16 * tg + g] = pack2<T>(acc[j][0], acc[j][2]);
                obuf[(blk + j) * 64 + 16 * tg + 8 + g] = pack2<T>(acc[j][1], acc[j][3]);
            }
        }
        __syncwarp();
        T* const orow = out + u.hi * out_batch_stride + u.mid * out_c_stride;
        #pragma unroll
        for (int j = 0; j < SPAN / VN / 32; ++j) {
            const int64 t = start + (32 * j + lane) * VN;
            const uint4 v = reinterpret_cast<const uint4*>(obuf)[32 * j + lane];
            if (out_vec && t + VN <= seqlen) {
                *reinterpret_cast<uint4*>(orow + t) = v;
            } else if (t < seqlen) {
                const T* e = reinterpret_cast<const T*>(&v);
                #pragma unroll
                for (int q = 0; q < VN; ++q)
                    if (t + q < seqlen) orow[(t + q) * out_l_stride] = e[q];
            }
        }
    };

    auto issue_next = [&](int st) {
        const bool valid = g_issued < n_tiles;
        issue(issued, st, valid);
        if (valid) {
            advance(issued, stride, tiles_per_row, dim);
            g_issued += n_warps;
        }
    };
    issue_next(0);
    int st = 0;
    for (int64 t = grid_warp(); t < n_tiles; t += n_warps) {
        issue_next(st ^ 1);
        cp_async_wait<1>();
        __syncwarp();
        compute(computed, st);
        advance(computed, stride, tiles_per_row, dim);
        __syncwarp();  // stage st and obuf are free again
        st ^= 1;
    }
}
