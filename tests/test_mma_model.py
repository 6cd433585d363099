"""A float64 model of the tensor-core forward (kernels/fwd_mma.cu) with the exact PTX
m16n8k16 fragment layouts: checks the index mapping of the A (Toeplitz weights, read from the
zero-padded weight row), B (inputs, read as 8-byte words of the staged window) and C (outputs,
stored as adjacent pairs) fragments, with the kernel's permutations of k and of the rows,
against a direct causal convolution.
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


def a_fragment(w, K, D, s):
    """Lane values of k-step s as load_row builds them: register r = (r & 1: row g + 8,
    r >> 1: upper k) holds wpad[PAD + tap], tap = 16 s + 4 tg + 2 (r >> 1) + h - 2 g - (r & 1)
    - (D - K + 1), from the zero-padded weight row."""
    pad = D + 15
    wpad = np.zeros(2 * D + 32)
    wpad[pad : pad + K] = w
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
