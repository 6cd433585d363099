// fwd_time_wide.cu: the forward for time-contiguous x and any width (run-time; the plan uses
// it above TIME_MAX_WIDTH where tensor cores do not serve).
//
//   fwd_time_wide<T, SEQ>
//       TIME_WIDE_WARPS independent warps a block; a warp takes rows (b, c) in turn and walks
//       each in spans of 32 R outputs, R = TIME_WIDE_RUN consecutive outputs a lane. SEQ says
//       whether seq_idx is given.
//
// A warp's shared memory (p.warp_bytes from byte warp * p.warp_bytes): two buffers of a span's
// inputs (positions t0 - (K - 1) .. t0 + 32 R - 1 as A; position t0 - (K - 1) + q in slot
// (q % R) * p.cols + q / R, so that the lanes, which read q = lane R + m at once, hit
// consecutive slots; p.cols is odd, so the staging stores of q = lane + 32 i meet at most
// two to a bank), then the row's taps (p.tap_slots, zero past K), then with SEQ two
// buffers of the positions' segment ids at byte p.ids_at of the warp's part. The warp copies
// its next span into the other buffer (float32 and float64 x by cp.async) while it computes
// this one. A lane's R outputs slide over its inputs through a ring of R registers that the
// loop over the taps, unrolled R at a time, indexes at compile time (the last width % R taps
// in a predicated tail); a tap is one shared load for R FMAs (the taps broadcast, four at a
// time).
#include "fwd_common.cuh"

template <typename T, bool SEQ>
__global__ void __launch_bounds__(32 * TIME_WIDE_WARPS)
    fwd_time_wide(FWD_ARRAYS, const __grid_constant__ FwdTimeWideParams p) {
    if (final_states_blocks(x, seq_idx, initial_states, final_states, p)) return;
    using A = typename AccOf<T>::type;
    constexpr int R = TIME_WIDE_RUN;
    constexpr int SPAN = 32 * R;
    const int width = (int)p.width, weight_dtype = (int)p.weight_dtype, bias_dtype = (int)p.bias_dtype,
              silu_act = (int)p.silu_act, out_aligned = (int)p.out_aligned, cols = (int)p.cols;
    const int64 batch = p.batch, dim = p.dim, seqlen = p.seqlen, x_batch_stride = p.x_batch_stride,
                x_c_stride = p.x_c_stride, x_l_stride = p.x_l_stride, weight_c_stride = p.weight_c_stride,
                weight_width_stride = p.weight_width_stride, bias_stride = p.bias_stride,
                out_batch_stride = p.out_batch_stride, out_c_stride = p.out_c_stride, out_l_stride = p.out_l_stride;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const int lane = threadIdx.x & 31;
    unsigned char* const mine = smem_raw + (threadIdx.x / 32) * p.warp_bytes;
    A* const ws = reinterpret_cast<A*>(mine + 2 * cols * R * sizeof(A));  // the row's taps
    auto inputs = [&](int buf) { return reinterpret_cast<A*>(mine) + buf * cols * R; };
    auto ids_of = [&](int buf) { return reinterpret_cast<int64*>(mine + p.ids_at) + buf * cols * R; };
    auto slot = [&](int q) { return (q % R) * cols + q / R; };  // q >= 0
    const int n_in = width - 1 + SPAN;  // a span's inputs
    const A scale = act_scale<A>(silu_act);

    // Copies (or starts copying) the inputs (and ids) of the span from t0 of row (b, c).
    auto stage = [&](int64 b, int64 c, int64 t0, int buf) {
        A* const xs = inputs(buf);
        const T* const xr = x + b * x_batch_stride + c * x_c_stride;
        for (int q = lane; q < n_in; q += 32) {
            const int64 pos = t0 - (width - 1) + q;
            if constexpr (same_type<T, A>) {
                if (pos >= 0) {  // zeros past the row
                    const bool in_row = pos < seqlen;
                    cp_async<sizeof(A)>(xs + slot(q), in_row ? xr + pos * x_l_stride : xr, in_row ? sizeof(A) : 0);
                    continue;
                }
            }
            xs[slot(q)] = pos < seqlen ? input_at<A>(x, initial_states, p, b, c, pos) : A(0);
        }
        if constexpr (SEQ) {
            int64* const ids = ids_of(buf);
            for (int q = lane; q < n_in; q += 32) {
                const int64 pos = t0 - (width - 1) + q;
                ids[slot(q)] = pos < seqlen ? segment_id(seq_idx, p, b, pos) : -1;
            }
        }
    };

    const int64 spans = (seqlen + SPAN - 1) / SPAN;
    for (int64 row = grid_warp(); row < batch * dim; row += main_warps(p)) {
        int64 b, c;
        divmod(row, dim, b, c);
        __syncwarp();  // the previous row's readers of the taps are done
        for (int k = lane; k < (int)p.tap_slots; k += 32)
            ws[k] = k < width ? scale * load_as<A>(weight, weight_dtype, c * weight_c_stride + k * weight_width_stride)
                              : A(0);
        const A bias_c = bias ? scale * load_as<A>(bias, bias_dtype, c * bias_stride) : A(0);
        stage(b, c, 0, 0);
        cp_async_commit();
        int buf = 0;
        for (int64 s = 0; s < spans; ++s, buf ^= 1) {
            const int64 t0 = s * SPAN;
            if (s + 1 < spans) stage(b, c, t0 + SPAN, buf ^ 1);
            cp_async_commit();
            cp_async_wait<1>();
            __syncwarp();  // the span's inputs (and the taps) are in place

            // Output t0 + lane R + r reads slot q = lane R + r + k at tap k; win[(r + j) % R]
            // holds q = lane R + k0 + j + r at tap k0 + j.
            // Slot q = lane R + R kb + m (m < 2 R known at compile time) is at column m % R,
            // row lane + kb + m / R: at(m) + kb.
            const A* const xs = inputs(buf) + lane;
            const int64* const ids = ids_of(buf) + lane;
            auto at = [&](int m) { return (m % R) * cols + m / R; };
            A acc[R], win[R];
            #pragma unroll
            for (int r = 0; r < R; ++r) {
                acc[r] = bias_c;
                if (r < R - 1) win[r] = xs[at(r)];
            }
            int64 out_id[SEQ ? R : 1], id_win[SEQ ? R : 1];
            if constexpr (SEQ) {
                #pragma unroll
                for (int r = 0; r < R; ++r) {
                    out_id[r] = ids_of(buf)[slot(lane * R + r + width - 1)];
                    if (r < R - 1) id_win[r] = ids[at(r)];
                }
            }
            auto tap = [&](int kb, int j, A w) {  // tap R kb + j, j < R known at compile time
                win[(j + R - 1) % R] = xs[at(j + R - 1) + kb];
                if constexpr (SEQ) {
                    id_win[(j + R - 1) % R] = ids[at(j + R - 1) + kb];
                    #pragma unroll
                    for (int r = 0; r < R; ++r)
                        if (id_win[(r + j) % R] == out_id[r]) acc[r] += w * win[(r + j) % R];
                } else {
                    #pragma unroll
                    for (int r = 0; r < R; ++r) acc[r] += w * win[(r + j) % R];
                }
            };
            int kb = 0;
            #pragma unroll 1
            for (; R * kb + R <= width; ++kb) {
                #pragma unroll
                for (int j = 0; j < R; j += 4) {
                    A w[4];
                    if constexpr (same_type<A, float>) {
                        const float4 q = *reinterpret_cast<const float4*>(ws + R * kb + j);
                        w[0] = q.x, w[1] = q.y, w[2] = q.z, w[3] = q.w;
                    } else {
                        #pragma unroll
                        for (int i = 0; i < 4; ++i) w[i] = ws[R * kb + j + i];
                    }
                    #pragma unroll
                    for (int i = 0; i < 4; ++i) tap(kb, j + i, w[i]);
                }
            }
            #pragma unroll
            for (int j = 0; j < R - 1; ++j)
                if (R * kb + j < width) tap(kb, j, ws[R * kb + j]);

            const int64 o = t0 + lane * R;  // the lane's first output
            if (o < seqlen) {
                Vec<T> res[R * sizeof(T) / 16];
                if constexpr (SEQ) {
                    #pragma unroll
                    for (int r = 0; r < R; ++r)
                        if (out_id[r] < 0) acc[r] = A(0);  // padding (act(0) = 0)
                }
                activate_store(acc, silu_act, reinterpret_cast<T*>(res));
                T* const dst = out + b * out_batch_stride + c * out_c_stride;
                if (out_aligned && o + R <= seqlen) {
                    #pragma unroll
                    for (int v = 0; v < R * (int)sizeof(T) / 16; ++v) reinterpret_cast<uint4*>(dst + o)[v] = res[v].raw;
                } else {
                    #pragma unroll
                    for (int r = 0; r < R; ++r)
                        if (o + r < seqlen) dst[(o + r) * out_l_stride] = reinterpret_cast<const T*>(res)[r];
                }
            }
            __syncwarp();  // buffer buf is read
        }
    }
}
