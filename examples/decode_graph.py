"""Serving: a pool of conv states, a decode batch with a padding row, and a CUDA graph.

Three prompts are prefilled and their final states copied into rows of a state pool. The
decode step (causal_conv1d_update on the pool rows named by conv_state_indices; -1 marks a
padding row: output 0, no state touched) is captured once in a CUDA graph over static buffers
and replayed for every token, after the token is copied into the static x. Checked: each step
against the float64 reference, the pool exactly, the outputs against whole-sequence forwards.

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

    n_slots, dim, width, prompt_len, new_tokens = 8, 256, 4, 32, 6
    bf16 = {"device": "cuda", "dtype": torch.bfloat16}
    torch.manual_seed(0)
    weight, bias = torch.randn(dim, width, **bf16), torch.randn(dim, **bf16)

    # Static buffers: the state pool, each batch row's pool row (-1: padding), one token a row.
    pool = torch.zeros(n_slots, dim, width - 1, **bf16)  # [n_slots, dim, width - 1]
    slots = torch.tensor([5, -1, 2, 7], device="cuda", dtype=torch.int32)
    x = torch.zeros(len(slots), dim, **bf16)  # [batch, dim]
    args = (x, pool, weight, bias, "silu", None, slots)

    # Compile, warm up on a side stream as torch's docs ask (x = 0 keeps the pool 0), capture.
    cupyconv.warmup(cupyconv.causal_conv1d_update, *args)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        cupyconv.causal_conv1d_update(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cupyconv.causal_conv1d_update(*args)  # a static output: [batch, dim]

    # Prefill three prompts (channel-last x) and keep their final states in the pool.
    prompts = torch.randn(3, prompt_len, dim, **bf16).transpose(1, 2)  # [3, dim, prompt_len]
    _, states = cupyconv.causal_conv1d_fn(
        prompts, weight, bias, activation="silu", return_final_states=True
    )
    pool[[5, 2, 7]] = states  # [3, dim, width - 1]: the pool rows of batch rows 0, 2, 3

    # Decode: write each token into the static x, replay, check against the reference.
    tokens = torch.randn(len(slots), dim, new_tokens, **bf16)  # batch row 1's are never read
    w64, b64, pool64, slots64 = to_numpy(weight), to_numpy(bias), to_numpy(pool), slots.tolist()
    outs = []
    for t in range(new_tokens):
        x.copy_(tokens[..., t])
        graph.replay()
        want, pool64 = reference.causal_conv1d_update(
            to_numpy(tokens[..., t]), pool64, w64, b64, "silu", conv_state_indices=slots64
        )
        assert_close(out, want, name=f"out of token {t}")
        outs.append(out.clone())
    assert (to_numpy(pool) == pool64).all()  # the states are copies of inputs: exact

    # The decoded outputs continue the prompts: one forward over prompt + new tokens.
    whole = torch.cat([prompts, tokens[[0, 2, 3]]], dim=2)  # [3, dim, prompt_len + new_tokens]
    want = reference.causal_conv1d_fn(to_numpy(whole), w64, b64, activation="silu")
    assert_close(torch.stack(outs, dim=2)[[0, 2, 3]], want[..., prompt_len:], name="decoded")
    print(f"decoded {new_tokens} tokens for 3 sequences and a padding row from a CUDA graph: ok")
