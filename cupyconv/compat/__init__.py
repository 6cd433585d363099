"""cupyconv.compat: a drop-in for causal-conv1d 1.5.0 (the ``causal_conv1d`` package and its
``causal_conv1d_cuda`` extension), computed by cupyconv.

    from cupyconv.compat import causal_conv1d_fn, causal_conv1d_update
    # or, for code written against causal-conv1d (mamba_ssm, ...):
    import cupyconv.compat
    cupyconv.compat.install()     # where causal-conv1d is not installed
    from causal_conv1d import causal_conv1d_fn

The public API of 1.5.0 with its argument names, defaults, return structures, output layouts
(final_states and dinitial_states laid out [batch, width - 1, dim], viewed as
[batch, dim, width - 1]) and in-place writes:

- ``causal_conv1d_fn``, ``CausalConv1dFn``, ``causal_conv1d_update``, ``causal_conv1d_ref``,
  ``causal_conv1d_update_ref`` (``causal_conv1d.causal_conv1d_interface``);
- ``causal_conv1d_varlen_states``, ``causal_conv1d_varlen_states_ref``
  (``causal_conv1d.causal_conv1d_varlen``);
- the module objects ``causal_conv1d``, ``causal_conv1d_interface``, ``causal_conv1d_varlen``
  and ``causal_conv1d_cuda`` (``causal_conv1d_fwd``, ``causal_conv1d_bwd``,
  ``causal_conv1d_update`` with the C++ signatures);
- ``install()``: ``import causal_conv1d`` (and its submodules, and ``causal_conv1d_cuda``)
  resolve to these modules when the real package is absent.

Restrictions of 1.5.0 that compat lifts (it accepts what 1.5.0 refuses; docs/compat.md):

- width 2..4 only: any width from 1 to 256;
- float32/float16/bfloat16 only: float64 too; bias, conv_state in any float dtype (1.5.0: the
  dtype of weight, the dtype of x);
- seq_idx, initial_states, final_states, dfinal_states and dinitial_states only on channel-last
  x: every memory layout;
- seq_idx with initial_states or return_final_states (an assert in 1.5.0): every combination;
- channel-last x with dim % 8 == 0 and strides % 8 == 0, other strides copied: any strides,
  never a copy;
- int32 seq_idx, cache_seqlens and conv_state_indices, contiguous: int32 or int64, any strides;
- negative conv_state_indices (out-of-bounds in 1.5.0): padding rows, output 0, no state
  touched; negative seq_idx: padding tokens, output 0, seen by no other token;
- ``causal_conv1d_cuda.causal_conv1d_update`` with 3-D x only: 2-D x too;
- final_states_out under autograd: a differentiable copy (the tensor joins the graph);
- dweight/dbias by floating-point atomics: bitwise the same from run to run;
- 32-bit offsets, dim < 65536: 64-bit offsets, any size;
- CUDA torch tensors only: CPU torch tensors too (through cupyconv's float64 reference), and
  for ``causal_conv1d_fn``/``causal_conv1d_update``/``causal_conv1d_varlen_states`` numpy,
  CuPy and JAX arrays (results in the framework of x);
- the varlen functions need triton, and the ref fails on an empty sequence: no triton, zeros.

Errors: a refused input raises ValueError or TypeError naming the argument (1.5.0: assert or
RuntimeError from TORCH_CHECK); a bad activation raises ``ActivationError``, both ValueError and
NotImplementedError (1.5.0's type). compat imports torch only when a torch tensor arrives, and
``install()`` imports nothing.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

from . import causal_conv1d, causal_conv1d_cuda
from ._common import ActivationError
from .causal_conv1d import causal_conv1d_interface, causal_conv1d_varlen
from .causal_conv1d.causal_conv1d_interface import (
    CausalConv1dFn,
    causal_conv1d_fn,
    causal_conv1d_ref,
    causal_conv1d_update,
    causal_conv1d_update_ref,
)
from .causal_conv1d.causal_conv1d_varlen import (
    causal_conv1d_varlen_states,
    causal_conv1d_varlen_states_ref,
)

__all__ = [
    "ActivationError",
    "CausalConv1dFn",
    "CompatWarning",
    "MODULES",
    "causal_conv1d",
    "causal_conv1d_cuda",
    "causal_conv1d_fn",
    "causal_conv1d_interface",
    "causal_conv1d_ref",
    "causal_conv1d_update",
    "causal_conv1d_update_ref",
    "causal_conv1d_varlen",
    "causal_conv1d_varlen_states",
    "causal_conv1d_varlen_states_ref",
    "install",
]

#: The import names of causal-conv1d 1.5.0 and the cupyconv.compat modules they resolve to.
MODULES = {
    "causal_conv1d": causal_conv1d.__name__,
    "causal_conv1d.causal_conv1d_interface": causal_conv1d_interface.__name__,
    "causal_conv1d.causal_conv1d_varlen": causal_conv1d_varlen.__name__,
    "causal_conv1d_cuda": causal_conv1d_cuda.__name__,
}


class CompatWarning(UserWarning):
    """What ``install()`` says, once per process."""


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """A meta-path finder that resolves each name in MODULES to its cupyconv.compat module: the
    same module object, under a second name in sys.modules. It goes first in sys.meta_path
    (the path finder would otherwise find the submodules again through the parent's
    ``__path__``, as new modules); it answers for those four names only."""

    def __init__(self):
        self._own_specs = {}  # module name -> its own __spec__, which the import system replaces

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MODULES:
            return None
        is_package = hasattr(importlib.import_module(MODULES[fullname]), "__path__")
        return importlib.util.spec_from_loader(
            fullname, self, origin=MODULES[fullname], is_package=is_package
        )

    def create_module(self, spec):
        module = importlib.import_module(MODULES[spec.name])
        self._own_specs[module.__name__] = module.__spec__
        return module

    def exec_module(self, module):
        module.__spec__ = self._own_specs[module.__name__]  # __spec__.name == __name__ again


_announced = False  # install() has said what it did


def install() -> bool:
    """Make ``import causal_conv1d``, ``import causal_conv1d.causal_conv1d_interface``,
    ``import causal_conv1d.causal_conv1d_varlen`` and ``import causal_conv1d_cuda`` (and every
    ``from ... import``) resolve to cupyconv.compat, unless the real causal-conv1d is
    importable, which is then left alone.

    Returns True when these names resolve to cupyconv.compat (installed now or by an earlier
    call; idempotent), False when the real package is importable. Says which, once per process
    (a ``CompatWarning``). Imports nothing (torch loads when a torch tensor reaches compat).
    """
    global _announced
    if any(isinstance(finder, _Alias) for finder in sys.meta_path):
        return True
    real = _real_package()
    if real is None:
        sys.meta_path.insert(0, _Alias())
        message = (
            "causal_conv1d is not installed: cupyconv.compat.install() resolves "
            f"{', '.join(MODULES)} to cupyconv.compat (the API of causal-conv1d 1.5.0)"
        )
    else:
        message = f"causal_conv1d is importable ({real}): cupyconv.compat.install() leaves it alone"
    if not _announced:
        _announced = True
        warnings.warn(message, CompatWarning, stacklevel=2)
    return real is None


def _real_package() -> str | None:
    """Where the real causal_conv1d lives (its origin), or None when it cannot be imported."""
    try:
        spec = importlib.util.find_spec("causal_conv1d")
    except (ImportError, ValueError) as e:  # in sys.modules without a spec, or broken
        return f"sys.modules, {e}"
    if spec is None:
        return None
    return spec.origin or "a namespace package"
