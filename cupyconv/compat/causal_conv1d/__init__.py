"""Stands for the package ``causal_conv1d`` (causal-conv1d 1.5.0): its version string and the
two functions its ``__init__`` exports; the submodules ``causal_conv1d_interface`` and
``causal_conv1d_varlen`` sit beside this file. ``cupyconv.compat.install()`` makes
``import causal_conv1d`` resolve here."""

__version__ = "1.5.0"  # the version of causal-conv1d whose API this package keeps

from .causal_conv1d_interface import causal_conv1d_fn, causal_conv1d_update

__all__ = ["causal_conv1d_fn", "causal_conv1d_update"]
