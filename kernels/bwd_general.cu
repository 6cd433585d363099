// bwd_general.cu: the backward for any strides and any width, the initial states' gradient,
// and the reduction of the dweight / dbias partials.
//
//   bwd_dz<T>       one thread per (b, c, t): dz into scratch (accumulation type, laid out by
//                   the plan: scratch_*_stride).
//   bwd_dx<T>       one thread per (b, c, s), s >= 0: dx from scratch.
//   bwd_weight<T>   one block of WEIGHT_THREADS threads per (part, c): the partial sums of
//                   dweight[c, :] and dbias[c] over the part's runs of WEIGHT_RUN positions of a
//                   row (one run a thread; the inputs slide through a window of registers, one
//                   new input per tap), each tap's sum reduced over the block in a fixed tree.
//   bwd_states<T>   one thread per (b, c), after the main kernel: dinitial_states[b, c, :], and
//                   with dfinal_states dx at the row's last K-1 positions again, with the
//                   gradient of final_states added (dz of those positions recomputed; every
//                   layout's plan launches it when either is given).
//   bwd_reduce<T, S>  32 S sums (c, k) a block of REDUCE_WARPS warps, lane l the block's sums
//                   l, l + 32, ... (a warp's load reads 32 consecutive sums of a part): warp w
//                   adds parts w, w + REDUCE_WARPS, ... of them, then warp j the warps' totals
//                   of sums l + 32 j in warp order, into dweight[c, k] (k < K) or dbias[c]
//                   (k = K): a fixed order, the same for every S. Not launched for a single
//                   part (write_sum).
// p.channels_fastest numbers the threads of bwd_dz and bwd_dx channels fastest (channel-
// contiguous data: coalesced), else time fastest. Every kernel loops over its work grid-stride;
// every offset is 64-bit.
#include "bwd_common.cuh"

template <typename T>
__global__ void bwd_dz(BWD_ARRAYS, const __grid_constant__ BwdDzParams p) {
    wait_for_previous_kernel();
    using A = typename AccOf<T>::type;
    const int64 batch = p.batch, dim = p.dim, seqlen = p.seqlen, total = batch * dim * seqlen;
    for (int64 i = blockIdx.x * (int64)blockDim.x + threadIdx.x; i < total; i += (int64)gridDim.x * blockDim.x) {
        int64 b, c, t;
        if (p.channels_fastest) {
            c = i % dim;
            t = (i / dim) % seqlen;
        } else {
            t = i % seqlen;
            c = (i / seqlen) % dim;
        }
        b = i / (dim * seqlen);
        scratch[b * p.scratch_batch_stride + c * p.scratch_c_stride + t * p.scratch_l_stride] =
            dz_at<A>(x, weight, bias, seq_idx, initial_states, dout, p, b, c, t);
    }
}

template <typename T>
__global__ void bwd_dx(BWD_ARRAYS, const __grid_constant__ BwdDxParams p) {
    wait_for_previous_kernel();
    using A = typename AccOf<T>::type;
    const int64 batch = p.batch, dim = p.dim, seqlen = p.seqlen, total = batch * dim * seqlen;
    const int width = (int)p.width;
    for (int64 i = blockIdx.x * (int64)blockDim.x + threadIdx.x; i < total; i += (int64)gridDim.x * blockDim.x) {
        int64 b, c, s;
        if (p.channels_fastest) {
            c = i % dim;
            s = (i / dim) % seqlen;
        } else {
            s = i % seqlen;
            c = (i / seqlen) % dim;
        }
        b = i / (dim * seqlen);
        const int64 sid = seq_idx ? segment_id(seq_idx, p, b, s) : 0;
        const A* const g = scratch + b * p.scratch_batch_stride + c * p.scratch_c_stride;
        A acc = A(0);
        for (int k = 0; k < width; ++k) {  // the output at t = s + (K-1) - k sees s through tap k
            const int64 t = s + (width - 1) - k;
            if (t >= seqlen || (seq_idx && segment_id(seq_idx, p, b, t) != sid)) continue;
            acc += load_as<A>(weight, (int)p.weight_dtype, c * p.weight_c_stride + k * p.weight_width_stride) *
                   g[t * p.scratch_l_stride];
        }
        dx[b * p.dx_batch_stride + c * p.dx_c_stride + s * p.dx_l_stride] = from_acc<T>(acc);
    }
}

// Sum of v over the block's WEIGHT_THREADS threads, in a fixed order; valid in thread 0.
template <typename A>
__device__ __forceinline__ A block_sum(A v, A* shared) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int warp = threadIdx.x / 32;
    __syncthreads();  // the previous sum's readers are done
    if ((threadIdx.x & 31) == 0) shared[warp] = v;
    __syncthreads();
    A total = A(0);
    if (threadIdx.x == 0)
        for (int w = 0; w < WEIGHT_THREADS / 32; ++w) total += shared[w];
    return total;
}

template <typename T>
__global__ void __launch_bounds__(WEIGHT_THREADS) bwd_weight(BWD_ARRAYS, const __grid_constant__ BwdWeightParams p) {
    wait_for_previous_kernel();
    using A = typename AccOf<T>::type;
    constexpr int RUN = WEIGHT_RUN;
    __shared__ A shared[WEIGHT_THREADS / 32];
    const int64 dim = p.dim, seqlen = p.seqlen, n_parts = p.n_parts;
    const int64 runs_per_row = (seqlen + RUN - 1) / RUN, runs = p.batch * runs_per_row;
    const int width = (int)p.width;
    for (int64 item = blockIdx.x; item < n_parts * dim; item += gridDim.x) {
        const int64 part = item / dim, c = item % dim;
        const int64 run = part * WEIGHT_THREADS + threadIdx.x;  // this thread's run of a row
        const bool active = run < runs;
        const int64 b = active ? run / runs_per_row : 0, t0 = active ? run % runs_per_row * RUN : 0;
        // dz and segment id of the run's positions t0 + j (id -1: padding or past the row),
        // and the window of inputs h(s) with their ids, s = t0 + j - (K-1) + k for tap k.
        A g[RUN], win[RUN];
        int64 sid[RUN], ids[RUN];
        auto id_at = [&](int64 s) { return seq_idx ? segment_id(seq_idx, p, b, s) : (int64)0; };
        auto input = [&](int64 s) { return active && s < seqlen ? input_at<A>(x, initial_states, p, b, c, s) : A(0); };
        #pragma unroll
        for (int j = 0; j < RUN; ++j) {
            const int64 t = t0 + j, s = t - (width - 1);
            const bool in = active && t < seqlen;
            g[j] = in ? scratch[b * p.scratch_batch_stride + c * p.scratch_c_stride + t * p.scratch_l_stride] : A(0);
            sid[j] = in ? id_at(t) : -1;
            win[j] = input(s);
            ids[j] = active && s < seqlen ? id_at(s) : -2;
        }
        for (int k = 0; k < width; ++k) {
            A sum = A(0);
            #pragma unroll
            for (int j = 0; j < RUN; ++j)
                if (sid[j] >= 0 && ids[j] == sid[j]) sum += g[j] * win[j];
            const A total = block_sum(sum, shared);
            if (threadIdx.x == 0) write_sum(partials, dweight, dbias, p, part, c, k, total);
            const int64 s_next = t0 + RUN - (width - 1) + k;  // enters the window for tap k + 1
            #pragma unroll
            for (int j = 0; j + 1 < RUN; ++j) {
                win[j] = win[j + 1];
                ids[j] = ids[j + 1];
            }
            win[RUN - 1] = input(s_next);
            ids[RUN - 1] = active && s_next < seqlen ? id_at(s_next) : -2;
        }
        A sum = A(0);
        #pragma unroll
        for (int j = 0; j < RUN; ++j) sum += g[j];
        const A total = block_sum(sum, shared);
        if (threadIdx.x == 0) write_sum(partials, dweight, dbias, p, part, c, (int64)width, total);
    }
}

template <typename T>
__global__ void bwd_states(BWD_ARRAYS, const __grid_constant__ BwdStatesParams p) {
    wait_for_previous_kernel();
    using A = typename AccOf<T>::type;
    const int64 batch = p.batch, dim = p.dim, seqlen = p.seqlen;
    const int n = (int)p.width - 1;
    for (int64 i = blockIdx.x * (int64)blockDim.x + threadIdx.x; i < batch * dim; i += (int64)gridDim.x * blockDim.x) {
        const int64 b = i / dim, c = i % dim;
        auto w_at = [&](int k) {
            return load_as<A>(weight, (int)p.weight_dtype, c * p.weight_c_stride + k * p.weight_width_stride);
        };
        auto visible = [&](int64 t, int64 s) {  // the output at t sees position s
            return !seq_idx || segment_id(seq_idx, p, b, t) == segment_id(seq_idx, p, b, s);
        };
        A g[MAX_STATE];  // dz at the first (dinitial_states) or the last (dfinal_states) positions
        if (dinitial_states) {  // positions s = j - n, seen by the outputs t = 0 .. j
            const int m = (int)min(seqlen, (int64)n);
            for (int t = 0; t < m; ++t) g[t] = dz_at<A>(x, weight, bias, seq_idx, initial_states, dout, p, b, c, t);
            for (int j = 0; j < n; ++j) {
                A acc = A(0);
                for (int t = 0; t <= j && t < m; ++t)
                    if (visible(t, 0)) acc += w_at(j - t) * g[t];
                if (dfinal_states && j >= seqlen) acc += dfinal_at<A>(dfinal_states, seq_idx, p, b, c, (int64)j - n);
                dinitial_states[b * p.dinit_batch_stride + c * p.dinit_c_stride + j * p.dinit_l_stride] = from_acc<T>(acc);
            }
        }
        if (dfinal_states) {  // dx at the last positions s = s0 .. L-1, seen by the outputs s .. L-1
            const int64 s0 = max(seqlen - n, (int64)0);
            const int m = (int)(seqlen - s0);
            for (int u = 0; u < m; ++u) g[u] = dz_at<A>(x, weight, bias, seq_idx, initial_states, dout, p, b, c, s0 + u);
            for (int u = 0; u < m; ++u) {
                const int64 s = s0 + u;
                A acc = A(0);
                for (int v = u; v < m; ++v)  // the output at s0 + v, tap n - (v - u)
                    if (visible(s0 + v, s)) acc += w_at(n - (v - u)) * g[v];
                acc += dfinal_at<A>(dfinal_states, seq_idx, p, b, c, s);
                dx[b * p.dx_batch_stride + c * p.dx_c_stride + s * p.dx_l_stride] = from_acc<T>(acc);
            }
        }
    }
}

template <typename T, int S>
__global__ void __launch_bounds__(32 * REDUCE_WARPS) bwd_reduce(BWD_ARRAYS, const __grid_constant__ BwdReduceParams p) {
    wait_for_previous_kernel();
    using A = typename AccOf<T>::type;
    static_assert(S <= REDUCE_WARPS, "a warp adds up each of a thread's sums");
    __shared__ A totals[REDUCE_WARPS][S][32];
    const int64 row = p.width + 1, sums = p.dim * row, n_parts = p.n_parts;
    const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
    for (int64 first = blockIdx.x * (32LL * S) + lane; first - lane < sums; first += gridDim.x * (32LL * S)) {
        A sum[S] = {};  // sums first + 32 j
        #pragma unroll 4
        for (int64 part = warp; part < n_parts; part += REDUCE_WARPS) {
            const A* const q = partials + part * sums + first;
            #pragma unroll
            for (int j = 0; j < S; ++j)
                if (first + 32 * j < sums) sum[j] += q[32 * j];
        }
        #pragma unroll
        for (int j = 0; j < S; ++j) totals[warp][j][lane] = sum[j];
        __syncthreads();
        if (warp < S) {  // warp j: the block's sums first + 32 j, the warps' totals in warp order
            const int64 i = first + 32 * warp;
            if (i < sums) {
                A total = totals[0][warp][lane];
                #pragma unroll
                for (int w = 1; w < REDUCE_WARPS; ++w) total += totals[w][warp][lane];
                const int64 c = sums < (1LL << 31) ? (int64)((int)i / (int)row) : i / row;  // (32-bit where it fits)
                write_result(dweight, dbias, p, c, i - c * row, total);
            }
        }
        __syncthreads();
    }
}
