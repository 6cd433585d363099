"""What the compat modules share: the activation check with 1.5.0's exception type, the
autograd test, and torch imported only when a torch tensor is already in hand."""

from __future__ import annotations

import contextlib
import sys

from ..reference import ACTIVATIONS


class ActivationError(ValueError, NotImplementedError):
    """An activation other than None, "silu" or "swish". causal-conv1d raises
    NotImplementedError here and cupyconv raises ValueError: this is both, so callers that
    catch either keep working."""


def check_activation(activation) -> bool:
    """True for SiLU ("silu", "swish"), False for None; ActivationError otherwise."""
    if not (activation is None or (isinstance(activation, str) and activation in ACTIVATIONS)):
        raise ActivationError(f"activation must be one of {ACTIVATIONS}; got {activation!r}")
    return activation is not None


def is_torch(a) -> bool:
    return type(a).__module__.startswith("torch")


def torch_module():
    """torch, which the caller's tensors have already imported."""
    return sys.modules["torch"] if "torch" in sys.modules else __import__("torch")


def records_grad(x, *others) -> bool:
    """Whether autograd records a call on torch tensor x (grad mode on, an input requires grad)."""
    if not is_torch(x) or not torch_module().is_grad_enabled():
        return False
    return any(getattr(t, "requires_grad", False) for t in (x, *others))


def no_grad(x):
    """torch.no_grad() for a torch tensor x (the extension's entries are not differentiable),
    else a context that does nothing."""
    return torch_module().no_grad() if is_torch(x) else contextlib.nullcontext()


def require_torch(a, name: str) -> None:
    if not is_torch(a):
        raise TypeError(f"{name} must be a torch tensor; got {type(a).__name__}")


def shape_of(a, name: str, expected: tuple, described: str) -> None:
    if tuple(a.shape) != tuple(expected):
        raise ValueError(
            f"{name} must have shape {described} = {tuple(expected)}; got {tuple(a.shape)}"
        )
