"""The packed-sequence states' plan: the kernel instance, its launch shape and its parameters.

Works on ``Array`` descriptions only. The kernel lives in ``kernels/varlen.cu``; its parameter
struct is generated from ``FIELDS`` and ``VARLEN`` below (as the forward's are,
``cupyconv/_forward_plan.py``). One thread per element of the states, channels fastest.
"""

from __future__ import annotations

from ._arrays import Array, remember
from ._compile import C_TYPES
from ._launch import (
    MAX_GRID,
    Kernel,
    Launch,
    ParamBlock,
    bind_sources,
    dtype_code,
    fast_divisor,
    pack,
)

VARLEN_THREADS = 256  # varlen_states: threads per block
POINTERS = 3

#: The parameter fields of varlen_states, after its three pointers (x, cu_seqlens, states).
FIELDS = (
    "n_seqs", "dim", "state_len", "x_t_stride", "x_c_stride", "cu_stride",
    "states_n_stride", "states_c_stride", "states_l_stride", "cu_dtype",
)  # fmt: skip
VARLEN = Kernel("varlen_states", "varlen.cu", "VarlenParams", ("dim_divisor", "state_divisor"))
SOURCES = bind_sources((VARLEN,), "cupyconv/_varlen_plan.py (FIELDS, VARLEN)", {}, FIELDS)


def varlen_name(dtype: str) -> str:
    return f"varlen_states<{C_TYPES[dtype]}>"


def all_varlen_instances(dtypes=tuple(C_TYPES)) -> dict:
    return {VARLEN.source: sorted(varlen_name(d) for d in dtypes)}


_plans: dict[tuple, Launch] = {}


def plan_varlen(dtype: str, n_seqs: int, dim: int, state_len: int) -> Launch:
    """The launch that fills states [n_seqs, dim, state_len] (no size 0); memoised."""
    key = (dtype, n_seqs, dim, state_len)
    plan = _plans.get(key)
    if plan is None:
        grid = max(1, min(-(-n_seqs * dim * state_len // VARLEN_THREADS), MAX_GRID))
        plan = VARLEN.launch(
            varlen_name(dtype), grid, (VARLEN_THREADS, 1), dim_divisor=fast_divisor(dim),
            state_divisor=fast_divisor(state_len),
        )  # fmt: skip
        remember(_plans, key, plan)
    return plan


def varlen_args(launch: Launch, x: Array, cu_seqlens: Array, states: Array) -> ParamBlock:
    """The kernel arguments: the three pointers, then FIELDS, then the plan's fields."""
    n_seqs, dim, state_len = states.shape
    return pack((
        x.ptr, cu_seqlens.ptr, states.ptr, n_seqs, dim, state_len, *x.strides,
        cu_seqlens.strides[0], *states.strides, dtype_code(cu_seqlens),
        *launch.plan_fields,
    ))  # fmt: skip
