"""Training a small Mamba-style block whose short convolution is cupyconv.causal_conv1d_fn:
u [batch, seqlen, d_model] -> in_proj -> x, z -> SiLU(causal conv of x) * SiLU(z) -> out_proj.

The conv reads x where in_proj wrote it: a channel slice of the projection viewed as
[batch, dim, seqlen] (channel-last), no copy. The first AdamW step is checked against the
float64 reference (the conv's output, and its weight/bias gradients for the upstream gradient
caught by a hook); a few more steps must lower the loss. Runs on CUDA where torch sees a GPU
(bfloat16 autocast, float32 parameters; needs CuPy), else on CPU tensors in float32 (cupyconv's
reference path, with autograd). Without torch it says why and exits 0.
"""

import importlib.util
import math
import sys

if __name__ == "__main__":
    if importlib.util.find_spec("torch") is None:
        print("skipped: torch is not installed")
        sys.exit(0)
    import torch
    import torch.nn.functional as F

    import cupyconv
    from cupyconv import reference
    from cupyconv.testing import GRAD_TOLERANCE, assert_close, to_numpy

    class MambaBlock(torch.nn.Module):
        def __init__(self, d_model, dim, width):
            super().__init__()
            self.in_proj = torch.nn.Linear(d_model, 2 * dim)
            self.conv_weight = torch.nn.Parameter(torch.randn(dim, width) / math.sqrt(width))
            self.conv_bias = torch.nn.Parameter(torch.zeros(dim))
            self.out_proj = torch.nn.Linear(dim, d_model)

        def forward(self, u):  # u: [batch, seqlen, d_model]
            x, z = self.in_proj(u).chunk(2, dim=-1)  # two [batch, seqlen, dim] views
            self.conv_in = x.transpose(1, 2)  # [batch, dim, seqlen], channel-last
            self.conv_out = cupyconv.causal_conv1d_fn(
                self.conv_in, self.conv_weight, self.conv_bias, activation="silu"
            )
            return self.out_proj(self.conv_out.transpose(1, 2) * F.silu(z))  # the gate

    gpu = torch.cuda.is_available() and importlib.util.find_spec("cupy") is not None
    device = "cuda" if gpu else "cpu"
    batch, seqlen, d_model, dim, width = 2, 64, 32, 64, 4
    torch.manual_seed(0)
    block = MambaBlock(d_model, dim, width).to(device)
    optimizer = torch.optim.AdamW(block.parameters(), lr=2e-2)
    u = torch.randn(batch, seqlen, d_model, device=device)
    target = F.pad(u[:, :-1], (0, 0, 1, 0))  # the task: output the previous token

    def step(douts=None):
        optimizer.zero_grad()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=gpu):
            y = block(u)
        if douts is not None:
            block.conv_out.register_hook(douts.append)  # catches d loss / d conv_out
        loss = F.mse_loss(y.float(), target)
        loss.backward()
        return loss.item()

    douts = []
    losses = [step(douts)]
    # The conv against the float64 oracle, on the same inputs, before the weights move.
    x64, w64, b64 = (to_numpy(a) for a in (block.conv_in, block.conv_weight, block.conv_bias))
    assert_close(block.conv_out, reference.causal_conv1d_fn(x64, w64, b64, activation="silu"))
    dout = to_numpy(douts[0])
    _, dweight, dbias, _ = reference.causal_conv1d_bwd(x64, w64, b64, dout, activation="silu")
    rtol, atol = GRAD_TOLERANCE  # atol: for |dout| ~ 1, times sqrt(terms summed)
    atol *= math.sqrt(batch * seqlen) * abs(dout).max()
    assert_close(block.conv_weight.grad, dweight, rtol=rtol, atol=atol, name="dweight")
    assert_close(block.conv_bias.grad, dbias, rtol=rtol, atol=atol, name="dbias")
    optimizer.step()

    for _ in range(9):
        losses.append(step())
        optimizer.step()
    print(f"{device}, conv in {block.conv_out.dtype}: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    assert losses[-1] < 0.8 * losses[0]
    print("ok")
