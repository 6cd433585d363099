"""causal_conv1d_fn on CUDA torch tensors: a channel-last bfloat16 activation (the layout of a
[batch, seqlen, dim] projection), float32 weight, and the final states for a decoder.

Needs a CUDA GPU, torch with CUDA and CuPy; without them it says why and exits 0.
"""

import importlib.util
import sys

if __name__ == "__main__":
    try:
        import torch
    except ImportError:
        print("skipped: torch is not installed")
        sys.exit(0)
    if not torch.cuda.is_available():
        print("skipped: torch sees no CUDA GPU")
        sys.exit(0)
    if importlib.util.find_spec("cupy") is None:
        print("skipped: CuPy (which compiles cupyconv's kernels) is not installed")
        sys.exit(0)

    import cupyconv
    from cupyconv import reference
    from cupyconv.testing import assert_close, to_numpy

    batch, dim, seqlen, width = 2, 256, 1024, 4
    torch.manual_seed(0)
    x = torch.randn(batch, seqlen, dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    weight = torch.randn(dim, width, device="cuda")
    bias = torch.randn(dim, device="cuda")

    out, final_states = cupyconv.causal_conv1d_fn(
        x, weight, bias, activation="silu", return_final_states=True
    )
    torch.cuda.synchronize()
    print(f"out: {tuple(out.shape)} {out.dtype}, strides {out.stride()} (x: {x.stride()})")
    assert out.stride() == x.stride()  # channel-last in, channel-last out

    want, want_final = reference.causal_conv1d_fn(
        to_numpy(x),
        to_numpy(weight),
        to_numpy(bias),
        activation="silu",
        return_final_states=True,
    )
    assert_close(out, want)
    assert_close(final_states, want_final, name="final_states")
    print("ok")
