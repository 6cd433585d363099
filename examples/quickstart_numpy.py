"""Quickstart: causal depthwise conv1d on numpy arrays (runs anywhere, no GPU needed).

    out[b, c, t] = silu(bias[c] + sum_k weight[c, k] * x[b, c, t - (width - 1) + k])

i.e. ``F.conv1d(x, weight.unsqueeze(1), bias, padding=width - 1, groups=dim)[..., :seqlen]``
followed by SiLU. On CPU arrays cupyconv runs its float64 reference and rounds once to the
dtype of x; GPU arrays (torch, CuPy, JAX) run the CUDA kernels.
"""

import numpy as np

import cupyconv
from cupyconv import reference
from cupyconv.testing import assert_close

if __name__ == "__main__":
    batch, dim, seqlen, width = 2, 64, 128, 4
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, dim, seqlen)).astype(np.float32)  # [batch, dim, seqlen]
    weight = rng.standard_normal((dim, width)).astype(np.float32)  # [dim, width]
    bias = rng.standard_normal(dim).astype(np.float32)  # [dim]

    out = cupyconv.causal_conv1d_fn(x, weight, bias, activation="silu")
    print(f"out: shape {out.shape}, dtype {out.dtype}")

    # The formula above, written out with a zero-padded history of width - 1 steps.
    history = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (width - 1, 0)))
    pre = bias[None, :, None] + sum(
        weight[None, :, k, None] * history[:, :, k : k + seqlen] for k in range(width)
    )
    assert_close(out, reference.silu(pre))

    # A channel-last x (a [batch, seqlen, dim] buffer viewed as [batch, dim, seqlen]) gives a
    # channel-last out.
    x_cl = np.ascontiguousarray(x.transpose(0, 2, 1)).transpose(0, 2, 1)
    out_cl = cupyconv.causal_conv1d_fn(x_cl, weight, bias, activation="silu")
    assert out_cl.strides == x_cl.strides
    assert_close(out_cl, reference.causal_conv1d_fn(x, weight, bias, activation="silu"))
    print("ok")
