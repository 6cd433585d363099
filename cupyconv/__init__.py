"""cupyconv: causal depthwise conv1d for torch, JAX, CuPy and numpy, with CUDA kernels compiled
at run time through CuPy (NVRTC).

    import cupyconv
    out = cupyconv.causal_conv1d_fn(x, weight, bias, activation="silu")

The API keeps the names and arguments of ``causal-conv1d``. The forward, the backward, the
decode update and the packed-sequence states run on the GPU for GPU arrays (torch tensors that
require grad train through custom operators; ``cupyconv.jax`` is the JAX function with its
gradient) and through the float64 reference for CPU arrays.
``cupyconv.reference`` is the float64 numpy reference every result is tested against.
"""

__version__ = "0.1.0"

from . import reference
from ._validate import debug
from ._warmup import warmup
from .backward import causal_conv1d_bwd
from .forward import causal_conv1d_fn
from .update import causal_conv1d_update
from .varlen import causal_conv1d_varlen_states

__all__ = [
    "__version__",
    "causal_conv1d_bwd",
    "causal_conv1d_fn",
    "causal_conv1d_update",
    "causal_conv1d_varlen_states",
    "debug",
    "reference",
    "warmup",
]
