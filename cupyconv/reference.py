"""The float64 numpy reference for every cupyconv operator (the oracle the tests trust).

Pure numpy, written to read like the semantics (``docs/semantics.md``), not to be fast. Every
input may be any numpy array (float16, float32, float64 or ``ml_dtypes.bfloat16``); it is
converted once to float64 (index arrays to int64). Every output is a new float64 array; inputs
are never modified.

Notation (docs/semantics.md)::

    x:              [batch, dim, seqlen]
    weight:         [dim, width]          oldest tap first: weight[:, width-1] multiplies x[t]
    bias:           [dim]
    seq_idx:        [batch, seqlen]       segment id of each token; negative ids are padding
    initial_states: [batch, dim, width-1] the inputs at positions -(width-1) .. -1

With ``K = width``, the causal depthwise convolution is::

    out[b,c,t] = act( bias[c] + sum_{k=0}^{K-1} weight[c,k] * h(b, c, t, t-(K-1)+k) )

where ``h(b, c, t, s)`` is the input that the output at ``t`` may see at position ``s``:

- ``s >= 0``: ``x[b,c,s]``, but 0 when ``seq_idx[b,s] != seq_idx[b,t]``;
- ``s < 0``: ``initial_states[b,c,K-1+s]`` (0 without initial states), visible with seq_idx
  only when ``seq_idx[b,t] == seq_idx[b,0]`` (the initial state belongs to the first segment);
- padding (``seq_idx[b,t] < 0``): ``out[b,c,t] = 0`` and ``h(b, c, t, s) = 0`` for every ``s``;
  a padding position is never visible input, not even to another padding position.

Implementation: the history ``x`` is prefixed with the initial states, so that position ``s``
(``-(K-1) <= s < seqlen``) lives at index ``s + K-1`` of one ``[batch, dim, K-1+seqlen]`` array,
and every tap ``k`` is one shifted slice of it times a ``[batch, seqlen]`` visibility mask.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "ACTIVATIONS",
    "check_activation",
    "causal_conv1d_bwd",
    "causal_conv1d_fn",
    "causal_conv1d_update",
    "causal_conv1d_varlen_states",
    "silu",
]

#: The accepted activations: None (the identity), "silu", and "swish" (the same as SiLU).
ACTIVATIONS = (None, "silu", "swish")


def _f64(a) -> np.ndarray:
    """A float64 copy of ``a`` (``ml_dtypes.bfloat16`` converts through ``astype`` too)."""
    return np.asarray(a).astype(np.float64)


def _i64(a) -> np.ndarray:
    return np.asarray(a).astype(np.int64)


def check_activation(activation) -> bool:
    """True for SiLU ("silu", "swish"), False for the identity (None); ValueError otherwise."""
    if not (activation is None or (isinstance(activation, str) and activation in ACTIVATIONS)):
        raise ValueError(f"activation must be one of {ACTIVATIONS}; got {activation!r}")
    return activation is not None


def _sigmoid(z: np.ndarray) -> np.ndarray:
    """1 / (1 + exp(-z)), computed without overflow for large |z|."""
    e = np.exp(-np.abs(z))
    return np.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def silu(z) -> np.ndarray:
    """SiLU (swish): ``z * sigmoid(z)``, in float64."""
    z = _f64(z)
    return z * _sigmoid(z)


def _silu_grad(z: np.ndarray) -> np.ndarray:
    """d silu / dz = sigmoid(z) * (1 + z * (1 - sigmoid(z)))."""
    s = _sigmoid(z)
    return s * (1.0 + z * (1.0 - s))


def _select(values: np.ndarray, visible: np.ndarray | None) -> np.ndarray:
    """``values`` [batch, dim, n] where ``visible`` [batch, n] (None: everywhere), else 0.
    Masking selects rather than multiplies: a masked inf or NaN contributes nothing."""
    if visible is None:
        return values
    return np.where(visible[:, None, :], values, 0.0)


class _Conv:
    """The forward problem in the padded-history form, shared by forward and backward.

    ``history[b, c, (K-1) + s]`` holds position ``s`` for ``s = -(K-1) .. seqlen-1``
    (initial states or zeros, then x); ``tap_visible[k][b, t]`` says whether the output at ``t``
    sees ``history[b, c, t + k]`` (``None`` when everything is visible, i.e. without seq_idx);
    ``final_visible[b, j]`` the same for ``final_states[b, :, j]``, which is
    ``history[b, :, seqlen + j]`` seen from the last token ``t = seqlen-1``.
    """

    def __init__(self, x, weight, bias, seq_idx, initial_states):
        self.x = _f64(x)  # [batch, dim, seqlen]
        self.weight = _f64(weight)  # [dim, width]
        batch, dim, seqlen = self.x.shape
        width = self.weight.shape[1]
        self.shape = (batch, dim, seqlen, width)
        self.bias = np.zeros(dim) if bias is None else _f64(bias)
        if initial_states is None:
            initial = np.zeros((batch, dim, width - 1))
        else:
            initial = _f64(initial_states)
        self.history = np.concatenate([initial, self.x], axis=2)  # [batch, dim, K-1+seqlen]

        self.valid = None  # [batch, seqlen] bool: not padding
        self.tap_visible = [None] * width
        self.final_visible = None  # [batch, K-1]
        if seq_idx is None:
            return
        seq_idx = _i64(seq_idx)  # [batch, seqlen]
        self.valid = seq_idx >= 0
        if seqlen == 0:
            return  # no token to mask for
        # Segment id of every history position: the initial states belong to the first segment.
        first = np.repeat(seq_idx[:, :1], width - 1, axis=1)
        history_ids = np.concatenate([first, seq_idx], axis=1)  # [batch, K-1+seqlen]
        # h(t, s) is visible iff t is not padding and id(s) == id(t); s = t-(K-1)+k is at t+k.
        self.tap_visible = [
            self.valid & (history_ids[:, k : k + seqlen] == seq_idx) for k in range(width)
        ]
        last = seq_idx[:, -1:]  # [batch, 1]
        self.final_visible = (last >= 0) & (history_ids[:, seqlen:] == last)

    def tap(self, k: int) -> np.ndarray:
        """``h(b, c, t, t-(K-1)+k)`` for all b, c, t: ``[batch, dim, seqlen]``."""
        seqlen = self.shape[2]
        h = self.history[:, :, k : k + seqlen]
        return _select(h, self.tap_visible[k])

    def preactivation(self) -> np.ndarray:
        """``bias[c] + sum_k weight[c,k] * h(b, c, t, t-(K-1)+k)``: ``[batch, dim, seqlen]``."""
        width = self.shape[3]
        pre = np.broadcast_to(self.bias[None, :, None], self.x.shape).copy()
        for k in range(width):
            pre += self.weight[None, :, k, None] * self.tap(k)
        return pre

    def final_states(self) -> np.ndarray:
        """``final_states[b,c,j] = h(b, c, seqlen-1, seqlen-(K-1)+j)``: ``[batch, dim, K-1]``."""
        seqlen = self.shape[2]
        return _select(self.history[:, :, seqlen:], self.final_visible).copy()


def causal_conv1d_fn(
    x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
    activation=None,
):  # fmt: skip
    """Causal depthwise conv1d with optional packed sequences and carried states, in float64.

    ::

        x:              [batch, dim, seqlen]
        weight:         [dim, width]
        bias:           [dim] or None
        seq_idx:        [batch, seqlen] ints or None (negative = padding)
        initial_states: [batch, dim, width-1] or None
        returns out:    [batch, dim, seqlen]
                        (out, final_states [batch, dim, width-1]) when return_final_states

    ``out[b,c,t] = act(bias[c] + sum_k weight[c,k] * h(b, c, t, t-(width-1)+k))`` with ``h`` as
    in the module docstring, ``act`` the identity or SiLU (``"silu"``/``"swish"``), and
    ``out[b,c,t] = 0`` where ``seq_idx[b,t] < 0``. Without seq_idx and states this equals
    ``F.conv1d(x, weight.unsqueeze(1), bias, padding=width-1, groups=dim)[..., :seqlen]``.

    ``final_states[b,c,j] = h(b, c, seqlen-1, seqlen-(width-1)+j)`` for ``j = 0..width-2``: the
    last width-1 inputs of the row (reaching into ``initial_states``, or zeros, when
    ``seqlen < width-1``), masked to the segment of the last token when seq_idx is given; all
    zero when the last token is padding. It is the ``conv_state`` (state_len width-1) that
    :func:`causal_conv1d_update` continues from.
    """
    use_silu = check_activation(activation)
    conv = _Conv(x, weight, bias, seq_idx, initial_states)
    pre = conv.preactivation()
    out = silu(pre) if use_silu else pre
    out = _select(out, conv.valid)  # padding outputs are 0
    if return_final_states:
        return out, conv.final_states()
    return out


def causal_conv1d_bwd(
    x, weight, bias, dout, seq_idx=None, initial_states=None, dfinal_states=None, activation=None
):  # fmt: skip
    """Vector-Jacobian product of :func:`causal_conv1d_fn`, in float64.

    ::

        x, dout:         [batch, dim, seqlen]
        weight:          [dim, width]
        bias:            [dim] or None
        seq_idx:         [batch, seqlen] ints or None
        initial_states:  [batch, dim, width-1] or None
        dfinal_states:   [batch, dim, width-1] or None
        returns (dx [batch, dim, seqlen], dweight [dim, width],
                 dbias [dim] or None (when bias is None),
                 dinitial_states [batch, dim, width-1] or None (when initial_states is None))

    The gradient of ``sum(out * dout) + sum(final_states * dfinal_states)`` (the second term only
    when ``dfinal_states`` is given) with ``out, final_states = causal_conv1d_fn(...)``. With
    ``z`` the pre-activation and ``dz = dout * act'(z)`` (0 at padding positions; SiLU's
    derivative taken at z), K = width::

        dbias[c]      = sum_{b,t} dz[b,c,t]
        dweight[c,k]  = sum_{b,t} dz[b,c,t] * h(b, c, t, t-(K-1)+k)
        dh(s)[b,c]   += dz[b,c,t] * weight[c,k]   for each tap k with s = t-(K-1)+k visible
        dh(s)[b,c]   += dfinal_states[b,c,j]      for s = seqlen-(K-1)+j visible from seqlen-1

    and ``dx`` / ``dinitial_states`` are ``dh(s)`` for ``s >= 0`` / ``s < 0``.
    """
    use_silu = check_activation(activation)
    conv = _Conv(x, weight, bias, seq_idx, initial_states)
    _, dim, seqlen, width = conv.shape
    dout = _f64(dout)

    dz = dout * _silu_grad(conv.preactivation()) if use_silu else dout
    dz = _select(dz, conv.valid)

    dhistory = np.zeros_like(conv.history)  # [batch, dim, K-1+seqlen]
    dweight = np.zeros((dim, width))
    for k in range(width):
        # selected after the product, as dx's terms: a masked tap's term is not inf * 0 = NaN
        tap = _select(dz * conv.history[:, :, k : k + seqlen], conv.tap_visible[k])
        dweight[:, k] = tap.sum(axis=(0, 2))
        dtap = _select(dz * conv.weight[None, :, k, None], conv.tap_visible[k])
        dhistory[:, :, k : k + seqlen] += dtap
    if dfinal_states is not None:
        dfinal = _select(_f64(dfinal_states), conv.final_visible)
        dhistory[:, :, seqlen:] += dfinal

    dx = dhistory[:, :, width - 1 :].copy()
    dbias = None if bias is None else dz.sum(axis=(0, 2))
    dinitial_states = None if initial_states is None else dhistory[:, :, : width - 1].copy()
    return dx, dweight, dbias, dinitial_states


def causal_conv1d_update(
    x, conv_state, weight, bias=None, activation=None, cache_seqlens=None, conv_state_indices=None
):  # fmt: skip
    """One decode step (or a few tokens) against a rolling state, in float64; no in-place write.

    ::

        x:                  [batch, dim] (one token) or [batch, dim, seqlen] (seqlen new tokens)
        conv_state:         [N, dim, state_len], state_len >= width-1
        weight:             [dim, width]
        bias:               [dim] or None
        cache_seqlens:      [batch] ints or None (circular mode: tokens already written)
        conv_state_indices: [batch] ints or None (row b uses conv_state[conv_state_indices[b]];
                            negative = padding row); without it N == batch and row b uses b
        returns (out with x's shape, new_conv_state [N, dim, state_len])

    For each batch row the K-1 = width-1 inputs before token 0 (the *history*) are read from
    its state row before anything is written:

    - sliding mode: ``history = state[:, state_len-(K-1):]`` (oldest first); afterwards the
      state row is the last state_len entries of ``concat(state, x_row)`` along time;
    - circular mode: with ``p = cache_seqlens[b] mod state_len``, ``history[:, j] =
      state[:, (p-(K-1)+j) mod state_len]``; token i is then written at ``(p+i) mod state_len``
      (in order, so with seqlen > state_len later tokens overwrite earlier ones).

    ``out = causal_conv1d_fn(x, weight, bias, initial_states=history, activation=activation)``.
    Padding rows (negative conv_state_indices) give ``out = 0`` and touch no state row.
    ``new_conv_state`` is a float64 copy of ``conv_state`` with the used rows updated. (Two
    batch rows pointing at the same state row is the caller's error; here the later one wins.)
    """
    check_activation(activation)
    x = _f64(x)
    one_token = x.ndim == 2
    if one_token:
        x = x[:, :, None]  # [batch, dim, 1]
    state = _f64(conv_state)  # read from here, write into new_state
    new_state = state.copy()
    weight = _f64(weight)
    batch, dim, seqlen = x.shape
    width = weight.shape[1]
    state_len = state.shape[2]

    rows = np.arange(batch) if conv_state_indices is None else _i64(conv_state_indices)
    if cache_seqlens is not None:
        cache_seqlens = _i64(cache_seqlens)

    history = np.zeros((batch, dim, width - 1))
    for b in range(batch):
        row = rows[b]
        if row < 0:
            continue  # padding row: out stays 0, no state read or written
        if cache_seqlens is None:  # sliding
            history[b] = state[row][:, state_len - (width - 1) :]
            both = np.concatenate([state[row], x[b]], axis=1)  # [dim, state_len + seqlen]
            new_state[row] = both[:, both.shape[1] - state_len :]
        elif state_len > 0:  # circular
            p = cache_seqlens[b] % state_len
            read_at = (p - (width - 1) + np.arange(width - 1)) % state_len
            history[b] = state[row][:, read_at]
            for i in range(seqlen):
                new_state[row][:, (p + i) % state_len] = x[b, :, i]

    out = causal_conv1d_fn(x, weight, bias, initial_states=history, activation=activation)
    out[rows < 0] = 0.0
    if one_token:
        out = out[:, :, 0]
    return out, new_state


def causal_conv1d_varlen_states(x, cu_seqlens, state_len):
    """The final state of every packed sequence, in float64.

    ::

        x:          [T, dim]      all sequences concatenated along time
        cu_seqlens: [N+1] ints    sorted, cu_seqlens[0] = 0; sequence n is x[cu[n]:cu[n+1]]
        returns     [N, dim, state_len]

    ``states[n]`` holds the last ``m = min(len_n, state_len)`` tokens of sequence n,
    right-aligned, with zeros before them::

        states[n, :, state_len-m+i] = x[cu[n+1]-m+i, :]   for i = 0..m-1
    """
    x = _f64(x)
    cu_seqlens = _i64(cu_seqlens)
    count = len(cu_seqlens) - 1
    dim = x.shape[1]
    states = np.zeros((count, dim, state_len))
    for n in range(count):
        start, end = cu_seqlens[n], cu_seqlens[n + 1]
        m = min(end - start, state_len)
        states[n, :, state_len - m :] = x[end - m : end, :].T
    return states
