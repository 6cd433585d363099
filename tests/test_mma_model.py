"""A float64 model of the tensor-core forward (kernels/fwd_mma.cu) with the exact PTX
m16n8k16 fragment layouts: checks the index mapping of the A (Toeplitz weights, read from the
zero-padded weight row), B (inputs, read as 8-byte words of the staged window) and C (outputs,
stored as adjacent pairs) fragments, with the kernel's permutations of k and of the rows,
against a direct causal convolution; a model of bwd_mma_time's backward (a group's blocks as
the rows of A, shifted across lanes and groups, the bands as B, dweight from register
transposes summed along its lags) against the reference backward; and models of the
channel-last moves of fwd_mma and bwd_mma (index math, byte permutations, shared-memory bank
conflicts); and fwd_mma_cl's bookkeeping of a block's staging buffer (who copies, moves,
computes and writes out which pieces, for each block size) and its step of one block barrier
(which warps touch which places of shared memory between two barriers).
"""

import numpy as np
import pytest

rng = np.random.default_rng(0)


def mma(a, b, c):
    """One m16n8k16 MMA from lane fragments: a [32][8], b [32][4], c [32][4] (PTX layouts)."""
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        vals = a[lane]
        # a0: (g, 2t..2t+1), a1: (g+8, 2t..), a2: (g, 2t+8..), a3: (g+8, 2t+8..)
        A[g, 2 * t], A[g, 2 * t + 1] = vals[0], vals[1]
        A[g + 8, 2 * t], A[g + 8, 2 * t + 1] = vals[2], vals[3]
        A[g, 2 * t + 8], A[g, 2 * t + 9] = vals[4], vals[5]
        A[g + 8, 2 * t + 8], A[g + 8, 2 * t + 9] = vals[6], vals[7]
        bv = b[lane]
        B[2 * t, g], B[2 * t + 1, g] = bv[0], bv[1]
        B[2 * t + 8, g], B[2 * t + 9, g] = bv[2], bv[3]
    C = A @ B
    out = c.copy()
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        out[lane] += [C[g, 2 * t], C[g, 2 * t + 1], C[g + 8, 2 * t], C[g + 8, 2 * t + 1]]
    return out


def padded_taps(w, K, D):
    """The taps zero-padded as the kernels hold them (ToeplitzTaps: 2 D + 32 values, the taps from
    PAD = D + 15 on), and PAD."""
    pad = D + 15
    wpad = np.zeros(2 * D + 32)
    wpad[pad : pad + K] = w
    return wpad, pad


def a_fragment(w, K, D, s):
    """Lane values of k-step s as load_row builds them: register r = (r & 1: row g + 8,
    r >> 1: upper k) holds wpad[PAD + tap], tap = 16 s + 4 tg + 2 (r >> 1) + h - 2 g - (r & 1)
    - (D - K + 1), from the zero-padded weight row."""
    wpad, pad = padded_taps(w, K, D)
    frag = np.zeros((32, 8))
    for lane in range(32):
        g, tg = lane >> 2, lane & 3
        base = pad + 4 * tg - 2 * g - (D - K + 1) + 16 * s
        for r in range(4):
            q = base + 2 * (r >> 1) - (r & 1)
            frag[lane, 2 * r], frag[lane, 2 * r + 1] = wpad[q], wpad[q + 1]
    return frag


def model(x, w, K):
    """Outputs of one row by the fwd_mma algorithm (blocks of 8 columns x 16 steps)."""
    L = len(x)
    KS = -(-(K - 1) // 16) + 1
    D = 16 * (KS - 1)
    A = [a_fragment(w, K, D, s) for s in range(KS)]
    out = np.zeros(L)
    for T0 in range(0, L, 128):

        def xw(e, T0=T0):  # element e of the staged window: position T0 - D + e
            p = T0 - D + e
            return x[p] if 0 <= p < L else 0.0

        acc = np.zeros((32, 4))
        for s in range(KS):
            # lane (g, tg): the 8-byte word of inputs 4 tg .. 4 tg + 3 of segment g + s
            b = np.array(
                [
                    [xw(16 * ((lane >> 2) + s) + 4 * (lane & 3) + e) for e in range(4)]
                    for lane in range(32)
                ]
            )
            acc = mma(A[s], b, acc)
        for lane in range(32):
            g, tg = lane >> 2, lane & 3
            # c0, c2: outputs 32 tg + 2 g, + 1; c1, c3: outputs 32 tg + 16 + 2 g, + 1
            for v, o in zip(
                acc[lane],
                (32 * tg + 2 * g, 32 * tg + 16 + 2 * g, 32 * tg + 2 * g + 1, 32 * tg + 17 + 2 * g),
            ):
                if T0 + o < L:
                    out[T0 + o] = v
    return out


def direct(x, w, K):
    L = len(x)
    return np.array(
        [sum(w[k] * x[t - (K - 1) + k] for k in range(K) if t - (K - 1) + k >= 0) for t in range(L)]
    )


@pytest.mark.parametrize("width", (18, 31, 33, 34, 64, 65, 100, 129))
def test_fragment_model_is_the_convolution(width):
    for length in (1, 37, 128, 300):
        x = rng.standard_normal(length)
        w = rng.standard_normal(width)
        np.testing.assert_allclose(model(x, w, width), direct(x, w, width), atol=1e-9)


# ---- bwd_mma_time: a group's blocks as the rows of A (kernels/bwd_mma_time.cu) -----------------
# A lane's data of a group of 256 positions: its rows 0 and 1, positions 16 g + 4 tg + e and 128
# more (e = 0 .. 3), as [32][8] arrays (row 0's four values, then row 1's). Word x of a row is
# its values 0, 1 (A's k = 2 tg, 2 tg + 1), word y its values 2, 3 (k = 2 tg + 8, + 9).


def group_rows(v, start):
    """The lane rows of the group at ``start`` of the row ``v`` (zeros outside it)."""
    rows = np.zeros((32, 8))
    for lane in range(32):
        g, tg = lane >> 2, lane & 3
        for r in range(2):
            for e in range(4):
                p = start + 128 * r + 16 * g + 4 * tg + e
                rows[lane, 4 * r + e] = v[p] if 0 <= p < len(v) else 0.0
    return rows


def shifted(prev, cur, nxt, d):
    """A's values (a0 .. a3 pairs) of a group's blocks d back (d > 0: back(), the group before's
    row 1 where they wrap) or -d ahead (d < 0: ahead(), the group after's row 0): each lane
    gives lane (g + d) mod 8 the rows its reader needs, one shuffle a word."""
    give = np.zeros((32, 8))
    for lane in range(32):
        g = lane >> 2
        if d >= 0:
            wrap = g + d >= 8
            give[lane, :4] = prev[lane, 4:] if wrap else cur[lane, :4]
            give[lane, 4:] = cur[lane, :4] if wrap else cur[lane, 4:]
        else:
            wrap = g < -d
            give[lane, :4] = cur[lane, 4:] if wrap else cur[lane, :4]
            give[lane, 4:] = nxt[lane, :4] if wrap else cur[lane, 4:]
    got = np.array([give[(lane - 4 * d) & 31] for lane in range(32)])
    r0, r1 = got[:, :4], got[:, 4:]
    return np.concatenate([r0[:, :2], r1[:, :2], r0[:, 2:], r1[:, 2:]], axis=1)


def band(w, K, D, d, H, reverse):
    """B of half H for the blocks d apart: column g is output o = 4 (g / 2) + 2 H + g % 2, k = 2 tg
    + h input 4 tg + h, k = 2 tg + 8 + h input 4 tg + 2 + h; z's taps K - 1 + e - o - 16 d, dx's
    K - 1 - 16 d - e + o, from the zero-padded row."""
    wpad, pad = padded_taps(w, K, D)
    b = np.zeros((32, 4))
    for lane in range(32):
        g, tg = lane >> 2, lane & 3
        o = 4 * (g >> 1) + 2 * H + (g & 1)
        for e in range(4):
            tap = K - 1 - 16 * d + (o - 4 * tg - e if reverse else 4 * tg + e - o)
            b[lane, e] = wpad[pad + tap]
    return b


def accumulators_to_rows(acc):
    """The lane rows of a group from the accumulators of halves 0 and 1 (c0, c1: row g, outputs
    4 tg + 2 H, + 1; c2, c3: row g + 8)."""
    rows = np.zeros((32, 8))
    rows[:, [0, 1, 4, 5]] = acc[0][:, [0, 1, 2, 3]]
    rows[:, [2, 3, 6, 7]] = acc[1][:, [0, 1, 2, 3]]
    return rows


def movmatrix(pairs):
    """movmatrix .trans: lane (g, tg)'s pair of row g, columns 2 tg, 2 tg + 1 of an 8 x 8 matrix ->
    the same of the transposed matrix."""
    m = np.zeros((8, 8))
    for lane in range(32):
        m[lane >> 2, 2 * (lane & 3) : 2 * (lane & 3) + 2] = pairs[lane]
    return np.array(
        [[m[2 * (lane & 3), lane >> 2], m[2 * (lane & 3) + 1, lane >> 2]] for lane in range(32)]
    )


def backward_model(x, dout, w, bias, K):
    """dx, dweight and dbias of one row by bwd_mma_time's fragments (float64, with SiLU)."""
    L, KS = len(x), -(-(K - 1) // 16) + 1
    D, n_groups = 16 * (KS - 1), -(-L // 256)
    xs = [group_rows(x, 256 * j) for j in range(-1, n_groups + 1)]  # xs[j + 1]: group j
    dz_rows = []  # groups 0 .. n_groups (the group after the row: its dz is 0)
    for j in range(n_groups + 1):
        acc = [np.full((32, 4), float(bias)), np.full((32, 4), float(bias))]
        for d in range(KS - 1, -1, -1):
            a = shifted(xs[j], xs[j + 1], None, d)
            for H in range(2):
                acc[H] = mma(a, band(w, K, D, d, H, False), acc[H])
        z = accumulators_to_rows(acc)
        sig = 1 / (1 + np.exp(-z))
        dz_rows.append(group_rows(dout, 256 * j) * sig * (1 + z * (1 - sig)))
    cacc = np.zeros((KS, 2, 32, 4))
    # dweight's lag products, group by group
    for j in range(n_groups):
        for d in range(KS):
            a = shifted(xs[j], xs[j + 1], None, d)
            ta = np.concatenate([movmatrix(a[:, 2 * i : 2 * i + 2]) for i in (0, 2, 1, 3)], axis=1)
            for H in range(2):
                b = np.concatenate(
                    [movmatrix(dz_rows[j][:, 4 * r + 2 * H : 4 * r + 2 * H + 2]) for r in range(2)],
                    axis=1,
                )
                cacc[d, H] = mma(ta, b, cacc[d, H])
    dx = np.zeros(L)
    for j in range(n_groups):
        acc = [np.zeros((32, 4)), np.zeros((32, 4))]
        for d in range(KS):
            a = shifted(None, dz_rows[j], dz_rows[j + 1], -d)
            for H in range(2):
                acc[H] = mma(a, band(w, K, D, d, H, True), acc[H])
        rows = accumulators_to_rows(acc)
        for lane in range(32):
            g, tg = lane >> 2, lane & 3
            for r in range(2):
                for e in range(4):
                    p = 256 * j + 128 * r + 16 * g + 4 * tg + e
                    if p < L:
                        dx[p] = rows[lane, 4 * r + e]
    dweight = np.zeros(K)
    for d in range(KS):
        for H in range(2):
            for lane in range(32):
                g, tg = lane >> 2, lane & 3
                for i, (a_off, n_off) in enumerate(
                    ((0, 0), (0, 1), (2, 0), (2, 1))
                ):  # c0, c1: a = g; c2, c3: a = g + 8 (2 positions on)
                    a = 4 * (g >> 1) + (g & 1) + a_off
                    n = 4 * tg + 2 * H + n_off
                    tap = K - 1 - 16 * d - n + a
                    if 0 <= tap < K:
                        dweight[tap] += cacc[d, H, lane, i]
    dbias = sum(dz_rows[j].sum() for j in range(n_groups))
    return dx, dweight, dbias


@pytest.mark.parametrize("width", (2, 5, 16, 17, 31, 33))
def test_time_backward_fragment_model_is_the_backward(width):
    """bwd_mma_time's layouts (blocks as A's rows, shifted by shuffles across groups, the bands as
    B, dweight from transposed operands summed along the C_d's lags) give the backward of a
    causal convolution with SiLU."""
    from cupyconv import reference

    for length in (37, 256, 300, 600):
        x, dout = rng.standard_normal(length), rng.standard_normal(length)
        w, bias = rng.standard_normal(width) * width**-0.5, 0.3
        dx, dweight, dbias = backward_model(x, dout, w, bias, width)
        want = reference.causal_conv1d_bwd(
            x[None, None], w[None], np.array([bias]), dout[None, None], activation="silu"
        )
        np.testing.assert_allclose(dx, want[0][0, 0], atol=1e-9)
        np.testing.assert_allclose(dweight, want[1][0], atol=1e-9)
        np.testing.assert_allclose(dbias, want[2][0], atol=1e-9)


# ---- channel-contiguous x: the staging area, the rows and the output block -------------------
# Shared memory is 32 banks of 4 bytes; a warp's access is free of conflicts when no two of its
# lanes (of one phase: 8 lanes for 16-byte accesses) touch different words of one bank.


def slot(i, h):
    """The 16-byte slot of channels 8 h .. 8 h + 7 at window position i (fwd_mma.cu)."""
    return 2 * i + (h ^ ((i >> 2) & 1))


def ldmatrix_trans(row_bytes):
    """ldmatrix.x4.trans: four 8x8 matrices of 16-bit values, lanes 8 q .. 8 q + 7 giving the
    byte addresses of matrix q's rows. Returns, per lane (g, tg) and matrix q, the (row address,
    column) of the two elements its word holds: (2 tg, g) and (2 tg + 1, g)."""
    return {
        (lane, q): [(row_bytes[8 * q + 2 * (lane & 3) + e], lane >> 2) for e in (0, 1)]
        for lane in range(32)
        for q in range(4)
    }


def ways(byte_addresses, width):
    """The most distinct words of one bank among accesses of ``width`` bytes at these addresses
    (one phase): 1 where they hit distinct banks or the same words."""
    words = {}
    for a in byte_addresses:
        for w in range(a // 4, (a + width) // 4):
            words.setdefault(w % 32, set()).add(w)
    return max(len(ws) for ws in words.values())


def conflict_free(byte_addresses, width):
    """Whether accesses of ``width`` bytes at these addresses (one phase) hit distinct banks or
    the same words."""
    return ways(byte_addresses, width) == 1


def warp_pass(row_bytes, src, dst, element_at):
    """One warp's move: ldmatrix.x4.trans of the 8x8 matrices of ``src`` (16-bit elements) whose
    rows lie at ``row_bytes``, then each lane's word of matrix q stored into ``dst`` at element
    ``element_at(lane, q)``; asserts both free of bank conflicts."""
    for q in range(4):
        assert conflict_free(row_bytes[8 * q : 8 * q + 8], 16)
    words = ldmatrix_trans(row_bytes)
    for q in range(4):
        stores = []
        for lane in range(32):
            at = element_at(lane, q)
            stores.append(2 * at)
            for e, (rb, col) in enumerate(words[(lane, q)]):
                dst[at + e] = src[rb // 2 + col]
        assert conflict_free(stores, 4)


@pytest.mark.parametrize("width,span", [(9, 1024), (31, 512), (64, 512), (256, 512)])
def test_channel_last_transposes(width, span):
    """The staged window (position-major, 16 channels a position) reaches the rows (channel-
    major) element for element through each warp's ldmatrix.trans and 4-byte stores, and the
    outputs leave the rows through the output block the same way, every access free of bank
    conflicts, with the rows the plan lays out (8 mod 16 elements)."""
    d = 16 * (-(-(width - 1) // 16))
    row_len = d + span + (8 - d - span) % 16
    n_in = d + span
    window = rng.integers(0, 2**15, (n_in, 16))  # [position][channel]
    staging = np.zeros(2 * n_in * 8, np.int64)  # 16-bit elements
    for i in range(n_in):
        for h in range(2):
            staging[8 * slot(i, h) : 8 * slot(i, h) + 8] = window[i, 8 * h : 8 * h + 8]
    rows = np.zeros(16 * row_len, np.int64)

    def row_at(lane, q):  # lane (g, tg)'s element of matrix q in the rows, less the pass's base
        return (8 * (q & 1) + (lane >> 2)) * row_len + 8 * (q >> 1) + 2 * (lane & 3)

    def block_at(lane, q):  # lane (g, tg)'s element of matrix q in the output block
        g, tg, sw = lane >> 2, lane & 3, 4 * ((lane >> 4) & 1)
        return 2 * (8 * g + tg + [sw, 4 - sw, 64 + sw, 68 - sw][q])

    for base in range(0, n_in, 16):  # one warp's pass
        # matrix q = (a, hq): its row j is position base + 8 a + j, channels 8 hq ..; lane
        # (g, tg) stores positions 2 tg, 2 tg + 1 of channel 8 hq + g (in_to[...])
        row_bytes = [16 * slot(base + 8 * (q >> 1) + j, q & 1) for q in range(4) for j in range(8)]
        warp_pass(row_bytes, staging, rows, lambda lane, q, base=base: row_at(lane, q) + base)
    assert (rows.reshape(16, row_len)[:, :n_in] == window.T).all()

    block = np.zeros(16 * 16, np.int64)  # the output block: 16 positions of 32 bytes
    for base in range(0, span, 16):
        # matrix q = (a, hq): its row j is channel 8 hq + j at positions base + 8 a ..; lane
        # (g, tg) stores channels 8 hq + 2 tg, + 1 of position 8 a + g into the block (out_to[...])
        row_bytes = [
            2 * ((8 * (q & 1) + j) * row_len + base + 8 * (q >> 1))
            for q in range(4)
            for j in range(8)
        ]
        warp_pass(row_bytes, rows, block, block_at)
        loads = [16 * slot(lane >> 1, lane & 1) for lane in range(32)]
        for phase in range(4):
            assert conflict_free(loads[8 * phase : 8 * phase + 8], 16)
        for lane in range(32):  # lane (i, h): channels 8 h .. of position base + i
            i, h = lane >> 1, lane & 1
            got = block[8 * slot(i, h) : 8 * slot(i, h) + 8]
            assert (got == window[base + i, 8 * h : 8 * h + 8]).all()


# ---- bwd_mma on channel-contiguous x: the block's moves into the warps' rows and back ----------


def byte_perm(x: int, y: int, selector: int) -> int:
    """PTX prmt / __byte_perm: byte i of the result is byte (selector nibble i) of y:x."""
    pool = (x | y << 32).to_bytes(8, "little")
    return int.from_bytes(bytes(pool[selector >> 4 * i & 7] for i in range(4)), "little")


def words(values) -> list[int]:
    """16-bit values as 32-bit words, two a word, the first in the low half."""
    return [int(values[i]) | int(values[i + 1]) << 16 for i in range(0, len(values), 2)]


@pytest.mark.parametrize("channels", (16, 8))  # BWD_MMA_CL_WARPS: two or one run a row
@pytest.mark.parametrize("rows", (2, 528, 640, 1552))
def test_backward_channel_last_moves(channels, rows):
    """kernels/bwd_mma.cu, CL = 1: each thread's share of the staged rows (stage), of their
    move into the warps' rows as pairs of positions (unstage: __byte_perm 0x5410 / 0x7632 of
    the runs of two rows), and of dx's move back out as 16-byte runs; every staged element
    reaches its warp's row at its position, and every element of the warps' rows its run."""
    runs = channels // 8
    threads, step = 32 * channels, 32 * channels // runs  # ROWS
    staged = rng.integers(0, 1 << 16, size=(rows, channels))  # [position][channel], 16 bits
    run = {(r, h): words(staged[r, 8 * h : 8 * h + 8]) for r in range(rows) for h in range(runs)}

    covered = []  # stage: thread t copies run h = t % RUNS of rows t / RUNS, + ROWS, ...
    for t in range(threads):
        covered += [(r, t % runs) for r in range(t // runs, rows, step)]
    assert sorted(covered) == sorted(run)

    warp_rows = np.full((channels, rows // 2), -1)  # u32 words, pairs of positions
    for t in range(threads):  # unstage
        h = t % runs
        for j in range(t // runs, rows // 2, step):
            ra, rb = run[(2 * j, h)], run[(2 * j + 1, h)]
            for e in range(8):
                assert warp_rows[8 * h + e, j] == -1, "written twice"
                sel = 0x7632 if e & 1 else 0x5410
                warp_rows[8 * h + e, j] = byte_perm(ra[e >> 1], rb[e >> 1], sel)
    got = np.stack([warp_rows & 0xFFFF, warp_rows >> 16], axis=2).reshape(channels, rows)
    assert np.array_equal(got, staged.T)

    out = {}  # dx out: thread t, positions 2 j and 2 j + 1 of run h
    for t in range(threads):
        h = t % runs
        for j in range(t // runs, rows // 2, step):
            w = [int(warp_rows[8 * h + e, j]) for e in range(8)]
            lo = [byte_perm(w[2 * k], w[2 * k + 1], 0x5410) for k in range(4)]
            hi = [byte_perm(w[2 * k], w[2 * k + 1], 0x7632) for k in range(4)]
            assert (2 * j, h) not in out and (2 * j + 1, h) not in out
            out[(2 * j, h)], out[(2 * j + 1, h)] = lo, hi
    assert out == run


# ---- fwd_mma on float32 x: the window and the taps split into bfloat16 parts -------------------


def test_float32_split_into_bfloat16_parts_keeps_float32_accuracy():
    """fwd_mma's products for float32 x: x and the taps each as a high and a low bfloat16 part
    (hi = bf16(v), lo = bf16(v - hi)), summed as hi hi + lo(taps) hi(x) + hi(taps) lo(x). Each
    term is within about 2^-16 of its own value: the error of a sum within 2^-14 of the sum of
    its terms' magnitudes at any scale, and for the tests' data far inside the float32
    tolerance of the contract (rtol 3e-4, atol 1e-3); the high parts alone would not be."""
    ml_dtypes = pytest.importorskip("ml_dtypes")

    def conv(x, w):  # direct(), by numpy
        return np.convolve(x, w[::-1])[: len(x)]

    def parts(v):
        hi = v.astype(ml_dtypes.bfloat16).astype(np.float64)
        lo = (v - hi).astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
        return hi, lo

    for width, spread in ((18, 0), (64, 0), (256, 0), (64, 8), (256, 8)):
        x = rng.standard_normal(3000) * np.exp(rng.uniform(-spread, spread, 3000))
        x = x.astype(np.float32).astype(np.float64)
        w = (rng.standard_normal(width) / width**0.5).astype(np.float32).astype(np.float64)
        want = conv(x, w)
        (xh, xl), (wh, wl) = parts(x), parts(w)
        got = conv(xh, wh) + conv(xh, wl) + conv(xl, wh)
        scale = conv(np.abs(x), np.abs(w))
        assert np.max(np.abs(got - want) / scale) < 2**-14
        if not spread:
            np.testing.assert_allclose(got, want, rtol=3e-4, atol=1e-4)  # a tenth of its atol
        coarse = conv(xh, wh)
        assert np.max(np.abs(coarse - want) / scale) > 2**-10  # one product is not enough


def test_float16_is_two_bfloat16_parts_exactly():
    """fwd_mma's split window for float16 x with other weights: every finite float16 value is
    exactly the sum of hi = bf16(x) and lo = bf16(x - hi) (x - hi computed in float32), so the
    products of x stay exact."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    every = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    x = every[np.isfinite(every)].astype(np.float32)
    hi = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    lo = (x - hi).astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(hi + lo, x)
    assert np.count_nonzero(lo) > len(x) // 2  # the low part carries bits for most values


# ---- fwd_mma_cl: who stages, moves, computes and writes out what ------------------------------


def cl_piece(i, u, m):
    """fwd_mma_cl's 16-byte piece (position i of a step, unit u, channels 8 m ..) of a staging
    buffer: units of odd positions swapped in pairs, pieces of a 64-byte row rotated."""
    return (i * 8 + (u ^ (i & 1))) * 4 + (m ^ ((u >> 1) & 3))


@pytest.mark.parametrize("warps", (4, 8))
def test_channel_last_block_bookkeeping(warps):
    """fwd_mma_cl's blocks of 4 or 8 warps (8 or 4 of the block's 32 channels each):
    every staged piece of a step is copied in once, a warp moves only the pieces it copied,
    every (position, unit, channel) output is placed once and written out by the thread that
    copies its piece, to its own position, unit and channel; the 8-byte output stores of a half
    warp are free of bank conflicts; each warp's tap table is 16-byte aligned and each tap of
    its channels is loaded by one lane."""
    cpw, rp, pstep = 32 // warps, 16 // warps, 32 * warps
    copied = {}
    for warp in range(warps):
        for lane in range(32):
            cu, cm = lane >> 2, lane & 3
            for r in range(rp):
                assert cl_piece(warp, cu, cm) + pstep * r == cl_piece(warp + warps * r, cu, cm)
                copied[cl_piece(warp + warps * r, cu, cm)] = warp
    assert sorted(copied) == list(range(16 * 8 * 4))
    for warp in range(warps):  # the move: lane 8 m + j reads piece (position, unit j, m)
        for lane in range(32):
            m, j = lane >> 3, lane & 7
            assert all(copied[cl_piece(warp + warps * r, j, m)] == warp for r in range(rp))
    placed = {}
    for warp in range(warps):
        for half in range(cpw // 4):  # channels 4 q .. 4 q + 3 of the block
            q = cpw // 4 * warp + half
            for r in range(4):
                half_warp_addresses = ([], [])
                for lane in range(32):
                    g, tg = lane >> 2, lane & 3
                    pos, unit, swap = g + 8 * (r >> 1), 2 * tg + (r & 1), (g >> 1) & 1
                    byte = 16 * cl_piece(pos, unit, q // 2) + 8 * ((q & 1) ^ swap)
                    half_warp_addresses[lane >> 4].append(byte)
                    for c in range(4):  # channel pair p2 = c // 2, element c % 2
                        assert (byte + 2 * c) not in placed
                        placed[byte + 2 * c] = (pos, unit, cpw * warp + 4 * half + c)
                assert all(conflict_free(a, 8) for a in half_warp_addresses)
    assert len(placed) == 16 * 8 * 32
    for warp in range(warps):  # the copy out: halves swapped back where bit 1 of warp is set
        for lane in range(32):
            cu, cm = lane >> 2, lane & 3
            for r in range(rp):
                byte = 16 * (cl_piece(warp, cu, cm) + pstep * r)
                for e in range(8):
                    got = placed[byte + 2 * (e ^ 4 if warp & 2 else e)]
                    assert got == (warp + warps * r, cu, 8 * cm + e)
    for ks in range(2, 18):
        d = 16 * (ks - 1)
        tab = d + 32  # words of a channel's table
        assert all(warp * cpw * tab % 4 == 0 for warp in range(warps))
        lanes_a_channel = 32 // cpw
        taps = [
            (lane // lanes_a_channel, lane % lanes_a_channel + lanes_a_channel * r)
            for lane in range(32)
            for r in range(-(-(d + 1) // lanes_a_channel))
        ]
        assert sorted(t for t in taps if t[1] <= d) == [
            (c, k) for c in range(cpw) for k in range(d + 1)
        ]


def one_barrier_conflicts(ks, warps, ring_blocks, buffers, steps=12):
    """fwd_mma_cl's step protocol with one block barrier a step, as sets of accesses: the
    shared-memory places two warps touch between the same two barriers (an epoch) where one
    of them writes, or where a copy in flight lands on a place another warp reads."""
    channels, cpw = 32, 32 // warps
    positions = [[w + warps * r for r in range(16 // warps)] for w in range(warps)]
    buf = [a % buffers for a in range(steps + 2)]
    blk = [a % ring_blocks for a in range(steps + 2)]
    window = {a: {blk[a] - s for s in range(ks)} for a in range(steps)}  # (mod ring_blocks)
    window = {a: {b % ring_blocks for b in bs} for a, bs in window.items()}
    # accesses[epoch][warp] = [(place, writes)]; epoch a: after barrier a, up to barrier a + 1
    accesses = [[[] for _ in range(warps)] for _ in range(steps + 2)]
    for w in range(warps):
        own = range(cpw * w, cpw * w + cpw)
        for a in range(steps):
            # before barrier a (epoch a - 1): the move of step a from its buffer into the ring
            for i in positions[w]:
                for c in range(channels):
                    accesses[a - 1][w].append((("buf", buf[a], i, c), False))
                    accesses[a - 1][w].append((("ring", blk[a], i, c), True))
            # after barrier a (epoch a): step a - 1's outputs out, the copy of step a + 2 in
            # (landing by barrier a + 2), step a's window read and its outputs written
            for i in positions[w]:
                for c in range(channels):
                    if a >= 1 and a - 1 >= ks - 1:
                        accesses[a][w].append((("buf", buf[a - 1], i, c), False))
                    if a + 2 < steps:
                        for e in (a, a + 1):
                            accesses[e][w].append((("buf", buf[a + 2], i, c), True))
            if a >= ks - 1:
                for b in window[a]:
                    for i in range(16):
                        for c in own:
                            accesses[a][w].append((("ring", b, i, c), False))
                for i in range(16):
                    for c in own:
                        accesses[a][w].append((("buf", buf[a], i, c), True))
    conflicts = 0
    for epoch in accesses:
        seen = {}
        for w, acc in enumerate(epoch):
            for place, writes in acc:
                seen.setdefault(place, []).append((w, writes))
        for users in seen.values():
            ws = {w for w, _ in users}
            if len(ws) > 1 and any(writes for _, writes in users):
                conflicts += 1
    return conflicts


@pytest.mark.parametrize("ks", (2, 3, 5))
@pytest.mark.parametrize("warps", (4, 8))
def test_channel_last_one_barrier_a_step(ks, warps):
    """With a ring of KS + 1 blocks and three staging buffers, no two warps touch one place of
    shared memory between the same two barriers where one writes it (a copy in flight counted
    as writing until the barrier after it lands); a ring of KS blocks, or two buffers, would."""
    assert one_barrier_conflicts(ks, warps, ks + 1, 3) == 0
    assert one_barrier_conflicts(ks, warps, ks, 3) > 0
    assert one_barrier_conflicts(ks, warps, ks + 1, 2) > 0
