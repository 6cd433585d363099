// bwd_time.cu: the backward for time-contiguous x (x_l_stride == 1, or rows of one step).
//
//   bwd_time<T, K, SEQ, NV, WARPS, BUFS>
//       width K <= the plan's TIME_MAX_WIDTH. Rows are cut into chunks of 32 NV vectors of VN
//       elements (16 bytes each), and a channel's chunks (batch row by batch row) into
//       p.runs runs of p.run_chunks. A warp takes a run (WARPS warps a block; the channels of
//       a run, then the runs, handed out in order) and its chunks one after the other: the
//       channel's taps loaded once, its dweight / dbias sums carried over them. SEQ says
//       whether seq_idx is given. BUFS = 2: two staging areas a warp, the run's next chunk
//       copied while one is computed.
//
// For a chunk, the warp stages x with HV vectors on each side (HV VN >= K-1) and dout with HV
// vectors after it in shared memory (cp.async, coalesced 16-byte vectors; rows that are
// misaligned, strided or cut mid-vector element by element), then lane l computes the vectors
// l, l + 32, ... of the chunk: dz at its vector's VN positions (the pre-activation recomputed
// from x; the vector's VN SiLU derivatives in one branch, so that they interleave) and its
// share of the dweight / dbias sums, then dx at its VN positions from the dz of its vector and
// the K-1 after it, read back from the stage (dz lies where the x and dout it came from were).
// After the run the warp adds the lanes' shares in a fixed tree, and K + 1 of its lanes write
// the sums as part `run` of the partials. Positions before the row are initial_states (zeros
// without them); dz past the row's end is 0. The work item is divided by the plan's fast
// divisor p.dim_divisor, the run's first chunk by p.chunk_divisor (chunks per row). p.x_aligned
// / p.dout_aligned / p.dx_aligned: rows time-contiguous and starting on 16-byte boundaries.
// p.whole_rows: every row is one whole chunk and x and dout are aligned, so a chunk is staged
// as its row's vectors alone (no halo copies, no bounds: x's halo before the row is zeros, put
// back after each chunk; the chunk's tail past the row is 0).
#include "bwd_common.cuh"

template <typename T, int K, bool SEQ, int NV, int WARPS, int BUFS>
__global__ void __launch_bounds__(32 * WARPS, bwd_warps_per_sm(sizeof(T), 1) / WARPS) bwd_time(BWD_ARRAYS, const __grid_constant__ BwdTimeParams p) {
    wait_for_previous_kernel();
    using A = typename AccOf<T>::type;
    const int64 batch = p.batch, dim = p.dim, seqlen = p.seqlen, x_batch_stride = p.x_batch_stride,
                x_c_stride = p.x_c_stride, x_l_stride = p.x_l_stride, weight_c_stride = p.weight_c_stride,
                weight_width_stride = p.weight_width_stride, bias_stride = p.bias_stride,
                dout_batch_stride = p.dout_batch_stride, dout_c_stride = p.dout_c_stride,
                dout_l_stride = p.dout_l_stride, dx_batch_stride = p.dx_batch_stride, dx_c_stride = p.dx_c_stride,
                dx_l_stride = p.dx_l_stride, chunk_divisor = p.chunk_divisor, dim_divisor = p.dim_divisor,
                runs = p.runs, run_chunks = p.run_chunks;
    const int weight_dtype = (int)p.weight_dtype, bias_dtype = (int)p.bias_dtype, silu_act = (int)p.silu_act,
              x_aligned = (int)p.x_aligned, dout_aligned = (int)p.dout_aligned, dx_aligned = (int)p.dx_aligned,
              whole_rows = (int)p.whole_rows;
    using Raw = typename Vec<T>::Raw;
    constexpr int VN = Vec<T>::V;              // elements per 16-byte vector
    constexpr int HV = (K - 1 + VN - 1) / VN;  // halo vectors on each side
    constexpr int HE = HV * VN;                // halo elements (>= K-1)
    constexpr int OFF = HE - (K - 1);          // window slot of tap 0 for position 0
    constexpr int span = 32 * NV * VN;         // elements per chunk
    constexpr int XV = 32 * NV + 2 * HV, DV = 32 * NV + HV;  // staged vectors of x and dout
    const int lane = threadIdx.x & 31;
    const int64 chunks_per_row = (seqlen + span - 1) / span, row_chunks = batch * chunks_per_row;
    __shared__ Raw stage_mem[WARPS][BUFS][XV + DV];
    Raw* xs = stage_mem[threadIdx.x / 32][0];  // the chunk's staged x, then its dout at ds
    Raw* ds = xs + XV;
    Raw* other = stage_mem[threadIdx.x / 32][BUFS - 1];  // the next chunk's (BUFS = 2)
    constexpr bool ahead = BUFS == 2;  // copies a chunk ahead
    // Whole rows: x's halo before the row is zeros, never copied over (the halos after it go unread).
    if (whole_rows && lane < HV) {
        #pragma unroll
        for (int k = 0; k < BUFS; ++k) stage_mem[threadIdx.x / 32][k][lane] = Raw{};
    }

    const int64 n_runs = dim * runs;
    for (int64 g = grid_warp(); g < n_runs; g += grid_warps()) {
        int64 c, run, b, chunk;
        divmod_fast(g, dim, dim_divisor, run, c);
        const int64 first = run * run_chunks;  // the run's chunks, first .. of the channel's
        int left = (int)min((int64)run_chunks, row_chunks - first);
        divmod_fast(first, chunks_per_row, chunk_divisor, b, chunk);
        // Lane k < K loads tap k, lane K the bias; every lane gets all of them by shuffles.
        const bool tap = lane < K;
        const void* const param = tap ? weight : bias;
        A mine = A(0);
        if (lane <= K && param)
            mine = load_as<A>(param, tap ? weight_dtype : bias_dtype,
                              tap ? c * weight_c_stride + lane * weight_width_stride : c * bias_stride);
        A dw[K + 1] = {};  // this lane's share of dweight[c, :] and (k = K) dbias[c] over the run
        A w[K], bias_c;
        // Stages chunk sc of row sb: x at sx, dout at sx + XV (one cp.async group).
        auto stage = [&](int64 sb, int64 sc, Raw* sx) {
            Raw* const sd = sx + XV;
            if (whole_rows) {  // the chunk is row sb, in 16-byte vectors: copied without checks
                const Raw* const xr = reinterpret_cast<const Raw*>(x + sb * x_batch_stride + c * x_c_stride);
                const Raw* const dr = reinterpret_cast<const Raw*>(dout + sb * dout_batch_stride + c * dout_c_stride);
                __syncwarp();  // the stage's last readers are done
                #pragma unroll
                for (int v = lane; v < 32 * NV; v += 32) {
                    cp_async<16, 128>(sx + HV + v, xr + v, 16);
                    cp_async<16, 128>(sd + v, dr + v, 16);
                }
                cp_async_commit();
                return;
            }
            const int64 start = sc * span;
            const int n = (int)min(seqlen - start, (int64)span);  // the chunk's positions in the row
            const T* const xr = x + sb * x_batch_stride + c * x_c_stride;
            const T* const dr = dout + sb * dout_batch_stride + c * dout_c_stride;
            const bool whole = n == span || seqlen % VN == 0;  // no vector cut by the row's end
            __syncwarp();  // the stage's last readers are done
            // x: stage vector v holds positions start + (v - HV) VN ..; dout: start + v VN ... Rows
            // in 16-byte vectors: the chunk's own (unchecked when the chunk is all in the row,
            // else zeros past the row), then the halos (lanes < 2 HV for x, < HV for dout),
            // checked against both ends.
            const int in_row = (n + VN - 1) / VN;  // the chunk's vectors in the row
            // The chunk's own vectors of a row, from src to dst (the checked loop kept rolled:
            // compiled as a branch, not predicated and issued beside the unchecked one).
            auto stage_own = [&](Raw* dst, const Raw* src) {
                if (n == span) {
                    #pragma unroll
                    for (int v = lane; v < 32 * NV; v += 32) cp_async<16, 128>(dst + v, src + v, 16);
                } else {
                    #pragma unroll 1
                    for (int v = lane; v < 32 * NV; v += 32)
                        cp_async<16, 128>(dst + v, v < in_row ? src + v : src, v < in_row ? 16 : 0);
                }
            };
            if (x_aligned && whole) {
                stage_own(sx + HV, reinterpret_cast<const Raw*>(xr + start));
                if (lane < 2 * HV) {
                    const int v = lane < HV ? lane : 32 * NV + lane;
                    const int64 pos = start + (int64)(v - HV) * VN;
                    const bool in = pos >= 0 && pos < seqlen;
                    cp_async<16, 128>(sx + v, in ? xr + pos : xr, in ? 16 : 0);
                }
            } else {
                T* const e = reinterpret_cast<T*>(sx);
                for (int q = lane; q < XV * VN; q += 32) {
                    const int64 pos = start - HE + q;
                    e[q] = pos >= 0 && pos < seqlen ? xr[pos * x_l_stride] : T();
                }
            }
            if (dout_aligned && whole) {
                const Raw* const src = reinterpret_cast<const Raw*>(dr + start);
                stage_own(sd, src);
                if (lane < HV) {
                    const int v = 32 * NV + lane;
                    const bool in = start + (int64)v * VN < seqlen;
                    cp_async<16, 128>(sd + v, in ? src + v : src, in ? 16 : 0);
                }
            } else {
                T* const e = reinterpret_cast<T*>(sd);
                for (int q = lane; q < DV * VN; q += 32) {
                    const int64 pos = start + q;
                    e[q] = pos < seqlen ? dr[pos * dout_l_stride] : T();
                }
            }
            cp_async_commit();
        };
        for (bool first_chunk = true;; first_chunk = false) {  // chunk `chunk` of row b
            const int64 start = chunk * span;
            const int n = (int)min(seqlen - start, (int64)span);  // the chunk's positions in the row
            T* const dxr = dx + b * dx_batch_stride + c * dx_c_stride;
            const bool whole = n == span || seqlen % VN == 0;  // no vector cut by the row's end
            // Staged now: this chunk (k = 0) unless it was copied ahead, and with two areas the
            // run's next chunk (k = 1, into the other area). One call site: bwd_time is
            // sensitive to its code size (benchmarks/NOTES.md).
            const int from = ahead && !first_chunk ? 1 : 0, to = ahead && left > 1 ? 2 : 1;
            #pragma unroll 1
            for (int k = from; k < to; ++k) {
                const bool wrap = k == 1 && chunk + 1 == chunks_per_row;
                stage(wrap ? b + 1 : b, k == 0 ? chunk : wrap ? 0 : chunk + 1, k == 0 ? xs : other);
            }
            if (first_chunk) {  // with SiLU: scaled (silu_grad_scaled), as are dz and dw
                const A scale = act_scale<A>(silu_act);
                #pragma unroll
                for (int k = 0; k < K; ++k) w[k] = scale * __shfl_sync(0xffffffffu, mine, k);
                bias_c = scale * __shfl_sync(0xffffffffu, mine, K);
            }
            if (to == 2) cp_async_wait<1>();  // (the next chunk's copies may run on)
            else cp_async_wait<0>();
            __syncwarp();
            // The chunk, compiled twice: TAIL (the row ends inside the chunk: every position is
            // checked against it) and not.
            auto chunk_body = [&](auto tail_flag) {
                constexpr bool TAIL = decltype(tail_flag)::value;
                // dz at the VN positions of chunk vector q (start + q VN ..), from the staged x
                // (the K-1 inputs before them too) and dout, 0 past the row; adds their dweight /
                // dbias terms.
                auto dz_vector = [&](int q, A (&dz)[VN]) {
                    const int i = q * VN, limit = TAIL ? n - i : VN;
                    A xw[HE + VN];  // x at positions start + i - HE ..
                    #pragma unroll
                    for (int h = 0; h <= HV; ++h) {
                        Vec<T> v;
                        v.raw = xs[q + h];
                        widen<T, A, VN>(v.e, xw + h * VN);
                    }
                    if (initial_states && start + i < K - 1) {  // positions before the row
                        #pragma unroll
                        for (int u = OFF; u < HE; ++u) {
                            const int64 pos = start + i - HE + u;
                            if (pos < 0) xw[u] = input_at<A>(x, initial_states, p, b, c, pos);
                        }
                    }
                    Vec<T> dv;
                    dv.raw = ds[q];
                    A go[VN];
                    widen<T, A, VN>(dv.e, go);
                    int64 ids[SEQ ? VN + K - 1 : 1];  // segment ids of positions start + i - (K-1) ..
                    if constexpr (SEQ) {
                        #pragma unroll
                        for (int u = 0; u < VN + K - 1; ++u) {
                            const int64 pos = start + i - (K - 1) + u;
                            ids[u] = pos < seqlen ? segment_id(seq_idx, p, b, pos) : -1;
                        }
                    }
                    if (silu_act) {  // one branch for the vector: its VN derivatives interleave
                        #pragma unroll
                        for (int o = 0; o < VN; ++o) {
                            A z = bias_c;
                            #pragma unroll
                            for (int k = 0; k < K; ++k) {
                                if constexpr (SEQ) {
                                    if (ids[o + k] == ids[o + K - 1]) z += w[k] * xw[OFF + o + k];
                                } else {
                                    z += w[k] * xw[OFF + o + k];
                                }
                            }
                            go[o] *= silu_grad_scaled(z);
                        }
                    }
                    #pragma unroll
                    for (int o = 0; o < VN; ++o) {
                        A gm = go[o];
                        if constexpr (SEQ) {
                            if (ids[o + K - 1] < 0) gm = A(0);  // padding
                        }
                        dz[o] = !TAIL || o < limit ? gm : A(0);
                        if (!TAIL || o < limit) {
                            #pragma unroll
                            for (int k = 0; k < K; ++k) {
                                if constexpr (SEQ) {
                                    // (selected: a padding dz meets inf or NaN inputs of its own id)
                                    if (ids[o + K - 1] >= 0 && ids[o + k] == ids[o + K - 1]) dw[k] += dz[o] * xw[OFF + o + k];
                                } else {
                                    dw[k] += dz[o] * xw[OFF + o + k];
                                }
                            }
                            dw[K] += dz[o];
                        }
                    }
                };
                // dz at the K-1 positions after the chunk (lane u < K-1: start + span + u), for the dx
                // of the chunk's last positions; read from the stages element by element.
                A tail = A(0);
                if (lane < K - 1 && start + span + lane < seqlen) {
                    const T* const xe = reinterpret_cast<const T*>(xs);  // element e: start - HE + e
                    const T* const de = reinterpret_cast<const T*>(ds);  // element e: start + e
                    const int64 t = start + span + lane;
                    const int64 sid = SEQ ? segment_id(seq_idx, p, b, t) : 0;
                    A gm = A(to_acc(de[span + lane]));
                    if (silu_act) {
                        A z = bias_c;
                        #pragma unroll
                        for (int k = 0; k < K; ++k)
                            if (!SEQ || segment_id(seq_idx, p, b, t - (K - 1) + k) == sid)
                                z += w[k] * A(to_acc(xe[HE + span + lane - (K - 1) + k]));
                        gm *= silu_grad_scaled(z);
                    }
                    tail = sid < 0 ? A(0) : gm;
                }

                // A chunk cut by the row's end runs its passes up to the row's last vector: dz past
                // the row is 0.
                const int passes = TAIL ? (n + 32 * VN - 1) / (32 * VN) : NV;
                // dz of chunk vector v, once computed, lies in the stages where its x and dout were:
                // its first 16 bytes in ds[v], the rest (16-bit x: 32 bytes of dz) in xs[v], the x
                // vector v - HV, which no dz left to compute reads. So lane l's pass reads the dz
                // after its vector (the next lanes', the next pass's, or past the chunk) from
                // shared memory as it reads its own.
                constexpr int PER = 16 / (int)sizeof(A);  // dz values a 16-byte slot holds
                auto dz_slot = [&](int v, int half) { return reinterpret_cast<A*>(half ? xs + v : ds + v); };
                auto store_dz = [&](int v, const A (&d)[VN]) {
                    #pragma unroll
                    for (int o = 0; o < VN; o += PER) {
                        A* const at = dz_slot(v, o / PER);
                        if constexpr (PER == 4) {
                            *reinterpret_cast<float4*>(at) = make_float4(d[o], d[o + 1], d[o + 2], d[o + 3]);
                        } else {
                            *reinterpret_cast<double2*>(at) = make_double2(d[o], d[o + 1]);
                        }
                    }
                };
                {
                    A d[VN];
                    dz_vector(lane, d);
                    __syncwarp();  // x vector lane - HV's last reader is done
                    store_dz(lane, d);
                }
                #pragma unroll 2
                for (int j = 0; j < passes; ++j) {
                    const int q = 32 * j + lane, i = q * VN;
                    if (j + 1 < passes) {
                        A d[VN];
                        dz_vector(q + 32, d);
                        __syncwarp();
                        store_dz(q + 32, d);
                    } else {  // past the last pass: the tail, 0 past the row
                        __syncwarp();
                        if (lane < HE) dz_slot(32 * passes + lane / VN, lane % VN / PER)[lane % PER] = tail;
                    }
                    __syncwarp();
                    // dz at positions start + i .. start + i + VN + K - 2, 16 bytes at a time.
                    A win[VN + K - 1];
                    #pragma unroll
                    for (int u = 0; u < VN + K - 1; u += PER) {
                        const A* const at = dz_slot(q + u / VN, (u % VN) / PER);
                        A got[PER];
                        if constexpr (PER == 4) {
                            const float4 f = *reinterpret_cast<const float4*>(at);
                            got[0] = f.x, got[1] = f.y, got[2] = f.z, got[3] = f.w;
                        } else {
                            const double2 f = *reinterpret_cast<const double2*>(at);
                            got[0] = f.x, got[1] = f.y;
                        }
                        #pragma unroll
                        for (int e = 0; e < PER; ++e)
                            if (u + e < VN + K - 1) win[u + e] = got[e];
                    }
                    int64 ids[SEQ ? VN + K - 1 : 1];  // segment ids of positions start + i ..
                    if constexpr (SEQ) {
                        #pragma unroll
                        for (int u = 0; u < VN + K - 1; ++u) {
                            const int64 pos = start + i + u;
                            ids[u] = pos < seqlen ? segment_id(seq_idx, p, b, pos) : -1;
                        }
                    }
                    A acc[VN];
                    #pragma unroll
                    for (int o = 0; o < VN; ++o) {
                        acc[o] = A(0);
                        #pragma unroll
                        for (int k = 0; k < K; ++k) {  // the output at o + (K-1) - k sees o through tap k
                            if constexpr (SEQ) {
                                if (ids[o] == ids[o + K - 1 - k]) acc[o] += w[k] * win[o + K - 1 - k];
                            } else {
                                acc[o] += w[k] * win[o + K - 1 - k];
                            }
                        }
                    }
                    const int limit = TAIL ? n - i : VN;
                    if (!TAIL || limit > 0) {
                        Vec<T> res;
                        #pragma unroll
                        for (int o = 0; o < VN; ++o) res.e[o] = from_acc<T>(acc[o]);
                        if (dx_aligned && (!TAIL || whole)) {
                            reinterpret_cast<Raw*>(dxr + start)[q] = res.raw;
                        } else {
                            #pragma unroll
                            for (int o = 0; o < VN; ++o)
                                if (!TAIL || o < limit) dxr[(start + i + o) * dx_l_stride] = res.e[o];
                        }
                    }
                }
            };
            if (n < span) chunk_body(Flag<true>());
            else chunk_body(Flag<false>());
            if (whole_rows) {  // dz took x's zero halo before the row
                __syncwarp();
                if (lane < HV) xs[lane] = Raw{};
            }
            if (--left == 0) break;
            if (++chunk == chunks_per_row) {
                chunk = 0;
                ++b;
            }
            if (ahead) {  // the next chunk is in the other area
                Raw* const t = xs;
                xs = other;
                other = t;
                ds = xs + XV;
            }
        }
        // The warp's sums of the K + 1 shares, by halving exchanges (a fixed tree): after the
        // exchange over lane bit 4 - s, a lane holds half of the sums it held, the upper half
        // where that bit is set; when one is left, the last exchanges add it up. Lane l then
        // holds sum number (l >> (5 - LOG)) mod P, where P = 2^LOG >= K + 1 (sums K + 1 .. P - 1
        // are zeros).
        constexpr int LOG = K < 2 ? 1 : K < 4 ? 2 : K < 8 ? 3 : K < 16 ? 4 : 5, P = 1 << LOG;
        #pragma unroll
        for (int s = 0; s < 5; ++s) {
            const int o = 16 >> s, half = P >> (s + 1);
            if (half >= 1) {
                const bool upper = lane & o;
                #pragma unroll
                for (int j = 0; j < P / 2; ++j) {
                    if (j < half) {
                        const A high = j + half <= K ? dw[j + half] : A(0);
                        const A send = upper ? dw[j] : high, keep = upper ? high : dw[j];
                        dw[j] = keep + __shfl_xor_sync(0xffffffffu, send, o);
                    }
                }
            } else {
                dw[0] += __shfl_xor_sync(0xffffffffu, dw[0], o);
            }
        }
        const int k = (lane >> (5 - LOG)) & (P - 1);
        if ((lane & ((1 << (5 - LOG)) - 1)) == 0 && k <= K) {
            const A scale = act_scale<A>(silu_act);
            write_sum(partials, dweight, dbias, p, run, c, k, scale * dw[0]);
        }
    }
}
