"""The lean host path's signature (cupyconv/_fast.py): what a later call must share with an
earlier one to reuse its launches, read from torch tensors' attributes. Runs on the CPU: the
signature reads only layouts and addresses.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from cupyconv import _fast  # noqa: E402

Torch = _fast.Torch


def sig(*arrays, others=("op", "silu"), written=(), known=None):
    return _fast.signature(Torch, arrays, *others, written=written, known=known)


def test_addresses_come_with_the_key():
    a, b = torch.zeros(2, 8, 16), torch.zeros(8, 4)
    key, ptrs = sig(a, b, None)
    assert ptrs == [a.data_ptr(), b.data_ptr(), 0]
    assert key[0] is Torch and key[1:3] == ("op", "silu")


def test_same_layout_same_key():
    """Other tensors of the same shapes, strides, dtypes and address bits share the key."""
    a, b = torch.zeros(2, 8, 16), torch.zeros(8, 4)
    c, d = torch.ones(2, 8, 16), torch.ones(8, 4)
    assert (a.data_ptr() - c.data_ptr()) % 16 == 0 and (b.data_ptr() - d.data_ptr()) % 16 == 0
    assert sig(a, b)[0] == sig(c, d)[0]


@pytest.mark.parametrize(
    "other",
    [
        lambda a: torch.zeros(2, 8, 17)[..., :16],  # strides
        lambda a: torch.zeros(2, 16, 8).transpose(1, 2),  # memory order
        lambda a: torch.zeros(2, 8, 15),  # shape
        lambda a: torch.zeros(2, 8, 16, dtype=torch.float64),  # dtype
        lambda a: torch._neg_view(a),  # a negated view of the same memory
        lambda a: torch.zeros(2 * 8 * 16 + 1)[1:].view(2, 8, 16),  # address bits (4 bytes on)
    ],
    ids=["strides", "order", "shape", "dtype", "negated", "address"],
)
def test_layout_changes_change_the_key(other):
    a = torch.zeros(2, 8, 16)
    assert sig(a)[0] != sig(other(a))[0]


def test_absent_arrays_and_other_arguments_are_part_of_the_key():
    a, b = torch.zeros(2, 8, 16), torch.zeros(8, 4)
    assert sig(a, b, None)[0] != sig(a, None, b)[0]
    assert sig(a, b)[0] != sig(a, b, others=("op", None))[0]


def test_written_buffers_add_what_decides_whether_they_may_be_written():
    a, state = torch.zeros(2, 8, 16), torch.zeros(2, 8, 3)
    grad_state = torch.zeros(2, 8, 3).requires_grad_()
    with torch.inference_mode():
        inference_state = torch.zeros(2, 8, 3)
    assert sig(a, state, written=(state,))[0][-2:] == (False, False)
    assert sig(a, grad_state, written=(grad_state,))[0][-2:] == (True, False)
    assert sig(a, inference_state, written=(inference_state,))[0][-2:] == (False, True)
    assert len(sig(a, state)[0]) == len(sig(a, state, written=(state,))[0]) - 2


def test_known_layouts_give_the_full_key_and_fresh_addresses():
    """An autograd backward reuses the layouts its forward read; the addresses are read again
    (a saved tensor's storage can have been replaced)."""
    x, w, g = torch.zeros(2, 8, 16), torch.zeros(8, 4), torch.zeros(2, 8, 16)
    known = _fast.known_of(sig(x, w, None), 2, 3)
    assert sig(x, w, None, g, known=known) == sig(x, w, None, g)
    old = x.data_ptr()
    x.set_(torch.ones(2, 8, 16).untyped_storage(), 0, (2, 8, 16), (128, 16, 1))
    key, ptrs = sig(x, w, None, g, known=known)
    assert ptrs[0] == x.data_ptr() != old


def test_unreadable_arrays_take_the_full_path():
    import numpy as np

    assert sig(np.zeros(3)) is None
    assert _fast.known_of(sig(np.zeros(3)), 2, 1) is None


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
    conv_state, cache_seqlens, conv_state_indices), one key for another set of tensors of the
    same layouts and address bits."""
    a, b = update_args(), update_args()
    key, ptrs = update_sig(**a)
    assert ptrs == [a["x"].data_ptr(), a["w"].data_ptr(), a["b"].data_ptr()] + [
        a["state"].data_ptr(), 0, 0,
    ]  # fmt: skip
    assert all((p - q) % 16 == 0 for p, q in zip(ptrs, update_sig(**b)[1]))
    assert key == update_sig(**b)[0]


@pytest.mark.parametrize(
    "name, other",
    [
        ("x", lambda a: torch.zeros(2, 8, 1)),  # shape (a 3-D token)
        ("x", lambda a: torch.zeros(8, 2).t()),  # strides
        ("x", lambda a: torch.zeros(2, 8, dtype=torch.float16)),  # dtype
        ("x", lambda a: torch.zeros(2 * 8 + 1)[1:].view(2, 8)),  # address bits
        ("w", lambda a: torch._neg_view(a)),  # a negated view
        ("w", lambda a: torch.zeros(8, 5)),  # width
        ("b", lambda a: None),  # absent
        ("b", lambda a: torch.zeros(16)[::2]),  # strides
        ("state", lambda a: torch.zeros(2, 3, 8).transpose(1, 2)),  # memory order
        ("state", lambda a: a.clone().requires_grad_()),  # may not be written in place
        ("lens", lambda a: torch.zeros(2, dtype=torch.int32)),  # circular mode
        ("idx", lambda a: torch.zeros(2, dtype=torch.int64)),  # a state pool
        ("activation", lambda a: None),
    ],
)
def test_update_signature_changes_with_each_argument(name, other):
    a = update_args()
    b = dict(a, **{name: other(a.get(name))})
    assert update_sig(**a)[0] != update_sig(**b)[0]


def test_update_signature_of_unreadable_arguments_is_none():
    import numpy as np

    a = update_args()
    assert update_sig(**dict(a, w=np.zeros((8, 4)))) is None


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
