"""Decoding: prefill a prompt, then feed one token at a time through causal_conv1d_update.

The prefill returns ``final_states`` ([batch, dim, width - 1]: the last width - 1 inputs of each
row), which is exactly the ``conv_state`` that ``causal_conv1d_update`` continues from; the
update writes the new token into that state in place. The decoded outputs equal one forward
over the whole sequence. CPU numpy arrays, so this runs anywhere.
"""

import numpy as np

import cupyconv
from cupyconv import reference
from cupyconv.testing import assert_close

if __name__ == "__main__":
    batch, dim, prompt_len, new_tokens, width = 2, 32, 16, 8, 4
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, dim, prompt_len + new_tokens)).astype(np.float32)
    weight = rng.standard_normal((dim, width)).astype(np.float32)
    bias = rng.standard_normal(dim).astype(np.float32)

    # Prefill: the prompt in one call, keeping the state for the decoder.
    prompt_out, conv_state = cupyconv.causal_conv1d_fn(
        x[:, :, :prompt_len], weight, bias, activation="silu", return_final_states=True
    )

    # Decode: one token ([batch, dim]) per call; conv_state is updated in place.
    decoded = []
    for t in range(prompt_len, prompt_len + new_tokens):
        token_out = cupyconv.causal_conv1d_update(x[:, :, t], conv_state, weight, bias, "silu")
        decoded.append(token_out)  # [batch, dim]
    out = np.concatenate([prompt_out, np.stack(decoded, axis=2)], axis=2)

    want = reference.causal_conv1d_fn(x, weight, bias, activation="silu")
    assert_close(out, want)
    # The state now holds the last width - 1 inputs.
    np.testing.assert_array_equal(conv_state, x[:, :, -(width - 1) :])
    print(f"decoded {new_tokens} tokens after a {prompt_len}-token prompt: ok")
