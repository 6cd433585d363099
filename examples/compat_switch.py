"""Code written for causal-conv1d, run on cupyconv: ``cupyconv.compat.install()`` makes
``import causal_conv1d`` resolve to cupyconv.compat (where causal-conv1d is not installed), and
the script below it is unchanged causal-conv1d code: a prefill that keeps the conv state, then
token-by-token decoding that updates it in place.

Runs on CPU torch tensors (cupyconv's float64 reference path), and again on CUDA tensors where
torch sees a GPU and CuPy is installed. Without torch it says why and exits 0.
"""

import importlib.util
import sys

import cupyconv.compat
from cupyconv import reference
from cupyconv.testing import assert_close, to_numpy


def prefill_and_decode(device, batch=2, dim=64, prompt_len=32, new_tokens=8, width=4):
    # ---- causal-conv1d code, as written for the reference library ----
    import torch
    from causal_conv1d import causal_conv1d_fn, causal_conv1d_update

    torch.manual_seed(0)
    xs = torch.randn(batch, prompt_len + new_tokens, dim, device=device)  # [batch, seqlen, dim]
    x = xs.transpose(1, 2)  # [batch, dim, seqlen], channel-last
    weight = torch.randn(dim, width, device=device)
    bias = torch.randn(dim, device=device)

    out, conv_state = causal_conv1d_fn(
        x[..., :prompt_len], weight, bias, return_final_states=True, activation="silu"
    )
    decoded = [
        causal_conv1d_update(x[..., t], conv_state, weight, bias, activation="silu")
        for t in range(prompt_len, prompt_len + new_tokens)
    ]
    return x, weight, bias, torch.cat([out, torch.stack(decoded, dim=-1)], dim=-1), conv_state


def check(device):
    x, weight, bias, out, conv_state = prefill_and_decode(device)
    want = reference.causal_conv1d_fn(
        to_numpy(x), to_numpy(weight), to_numpy(bias), activation="silu"
    )
    assert_close(out, want)
    kept = conv_state.shape[-1]  # width - 1: the state holds the last width - 1 inputs
    assert (to_numpy(conv_state) == to_numpy(x[..., -kept:])).all()
    print(f"{device}: prefill + decode through causal_conv1d match cupyconv.reference: ok")


if __name__ == "__main__":
    if importlib.util.find_spec("torch") is None:
        print("skipped: torch is not installed")
        sys.exit(0)
    import torch

    if not cupyconv.compat.install():  # the real causal-conv1d is installed: left alone
        print("skipped: causal-conv1d is installed, so causal_conv1d is not switched over")
        sys.exit(0)
    check("cpu")
    if torch.cuda.is_available() and importlib.util.find_spec("cupy"):
        check("cuda")
