// bwd_channel.cu: the backward for channel-contiguous x (x_c_stride == 1) whose rows split into
// aligned lane vectors, width K <= the plan's CHANNEL_MAX_WIDTH, in registers.
//
//   bwd_channel<T, K, SEQ, R, BYTES, WARPS>
//       a warp owns a strip of 32 lanes x V = BYTES / sizeof(T) channels and a group of
//       CHANNEL_TILES tiles of R time steps, which it computes one after the other, WARPS warps
//       a block (as many as fit the static shared memory, at most 4). SEQ says whether seq_idx
//       is given.
//
// For each tile, the warp stages by cp.async the R rows of x with K-1 rows on each side, and
// the R rows of dout with K-1 rows after them (one BYTES vector per lane and row); rows outside
// the sequence are zeros (before it: initial_states, when given). Then each lane slides down its
// V channels: dz at each of the R + K - 1 positions (the pre-activation recomputed from the
// window of K rows of x), dx at a position once the K values of dz after it are known, and its
// share of dweight / dbias, kept in registers over the whole group and written once as part
// (b, group) of the partials. Groups are numbered strips fastest, then time, then batch row,
// one per warp, divided by the plan's fast divisors p.strip_divisor and p.group_divisor.
// dout must split into the same lane vectors as x (p.dout_aligned, else it is read element by
// element); p.dx_aligned: dx does too.
#include "bwd_common.cuh"

template <typename T, int K, bool SEQ, int R, int BYTES, int WARPS>
__global__ void __launch_bounds__(32 * WARPS, 20 / WARPS) bwd_channel(BWD_ARRAYS, const __grid_constant__ BwdChannelParams p) {
    using A = typename AccOf<T>::type;
    const int64 batch = p.batch, dim = p.dim, seqlen = p.seqlen, x_batch_stride = p.x_batch_stride,
                x_l_stride = p.x_l_stride, weight_c_stride = p.weight_c_stride,
                weight_width_stride = p.weight_width_stride, bias_stride = p.bias_stride,
                dout_batch_stride = p.dout_batch_stride, dout_c_stride = p.dout_c_stride,
                dout_l_stride = p.dout_l_stride, dx_batch_stride = p.dx_batch_stride, dx_c_stride = p.dx_c_stride,
                dx_l_stride = p.dx_l_stride, strip_divisor = p.strip_divisor, group_divisor = p.group_divisor;
    const int weight_dtype = (int)p.weight_dtype, bias_dtype = (int)p.bias_dtype, silu_act = (int)p.silu_act,
              dout_aligned = (int)p.dout_aligned, dx_aligned = (int)p.dx_aligned;
    using VecT = Vec<T, BYTES>;
    using Raw = typename VecT::Raw;
    constexpr int V = VecT::V;  // channels per lane
    constexpr int W = K - 1;
    constexpr int XR = R + 2 * W, DR = R + W;  // staged rows of x and dout
    constexpr int SPAN = R * CHANNEL_TILES;    // time steps of a group
    const int lane = threadIdx.x & 31;
    __shared__ Raw stage_mem[WARPS][(XR + DR) * 32];  // per warp, lane-interleaved rows
    Raw* const xs = stage_mem[threadIdx.x / 32] + lane;
    Raw* const ds = xs + XR * 32;
    const int64 n_strips = (dim + 32 * V - 1) / (32 * V);
    const int64 groups_per_row = (seqlen + SPAN - 1) / SPAN;
    const int64 n_groups = batch * groups_per_row * n_strips;

    for (int64 g = grid_warp(); g < n_groups; g += grid_warps()) {
        int64 bt, strip, b, group;
        divmod_fast(g, n_strips, strip_divisor, bt, strip);
        divmod_fast(bt, groups_per_row, group_divisor, b, group);
        const int64 c0 = strip * (32 * V) + lane * V;
        if (c0 >= dim) continue;  // (nothing below is collective)
        const T* const xb = x + b * x_batch_stride + c0;
        const T* const db = dout + b * dout_batch_stride + c0 * dout_c_stride;
        T* const dxb = dx + b * dx_batch_stride + c0 * dx_c_stride;

        A w[K][V], bias_v[V] = {};
        #pragma unroll
        for (int v = 0; v < V; ++v) {
            #pragma unroll
            for (int k = 0; k < K; ++k)
                w[k][v] = load_as<A>(weight, weight_dtype, (c0 + v) * weight_c_stride + k * weight_width_stride);
            if (bias) bias_v[v] = load_as<A>(bias, bias_dtype, (c0 + v) * bias_stride);
        }
        A dw[K + 1][V] = {};  // this lane's share of dweight and (k = K) dbias over the group

        const int64 end = min(seqlen, (group + 1) * SPAN);
        #pragma unroll 1
        for (int64 t0 = group * SPAN; t0 < end; t0 += R) {
            __syncwarp();
            // x rows t0 - W .. (stage rows 0 .. XR - 1), dout rows t0 .. (0 .. DR - 1).
            #pragma unroll 1
            for (int r = 0; r < XR; ++r) {
                const int64 pos = t0 - W + r;
                const bool in_row = pos >= 0 && pos < seqlen;
                cp_async<BYTES>(xs + 32 * r, in_row ? xb + pos * x_l_stride : xb, in_row ? BYTES : 0);
            }
            if (dout_aligned) {
                #pragma unroll 1
                for (int r = 0; r < DR; ++r) {
                    const int64 pos = t0 + r;
                    const bool in_row = pos < seqlen;
                    cp_async<BYTES>(ds + 32 * r, in_row ? db + pos * dout_l_stride : db, in_row ? BYTES : 0);
                }
            }
            cp_async_commit();
            if (!dout_aligned) {
                #pragma unroll 1
                for (int r = 0; r < DR; ++r) {
                    VecT row;
                    const int64 pos = t0 + r;
                    #pragma unroll
                    for (int v = 0; v < V; ++v) row.e[v] = pos < seqlen ? db[pos * dout_l_stride + v * dout_c_stride] : T();
                    ds[32 * r] = row.raw;
                }
            }
            cp_async_wait<0>();

            // Rings of K slots, indexed by (row of the x stage) mod K: x rows, their segment ids,
            // and dz (dz at t0 + r in slot (r + W) mod K, with the row of t0 + r). Steps come
            // K at a time, so every slot index is a compile-time constant (no register moves).
            A xw[K][V], dzw[K][V];
            int64 ids[SEQ ? K : 1];
            auto x_row = [&](int r, A* dst) {
                VecT row;
                row.raw = xs[32 * r];
                widen<T, A, V>(row.e, dst);
                if (initial_states && t0 - W + r < 0) {
                    #pragma unroll
                    for (int v = 0; v < V; ++v) dst[v] = input_at<A>(x, initial_states, p, b, c0 + v, t0 - W + r);
                }
            };
            auto id_at = [&](int64 pos) { return pos < seqlen ? segment_id(seq_idx, p, b, pos) : (int64)-1; };
            #pragma unroll
            for (int r = 0; r < W; ++r) {
                x_row(r, xw[r]);
                if constexpr (SEQ) ids[r] = id_at(t0 - W + r);
            }
            #pragma unroll 1
            for (int r0 = 0; r0 < R + W; r0 += K) {
                #pragma unroll
                for (int u = 0; u < K; ++u) {  // step r: dz at t0 + r (stage row r + W), dx at t0 + r - W
                    const int r = r0 + u;
                    if (r >= R + W) break;
                    const int own = (u + W) % K;  // slot of row r + W
                    x_row(r + W, xw[own]);
                    if constexpr (SEQ) ids[own] = id_at(t0 + r);
                    VecT drow;
                    drow.raw = ds[32 * r];
                    A gd[V];
                    widen<T, A, V>(drow.e, gd);
                    const bool live = t0 + r < seqlen;
                    #pragma unroll
                    for (int v = 0; v < V; ++v) {
                        A gm = gd[v];
                        if (silu_act) {
                            A z = bias_v[v];
                            #pragma unroll
                            for (int k = 0; k < K; ++k) {  // tap k: stage row r + k
                                if constexpr (SEQ) {
                                    if (ids[(u + k) % K] == ids[own]) z += w[k][v] * xw[(u + k) % K][v];
                                } else {
                                    z += w[k][v] * xw[(u + k) % K][v];
                                }
                            }
                            gm *= silu_grad(z);
                        }
                        if constexpr (SEQ) {
                            if (ids[own] < 0) gm = A(0);  // padding
                        }
                        dzw[own][v] = live ? gm : A(0);
                    }
                    if (r < R && live) {
                        #pragma unroll
                        for (int v = 0; v < V; ++v) {
                            #pragma unroll
                            for (int k = 0; k < K; ++k) {
                                if constexpr (SEQ) {
                                    if (ids[(u + k) % K] == ids[own]) dw[k][v] += dzw[own][v] * xw[(u + k) % K][v];
                                } else {
                                    dw[k][v] += dzw[own][v] * xw[(u + k) % K][v];
                                }
                            }
                            dw[K][v] += dzw[own][v];
                        }
                    }
                    if (r >= W && t0 + r - W < end) {  // dx at t0 + s (stage row r, slot u)
                        const int64 s = t0 + r - W;
                        A acc[V];
                        #pragma unroll
                        for (int v = 0; v < V; ++v) {
                            acc[v] = A(0);
                            #pragma unroll
                            for (int k = 0; k < K; ++k) {  // tap k: the output at s + W - k, slot (u + W - k) mod K
                                if constexpr (SEQ) {
                                    if (ids[u] == ids[(u + W - k) % K]) acc[v] += w[k][v] * dzw[(u + W - k) % K][v];
                                } else {
                                    acc[v] += w[k][v] * dzw[(u + W - k) % K][v];
                                }
                            }
                        }
                        VecT res;
                        #pragma unroll
                        for (int v = 0; v < V; ++v) res.e[v] = from_acc<T>(acc[v]);
                        T* const o = dxb + s * dx_l_stride;
                        if (dx_aligned) {
                            *reinterpret_cast<Raw*>(o) = res.raw;
                        } else {
                            #pragma unroll
                            for (int v = 0; v < V; ++v) o[v * dx_c_stride] = res.e[v];
                        }
                    }
                }
            }
        }
        A* const out = partials + ((b * groups_per_row + group) * dim + c0) * (K + 1);
        #pragma unroll
        for (int v = 0; v < V; ++v)
            #pragma unroll
            for (int k = 0; k <= K; ++k) out[v * (K + 1) + k] = dw[k][v];
    }
}
