"""Training through cupyconv.jax: fit the filter and bias of a causal depthwise conv (with SiLU)
to a teacher's outputs by gradient descent, each step one ``jax.jit``-compiled
``jax.value_and_grad``.

Runs on JAX's default device: on a GPU, cupyconv's CUDA kernels on XLA's stream (needs CuPy);
on the CPU, the float64 reference through a host callback. Without JAX it says why and exits 0.
"""

import importlib.util
import sys

if __name__ == "__main__":
    try:
        import jax
    except ImportError:
        print("skipped: JAX is not installed")
        sys.exit(0)
    if jax.default_backend() == "gpu" and importlib.util.find_spec("cupy") is None:
        print("skipped: JAX runs on a GPU, and CuPy (which compiles cupyconv's kernels) is missing")
        sys.exit(0)

    import jax.numpy as jnp
    import numpy as np

    import cupyconv.jax as cj
    from cupyconv import reference
    from cupyconv.testing import assert_close

    batch, dim, seqlen, width = 4, 32, 256, 4
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((batch, dim, seqlen)), jnp.float32)  # [batch, dim, seqlen]
    teacher = {
        "weight": jnp.asarray(rng.standard_normal((dim, width)) / 2, jnp.float32),  # [dim, width]
        "bias": jnp.asarray(rng.standard_normal(dim) / 2, jnp.float32),  # [dim]
    }
    target = cj.causal_conv1d_fn(x, teacher["weight"], teacher["bias"], activation="silu")

    def loss_fn(params):
        out = cj.causal_conv1d_fn(x, params["weight"], params["bias"], activation="silu")
        return jnp.mean((out - target) ** 2)

    @jax.jit
    def step(params, lr):
        loss, grads = jax.value_and_grad(loss_fn)(params)
        return jax.tree.map(lambda p, g: p - lr * g, params, grads), loss, grads

    params = {"weight": jnp.zeros((dim, width)), "bias": jnp.zeros(dim)}
    first_params = params
    for i in range(300):
        params, loss, grads = step(params, 10.0)
        if i == 0:
            first_loss, first_grads = loss, grads
        if i % 100 == 0:
            print(f"step {i:3d}: loss {float(loss):.3e} on {jax.default_backend()}")
    print(f"final loss {float(loss):.3e} (first {float(first_loss):.3e})")
    assert loss < 1e-3 * first_loss

    # The first step's gradients against the float64 oracle: d mean((out - target)^2) / d out
    # = 2 (out - target) / out.size, through causal_conv1d_bwd.
    x64, w64, b64 = (np.asarray(a, np.float64) for a in (x, *first_params.values()))
    out64 = reference.causal_conv1d_fn(x64, w64, b64, activation="silu")
    dout = 2 * (out64 - np.asarray(target, np.float64)) / out64.size
    _, dweight, dbias, _ = reference.causal_conv1d_bwd(x64, w64, b64, dout, activation="silu")
    assert_close(first_grads["weight"], dweight, rtol=1e-3, atol=1e-6, name="dweight")
    assert_close(first_grads["bias"], dbias, rtol=1e-3, atol=1e-6, name="dbias")
    assert_close(params["weight"], teacher["weight"], rtol=0, atol=1e-2, name="weight")
    print("ok")
