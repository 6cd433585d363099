"""causal_conv1d_fn on JAX arrays on a GPU (exchanged with CuPy through DLPack, no copy); the
result is a JAX array.

Needs JAX with a GPU backend and CuPy; without them it says why and exits 0.
"""

import importlib.util
import sys

if __name__ == "__main__":
    try:
        import jax
    except ImportError:
        print("skipped: JAX is not installed")
        sys.exit(0)
    try:
        gpu = jax.devices("gpu")[0]
    except RuntimeError:
        print(f"skipped: JAX has no GPU backend (default backend: {jax.default_backend()})")
        sys.exit(0)
    if importlib.util.find_spec("cupy") is None:
        print("skipped: CuPy (which compiles cupyconv's kernels) is not installed")
        sys.exit(0)

    import jax.numpy as jnp
    import numpy as np

    import cupyconv
    from cupyconv import reference
    from cupyconv.testing import assert_close

    batch, dim, seqlen, width = 2, 128, 1024, 4
    rng = np.random.default_rng(0)
    x = jax.device_put(jnp.asarray(rng.standard_normal((batch, dim, seqlen)), jnp.float16), gpu)
    weight = jax.device_put(jnp.asarray(rng.standard_normal((dim, width)), jnp.float32), gpu)
    bias = jax.device_put(jnp.asarray(rng.standard_normal(dim), jnp.float32), gpu)

    out = cupyconv.causal_conv1d_fn(x, weight, bias, activation="silu")
    assert isinstance(out, jax.Array) and out.dtype == jnp.float16
    print(f"out: {out.shape} {out.dtype} on {out.devices()}")

    want = reference.causal_conv1d_fn(
        np.asarray(x), np.asarray(weight), np.asarray(bias), activation="silu"
    )
    assert_close(out, want)
    print("ok")
