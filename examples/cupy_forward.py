"""causal_conv1d_fn on CuPy arrays, writing into a preallocated output buffer.

Needs CuPy and a CUDA GPU; without them it says why and exits 0.
"""

import sys

if __name__ == "__main__":
    try:
        import cupy
    except ImportError:
        print("skipped: CuPy is not installed")
        sys.exit(0)
    if not cupy.cuda.is_available():
        print("skipped: CuPy sees no CUDA GPU")
        sys.exit(0)

    import cupyconv
    from cupyconv import reference
    from cupyconv.testing import assert_close

    batch, dim, seqlen, width = 2, 128, 2048, 4
    rng = cupy.random.default_rng(0)
    x = rng.standard_normal((batch, dim, seqlen), dtype=cupy.float32)  # channel-first
    weight = rng.standard_normal((dim, width), dtype=cupy.float32)
    bias = rng.standard_normal(dim, dtype=cupy.float32)
    out = cupy.full_like(x, cupy.nan)  # any [batch, dim, seqlen] buffer of x's dtype

    result = cupyconv.causal_conv1d_fn(x, weight, bias, activation="silu", out=out)
    assert result is out
    print(f"out: {out.shape} {out.dtype}")

    want = reference.causal_conv1d_fn(x.get(), weight.get(), bias.get(), activation="silu")
    assert_close(out, want)
    print("ok")
