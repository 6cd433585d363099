// bwd_channel.cu: the backward for channel-contiguous x (x_c_stride == 1) whose rows split into
// aligned lane vectors, width K <= the plan's CHANNEL_MAX_WIDTH, in registers.
//
//   bwd_channel<T, K, SEQ, R, BYTES, BUFS, WARPS>
//       a warp owns a strip of 32 lanes x V = BYTES / sizeof(T) channels and a group of
//       p.group_tiles tiles of R time steps of a batch row, WARPS warps a block, BUFS staged
//       tiles a warp. R is a multiple of K.
//       SEQ says whether seq_idx is given. V = 1 from the plan's CHANNEL_LANE_FROM (one channel
//       a lane, so that the rings of wider filters stay in registers).
//
// The warp streams its group's positions g0 .. g1 - 1 and the K-1 after them in tiles of R rows,
// staging tiles i + 1 .. i + BUFS - 1 of x and dout by cp.async (one BYTES vector per lane and row;
// a miss brings in the 256 bytes around it, which the neighbouring strip's warp reads) while it
// computes tile i. Step r (position g0 + r) takes the row of x and dout at that position:
// dz there (the pre-activation recomputed from the K rows of x up to it), its dweight / dbias
// terms, and dx at g0 + r - (K-1), whose K values of dz are then known. x rows, their segment ids
// and dz live in rings of K register slots indexed by position mod K (steps come K at a time, so
// every slot index is a compile-time constant). The K-1 rows of x before the group are read first
// (from initial_states before the row). The lane's dweight / dbias sums over the group are written
// once as part (b, group) of the partials. Groups are numbered strips fastest, then time, then
// batch row, one per warp, divided by the plan's fast divisors p.strip_divisor and p.group_divisor.
// p.block_sum (a call whose batch rows x groups a row fit one block's WARPS warps): block s takes
// strip s, its warp w group w mod groups_per_row of batch row w / groups_per_row; the warps' sums
// meet in their stage areas and warp 0 adds them in warp order into dweight and dbias (one part:
// no partials, no bwd_reduce).
// dout must split into the same lane vectors as x (p.dout_aligned, else it is read element by
// element); p.dx_aligned: dx does too.
//
//   bwd_channel_pair<T, K, R, BUFS, PAIRS>
//       16-bit x on strips of 128 channels by pairs of warps (below).
#include "bwd_common.cuh"

// gd (dout at step u of a round of K) times SiLU's derivative at the step's recomputed
// pre-activation: the taps over the x ring's slots (u + k) mod K, where same(k) (with seq_idx:
// tap k's position in the step's sequence).
template <int K, int V, typename A, typename Same>
__device__ __forceinline__ void times_silu_grad(A (&gd)[V], const A (&w)[K][V], const A (&bias_v)[V],
                                                const A (&xw)[K][V], int u, Same same) {
    #pragma unroll
    for (int v = 0; v < V; ++v) {
        A z = bias_v[v];
        #pragma unroll
        for (int k = 0; k < K; ++k)
            if (same(k)) z += w[k][v] * xw[(u + k) % K][v];
        gd[v] *= silu_grad_scaled(z);
    }
}

// step(row, u, r) for tile i's steps in rounds of K: its row in the tile, u = row mod K (a
// compile-time constant once unrolled), r = i R + row the group's step; where CHECKED, up to the
// group's last step (steps).
template <int R, int K, bool CHECKED, typename Step>
__device__ __forceinline__ void tile_steps(int i, int steps, Step step) {
    #pragma unroll 1
    for (int r0 = 0; r0 < R; r0 += K) {
        #pragma unroll
        for (int u = 0; u < K; ++u) {
            const int r = i * R + r0 + u;
            if (CHECKED && r >= steps) break;
            step(r0 + u, u, r);
        }
    }
}

template <typename T, int K, bool SEQ, int R, int BYTES, int BUFS, int WARPS>
__global__ void __launch_bounds__(32 * WARPS, bwd_warps_per_sm(sizeof(T), BYTES / sizeof(T), K) / WARPS)
    bwd_channel(BWD_ARRAYS, const __grid_constant__ BwdChannelParams p) {
    wait_for_previous_kernel();
    using A = typename AccOf<T>::type;
    const int64 batch = p.batch, dim = p.dim, seqlen = p.seqlen, x_batch_stride = p.x_batch_stride,
                x_l_stride = p.x_l_stride, weight_c_stride = p.weight_c_stride,
                weight_width_stride = p.weight_width_stride, bias_stride = p.bias_stride,
                dout_batch_stride = p.dout_batch_stride, dout_c_stride = p.dout_c_stride,
                dout_l_stride = p.dout_l_stride, dx_batch_stride = p.dx_batch_stride, dx_c_stride = p.dx_c_stride,
                dx_l_stride = p.dx_l_stride, strip_divisor = p.strip_divisor, group_divisor = p.group_divisor,
                span = R * p.group_tiles;  // time steps of a group
    const int weight_dtype = (int)p.weight_dtype, bias_dtype = (int)p.bias_dtype, silu_act = (int)p.silu_act,
              dout_aligned = (int)p.dout_aligned, dx_aligned = (int)p.dx_aligned, rows16 = (int)p.rows16;
    using VecT = Vec<T, BYTES>;
    using Raw = typename VecT::Raw;
    constexpr int V = VecT::V;  // channels per lane
    constexpr int W = K - 1;
    static_assert(R % K == 0, "ring slots are compile-time constants only if R is a multiple of K");
    constexpr int PIECES = 2 * BYTES;  // 16-byte pieces of a staged row (32 lanes x BYTES)
    constexpr int ROUND = 32 / PIECES;  // rows the warp stages together per 16-byte copy of a lane
    const int lane = threadIdx.x & 31;
    __shared__ __align__(16) Raw stage_mem[WARPS][BUFS][2 * R * 32];  // per warp, BUFS tiles: R rows of x, R of dout
    static_assert(sizeof(stage_mem[0]) >= (K + 1) * V * 32 * sizeof(A), "a warp's sums fit its stage area");
    Raw (*const stage)[2 * R * 32] = stage_mem[threadIdx.x / 32];
    const int64 n_strips = (dim + 32 * V - 1) / (32 * V);
    const int64 groups_per_row = (seqlen + span - 1) / span;
    // With SiLU, the taps and bias scaled (silu_grad_scaled), and so are dz and dw.
    const A scale = act_scale<A>(silu_act);
    const bool block_sum = p.block_sum;
    const int64 n_groups = block_sum ? n_strips * WARPS : batch * groups_per_row * n_strips;
    A dw[K + 1][V] = {};  // this lane's share of dweight and (k = K) dbias over its group

    for (int64 g = grid_warp(); g < n_groups; g += grid_warps()) {
        // Block sums: g = strip WARPS + w (p.strip_divisor divides by WARPS; the warps past the
        // strip's groups have none).
        int64 q, r, strip, bt, b, group;
        divmod_fast(g, block_sum ? WARPS : n_strips, strip_divisor, q, r);
        strip = block_sum ? q : r;
        bt = block_sum ? r : q;
        if (bt >= batch * groups_per_row) continue;
        divmod_fast(bt, groups_per_row, group_divisor, b, group);
        const int64 c0 = strip * (32 * V) + lane * V;
        if (c0 >= dim) continue;  // (nothing below is collective but among the lanes with channels)
        const T* const xb = x + b * x_batch_stride + c0;
        const T* const db = dout + b * dout_batch_stride + c0 * dout_c_stride;
        T* const dxb = dx + b * dx_batch_stride + c0 * dx_c_stride;
        const int64 g0 = group * span, g1 = min(seqlen, g0 + span);
        const int len = (int)(g1 - g0), steps = len + W;  // positions g0 .. g1 - 1, and g1 + W - 1
        const int n_tiles = (steps + R - 1) / R;

        // A whole strip of 16-byte aligned rows is staged by the warp together, in 16-byte pieces
        // (lane l: piece l mod PIECES of rows l / PIECES, + ROUND, ...); otherwise each lane
        // stages its own vectors.
        const bool together = BYTES < 16 && rows16 && (strip + 1) * (32 * V) <= dim;  // warp-uniform
        if (together) __syncwarp();  // the stage's last readers are done
        // The tiles are staged in order, tile t into buffer t mod BUFS (one cp.async group a tile,
        // an empty one past the group's last tile), each from the lane's running sources: its
        // piece of row `first` of the tile (together), or its vectors of the tile's first row.
        // Rows past the row are zeros.
        const int in_row = (int)min(seqlen - g0, (int64)n_tiles * R);  // staged rows inside the row
        const int piece = lane % PIECES, first = together ? lane / PIECES : 0;
        const int64 c_first = together ? strip * (32 * V) + piece * (16 / (int)sizeof(T)) : c0;
        const T* x_next = x + b * x_batch_stride + c_first + (g0 + first) * x_l_stride;
        const T* d_next = dout + b * dout_batch_stride + c_first * dout_c_stride + (g0 + first) * dout_l_stride;
        asm("" : "+l"(x_next), "+l"(d_next));  // opaque: else NVRTC keeps a pair for each way of staging
        const int64 x_tile = R * x_l_stride, d_tile = R * dout_l_stride;
        constexpr int TILE_BYTES = (int)sizeof(stage[0]);
        char* const dst_first = reinterpret_cast<char*>(stage[0]) + (together ? piece * 16 : lane * BYTES);
        int next = 0, next_buf = 0;
        auto stage_next = [&]() {
            const int i = next++;
            char* const dst = dst_first + next_buf * TILE_BYTES;
            next_buf = next_buf == BUFS - 1 ? 0 : next_buf + 1;
            const T* const src = x_next;
            const T* const d = d_next;
            x_next += x_tile;
            d_next += d_tile;
            if (i >= n_tiles) {
                cp_async_commit();
                return;
            }
            // whole: tile i lies wholly inside the row and is staged without checks. (Not tested as
            // rows == R: NVRTC 13.0 compiled that as in_row - i R < R, so each group's last partial
            // tile was staged unchecked, past the row: compute-sanitizer found the reads.)
            const bool whole = (i + 1) * R <= in_row;
            const int rows = max(min(in_row - i * R, R), 0);
            if (together) {
                // Whole tiles in the row without checks, the last one with (zeros past the row).
                auto copy_rows = [&](auto checked_flag) {
                    constexpr bool CHECKED = decltype(checked_flag)::value;
                    const T *s = src, *t = d;
                    #pragma unroll
                    for (int k = 0; k < (R + ROUND - 1) / ROUND; ++k, s += ROUND * x_l_stride, t += ROUND * dout_l_stride) {
                        const int r = first + k * ROUND;
                        const bool in = !CHECKED || r < rows;
                        if (r < R) {
                            cp_async<16, 256>(dst + r * 32 * BYTES, in ? s : x, in ? 16 : 0);
                            cp_async<16, 256>(dst + (R + r) * 32 * BYTES, in ? t : dout, in ? 16 : 0);
                        }
                    }
                };
                if (whole) copy_rows(Flag<false>());
                else copy_rows(Flag<true>());
                cp_async_commit();
                return;
            }
            Raw* const st = reinterpret_cast<Raw*>(dst);
            // A lane's own vector (zeros where !in): by cp.async, or (2 bytes, below its smallest
            // copy) loaded and stored.
            auto own = [&](Raw* to, const T* from, bool in) {
                if constexpr (BYTES >= 4) cp_async<BYTES, 256>(to, from, in ? BYTES : 0);
                else *to = in ? *reinterpret_cast<const Raw*>(from) : Raw(0);
            };
            const T *s = src, *t = d;
            if (whole) {  // the whole tile in the row: no checks
                #pragma unroll
                for (int r = 0; r < R; ++r, s += x_l_stride) own(st + 32 * r, s, true);
                if (dout_aligned) {
                    #pragma unroll
                    for (int r = 0; r < R; ++r, t += dout_l_stride) own(st + 32 * (R + r), t, true);
                }
            } else {
                #pragma unroll 1
                for (int r = 0; r < R; ++r, s += x_l_stride) own(st + 32 * r, r < rows ? s : xb, r < rows);
                if (dout_aligned) {
                    #pragma unroll 1
                    for (int r = 0; r < R; ++r, t += dout_l_stride) own(st + 32 * (R + r), r < rows ? t : db, r < rows);
                }
            }
            if (!dout_aligned) {
                #pragma unroll 1
                for (int r = 0; r < R; ++r, t += dout_l_stride) {
                    VecT row;
                    #pragma unroll
                    for (int v = 0; v < V; ++v) row.e[v] = r < rows ? t[v * dout_c_stride] : T();
                    st[32 * (R + r)] = row.raw;
                }
            }
            cp_async_commit();
        };
        #pragma unroll
        for (int i = 0; i < BUFS - 1; ++i) stage_next();

        A w[K][V], bias_v[V] = {};
        #pragma unroll
        for (int v = 0; v < V; ++v) {
            #pragma unroll
            for (int k = 0; k < K; ++k)
                w[k][v] = scale * load_as<A>(weight, weight_dtype, (c0 + v) * weight_c_stride + k * weight_width_stride);
            if (bias) bias_v[v] = scale * load_as<A>(bias, bias_dtype, (c0 + v) * bias_stride);
        }
        #pragma unroll
        for (int k = 0; k <= K; ++k)
            #pragma unroll
            for (int v = 0; v < V; ++v) dw[k][v] = A(0);
        T* dxp = dxb + g0 * dx_l_stride;  // dx at the next position it is written
        // Rings of K slots: position g0 + r - W + k of the window of step r in slot (r + k) mod K.
        A xw[K][V], dzw[K][V];
        int64 ids[SEQ ? K : 1];
        auto id_at = [&](int64 pos) { return pos < seqlen ? segment_id(seq_idx, p, b, pos) : (int64)-1; };
        #pragma unroll
        for (int k = 0; k < W; ++k) {  // the K-1 positions before the group
            const int64 pos = g0 - W + k;
            #pragma unroll
            for (int v = 0; v < V; ++v) xw[k][v] = input_at<A>(x, initial_states, p, b, c0 + v, pos);
            if constexpr (SEQ) ids[k] = id_at(pos);
        }

        int buf = 0;  // tile i's buffer, i mod BUFS
        #pragma unroll 1
        for (int i = 0; i < n_tiles; ++i) {
            if (together) __syncwarp();  // tile i - 1's readers are done with its stage
            stage_next();  // tile i + BUFS - 1
            cp_async_wait<BUFS - 1>();  // tile i's group has landed
            if (together) __syncwarp();  // the pieces the other lanes staged have landed
            const Raw* const st = stage[buf] + lane;
            buf = buf == BUFS - 1 ? 0 : buf + 1;
            // Tile i's steps (tile_steps), compiled five times: CHECKED (the tiles holding the
            // group's first K-1 steps or positions past g1: every step checked, SiLU and the dx
            // store run-time choices) and, for the tiles inside, with the activation fixed
            // (SILU), so that the K V derivatives of the steps interleave, and the dx store
            // fixed (DXA: whole lane vectors; else element by element), so that the other
            // store's instructions are not issued predicated off.
            auto tile = [&](auto checked_flag, auto silu_flag, auto dxa_flag) {
                constexpr bool CHECKED = decltype(checked_flag)::value, SILU = decltype(silu_flag)::value,
                               DXA = decltype(dxa_flag)::value;
                tile_steps<R, K, CHECKED>(i, steps, [&](int row, int u, int r) {  // position g0 + r
                    const int64 pos = g0 + r;
                    const int own = (u + W) % K;  // slot of position g0 + r
                    VecT xrow, drow;
                    xrow.raw = st[32 * row];
                    drow.raw = st[32 * (R + row)];
                    widen<T, A, V>(xrow.e, xw[own]);
                    if constexpr (SEQ) ids[own] = id_at(pos);
                    A gd[V];
                    widen<T, A, V>(drow.e, gd);
                    auto same = [&](int k) { return !SEQ || ids[(u + k) % K] == ids[own]; };
                    if (CHECKED ? silu_act : SILU) times_silu_grad(gd, w, bias_v, xw, u, same);
                    const bool live = !CHECKED || pos < seqlen;
                    #pragma unroll
                    for (int v = 0; v < V; ++v) {
                        A gm = gd[v];
                        if constexpr (SEQ) {
                            if (ids[own] < 0) gm = A(0);  // padding
                        }
                        dzw[own][v] = live ? gm : A(0);
                    }
                    if (!CHECKED || pos < g1) {
                        #pragma unroll
                        for (int v = 0; v < V; ++v) {
                            #pragma unroll
                            for (int k = 0; k < K; ++k) {
                                if constexpr (SEQ) {
                                    // (selected: a padding dz meets inf or NaN inputs of its own id)
                                    if (ids[own] >= 0 && ids[(u + k) % K] == ids[own])
                                        dw[k][v] += dzw[own][v] * xw[(u + k) % K][v];
                                } else {
                                    dw[k][v] += dzw[own][v] * xw[(u + k) % K][v];
                                }
                            }
                            dw[K][v] += dzw[own][v];
                        }
                    }
                    if (!CHECKED || r >= W) {  // dx at pos - W (slot u, dxp), seen by the outputs pos - W .. pos
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
                        if (CHECKED ? dx_aligned : DXA) {
                            *reinterpret_cast<Raw*>(dxp) = res.raw;
                        } else {
                            #pragma unroll
                            for (int v = 0; v < V; ++v) dxp[v * dx_c_stride] = res.e[v];
                        }
                        dxp += dx_l_stride;
                    }
                });
            };
            if (i * R < W || i * R + R > len) tile(Flag<true>(), Flag<false>(), Flag<false>());
            else if (silu_act && dx_aligned) tile(Flag<false>(), Flag<true>(), Flag<true>());
            else if (silu_act) tile(Flag<false>(), Flag<true>(), Flag<false>());
            else if (dx_aligned) tile(Flag<false>(), Flag<false>(), Flag<true>());
            else tile(Flag<false>(), Flag<false>(), Flag<false>());
        }
        if (block_sum) break;  // its one group; the block adds the sums below
        #pragma unroll
        for (int v = 0; v < V; ++v)
            #pragma unroll
            for (int k = 0; k <= K; ++k)
                write_sum(partials, dweight, dbias, p, b * groups_per_row + group, c0 + v, k, scale * dw[k][v]);
    }
    if (block_sum) {  // one block a strip, the loop above a group a warp at most: dweight, dbias
        __syncthreads();  // every warp is done with its stage area
        A* const sums = reinterpret_cast<A*>(stage);
        #pragma unroll
        for (int k = 0; k <= K; ++k)
            #pragma unroll
            for (int v = 0; v < V; ++v) sums[(k * V + v) * 32 + lane] = scale * dw[k][v];  // 0 without a group
        __syncthreads();
        const int64 c0 = blockIdx.x * (int64)(32 * V) + lane * V;
        if (threadIdx.x < 32 && c0 < dim) {
            #pragma unroll
            for (int k = 0; k <= K; ++k)
                #pragma unroll
                for (int v = 0; v < V; ++v) {
                    A s = A(0);
                    #pragma unroll
                    for (int w = 0; w < WARPS; ++w) s += reinterpret_cast<const A*>(stage_mem[w])[(k * V + v) * 32 + lane];
                    write_sum(partials, dweight, dbias, p, 0, c0 + v, k, s);
                }
        }
    }
}

// bwd_channel_pair<T, K, R, BUFS, PAIRS>: the same backward for 16-bit x by warps in pairs, a pair
// a group of a strip of 32 lanes x 4 channels, so that every staged row is 256 bytes: the pair's
// first warp stages x and dout (BUFS tiles of R rows in flight), computes dz and dweight's sums
// and writes each tile's dz into one of two shared tiles; its second warp reads that tile one
// barrier later, computes and stores dx and sums dbias. The pair meets at one named barrier (id
// 1 + pair) a tile and one a group: the first warp writes tile i's dz after the barrier that ends
// the second warp's reading of tile i - 2 (the same buffer). Plan (the plan's _channel_pairs): no seq_idx,
// whole strips of 16-byte aligned x and dout rows, dout and dx in 8-byte lane vectors, not the
// block sums. Per element, the arithmetic and its order are bwd_channel's (dx and the dweight /
// dbias sums of a group: the same bits). Its register budget (CHANNEL_PAIR_WARPS_PER_SM) is
// above bwd_channel's: the first warp's x ring, taps and sums of four channels spill in 96.
template <typename T, int K, int R, int BUFS, int PAIRS>
__global__ void __launch_bounds__(64 * PAIRS, CHANNEL_PAIR_WARPS_PER_SM / (2 * PAIRS))
    bwd_channel_pair(BWD_ARRAYS, const __grid_constant__ BwdChannelParams p) {
    wait_for_previous_kernel();
    static_assert(sizeof(T) == 2, "16-bit x: four channels a lane in 8 bytes");
    using A = float;
    const int64 batch = p.batch, dim = p.dim, seqlen = p.seqlen, x_batch_stride = p.x_batch_stride,
                x_l_stride = p.x_l_stride, weight_c_stride = p.weight_c_stride,
                weight_width_stride = p.weight_width_stride, bias_stride = p.bias_stride,
                dout_batch_stride = p.dout_batch_stride, dout_l_stride = p.dout_l_stride,
                dx_batch_stride = p.dx_batch_stride, dx_l_stride = p.dx_l_stride,
                strip_divisor = p.strip_divisor, group_divisor = p.group_divisor, span = R * p.group_tiles;
    const int weight_dtype = (int)p.weight_dtype, bias_dtype = (int)p.bias_dtype, silu_act = (int)p.silu_act;
    using VecT = Vec<T, 8>;
    using Raw = typename VecT::Raw;
    constexpr int V = VecT::V, W = K - 1;
    static_assert(R % K == 0, "ring slots are compile-time constants only if R is a multiple of K");
    constexpr int PIECES = 16, ROUND = 32 / PIECES;  // 16-byte pieces of a row; rows a copy round
    __shared__ __align__(16) Raw stage_mem[PAIRS][BUFS][2 * R * 32];  // a pair's tiles: R rows of x, R of dout
    __shared__ __align__(16) float4 dz_mem[PAIRS][2][R * 32];  // a pair's two tiles of dz
    const int lane = threadIdx.x & 31, warp = threadIdx.x / 32, pair = warp / 2, bar = 1 + pair;
    const bool first = (warp & 1) == 0;
    Raw (*const stage)[2 * R * 32] = stage_mem[pair];
    const int64 n_strips = dim / (32 * V), groups_per_row = (seqlen + span - 1) / span;
    const int64 n_groups = batch * groups_per_row * n_strips;
    const A scale = act_scale<A>(silu_act);

    for (int64 g = blockIdx.x * (int64)PAIRS + pair; g < n_groups; g += (int64)gridDim.x * PAIRS) {
        int64 q, strip, b, group;
        divmod_fast(g, n_strips, strip_divisor, q, strip);
        divmod_fast(q, groups_per_row, group_divisor, b, group);
        const int64 c0 = strip * (32 * V) + lane * V;
        const int64 g0 = group * span, g1 = min(seqlen, g0 + span);
        const int len = (int)(g1 - g0), steps = len + W;
        const int n_tiles = (steps + R - 1) / R;
        A w[K][V];
        #pragma unroll
        for (int v = 0; v < V; ++v)
            #pragma unroll
            for (int k = 0; k < K; ++k)
                w[k][v] = scale * load_as<A>(weight, weight_dtype, (c0 + v) * weight_c_stride + k * weight_width_stride);
        named_barrier(bar, 64);  // the second warp is done with the previous group's dz tiles
        // A tile's rows need checks where it holds the group's first W steps or steps past g1.
        auto checked = [&](int i) { return i * R < W || i * R + R > len; };

        if (!first) {  // dx at g0 + r - W from the dz of steps r - W .. r
            T* dxp = dx + b * dx_batch_stride + c0 + g0 * dx_l_stride;
            A dzw[K][V], db[V] = {};  // (dbias's sums here: the first warp's registers are dearer)
            #pragma unroll 1
            for (int i = 0; i < n_tiles; ++i) {
                named_barrier(bar, 64);  // tile i's dz is in its buffer
                const float4* const dzt = dz_mem[pair][i & 1] + lane;
                auto tile = [&](auto checked_flag) {
                    constexpr bool CHECKED = decltype(checked_flag)::value;
                    tile_steps<R, K, CHECKED>(i, steps, [&](int row, int u, int r) {
                        const int own = (u + W) % K;
                        const float4 d = dzt[32 * row];
                        dzw[own][0] = d.x, dzw[own][1] = d.y, dzw[own][2] = d.z, dzw[own][3] = d.w;
                        if (!CHECKED || r < len) {
                            #pragma unroll
                            for (int v = 0; v < V; ++v) db[v] += dzw[own][v];
                        }
                        if (!CHECKED || r >= W) {
                            VecT res;
                            #pragma unroll
                            for (int v = 0; v < V; ++v) {
                                A acc = A(0);
                                #pragma unroll
                                for (int k = 0; k < K; ++k) acc += w[k][v] * dzw[(u + W - k) % K][v];
                                res.e[v] = from_acc<T>(acc);
                            }
                            *reinterpret_cast<Raw*>(dxp) = res.raw;
                            dxp += dx_l_stride;
                        }
                    });
                };
                if (checked(i)) tile(Flag<true>());
                else tile(Flag<false>());
            }
            #pragma unroll
            for (int v = 0; v < V; ++v)
                write_sum(partials, dweight, dbias, p, b * groups_per_row + group, c0 + v, K, scale * db[v]);
            continue;
        }

        // The first warp: tiles staged in order, tile t into buffer t mod BUFS (one cp.async group
        // a tile, an empty one past the last), lane l copying piece l mod 16 of rows l / 16, + 2, ..
        const int in_row = (int)min(seqlen - g0, (int64)n_tiles * R);  // staged rows inside the row
        const int piece = lane % PIECES, first_row = lane / PIECES;
        const int64 c_first = strip * (32 * V) + piece * 8;
        const T* x_next = x + b * x_batch_stride + c_first + (g0 + first_row) * x_l_stride;
        const T* d_next = dout + b * dout_batch_stride + c_first + (g0 + first_row) * dout_l_stride;
        const int64 x_tile = R * x_l_stride, d_tile = R * dout_l_stride;
        constexpr int TILE_BYTES = (int)sizeof(stage[0]);
        char* const dst_first = reinterpret_cast<char*>(stage[0]) + piece * 16;
        int next = 0, next_buf = 0;
        __syncwarp();  // the stage's last readers are done
        auto stage_next = [&]() {
            const int i = next++;
            char* const dst = dst_first + next_buf * TILE_BYTES;
            next_buf = next_buf == BUFS - 1 ? 0 : next_buf + 1;
            const T *s = x_next, *t = d_next;
            x_next += x_tile;
            d_next += d_tile;
            if (i < n_tiles) {
                const bool whole = (i + 1) * R <= in_row;  // (as in bwd_channel: not rows == R)
                const int rows = max(min(in_row - i * R, R), 0);
                auto copy_rows = [&](auto checked_flag) {
                    constexpr bool CHECKED = decltype(checked_flag)::value;
                    #pragma unroll
                    for (int k = 0; k < R / ROUND; ++k, s += ROUND * x_l_stride, t += ROUND * dout_l_stride) {
                        const int r = first_row + k * ROUND;
                        const bool in = !CHECKED || r < rows;
                        cp_async<16, 256>(dst + r * 32 * 8, in ? s : x, in ? 16 : 0);
                        cp_async<16, 256>(dst + (R + r) * 32 * 8, in ? t : dout, in ? 16 : 0);
                    }
                };
                if (whole) copy_rows(Flag<false>());
                else copy_rows(Flag<true>());
            }
            cp_async_commit();
        };
        #pragma unroll
        for (int i = 0; i < BUFS - 1; ++i) stage_next();

        A bias_v[V] = {}, dw[K][V] = {};
        if (bias) {
            #pragma unroll
            for (int v = 0; v < V; ++v) bias_v[v] = scale * load_as<A>(bias, bias_dtype, (c0 + v) * bias_stride);
        }
        A xw[K][V];  // ring: position g0 + r - W + k of step r's window in slot (r + k) mod K
        #pragma unroll
        for (int k = 0; k < W; ++k)
            #pragma unroll
            for (int v = 0; v < V; ++v) xw[k][v] = input_at<A>(x, initial_states, p, b, c0 + v, g0 - W + k);

        int buf = 0;
        #pragma unroll 1
        for (int i = 0; i < n_tiles; ++i) {
            __syncwarp();  // tile i - 1's readers are done with its stage
            stage_next();  // tile i + BUFS - 1
            cp_async_wait<BUFS - 1>();
            __syncwarp();  // the pieces the other lanes staged have landed
            const Raw* const st = stage[buf] + lane;
            buf = buf == BUFS - 1 ? 0 : buf + 1;
            float4* const dzt = dz_mem[pair][i & 1] + lane;
            auto tile = [&](auto checked_flag, auto silu_flag) {
                constexpr bool CHECKED = decltype(checked_flag)::value, SILU = decltype(silu_flag)::value;
                tile_steps<R, K, CHECKED>(i, steps, [&](int row, int u, int r) {
                    const int64 pos = g0 + r;
                    const int own = (u + W) % K;
                    VecT xrow, drow;
                    xrow.raw = st[32 * row];
                    drow.raw = st[32 * (R + row)];
                    widen<T, A, V>(xrow.e, xw[own]);
                    A gd[V];
                    widen<T, A, V>(drow.e, gd);
                    if (CHECKED ? silu_act : SILU) times_silu_grad(gd, w, bias_v, xw, u, [](int) { return true; });
                    const bool live = !CHECKED || pos < seqlen;
                    A dz[V];
                    #pragma unroll
                    for (int v = 0; v < V; ++v) dz[v] = live ? gd[v] : A(0);
                    if (!CHECKED || pos < g1) {
                        #pragma unroll
                        for (int v = 0; v < V; ++v) {
                            #pragma unroll
                            for (int k = 0; k < K; ++k) dw[k][v] += dz[v] * xw[(u + k) % K][v];
                        }
                    }
                    dzt[32 * row] = make_float4(dz[0], dz[1], dz[2], dz[3]);
                });
            };
            if (checked(i)) tile(Flag<true>(), Flag<false>());
            else if (silu_act) tile(Flag<false>(), Flag<true>());
            else tile(Flag<false>(), Flag<false>());
            named_barrier(bar, 64);  // tile i's dz is in its buffer
        }
        #pragma unroll
        for (int v = 0; v < V; ++v)
            #pragma unroll
            for (int k = 0; k < K; ++k)
                write_sum(partials, dweight, dbias, p, b * groups_per_row + group, c0 + v, k, scale * dw[k][v]);
    }
}
