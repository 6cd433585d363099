// update.cu: the decode update, causal_conv1d_update.
//
//   out[b,c,i] = act(bias[c] + sum_k weight[c,k] * h(b,c, i-(K-1)+k)),   i < seqlen
//
// h(b,c,s) is x[b,c,s] for s >= 0 and the row's history for s < 0: the K-1 inputs before the
// new tokens, read from conv_state row r = conv_state_indices[b] (or b) before anything is
// written. Sliding mode: state[r,c,state_len-(K-1)+j]; afterwards the row holds the last
// state_len entries of concat(state row, x row). Circular mode (cache_seqlens): with p =
// cache_seqlens[b] mod state_len, history j is at (p-(K-1)+j) mod state_len and token i is
// written at (p+i) mod state_len. A negative r is a padding row: out 0, no state touched.
//
//   conv_update<T, K>  a block takes UPDATE_THREADS neighbouring channels of UPDATE_ROWS batch
//                      rows; a thread takes one channel of those rows. Channels are fastest
//                      across a warp, so its reads and writes of x, out and a channel-contiguous
//                      state are coalesced (a time-contiguous state row is read and written
//                      whole by one thread, and a warp's rows are neighbours).
//                      K = 1..UPDATE_WINDOW: the fast path. The taps are read once for all the
//                      thread's rows; the rows are taken a few at a time, every load of those
//                      rows (indices, state, x) issued before the first is used: the update is
//                      a few dependent round trips to memory, so their number sets its time.
//                      The window of the last K inputs is held as stored in the state; in
//                      sliding mode with state_len == K - 1 it is the new state row, written
//                      back whole; circular mode reads K - 1 entries and writes the new tokens.
//                      K = 0 (any width, longer sliding rows, other state dtypes): one row at a
//                      time, inputs re-read (L1).
//   conv_update_lean<T, K, R>  the layout of a decode step (one token, channels contiguous, a
//                      dense state, one dtype, int32 indices, 32-bit offsets): the same
//                      mapping with R rows a thread, all in flight at once, and a few
//                      instructions a row (update_lean). Most serving calls take it.
//
// Each thread first computes every output from the unchanged state, then writes its own state
// rows: rows never share a thread, so the in-place update needs no synchronisation (two batch
// rows with the same conv_state_indices entry are the caller's error). The state has its own
// dtype (a float32 state with bfloat16 x: computed in float32, stored in float32): history is
// read and converted, state entries that move are copied bit for bit, and new tokens are
// rounded once to the state's dtype. The run-time dtypes of the taps, the bias and the state
// are dispatched once per thread (with_dtype), never per element.
//
// The parameter struct UpdateParams, UPDATE_WINDOW, UPDATE_THREADS, UPDATE_ROWS and
// UPDATE_OCCUPANCY come with the prelude cupyconv generates from cupyconv/_update_plan.py:
// FIELDS (batch, dim, seqlen, width, state_len and its fast divisor, the arrays' strides in
// elements, their dtype codes, silu_act), then channel_tiles and its fast divisor.
#include "common.cuh"

// The element i of the float array p (dtype `code`) set to the value of v, rounded once.
template <typename T>
__device__ __forceinline__ void store_rounded(void* p, int code, int64 i, T v) {
    if constexpr (same_type<T, double>) {
        switch (code) {
            case F32: static_cast<float*>(p)[i] = (float)v; break;
            case F16: static_cast<__half*>(p)[i] = __double2half(v); break;
            case BF16: static_cast<__nv_bfloat16*>(p)[i] = __double2bfloat16(v); break;
            default: static_cast<double*>(p)[i] = v; break;
        }
    } else {
        store_as<float>(p, code, i, to_acc(v));  // exact in float: one rounding
    }
}

// Element src of the float array p (dtype `code`) copied to element dst, bit for bit.
__device__ __forceinline__ void copy_element(void* p, int code, int64 dst, int64 src) {
    switch (code) {
        case F32: static_cast<float*>(p)[dst] = static_cast<const float*>(p)[src]; break;
        case F64: static_cast<double*>(p)[dst] = static_cast<const double*>(p)[src]; break;
        default: static_cast<unsigned short*>(p)[dst] = static_cast<const unsigned short*>(p)[src]; break;
    }
}

// x token v in the state's dtype S, rounded once.
template <typename S, typename T>
__device__ __forceinline__ S rounded_to(T v) {
    if constexpr (same_type<S, T>) {
        return v;
    } else if constexpr (same_type<S, double>) {
        return (double)to_acc(v);
    } else if constexpr (same_type<T, double>) {
        if constexpr (same_type<S, float>) return (float)v;
        else if constexpr (same_type<S, __half>) return __double2half(v);
        else return __double2bfloat16(v);
    } else {
        return from_acc<S>(to_acc(v));  // exact in float: one rounding
    }
}

// The dtype code of T.
template <typename T>
constexpr int code_of = same_type<T, float> ? F32 : same_type<T, __half> ? F16 : same_type<T, double> ? F64 : BF16;

// a mod m in [0, m) (0 when m is 0); 32-bit arithmetic when both fit.
__device__ __forceinline__ int64 mod_index(int64 a, int64 m) {
    if (m == 0) return 0;
    if (((a | m) >> 31) == 0) return (unsigned)a % (unsigned)m;
    const int64 q = a % m;
    return q < 0 ? q + m : q;
}

// v[i] = index array p (int32 or int64, `code`) at (first + i) * stride, for i < n: all the
// loads issued before any is used.
template <int N>
__device__ __forceinline__ void load_indices(const void* p, int code, int64 first, int64 stride,
                                             int n, int64 (&v)[N]) {
    if (code == I32) {
        int w[N];
        #pragma unroll
        for (int i = 0; i < N; ++i) w[i] = i < n ? static_cast<const int*>(p)[(first + i) * stride] : 0;
        #pragma unroll
        for (int i = 0; i < N; ++i) v[i] = w[i];
    } else {
        #pragma unroll
        for (int i = 0; i < N; ++i) v[i] = i < n ? static_cast<const int64*>(p)[(first + i) * stride] : 0;
    }
}

// The state rows r[i] of batch rows first + i (conv_state_indices, or the batch row itself)
// and, with cache_seqlens (`lens`), the write positions head[i] = cache_seqlens mod state_len.
// With int32 indices (the usual case) every load of both arrays is issued before any is used.
template <int N>
__device__ __forceinline__ void load_rows(const void* idx, const void* lens, const UpdateParams& p,
                                          int64 first, int n, int64 (&r)[N], int64 (&head)[N]) {
    if ((!idx || p.idx_dtype == I32) && (!lens || p.lens_dtype == I32)) {
        int a[N], h[N];
        #pragma unroll
        for (int i = 0; i < N; ++i) {
            a[i] = idx && i < n ? static_cast<const int*>(idx)[(first + i) * p.idx_stride] : 0;
            h[i] = lens && i < n ? static_cast<const int*>(lens)[(first + i) * p.lens_stride] : 0;
        }
        #pragma unroll
        for (int i = 0; i < N; ++i) {
            r[i] = idx ? (int64)a[i] : first + i;
            head[i] = h[i];
        }
    } else {
        if (idx) {
            load_indices(idx, (int)p.idx_dtype, first, p.idx_stride, n, r);
        } else {
            #pragma unroll
            for (int i = 0; i < N; ++i) r[i] = first + i;
        }
        if (lens) load_indices(lens, (int)p.lens_dtype, first, p.lens_stride, n, head);
    }
    if (lens) {
        #pragma unroll
        for (int i = 0; i < N; ++i) head[i] = mod_index(head[i], p.state_len);
    }
}

// The general path: batch row b, channel c, any width, any state length, one row at a time.
template <typename T, typename A>
__device__ void update_row(const T* __restrict__ x, const void* __restrict__ weight, void* conv_state,
                           int64 r, int64 head, T* __restrict__ orow, int64 b, int64 c, A bias_c,
                           bool circular, const UpdateParams& p) {
    const int64 seqlen = p.seqlen, state_len = p.state_len, sl = p.state_l_stride;
    const int width = (int)p.width, state_dtype = (int)p.state_dtype;
    const T* const xrow = x + b * p.x_batch_stride + c * p.x_c_stride;
    const int64 srow = r * p.state_batch_stride + c * p.state_c_stride;
    // Where history entry j (0 <= j < width - 1) sits in the state row: at start + j, wrapped.
    int64 start = circular ? head - (width - 1) : state_len - (width - 1);
    if (start < 0) start += state_len;
    for (int64 t = 0; t < seqlen; ++t) {
        A acc = bias_c;
        for (int k = 0; k < width; ++k) {
            const int64 s = t - (width - 1) + k;
            A v;
            if (s >= 0) {
                v = A(to_acc(xrow[s * p.x_l_stride]));
            } else {
                int64 e = start + s + width - 1;
                if (e >= state_len) e -= state_len;
                v = load_as<A>(conv_state, state_dtype, srow + e * sl);
            }
            acc += load_as<A>(weight, (int)p.weight_dtype, c * p.weight_c_stride + k * p.weight_width_stride) * v;
        }
        orow[t * p.out_l_stride] = from_acc<T>(p.silu_act ? silu(acc) : acc);
    }
    if (state_len == 0) return;
    if (circular) {  // the last min(seqlen, state_len) tokens, in their slots
        int64 t = seqlen > state_len ? seqlen - state_len : 0;
        int64 s = mod_index(head + t, state_len);
        for (; t < seqlen; ++t) {
            store_rounded<T>(conv_state, state_dtype, srow + s * sl, xrow[t * p.x_l_stride]);
            if (++s == state_len) s = 0;
        }
    } else {  // slide left by seqlen: ascending, each entry is read before it is overwritten
        for (int64 j = 0; j < state_len; ++j) {
            const int64 from = j + seqlen;
            if (from < state_len)
                copy_element(conv_state, state_dtype, srow + j * sl, srow + from * sl);
            else
                store_rounded<T>(conv_state, state_dtype, srow + j * sl, xrow[(from - state_len) * p.x_l_stride]);
        }
    }
}

// The fast path for N rows b0 + i (i < n) of channel c, state dtype S (T, or float with
// T of at most 4 bytes: x is exact in S): rows r[i] (negative: padding), circular heads
// head[i], taps w, bias bias_c. The window holds the last K inputs as stored in S (history
// entries bit for bit), so in sliding mode (state_len == K - 1) it is the new state row.
template <int N, int K, typename T, typename S, typename A>
__device__ __forceinline__ void update_rows(const T* __restrict__ x, S* conv_state, T* __restrict__ out,
                                            const int64 (&r)[N], const int64 (&head)[N], int64 b0, int n,
                                            int64 c, const A (&w)[K], A bias_c, bool circular,
                                            const UpdateParams& p) {
    const int64 state_len = p.state_len, sl = p.state_l_stride;
    const int64 stored = p.seqlen > state_len ? p.seqlen - state_len : 0;  // circular: first token kept
    bool live[N];     // a real row, not padding
    int64 slot[N];    // circular: where the next kept token goes
    S win[N][K];      // the inputs of the next output, oldest first; win[i][K-1] is set per token
    #pragma unroll
    for (int i = 0; i < N; ++i) {
        live[i] = i < n && r[i] >= 0;
        slot[i] = stored ? mod_index(head[i] + stored, state_len) : head[i];
        const int64 srow = r[i] * p.state_batch_stride + c * p.state_c_stride;
        int64 e = circular ? head[i] - (K - 1) : 0;  // where history entry 0 sits
        if (e < 0) e += state_len;
        #pragma unroll
        for (int j = 0; j + 1 < K; ++j) {
            win[i][j] = live[i] ? conv_state[srow + e * sl] : rounded_to<S>(0.0f);
            if (++e == state_len) e = 0;
        }
    }
    for (int64 t = 0; t < p.seqlen; ++t) {
        T xt[N];
        #pragma unroll
        for (int i = 0; i < N; ++i)
            xt[i] = i < n ? x[(b0 + i) * p.x_batch_stride + c * p.x_c_stride + t * p.x_l_stride] : from_acc<T>(A(0));
        #pragma unroll
        for (int i = 0; i < N; ++i) {
            if (i >= n) continue;
            win[i][K - 1] = rounded_to<S>(xt[i]);
            A acc = bias_c;
            #pragma unroll
            for (int k = 0; k < K; ++k) acc += w[k] * A(to_acc(win[i][k]));
            out[(b0 + i) * p.out_batch_stride + c * p.out_c_stride + t * p.out_l_stride] =
                from_acc<T>(live[i] ? (p.silu_act ? silu(acc) : acc) : A(0));
            if (circular && live[i] && state_len && t >= stored) {  // the last state_len tokens
                conv_state[r[i] * p.state_batch_stride + c * p.state_c_stride + slot[i] * sl] = win[i][K - 1];
                if (++slot[i] == state_len) slot[i] = 0;
            }
            #pragma unroll
            for (int k = 0; k + 1 < K; ++k) win[i][k] = win[i][k + 1];
        }
    }
    if (circular) return;
    #pragma unroll
    for (int i = 0; i < N; ++i) {
        const int64 srow = r[i] * p.state_batch_stride + c * p.state_c_stride;
        #pragma unroll
        for (int j = 0; j + 1 < K; ++j)
            if (live[i]) conv_state[srow + j * sl] = win[i][j];
    }
}

template <typename T, int K>
__device__ __forceinline__ void update(const T* __restrict__ x, const void* __restrict__ weight,
                                       const void* __restrict__ bias, void* __restrict__ conv_state,
                                       const void* __restrict__ cache_seqlens,
                                       const void* __restrict__ conv_state_indices, T* __restrict__ out,
                                       const UpdateParams& p) {
    using A = typename AccOf<T>::type;
    constexpr int ROWS = UPDATE_ROWS, N = K <= 4 ? 2 : 1;  // rows in flight at once
    static_assert(ROWS % N == 0, "UPDATE_ROWS is a multiple of the rows in flight");
    // A work item is UPDATE_THREADS channels of ROWS rows; fewer than 2^31 of them (x would
    // have 2^40 elements), so the item arithmetic is 32-bit.
    const int64 dim = p.dim, state_len = p.state_len;
    const unsigned tiles = (unsigned)p.channel_tiles, items = tiles * (unsigned)((p.batch + ROWS - 1) / ROWS);
    const bool circular = cache_seqlens != nullptr;
    for (unsigned item = blockIdx.x; item < items; item += gridDim.x) {
        const unsigned group = item / tiles;
        const int64 c = (int64)(item - group * tiles) * UPDATE_THREADS + threadIdx.x;
        if (c >= dim) continue;
        const int64 b0 = (int64)group * ROWS;
        const int rows = (int)min((int64)ROWS, p.batch - b0);
        A bias_c = A(0);
        if (bias) with_dtype(bias, (int)p.bias_dtype, [&](auto* bp) { bias_c = A(to_acc(bp[c * p.bias_stride])); });
        if constexpr (K > 0) {  // the plan's choice: takes_fast_path
            const int state_dtype = (int)p.state_dtype;
            A w[K];
            with_dtype(weight, (int)p.weight_dtype, [&](auto* wp) {
                #pragma unroll
                for (int k = 0; k < K; ++k) w[k] = A(to_acc(wp[c * p.weight_c_stride + k * p.weight_width_stride]));
            });
            for (int i0 = 0; i0 < rows; i0 += N) {
                const int n = min(N, rows - i0);
                int64 r[N], head[N] = {};  // head: circular mode only
                if (circular) {
                    load_rows(conv_state_indices, cache_seqlens, p, b0 + i0, n, r, head);
                } else if (conv_state_indices) {  // (measured: faster here than load_rows)
                    load_indices(conv_state_indices, (int)p.idx_dtype, b0 + i0, p.idx_stride, n, r);
                } else {
                    #pragma unroll
                    for (int i = 0; i < N; ++i) r[i] = b0 + i0 + i;
                }
                if (state_dtype == code_of<T>)
                    update_rows<N, K>(x, static_cast<T*>(conv_state), out, r, head, b0 + i0, n, c, w, bias_c, circular, p);
                else
                    update_rows<N, K>(x, static_cast<float*>(conv_state), out, r, head, b0 + i0, n, c, w, bias_c, circular, p);
            }
        } else {
            for (int i = 0; i < rows; ++i) {
                const int64 b = b0 + i;
                T* const orow = out + b * p.out_batch_stride + c * p.out_c_stride;
                const int64 r = conv_state_indices ? load_index(conv_state_indices, (int)p.idx_dtype, b * p.idx_stride) : b;
                if (r < 0) {  // padding row
                    for (int64 t = 0; t < p.seqlen; ++t) orow[t * p.out_l_stride] = from_acc<T>(A(0));
                    continue;
                }
                const int64 head =
                    circular ? mod_index(load_index(cache_seqlens, (int)p.lens_dtype, b * p.lens_stride), state_len) : 0;
                update_row(x, weight, conv_state, r, head, orow, b, c, bias_c, circular, p);
            }
        }
    }
}

// v[q] for a run-time q < N, by selection (v stays in registers).
template <int N, typename T>
__device__ __forceinline__ T pick(const T (&v)[N], int q) {
    T out = v[0];
    #pragma unroll
    for (int u = 1; u < N; ++u)
        if (q == u) out = v[u];
    return out;
}

// The lean path, for the layout of a decode step, recognised by the plan (`is_lean`): one
// token, x, out, the taps, the bias and the state of one dtype T; x and out with channels
// contiguous, the taps as a dense [dim, K] and the bias contiguous; a dense state (channel c's
// entries at c * state_len, contiguous; sliding mode: state_len == K - 1); int32 indices and
// cache_seqlens, contiguous; every offset below 2^31. Its offsets are 32-bit and its unit
// strides compile-time, so a row costs its loads, its K multiply-adds and its stores; a
// thread takes one channel of R rows, every load of them issued before the first is used.
template <typename T, int K, int R>
__device__ __forceinline__ void update_lean(const T* __restrict__ x, const T* __restrict__ weight,
                                            const T* __restrict__ bias, T* __restrict__ state,
                                            const int* __restrict__ lens, const int* __restrict__ idx,
                                            T* __restrict__ out, const UpdateParams& p) {
    using A = float;
    const int group = (int)quotient(blockIdx.x, p.tiles_divisor);
    const int c = ((int)blockIdx.x - group * (int)p.channel_tiles) * UPDATE_THREADS + threadIdx.x;
    if (c >= (int)p.dim) return;
    const int b0 = (int)group * R, rows = min(R, (int)p.batch - b0), state_len = (int)p.state_len;
    const int x_stride = (int)p.x_batch_stride, out_stride = (int)p.out_batch_stride;
    const int state_stride = (int)p.state_batch_stride;
    int r[R], head[R];
    T xt[R];
    #pragma unroll
    for (int i = 0; i < R; ++i) {
        const bool in = i < rows;
        r[i] = !in ? -1 : idx ? idx[b0 + i] : b0 + i;
        head[i] = in && lens ? lens[b0 + i] : 0;
        xt[i] = in ? x[(b0 + i) * x_stride + c] : from_acc<T>(0.0f);
    }
    A w[K], bias_c = bias ? to_acc(bias[c]) : A(0);
    #pragma unroll
    for (int k = 0; k < K; ++k) w[k] = to_acc(weight[c * K + k]);
    // A state row of K - 1 entries (every sliding row here; circular rows of that length) is
    // read whole, at fixed offsets: v is the row as stored, history entry j of a circular row
    // at (head + j) mod (K - 1). Longer circular rows: v is the history.
    const bool whole = !lens || state_len == K - 1;
    T v[R][K - 1];
    int row[R];  // where channel c's state row starts
    #pragma unroll
    for (int i = 0; i < R; ++i) {
        row[i] = r[i] * state_stride + c * state_len;
        if (lens) {  // circular: head = cache_seqlens mod state_len
            const int h = head[i];
            if (h >= 0) {
                head[i] = h - (int)quotient(h, p.state_len_divisor) * state_len;
            } else {
                const int m = h % state_len;
                head[i] = m < 0 ? m + state_len : m;
            }
        }
        if (whole) {
            #pragma unroll
            for (int j = 0; j < K - 1; ++j) v[i][j] = r[i] >= 0 ? state[row[i] + j] : from_acc<T>(0.0f);
        } else {  // history entry j at (head - (K - 1) + j) mod state_len
            int e = head[i] - (K - 1);
            if (e < 0) e += state_len;
            #pragma unroll
            for (int j = 0; j < K - 1; ++j) {
                v[i][j] = r[i] >= 0 ? state[row[i] + e] : from_acc<T>(0.0f);
                if (++e == state_len) e = 0;
            }
        }
    }
    #pragma unroll
    for (int i = 0; i < R; ++i) {
        if (i >= rows) break;
        A acc = bias_c + w[K - 1] * to_acc(xt[i]);
        if (lens && whole) {
            #pragma unroll
            for (int k = 0; k < K - 1; ++k) {
                const int q = head[i] + k;
                acc += w[k] * to_acc(pick(v[i], q < K - 1 ? q : q - (K - 1)));
            }
        } else {
            #pragma unroll
            for (int k = 0; k < K - 1; ++k) acc += w[k] * to_acc(v[i][k]);
        }
        out[(b0 + i) * out_stride + c] = from_acc<T>(r[i] < 0 ? A(0) : p.silu_act ? silu(acc) : acc);
        if (r[i] < 0) continue;
        if (!lens) {  // slide by one
            #pragma unroll
            for (int j = 0; j + 1 < K - 1; ++j) state[row[i] + j] = v[i][j + 1];
            state[row[i] + K - 2] = xt[i];
        } else {  // circular: the token over the oldest entry, the rest of the row unchanged
            state[row[i] + head[i]] = xt[i];
        }
    }
}

// The kernel. Instances of narrow filters on data of at most 4 bytes fit 64 registers: they are
// held to it, for UPDATE_OCCUPANCY blocks a SM (the update is latency-bound: resident warps set
// its speed); the others keep the compiler's choice. Two overloads, one viable per instance.
template <bool B> struct EnableIf {};
template <> struct EnableIf<true> { using type = void; };
template <typename T, int K> constexpr bool held = K > 0 && K <= 8 && sizeof(T) <= 4;

#define CONV_UPDATE_PARAMS                                                                         \
    const T *__restrict__ x, const void *__restrict__ weight, const void *__restrict__ bias,       \
        void *__restrict__ conv_state, const void *__restrict__ cache_seqlens,                     \
        const void *__restrict__ conv_state_indices, T *__restrict__ out,                          \
        const __grid_constant__ UpdateParams p
template <typename T, int K>
__global__ __launch_bounds__(UPDATE_THREADS, UPDATE_OCCUPANCY) typename EnableIf<held<T, K>>::type
conv_update(CONV_UPDATE_PARAMS) {
    wait_for_previous_kernel();
    update<T, K>(x, weight, bias, conv_state, cache_seqlens, conv_state_indices, out, p);
}
template <typename T, int K>
__global__ typename EnableIf<!held<T, K>>::type conv_update(CONV_UPDATE_PARAMS) {
    wait_for_previous_kernel();
    update<T, K>(x, weight, bias, conv_state, cache_seqlens, conv_state_indices, out, p);
}
template <typename T, int K, int R>
__global__ __launch_bounds__(UPDATE_THREADS, UPDATE_OCCUPANCY) void conv_update_lean(CONV_UPDATE_PARAMS) {
    wait_for_previous_kernel();
    static_assert(K >= 2 && held<T, K>, "the lean path: widths 2 to 8 of 2- and 4-byte x");
    update_lean<T, K, R>(x, static_cast<const T*>(weight), static_cast<const T*>(bias),
                         static_cast<T*>(conv_state), static_cast<const int*>(cache_seqlens),
                         static_cast<const int*>(conv_state_indices), out, p);
}
