"""The lean host path's signature (cupyconv/_fast.py): what a later call must share with an
earlier one to reuse its launches, read from torch tensors' attributes and torch's layout
check. Runs on the CPU: the signature reads only layouts and addresses.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from cupyconv import _fast  # noqa: E402

Torch = _fast.Torch


@pytest.fixture(autouse=True)
def fresh_calls(monkeypatch):
    monkeypatch.setattr(_fast, "_calls", {})


def sig(*arrays, others=("op", "silu"), written=()):
    return _fast.signature(Torch, arrays, *others, written=written)


def stored(signature):
    """A FastCall left under ``signature``."""
    fast = _fast.FastCall(Torch, 0, None, ())
    _fast.store(signature, fast)
    return fast


def test_torch_has_its_layout_check():
    """Without it torch tensors would always take the full path (about 3 us more a call)."""
    a = torch.zeros(2, 8)
    assert Torch.layout_check((a,)).check(a)


def test_addresses_and_tensors_come_with_the_key():
    a, b = torch.zeros(2, 8, 16), torch.zeros(8, 4)
    key, ptrs, tensors = sig(a, b, None)
    assert ptrs == [a.data_ptr(), b.data_ptr(), 0]
    assert key[0] is Torch and key[1:3] == ("op", "silu")
    assert tensors == (a, b)


def test_same_layout_finds_the_call():
    """Other tensors of the same shapes, strides, dtypes and address bits find the call."""
    a, b = torch.zeros(2, 8, 16), torch.zeros(8, 4)
    c, d = torch.ones(2, 8, 16), torch.ones(8, 4)
    assert (a.data_ptr() - c.data_ptr()) % 16 == 0 and (b.data_ptr() - d.data_ptr()) % 16 == 0
    fast = stored(sig(a, b))
    assert _fast.lookup(sig(c, d)) is fast


def _inference_zeros(*shape):
    with torch.inference_mode():
        return torch.zeros(*shape)


@pytest.mark.parametrize(
    "other",
    [
        lambda a: torch.zeros(2, 8, 17)[..., :16],  # strides
        lambda a: torch.zeros(2, 16, 8).transpose(1, 2),  # memory order
        lambda a: torch.zeros(2, 8, 15),  # shape
        lambda a: torch.zeros(2, 8, 16, dtype=torch.float64),  # dtype
        lambda a: torch._neg_view(a),  # a negated view of the same memory
        lambda a: torch.zeros(2 * 8 * 16 + 1)[1:].view(2, 8, 16),  # address bits (4 bytes on)
        lambda a: torch.zeros(2, 8, 16, requires_grad=True),  # requires_grad
        lambda a: torch.nn.Parameter(torch.zeros(2, 8, 16)),  # type
        lambda a: _inference_zeros(2, 8, 16),  # an inference tensor
    ],
    ids=["strides", "order", "shape", "dtype", "negated", "address", "grad", "type", "inference"],
)
@pytest.mark.parametrize("position", [0, 1])
def test_layout_changes_miss_the_call(other, position):
    """Any difference in either tensor's layout: no FastCall (x's shape is in the key, the
    other tensors' layouts are checked by the candidates)."""
    a, w = torch.zeros(2, 8, 16), torch.zeros(2, 8, 16)
    stored(sig(a, w))
    arrays = [a, w]
    arrays[position] = other(arrays[position])
    assert _fast.lookup(sig(*arrays)) is None


def test_absent_arrays_and_other_arguments_are_part_of_the_key():
    a, b = torch.zeros(2, 8, 16), torch.zeros(8, 4)
    stored(sig(a, b, None))
    assert _fast.lookup(sig(a, None, b)) is None
    assert _fast.lookup(sig(a, b)) is None
    assert _fast.lookup(sig(a, b, None, others=("op", None))) is None
    assert _fast.lookup(sig(a, b, None)) is not None


def test_written_buffers_must_not_be_inference_tensors_unless_the_call_was_made_for_one():
    """Inside inference mode the layout check does not tell inference tensors apart: whether a
    written buffer is one is part of the key."""
    a, state = torch.zeros(2, 8, 3), torch.zeros(2, 8, 3)
    with torch.inference_mode():
        stored(sig(a, state, written=(state,)))
    inference_state = _inference_zeros(2, 8, 3)
    assert _fast.lookup(sig(a, inference_state, written=(inference_state,))) is None
    with torch.inference_mode():
        assert _fast.lookup(sig(a, state, written=(state,))) is not None
    key = sig(a, inference_state, written=(inference_state,))[0]
    assert key[-1] is True and sig(a, state, written=(state,))[0][-1] is False


def test_candidates_under_one_key_newest_first_and_bounded():
    """Calls with the same x and other layouts of the other tensors each find their own
    FastCall; a key keeps the newest TORCH_CANDIDATES."""
    x = torch.zeros(2, 8, 16)
    ws = [torch.zeros(8, 4 + i) for i in range(_fast.TORCH_CANDIDATES + 1)]
    made = [stored(sig(x, w)) for w in ws]
    for w, fast in list(zip(ws, made))[1:]:
        assert _fast.lookup(sig(x, w)) is fast
    assert _fast.lookup(sig(x, ws[0])) is None  # the oldest, dropped
    assert len(_fast._calls[sig(x, ws[0])[0]]) == _fast.TORCH_CANDIDATES


def test_without_torch_layout_checks_torch_calls_leave_nothing(monkeypatch):
    monkeypatch.setattr(_fast, "_guards", False)
    a = torch.zeros(2, 8, 16)
    stored(sig(a))
    assert _fast.lookup(sig(a)) is None and _fast._calls == {}


def test_unreadable_arrays_take_the_full_path():
    import numpy as np

    assert sig(np.zeros(3)) is None


class Recorder:
    """A Replay that records the addresses it is run with."""

    def __init__(self):
        self.runs = []

    def run(self, pointers, stream):
        self.runs.append(list(pointers))


def test_run_torch_is_signature_then_run():
    """``run_torch`` finds what the full path left under ``signature``: the outputs allocated
    (LIKE: x's layout; a spec: its shape, strides and dtype; None), the launch with the inputs'
    addresses then the outputs' (0 for absent ones); a layout the candidates do not check true,
    or other arguments, miss; an unreadable tensor takes the full path."""
    x, w = torch.zeros(2, 8, 16).transpose(1, 2), torch.zeros(16, 4)
    spec = ((16, 5), (1, 16), torch.float32, x.device)
    fast = _fast.FastCall(Torch, 0, Recorder(), (_fast.LIKE, None, spec))
    fast.stream = lambda device: 7
    _fast.store(sig(x, None, w, others=("bwd", "silu", False)), fast)
    made = _fast.run_torch((x, None, w), ("bwd", "silu", False), x)
    assert made[1] is None and made[0].stride() == x.stride() and made[0].shape == x.shape
    assert made[2].shape == (16, 5) and made[2].stride() == (1, 16)
    assert fast.replay.runs == [
        [x.data_ptr(), 0, w.data_ptr(), made[0].data_ptr(), 0, made[2].data_ptr()]
    ]
    assert _fast.run_torch((x, None, w), ("bwd", None, False), x) is None
    assert _fast.run_torch((x, None, w.t().contiguous().t()), ("bwd", "silu", False), x) is None
    assert _fast.run_torch((x, w, None), ("bwd", "silu", False), x) is None
    assert _fast.run_torch((x, None, torch.zeros(3).to_sparse()), ("bwd", "silu", False), x) is None
    assert len(fast.replay.runs) == 1


def test_framework_by_type():
    assert _fast.framework(torch.zeros(1)) is Torch
    assert _fast.framework(torch.nn.Parameter(torch.zeros(1))) is Torch
    assert _fast.framework(torch.zeros(1)) is Torch  # (the type's entry, kept)
    assert _fast.framework([1.0]) is None


def update_sig(x, state, w, b=None, lens=None, idx=None, activation="silu"):
    from cupyconv import update

    return update._torch_signature(x, w, b, state, lens, idx, activation)


def update_args():
    return dict(
        x=torch.zeros(2, 8), state=torch.zeros(2, 8, 3), w=torch.zeros(8, 4), b=torch.zeros(8)
    )


def test_update_signature_addresses_and_same_layout():
    """The update's unrolled signature: the addresses in the kernel's order (x, weight, bias,
    conv_state, cache_seqlens, conv_state_indices); another set of tensors of the same layouts
    finds the call, at any addresses (the update's plan reads none:
    test_update_dispatch.py::test_the_plan_reads_no_address)."""
    a, b = update_args(), update_args()
    key, ptrs, _ = update_sig(**a)
    assert ptrs == [a["x"].data_ptr(), a["w"].data_ptr(), a["b"].data_ptr()] + [
        a["state"].data_ptr(), 0, 0,
    ]  # fmt: skip
    fast = stored(update_sig(**a))
    assert _fast.lookup(update_sig(**b)) is fast
    b["x"] = torch.zeros(2 * 8 + 1)[1:].view(2, 8)  # another 16-byte alignment
    assert _fast.lookup(update_sig(**b)) is fast


@pytest.mark.parametrize(
    "name, other",
    [
        ("x", lambda a: torch.zeros(2, 8, 1)),  # shape (a 3-D token)
        ("x", lambda a: torch.zeros(8, 2).t()),  # strides
        ("x", lambda a: torch.zeros(2, 8, dtype=torch.float16)),  # dtype
        ("w", lambda a: torch._neg_view(a)),  # a negated view
        ("w", lambda a: torch.zeros(8, 5)),  # width
        ("b", lambda a: None),  # absent
        ("b", lambda a: torch.zeros(16)[::2]),  # strides
        ("state", lambda a: torch.zeros(2, 3, 8).transpose(1, 2)),  # memory order
        ("state", lambda a: a.clone().requires_grad_()),  # may not be written in place
        ("state", lambda a: _inference_zeros(2, 8, 3)),  # nor this one outside inference mode
        ("lens", lambda a: torch.zeros(2, dtype=torch.int32)),  # circular mode
        ("idx", lambda a: torch.zeros(2, dtype=torch.int64)),  # a state pool
        ("activation", lambda a: None),
    ],
)
def test_update_signature_changes_with_each_argument(name, other):
    a = update_args()
    b = dict(a, **{name: other(a.get(name))})
    stored(update_sig(**a))
    assert _fast.lookup(update_sig(**b)) is None


def test_backward_lean_key_takes_buffers_for_every_result_or_none():
    """The backward's lean path takes a call with no output buffers, or with one for every
    result it makes (dbias with bias, dinitial_states when asked for with initial_states);
    its inputs then end with the buffers, None exactly where no result is made."""
    from cupyconv.backward import lean_key

    x, dout, dx = torch.zeros(2, 8, 16), torch.zeros(2, 8, 16), torch.zeros(2, 8, 16)
    w, b, init = torch.zeros(8, 4), torch.zeros(8), torch.zeros(2, 8, 3)
    dw, db, dinit = torch.zeros(8, 4), torch.zeros(8), torch.zeros(2, 8, 3)

    def key(bias, initial_states, want, *buffers):
        return lean_key(Torch, x, w, bias, dout, None, initial_states, None, buffers[0], want,
                        "silu", *buffers[1:])  # fmt: skip

    k, inputs = key(b, None, False, None, None, None, None)
    assert k is not None and len(inputs) == 7
    k, inputs = key(b, init, True, dx, dw, db, dinit)
    assert k is not None and inputs[7:] == (dx, dw, db, dinit)
    k, inputs = key(None, None, True, dx, dw, None, dinit)  # dinitial_states not made: ignored
    assert k is not None and inputs[7:] == (dx, dw, None, None)
    assert key(b, None, False, dx, dw, None, None) == (None, None)  # dbias missing
    assert key(None, None, False, dx, dw, db, None) == (None, None)  # dbias without bias
    assert key(b, init, True, dx, dw, db, None) == (None, None)  # dinitial_states missing
    assert key(b, None, False, dx, None, db, None) == (None, None)  # dweight missing


def test_guards_between_present_arrays_only():
    """A FastCall guards each written buffer against every array before it; pairs with an
    absent array (no span: absent under the same signature) are left out, and byte ranges that
    meet send the call the full way."""
    spans = ((0, 99), None, (0, 9), (0, 9))  # an input, an absent input, two written buffers
    fast = _fast.FastCall(Torch, 0, None, (), _fast.written_guards(1, 3), spans)
    assert [(w, o) for w, o, _, _ in fast.checks] == [(2, 0), (3, 0), (3, 2)]
    assert fast.clear([1000, 0, 2000, 3000])
    assert not fast.clear([1000, 0, 1050, 3000])  # buffer 2 inside the input
    assert not fast.clear([1000, 0, 2000, 2005])  # the two buffers meet


def test_one_tensor_for_two_arguments_takes_the_full_path():
    """The layout check is false for the same tensor twice: such calls always go the full
    way."""
    a, b = torch.zeros(2, 8, 16), torch.zeros(2, 8, 16)
    stored(sig(a, b))
    assert _fast.lookup(sig(a, a)) is None
    assert _fast.lookup(sig(b, a)) is not None


def test_a_kept_call_keeps_no_tensor_alive():
    """A FastCall's layout check holds layouts, not the tensors it was made for (a state pool
    or a layer's weights are freed when the caller drops them)."""
    import gc
    import weakref

    a = torch.zeros(64, 64)
    alive = weakref.ref(a)
    fast = stored(sig(a))
    del a
    gc.collect()
    assert alive() is None and fast.layout is not None
