"""cupyconv: causal depthwise conv1d (forward, backward, decode update) for torch, JAX, CuPy and
numpy, with CUDA kernels compiled at run time through CuPy (NVRTC).

    import cupyconv
    out = cupyconv.causal_conv1d_fn(x, weight, bias, activation="silu")

The API keeps the names and arguments of ``causal-conv1d``. ``cupyconv.reference`` is the
float64 numpy reference every result is tested against.
"""

__version__ = "0.1.0"

from . import reference
from .ops import (
    causal_conv1d_bwd,
    causal_conv1d_fn,
    causal_conv1d_update,
    causal_conv1d_varlen_states,
    warmup,
)

__all__ = [
    "__version__",
    "causal_conv1d_bwd",
    "causal_conv1d_fn",
    "causal_conv1d_update",
    "causal_conv1d_varlen_states",
    "reference",
    "warmup",
]
