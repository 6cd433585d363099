"""A float64 model of bwd_mma_cl (kernels/bwd_mma_cl.cu), the channel-contiguous backward on
tensor cores, with the exact m16n8k16 fragment layouts and every shared-memory access the kernel
makes: the copies into the staging buffers, the moves into the x ring and the odd ring (one
shuffle, and the first of each warp's positions filled in afterwards), z and dz as the forward
computes outputs, dz's halves into their rings by stmatrix.trans, dx from the reversed taps (the
forward table's words read backwards, halves swapped), dweight's lags in place (A the Toeplitz
matrix of x from the two x rings, B the dz blocks, zero bytes outside the unit) and dx out through
the staging buffer. Shared memory is poisoned with NaN at every item's start, so that a result
that depends on memory the item has not written comes out NaN; every access is checked for its
element type and bank conflicts.
"""

import numpy as np
import pytest
from test_mma_model import conflict_free, mma, ways

from cupyconv import reference

rng = np.random.default_rng(3)
STEP, CH = 128, 32  # BWD_CL_STEP, the channels of a block (8 a warp)


def bf16_round(v):
    """v rounded to bfloat16 (to nearest even), as float64."""
    import ml_dtypes

    return np.asarray(v, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


class Shared:
    """Shared memory as typed elements: each byte offset holds a 2-byte element's value where
    one starts, so that a read of the wrong type, or of bytes never written, fails."""

    def __init__(self, size):
        self.size = np.zeros(size, np.int8)  # bytes of the element starting here (0: none)
        self.value = np.full(size, np.nan)
        self.fixed = np.zeros(size, bool)  # bytes written once for the whole kernel (``fix``)

    def fix(self, at, values, itemsize):
        """Elements the kernel writes once at its start: no later store may reach them."""
        self.write(at, values, itemsize)
        self.fixed[at : at + itemsize * len(values)] = True

    def write(self, at, values, itemsize):
        assert not self.fixed[at : at + itemsize * len(values)].any(), (
            f"a store into fixed bytes at {at}"
        )
        for e, v in enumerate(values):
            b = at + itemsize * e
            self.size[b : b + itemsize] = -1
            self.size[b], self.value[b] = itemsize, v

    def read(self, at, n, itemsize):
        got = []
        for e in range(n):
            b = at + itemsize * e
            assert self.size[b] == itemsize, f"{itemsize}-byte read at {b}: not such an element"
            got.append(self.value[b])
        return got


def cl_items(batch, dim, seqlen, span):
    """The items in a block's order, channel groups of CH fastest: (batch row, first channel,
    the piece's start and end)."""
    pieces, groups = -(-seqlen // span), -(-dim // CH)
    for item in range(groups * batch * pieces):
        unit, grp = divmod(item, groups)
        b, jp = divmod(unit, pieces)
        yield b, grp * CH, jp * span, min(seqlen, jp * span + span)


def slot_bytes(s):
    """Byte offset of ring slot s in a channel's ring (16-byte halves of 32 swapped where bit 7
    of the offset is set)."""
    return 2 * s ^ ((2 * s >> 3) & 16)


def ldmatrix(smem, row_bytes, matrices, most_ways=1):
    """ldmatrix.x4 (x2: two matrices) as it lies: per lane (g, tg), matrix q's elements (g, 2 tg)
    and (g, 2 tg + 1), lanes 8 q + j giving the byte addresses of matrix q's rows j; each
    matrix's 8 rows free of bank conflicts (at most ``most_ways`` words a bank)."""
    for q in range(matrices):
        assert ways(row_bytes[8 * q : 8 * q + 8], 16) <= most_ways
    rows = [smem.read(a, 8, 2) for a in row_bytes[: 8 * matrices]]
    return [
        [rows[8 * q + (lane >> 2)][2 * (lane & 3) + e] for q in range(matrices) for e in (0, 1)]
        for lane in range(32)
    ]


def silu_grad(z):
    s = 1.0 / (1.0 + np.exp(-z))
    return s * (1.0 + z * (1.0 - s))


def stmatrix_trans(smem, row_bytes, held):
    """stmatrix.x4.trans: matrix q's row j (at the address of lane 8 q + j) gets column j of the
    matrix the lanes hold as ldmatrix gives it; each matrix's 8 rows free of bank conflicts."""
    for q in range(4):
        assert conflict_free(row_bytes[8 * q : 8 * q + 8], 16)
        for j in range(8):
            column = [held[4 * row + j // 2][2 * q + j % 2] for row in range(8)]
            smem.write(row_bytes[8 * q + j], column, 2)


def poison(smem, itemsize=2):
    """Every element of ``smem`` NaN but the fixed ones (the kernel cannot count on what an item
    has not written)."""
    for at in range(0, len(smem.size), itemsize):
        if not smem.fixed[at]:
            smem.write(at, [np.nan], itemsize)


def bwd_mma_cl_model(x, dout, w, bias, K, span, states=None, silu=True):
    """bwd_mma_cl's backward of x, dout [batch, dim, seqlen] as one block takes the items in
    turn. Returns dx, dweight [dim, K], dbias [dim] (the parts added up)."""
    batch, dim, seqlen = x.shape
    ks = max(-(-(K - 1) // 16) + 1, 10 if K > 128 else 0)
    D = 16 * (ks - 1)
    lf = 1 if D <= 128 else 2
    warm = lf
    ring_len = STEP * (warm + 1)
    rb = 2 * ring_len + 16
    drain = max(D, STEP - 1)
    rings = Shared(4 * CH * rb)  # x, odd x, dz high, dz low
    xstage, dstage = Shared(2 * STEP * 64), Shared(STEP * 64)
    dx = np.full(x.shape, np.nan)
    dw_total, db_total = np.zeros((dim, K)), np.zeros(dim)

    def turn(i):
        return ((i >> 1) & 3) ^ ((i >> 5) & 3)

    def xslot(buf, i, s):
        return buf * STEP * 64 + i * 64 + 16 * (s ^ turn(i))

    def dslot(i, s):
        return i * 64 + 16 * (s ^ turn(i))

    def wrap(s):
        assert -ring_len <= s < 2 * ring_len
        return s + ring_len if s < 0 else s - ring_len if s >= ring_len else s

    def ring(which, ch):
        return (which * CH + ch) * rb

    # The 16 bytes past each dz ring's slots: zeros, written at the kernel's start (dweight's B
    # rows for dz blocks outside the unit).
    for which in (2, 3):
        for ch in range(CH):
            rings.fix(ring(which, ch) + 2 * ring_len, [0.0] * 8, 2)

    def place(lane, r):
        return 32 * (lane & 3) + 16 * (r & 1) + 8 * (r >> 1) + (lane >> 2)

    for b, c0, start, end in cl_items(batch, dim, seqlen, span):
        length = end - start
        m1 = -(-length // 16)
        n_copies = warm + -(-(length + drain) // STEP)
        for smem in (rings, xstage, dstage):
            poison(smem)
        # the taps as the tables hold them: P[D + 16 - K + k] = w[k], tab[j] = (P[j], P[j + 1])
        P = np.zeros((CH, D + 33))
        bias_c = np.zeros(CH)
        for cl in range(CH):
            if c0 + cl < dim:
                P[cl, D + 16 - K : D + 16] = w[c0 + cl]
                bias_c[cl] = bias[c0 + cl]

        def x_at(c, rel, b=b, start=start):  # what copy_x brings
            pos = start + rel
            if c >= dim or rel < -D or pos >= seqlen or pos < -(K - 1):
                return 0.0
            if pos < 0:
                return 0.0 if states is None else states[b, c, K - 1 + pos]
            return x[b, c, pos]

        dw_acc = np.zeros((CH, lf, 32, 4))
        db_acc = np.zeros((CH, 32))
        for a in range(n_copies):
            buf, sbase, t0 = a & 1, (STEP * a) % ring_len, STEP * (a - warm)
            for warp in range(4):  # copy_x(a)
                for r in range(4):
                    at = []
                    for lane in range(32):
                        j8, m4 = lane & 7, lane >> 3
                        i = 32 * warp + 8 * r + j8
                        at.append(xslot(buf, i, m4))
                        xstage.write(at[-1], [x_at(c0 + 8 * m4 + e, t0 + i) for e in range(8)], 2)
                    for phase in range(4):
                        assert conflict_free(at[8 * phase : 8 * phase + 8], 16)
            if a >= warm:  # copy_dout(a), each warp its own slot
                for warp in range(4):
                    cw = c0 + 8 * warp
                    for r in range(4):
                        at = []
                        for lane in range(32):
                            i = lane + 32 * r
                            pos = start + t0 + i
                            at.append(dslot(i, warp))
                            values = [
                                dout[b, cw + e, pos] if cw + e < dim and pos < seqlen else 0.0
                                for e in range(8)
                            ]  # fmt: skip
                            dstage.write(at[-1], values, 2)
                        for phase in range(4):
                            assert conflict_free(at[8 * phase : 8 * phase + 8], 16)
            for warp in range(4):  # the moves
                prev = None
                for r in range(4):
                    at = 32 * warp + 8 * r
                    rows = [xslot(buf, at + (ln & 7), ln >> 3) for ln in range(32)]
                    held = ldmatrix(xstage, rows, 4)
                    dest = [ring(0, ln) + slot_bytes(wrap(sbase + at)) for ln in range(32)]
                    stmatrix_trans(rings, dest, held)
                    give = [prev[ln] if (ln >> 2) == 7 and r > 0 else held[ln] for ln in range(32)]
                    odd = [give[(ln + 28) & 31] for ln in range(32)]
                    stmatrix_trans(rings, [d + CH * rb for d in dest], odd)
                    prev = held
            for warp in range(4):  # the odd ring's first positions of each warp's 32
                for lane in range(32):
                    cl, q = lane >> 2, lane & 3
                    src = ring(0, 8 * warp + cl) + slot_bytes(wrap(sbase + 32 * q - 1))
                    (v,) = rings.read(src, 1, 2)
                    rings.write(ring(1, 8 * warp + cl) + slot_bytes(wrap(sbase + 32 * q)), [v], 2)
            if a < warm:
                continue

            def b_rows(lane, s, sbase=sbase):  # the B rows of k-steps s, s + 1: lane 8 mq + j
                mq, j = lane >> 3, lane & 7
                return slot_bytes(wrap(sbase - D + 16 * (j + s + (mq >> 1)) + 8 * (mq & 1)))

            def b_fragments(which, ch, b_rows=b_rows):  # [s] -> [32][4] (b0, b1 pairs)
                frags = []
                for s in range(0, ks, 2):
                    m = 4 if s + 1 < ks else 2
                    held = ldmatrix(rings, [ring(which, ch) + b_rows(ln, s) for ln in range(32)], m)
                    frags.append([h[0:4] for h in held])
                    if m == 4:
                        frags.append([h[4:8] for h in held])
                return np.array(frags)

            for warp in range(4):
                cw = c0 + 8 * warp
                dv = {}
                for r in range(4):
                    at = [dslot(place(ln, r), warp) for ln in range(32)]
                    for phase in range(4):
                        assert conflict_free(at[8 * phase : 8 * phase + 8], 16)
                    for ln in range(32):
                        dv[ln, r] = dstage.read(at[ln], 8, 2)
                for cl in range(8):
                    if cw + cl >= dim:
                        continue
                    bf = b_fragments(0, 8 * warp + cl)
                    acc = np.full((32, 4), bias_c[8 * warp + cl])
                    for s in range(ks):
                        af = []
                        for ln in range(32):
                            jb = 15 + 2 * (ln & 3) - (ln >> 2) + 16 * s
                            taps = P[8 * warp + cl]
                            af.append(
                                [taps[i + e] for i in (jb, jb - 8, jb + 8, jb) for e in (0, 1)]
                            )
                        acc = mma(np.array(af), bf[s], acc)
                    held = []
                    for ln in range(32):
                        d = np.array([dv[ln, r][cl] for r in range(4)])
                        dz = d * silu_grad(acc[ln]) if silu else d
                        for r in range(4):
                            if t0 + place(ln, r) < length:
                                db_acc[8 * warp + cl, ln] += dz[r]
                        hi = bf16_round(dz)
                        lo = bf16_round(dz - hi)
                        held.append([hi[0], hi[1], hi[2], hi[3], lo[0], lo[1], lo[2], lo[3]])
                    rows = []
                    for ln in range(32):
                        q, j = ln >> 3, ln & 7
                        off = slot_bytes(wrap(sbase + 16 * j + 8 * (q & 1)))
                        rows.append(ring(2 + (q >> 1), 8 * warp + cl) + off)
                    stmatrix_trans(rings, rows, held)
                # dx at t0 - D + place: the reversed taps' words, halves swapped
                out = {}
                for cl in range(8):
                    if cw + cl >= dim:
                        for ln in range(32):
                            for r in range(4):
                                out[ln, r, cl] = 0.0  # (the kernel's zeros past the channels)
                        continue
                    bh, bl = b_fragments(2, 8 * warp + cl), b_fragments(3, 8 * warp + cl)
                    acc = np.zeros((32, 4))
                    for s in range(ks):
                        af = []
                        for ln in range(32):
                            tw = D + 29 - (15 + 2 * (ln & 3) - (ln >> 2)) - 16 * s
                            words = [tw, tw + 8, tw - 8, tw]  # a0, a1, a2, a3 = a0
                            af.append([P[8 * warp + cl][i + 1 - e] for i in words for e in (0, 1)])
                        acc = mma(np.array(af), bh[s], acc)
                        acc = mma(np.array(af), bl[s], acc)
                    for ln in range(32):
                        for r in range(4):
                            out[ln, r, cl] = acc[ln, r]
                for r in range(4):
                    at = [xslot(buf, place(ln, r), warp) for ln in range(32)]
                    for phase in range(4):
                        assert conflict_free(at[8 * phase : 8 * phase + 8], 16)
                    for ln in range(32):
                        xstage.write(at[ln], bf16_round([out[ln, r, cl] for cl in range(8)]), 2)
                # dweight: x blocks n0 + ni, A words from the x ring (even v) or the odd ring
                n0 = t0 // 16 - 7
                for cl in range(8):
                    if cw + cl >= dim:
                        continue
                    aw = np.zeros((lf, 32, 17, 2))
                    for f in range(lf):
                        for ln in range(32):
                            v = 2 * (ln & 3) - (ln >> 2)
                            odd = v & 1
                            for e in range(17):
                                u = wrap(sbase - 112 - 128 * f + v + odd + 8 * (e - 1))
                                at = ring(odd, 8 * warp + cl) + slot_bytes(u)
                                aw[f, ln, e] = rings.read(at, 2, 2)
                    edge = n0 < 0 or n0 + 15 > m1  # (a block of the step's B outside the unit)
                    for ni in range(8):
                        rows = []
                        for ln in range(32):
                            mq, j = ln >> 3, ln & 7
                            zdz = ring(2 + (mq >> 1), 8 * warp + cl)
                            if 0 <= n0 + ni + j < m1:
                                u = wrap(sbase - 112 + 16 * (ni + j) + 8 * (mq & 1))
                                rows.append(zdz + slot_bytes(u))
                            else:  # (column j of B zero: the ring's zero bytes)
                                rows.append(zdz + 2 * ring_len)
                        # (in a unit's first and last steps a zero row may share a bank group
                        # with a row inside the unit: two ways there)
                        bw = np.array(ldmatrix(rings, rows, 4, 2 if edge else 1))
                        words = (2 * ni + 1, 2 * ni, 2 * ni + 2, 2 * ni + 1)  # a0, a1, a2, a3
                        for f in range(lf):
                            af = np.array([np.concatenate(aw[f, ln, words]) for ln in range(32)])
                            dw_acc[8 * warp + cl, f] = mma(af, bw[:, 0:4], dw_acc[8 * warp + cl, f])
                            dw_acc[8 * warp + cl, f] = mma(af, bw[:, 4:8], dw_acc[8 * warp + cl, f])
            for warp in range(4):  # dx out
                for lane in range(32):
                    j8, m4 = lane & 7, lane >> 3
                    for r in range(4):
                        rel = t0 - D + 32 * warp + 8 * r + j8
                        if 0 <= rel < length:
                            v = xstage.read(xslot(buf, 32 * warp + 8 * r + j8, m4), 8, 2)
                            for e in range(8):
                                if c0 + 8 * m4 + e < dim:
                                    dx[b, c0 + 8 * m4 + e, start + rel] = v[e]
        for cl in range(CH):  # the item's part
            c = c0 + cl
            if c >= dim:
                continue
            db_total[c] += db_acc[cl].sum()
            for f in range(lf):
                for ln in range(32):
                    g, tg = ln >> 2, ln & 3
                    for r in range(4):
                        lag = 128 * f + 32 * tg + 16 * (r & 1) + 8 * (r >> 1) + g
                        if lag < K:
                            dw_total[c, K - 1 - lag] += dw_acc[cl, f, ln, r]
    return dx, dw_total, db_total


@pytest.mark.parametrize(
    "width,dim,seqlen,span,states,silu",
    [
        (17, 8, 300, 256, False, True),  # KS 2: a row cut inside a step, a piece of 44
        (33, 40, 200, 128, True, False),  # a partial channel group, initial states, no activation
        (64, 16, 300, 128, True, True),  # KS 5: pieces shorter than the lags' reach
        (128, 8, 280, 256, False, True),  # KS 9: the widest lag in one fragment
        (129, 8, 300, 256, True, True),  # KS 10: two lag fragments, a ring of 384
        (256, 8, 400, 256, False, True),  # KS 17
    ],
)  # fmt: skip
def test_channel_last_backward_model(width, dim, seqlen, span, states, silu):
    """bwd_mma_cl's index mapping is the backward: dx within bfloat16's rounding of its output,
    dweight and dbias within the products of dz's two halves (hi + lo = dz to 2^-17), reading no
    shared memory the item has not written, every access free of bank conflicts."""
    shape = (2, dim, seqlen)
    x, dout = bf16_round(rng.standard_normal(shape)), bf16_round(rng.standard_normal(shape))
    w = bf16_round(rng.standard_normal((dim, width)) * width**-0.5)
    bias = bf16_round(rng.standard_normal(dim))
    init = bf16_round(rng.standard_normal((2, dim, width - 1))) if states else None
    act = "silu" if silu else None
    dx, dw, db = bwd_mma_cl_model(x, dout, w, bias, width, span, init, silu)
    want = reference.causal_conv1d_bwd(x, w, bias, dout, initial_states=init, activation=act)
    np.testing.assert_allclose(dx, want[0], rtol=1e-2, atol=2e-2)
    scale = (2 * seqlen) ** 0.5
    np.testing.assert_allclose(dw, want[1], rtol=1e-4, atol=1e-4 * scale)
    np.testing.assert_allclose(db, want[2], rtol=1e-4, atol=1e-4 * scale)
