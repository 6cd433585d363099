// bwd_wide.cu: the backward on CUDA cores for any layout, any width and any dtype pair,
// without seq_idx (the plan's route where no faster kernel serves).
//
//   bwd_wide<T>
//       a block of WIDE_THREADS threads takes items (batch row b, a group of WIDE_CHANNELS
//       channels, a segment of p.seg_tiles tiles of WIDE_TILE positions) and walks the
//       segment's tiles from last to first, so that the dz of the K-1 positions after a tile
//       is the tile before's (carried over in shared memory); a segment that ends inside the
//       row first computes the dz of its first K-1 positions after it.
//
// Per tile, every channel's row of x (positions t0-(K-1) .. t0+T-1) and dout (t0 .. t0+T-1)
// is staged in shared memory as A (element by element, in the order of each array's layout:
// p.x_channels_fastest, p.dout_channels_fastest; positions before the row from
// initial_states, past it 0). Then, with K-term sums in registers of 16 outputs a thread over
// taps in blocks of 8 (window reads of 16 bytes, one new block of inputs a tap block):
//   z and dz      thread (channel r, outputs 16 g ..): z = bias + sum_k w[k] x[t-(K-1)+k], dz
//                 over dout in place; the thread's share of dbias;
//   dweight       half-warp r: lane (tap block kb of 16 taps, position range pg) adds
//                 dz[t] x[t-(K-1)+k] over its positions, held over the item;
//   dx            thread (r, g): sum_m w[K-1-m] dz[s+m], through shared memory to dx in the
//                 order of its layout (p.dx_channels_fastest).
// The last tap block of a sum runs only its K mod 8 taps, and the dweight sums stop at the
// row's end: no product of a tap that does not exist, nor of a zero dz past the row (a NaN or
// inf input reaches only the sums that see it). At the item's end the dweight
// shares are added over the position ranges, dbias over the channel's 16 threads, in a fixed
// order, and written as part (b, segment) of the partials.
//
// Shared memory (the plan's layout, byte offsets): rows of x then dz at 0 and p.dz_at, each
// p.row_slots slots of A (a row's 16-byte blocks padded every WIDE_BANK_RUN slots, so that
// the window reads of a quarter warp hit distinct banks); taps at p.taps_at and reversed at
// p.rtaps_at, p.tap_slots each (0 past the width).
#include "bwd_common.cuh"

__device__ __forceinline__ int wide_slot(int e) { return e + e / WIDE_BANK_RUN * WIDE_BANK_PAD; }

// v[0..8) = row[e .. e+8), e a multiple of 8 (the two 16-byte halves never straddle a pad).
__device__ __forceinline__ void load8(const float* row, int e, float (&v)[8]) {
    const float4 lo = *reinterpret_cast<const float4*>(row + wide_slot(e));
    const float4 hi = *reinterpret_cast<const float4*>(row + wide_slot(e) + 4);
    v[0] = lo.x; v[1] = lo.y; v[2] = lo.z; v[3] = lo.w;
    v[4] = hi.x; v[5] = hi.y; v[6] = hi.z; v[7] = hi.w;
}
__device__ __forceinline__ void load8(const double* row, int e, double (&v)[8]) {
    #pragma unroll
    for (int j = 0; j < 8; j += 2) {
        const double2 q = *reinterpret_cast<const double2*>(row + wide_slot(e) + j);
        v[j] = q.x; v[j + 1] = q.y;
    }
}
// w[0..8) = taps[k .. k+8), k a multiple of 8 (tap rows are not padded: every lane of a group
// reads the same taps).
__device__ __forceinline__ void taps8(const float* taps, int k, float (&w)[8]) {
    const float4 lo = *reinterpret_cast<const float4*>(taps + k);
    const float4 hi = *reinterpret_cast<const float4*>(taps + k + 4);
    w[0] = lo.x; w[1] = lo.y; w[2] = lo.z; w[3] = lo.w;
    w[4] = hi.x; w[5] = hi.y; w[6] = hi.z; w[7] = hi.w;
}
__device__ __forceinline__ void taps8(const double* taps, int k, double (&w)[8]) {
    #pragma unroll
    for (int j = 0; j < 8; j += 2) {
        const double2 q = *reinterpret_cast<const double2*>(taps + k + j);
        w[j] = q.x; w[j + 1] = q.y;
    }
}

// acc[j] += sum_{i < n} w[i] v(j + i), j < 16, where v(e) for e < 24 is a, b, c's e-th value
// (n = 8 unless LAST: the sum's last tap block, of n taps).
template <bool LAST, typename A>
__device__ __forceinline__ void tap_block(A (&acc)[16], const A (&w)[8], const A (&a)[8], const A (&b)[8],
                                          const A (&c)[8], int n) {
    #pragma unroll
    for (int i = 0; i < 8; ++i) {
        if (LAST && i >= n) break;
        #pragma unroll
        for (int j = 0; j < 16; ++j) {
            const int e = i + j;
            acc[j] += w[i] * (e < 8 ? a[e] : e < 16 ? b[e - 8] : c[e - 16]);
        }
    }
}

// Blocks 0 .. full-1 by f(i, u, v, s) and, with `rest`, block `full` by last(full, u, v, s),
// the three buffers taking turns: block i's u, v, s are buffers i, i + 1, i + 2 (mod 3), and
// block i fills s (v and s are block i + 1's u and v).
template <typename A, typename F, typename G>
__device__ __forceinline__ void in_turn(A (&a)[8], A (&b)[8], A (&c)[8], int full, bool rest, F&& f, G&& last) {
    int i = 0;
    for (; i + 3 <= full; i += 3) {
        f(i, a, b, c);
        f(i + 1, b, c, a);
        f(i + 2, c, a, b);
    }
    if (full - i == 0) {
        if (rest) last(i, a, b, c);
    } else if (full - i == 1) {
        f(i, a, b, c);
        if (rest) last(i + 1, b, c, a);
    } else {
        f(i, a, b, c);
        f(i + 1, b, c, a);
        if (rest) last(i + 2, c, a, b);
    }
}

// acc[j] += sum_k taps[k] row[e0 + j + k], j < 16, k < K: tap blocks of 8, the inputs of the
// next block loaded while a block computes.
template <typename A>
__device__ __forceinline__ void window_sums(A (&acc)[16], const A* row, const A* taps, int e0, int K) {
    A a[8], b[8], c[8], w[8];
    load8(row, e0, a);
    load8(row, e0 + 8, b);
    auto block = [&](auto last_flag, int kb, A(&u)[8], A(&v)[8], A(&s)[8]) {
        load8(row, e0 + 8 * kb + 16, s);
        taps8(taps, 8 * kb, w);
        tap_block<decltype(last_flag)::value>(acc, w, u, v, s, K % 8);
    };
    in_turn(a, b, c, K / 8, K % 8 != 0, [&](int i, A(&u)[8], A(&v)[8], A(&s)[8]) { block(Flag<false>(), i, u, v, s); },
            [&](int i, A(&u)[8], A(&v)[8], A(&s)[8]) { block(Flag<true>(), i, u, v, s); });
}

// acc[i] += sum_t dz[t] x[t + i + e_tap], i < 16, over the positions t_begin <= t < t_end (their
// dz at drow[t], x at xrow[t + e_tap + i]) in blocks of 8: x's inputs of the next block loaded
// while a block computes; the last block, cut by the row's end, takes only its positions (a
// product with a dz of 0 past the row would turn an inf input into NaN).
template <typename A>
__device__ __forceinline__ void lag_sums(A (&acc)[16], const A* xrow, const A* drow, int e_tap, int t_begin,
                                         int t_end) {
    A a[8], b[8], c[8], g[8];
    const int n = t_end - t_begin;
    if (n <= 0) return;
    load8(xrow, t_begin + e_tap, a);
    load8(xrow, t_begin + e_tap + 8, b);
    auto block = [&](auto last_flag, int i, A(&u)[8], A(&v)[8], A(&s)[8]) {
        constexpr bool LAST = decltype(last_flag)::value;
        const int t = t_begin + 8 * i;
        load8(xrow, t + e_tap + 16, s);
        load8(drow, t, g);
        #pragma unroll
        for (int j = 0; j < 8; ++j) {
            if (LAST && j >= n % 8) break;
            #pragma unroll
            for (int k = 0; k < 16; ++k) {
                const int e = k + j;
                acc[k] += g[j] * (e < 8 ? u[e] : e < 16 ? v[e - 8] : s[e - 16]);
            }
        }
    };
    in_turn(a, b, c, n / 8, n % 8 != 0, [&](int i, A(&u)[8], A(&v)[8], A(&s)[8]) { block(Flag<false>(), i, u, v, s); },
            [&](int i, A(&u)[8], A(&v)[8], A(&s)[8]) { block(Flag<true>(), i, u, v, s); });
}

// rows[r][e] = array[c0 + r, first + e] (array: a batch row) for r < WIDE_CHANNELS, e < n <=
// 2 WIDE_THREADS; 0 for channels past dim and positions past the row, before(r, e, v) for
// positions before it. A thread's loads go out WIDE_BATCH at a time before their stores (in
// flight together), in the order of the array's layout: channels fastest (a thread keeps its
// channel, positions tid / CG + (THREADS / CG) u), or positions fastest (positions tid and
// tid + THREADS, rows in turn). Addresses step from a row's pointer: a few instructions an
// element.
template <typename T, typename A, typename F>
__device__ __forceinline__ void stage_rows(A* rows, int row_slots, const T* array, int64 c_stride, int64 l_stride,
                                           bool channels_fastest, int64 c0, int64 dim, int64 first, int n,
                                           int64 seqlen, F&& before) {
    constexpr int CG = WIDE_CHANNELS, THREADS = WIDE_THREADS, BATCH = WIDE_BATCH, STEP = THREADS / CG;
    // positions e inside the row: lo <= e < hi
    const int lo = (int)max((int64)0, -first), hi = (int)max((int64)lo, min((int64)n, seqlen - first));
    if (channels_fastest) {
        const int r = threadIdx.x % CG, e_first = threadIdx.x / CG;
        const bool live = c0 + r < dim;
        const int64 step = STEP * l_stride;
        const T* at = array + (live ? c0 + r : 0) * c_stride + (first + e_first) * l_stride;
        A* const out = rows + r * row_slots;
        for (int e0 = e_first; e0 < n; e0 += STEP * BATCH) {
            A v[BATCH];
            #pragma unroll
            for (int u = 0; u < BATCH; ++u, at += step) {
                const int e = e0 + STEP * u;
                v[u] = live && e >= lo && e < hi ? A(to_acc(*at)) : A(0);
            }
            #pragma unroll
            for (int u = 0; u < BATCH; ++u) {
                const int e = e0 + STEP * u;
                if (e < n) out[wide_slot(e)] = e < lo ? before(r, e, v[u]) : v[u];
            }
        }
    } else {
        int e[2], slot[2];
        bool in[2];
        const T* at[2];  // the element of row r0
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            e[h] = threadIdx.x + THREADS * h;
            slot[h] = wide_slot(e[h]);
            in[h] = e[h] >= lo && e[h] < hi;
            at[h] = array + c0 * c_stride + (first + e[h]) * l_stride;
        }
        const int live = (int)min((int64)CG, dim - c0);  // rows inside dim
        for (int r0 = 0; r0 < CG; r0 += BATCH / 2) {
            A v[BATCH];
            #pragma unroll
            for (int u = 0; u < BATCH; ++u) {
                const int h = u % 2;
                v[u] = r0 + u / 2 < live && in[h] ? A(to_acc(*at[h])) : A(0);
                if (h == 1) at[0] += c_stride, at[1] += c_stride;
            }
            #pragma unroll
            for (int u = 0; u < BATCH; ++u) {
                const int r = r0 + u / 2, h = u % 2;
                if (e[h] < n) rows[r * row_slots + slot[h]] = e[h] < lo ? before(r, e[h], v[u]) : v[u];
            }
        }
    }
}

// array[c0 + r, first + e] = rows[r][e] (array: a batch row) for channels below dim and
// positions inside the row, e < WIDE_TILE, in the order of the array's layout (as stage_rows).
template <typename T, typename A>
__device__ __forceinline__ void store_rows(T* array, int64 c_stride, int64 l_stride, bool channels_fastest,
                                           const A* rows, int row_slots, int64 c0, int64 dim, int64 first,
                                           int64 seqlen) {
    constexpr int CG = WIDE_CHANNELS, THREADS = WIDE_THREADS, TILE = WIDE_TILE, STEP = THREADS / CG;
    if (channels_fastest) {
        const int r = threadIdx.x % CG, e_first = threadIdx.x / CG;
        if (c0 + r >= dim) return;
        const int hi = (int)min((int64)TILE, seqlen - first);  // positions inside the row
        const int64 step = STEP * l_stride;
        T* at = array + (c0 + r) * c_stride + (first + e_first) * l_stride;
        const A* const in = rows + r * row_slots;
        #pragma unroll 4
        for (int e = e_first; e < hi; e += STEP, at += step) *at = from_acc<T>(in[wide_slot(e)]);
    } else {
        const int e = threadIdx.x;  // TILE == THREADS
        if (first + e >= seqlen) return;
        T* at = array + c0 * c_stride + (first + e) * l_stride;
        const int live = (int)min((int64)CG, dim - c0), slot = wide_slot(e);
        #pragma unroll 4
        for (int r = 0; r < live; ++r, at += c_stride) *at = from_acc<T>(rows[r * row_slots + slot]);
    }
}

template <typename T>
__global__ void __launch_bounds__(WIDE_THREADS, sizeof(T) == 8 ? 1 : WIDE_BLOCKS) bwd_wide(BWD_ARRAYS, const __grid_constant__ BwdWideParams p) {
    wait_for_previous_kernel();
    using A = typename AccOf<T>::type;
    constexpr int CG = WIDE_CHANNELS, TILE = WIDE_TILE, THREADS = WIDE_THREADS;
    static_assert(CG * TILE / 16 == THREADS && CG * 16 == THREADS, "a thread per 16 outputs, a half-warp a channel");
    static_assert(TILE == THREADS, "a tile's rows staged and stored at positions tid (+ THREADS)");
    extern __shared__ __align__(16) unsigned char smem[];
    A* const xs = reinterpret_cast<A*>(smem);
    A* const ds = reinterpret_cast<A*>(smem + p.dz_at);
    A* const ws = reinterpret_cast<A*>(smem + p.taps_at);
    A* const wr = reinterpret_cast<A*>(smem + p.rtaps_at);
    const int64 batch = p.batch, dim = p.dim, seqlen = p.seqlen;
    const int K = (int)p.width, row_slots = (int)p.row_slots, tap_slots = (int)p.tap_slots;
    const int64 tiles = (seqlen + TILE - 1) / TILE, seg_tiles = p.seg_tiles;
    const int64 segments = (tiles + seg_tiles - 1) / seg_tiles, groups = (dim + CG - 1) / CG;
    const int r = threadIdx.x / 16, g = threadIdx.x % 16;  // channel row, output block / lane
    // dweight: lane g of half-warp r takes taps 16 kb .. of positions [pg L, pg L + L)
    const int tap_blocks = (K + 15) / 16;
    int ranges = 1;
    while (2 * ranges * tap_blocks <= 16) ranges *= 2;
    const int kb = g % tap_blocks, pg = g / tap_blocks, range_len = TILE / ranges;
    const bool lag_lane = pg < ranges;

    for (int64 item = blockIdx.x; item < batch * groups * segments; item += gridDim.x) {
        const int64 seg = item % segments, bg = item / segments, grp = bg % groups, b = bg / groups;
        const int64 c0 = grp * CG, c = c0 + r;
        const int64 first = seg * seg_tiles, last = min(tiles, first + seg_tiles) - 1;
        __syncthreads();  // the item before is done with every row
        for (int q = threadIdx.x; q < CG * tap_slots; q += THREADS) {
            const int rr = q / tap_slots, k = q % tap_slots;
            const bool tap = k < K && c0 + rr < dim;
            ws[q] = tap ? load_as<A>(weight, (int)p.weight_dtype,
                                     (c0 + rr) * p.weight_c_stride + k * p.weight_width_stride)
                        : A(0);
            wr[q] = tap ? load_as<A>(weight, (int)p.weight_dtype,
                                     (c0 + rr) * p.weight_c_stride + (K - 1 - k) * p.weight_width_stride)
                        : A(0);
        }
        for (int e = threadIdx.x; e < K - 1; e += THREADS)  // dz past the row: 0
            for (int rr = 0; rr < CG; ++rr) ds[rr * row_slots + wide_slot(TILE + e)] = A(0);
        const A bias_c = bias && c < dim ? load_as<A>(bias, (int)p.bias_dtype, c * p.bias_stride) : A(0);
        A dw[16] = {}, db = A(0);
        const A* const xrow = xs + r * row_slots;
        A* const drow = ds + r * row_slots;
        const A* const taps = ws + r * tap_slots;
        const A* const rtaps = wr + r * tap_slots;

        // A segment that ends inside the row computes the dz of the tile after it first.
        for (int64 tile = last < tiles - 1 ? last + 1 : last; tile >= first; --tile) {
            const bool carry_only = tile > last;
            const int64 t0 = tile * TILE;
            __syncthreads();  // the tile before is done with the rows
            // x at t0 - (K-1) + e, e < TILE + K - 1; dout at t0 + e, e < TILE
            const int64 x_first = t0 - (K - 1);
            stage_rows(xs, row_slots, x + b * p.x_batch_stride, p.x_c_stride, p.x_l_stride, p.x_channels_fastest,
                       c0, dim, x_first, TILE + K - 1, seqlen, [&](int rr, int e, A v) {
                           return c0 + rr < dim ? input_at<A>(x, initial_states, p, b, c0 + rr, x_first + e) : v;
                       });
            stage_rows(ds, row_slots, dout + b * p.dout_batch_stride, p.dout_c_stride, p.dout_l_stride,
                       p.dout_channels_fastest, c0, dim, t0, TILE, seqlen, [](int, int, A v) { return v; });
            __syncthreads();

            // z and dz at t0 + 16 g + j
            {
                A z[16];
                #pragma unroll
                for (int j = 0; j < 16; ++j) z[j] = bias_c;
                if (p.silu_act) window_sums(z, xrow, taps, 16 * g, K);
                #pragma unroll
                for (int j = 0; j < 16; ++j) {
                    const int e = 16 * g + j;
                    const A go = drow[wide_slot(e)];
                    const A d = t0 + e >= seqlen ? A(0) : p.silu_act ? go * silu_grad(z[j]) : go;
                    drow[wide_slot(e)] = d;
                    if (!carry_only) db += d;
                }
            }
            __syncthreads();
            if (!carry_only) {
                if (lag_lane) {
                    const int begin = pg * range_len, end = (int)min((int64)(begin + range_len), seqlen - t0);
                    lag_sums(dw, xrow, drow, 16 * kb, begin, end);
                }
                A acc[16] = {};
                window_sums(acc, drow, rtaps, 16 * g, K);
                __syncthreads();  // the x rows are read
                #pragma unroll
                for (int j = 0; j < 16; ++j) xs[r * row_slots + wide_slot(16 * g + j)] = acc[j];
                __syncthreads();
                store_rows(dx + b * p.dx_batch_stride, p.dx_c_stride, p.dx_l_stride, p.dx_channels_fastest, xs,
                           row_slots, c0, dim, t0, seqlen);
            }
            // this tile's first K-1 dz are the ones past the tile before
            // (every reader of position e is done: barrier above; TILE + e > every e read)
            for (int e = threadIdx.x; e < K - 1; e += THREADS)
                for (int rr = 0; rr < CG; ++rr)
                    ds[rr * row_slots + wide_slot(TILE + e)] = ds[rr * row_slots + wide_slot(e)];
        }

        // dweight: the position ranges' shares added in order through the x rows; dbias over
        // the half-warp in a fixed tree.
        #pragma unroll
        for (int o = 8; o > 0; o >>= 1) db += __shfl_xor_sync(0xffffffffu, db, o);
        __syncthreads();  // the rows are free
        A* const sums = xs + r * row_slots;  // [pg][16 kb + i], unpadded
        if (lag_lane) {
            #pragma unroll
            for (int i = 0; i < 16; ++i) sums[pg * 16 * tap_blocks + 16 * kb + i] = dw[i];
        }
        __syncthreads();
        const int64 part = b * segments + seg;
        if (c < dim) {
            for (int k = g; k <= K; k += 16) {
                A v = db;
                if (k < K) {
                    v = A(0);
                    for (int q = 0; q < ranges; ++q) v += sums[q * 16 * tap_blocks + k];
                }
                write_sum(partials, dweight, dbias, p, part, c, (int64)k, v);
            }
        }
    }
}
