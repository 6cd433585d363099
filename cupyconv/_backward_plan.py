"""The backward's plan: which kernels a call launches, with what launch shapes and parameters,
and the scratch memory they need.

Works on ``Array`` descriptions only. The kernels live in ``kernels/bwd_*.cu``; their launch
constants and parameter structs are generated from ``CONSTANTS``, ``FIELDS`` and ``KERNELS``
below (as the forward's are, ``cupyconv/_forward_plan.py``).

A call runs one main kernel that writes dx and the partial sums of dweight and dbias (one
``[dim, width + 1]`` block of them per part of the data), ``bwd_initial`` when dinitial_states
is asked for, and ``bwd_reduce``, which adds the partials in a fixed order: no floating-point
atomics, every result bitwise the same from run to run. Layouts without a fast kernel take the
general path: ``bwd_dz`` writes dz into a scratch array, ``bwd_dx`` and ``bwd_weight`` read it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._arrays import Array, remember
from ._compile import C_TYPES
from ._launch import MAX_GRID, Kernel, Launch, ParamBlock, bind_sources, dtype_code, pack

# Launch constants shared with the kernels.
CONSTANTS = {
    "WEIGHT_THREADS": 256,  # bwd_weight: threads per block
    "MAX_STATE": 255,  # bwd_initial: most state positions (width - 1)
}
GENERAL_THREADS = 256  # bwd_dz, bwd_dx, bwd_initial, bwd_reduce: threads per block
PART_LEN = 4096  # bwd_weight: positions (b, t) per part

#: The parameter fields every backward kernel takes from the call, after its thirteen pointers
#: (x, weight, bias, seq_idx, initial_states, dout, dfinal_states, dx, dweight, dbias,
#: dinitial_states, partials, scratch; 0 when absent). ``n_parts`` (parts of the dweight
#: partials) comes from the plan.
FIELDS = (
    "batch", "dim", "seqlen", "width",
    "x_batch_stride", "x_c_stride", "x_l_stride",
    "weight_c_stride", "weight_width_stride", "bias_stride",
    "seq_batch_stride", "seq_l_stride",
    "init_batch_stride", "init_c_stride", "init_l_stride",
    "dout_batch_stride", "dout_c_stride", "dout_l_stride",
    "dfinal_batch_stride", "dfinal_c_stride", "dfinal_l_stride",
    "dx_batch_stride", "dx_c_stride", "dx_l_stride",
    "dinit_batch_stride", "dinit_c_stride", "dinit_l_stride",
    "dweight_c_stride", "dweight_width_stride", "dbias_stride",
    "weight_dtype", "bias_dtype", "seq_dtype", "init_dtype", "dfinal_dtype",
    "silu_act", "n_parts",
)  # fmt: skip
_SCRATCH = ("scratch_batch_stride", "scratch_c_stride", "scratch_l_stride")

DZ = Kernel("bwd_dz", "bwd_general.cu", "BwdDzParams", ("channels_fastest", *_SCRATCH))
DX = Kernel("bwd_dx", "bwd_general.cu", "BwdDxParams", ("channels_fastest", *_SCRATCH))
WEIGHT = Kernel("bwd_weight", "bwd_general.cu", "BwdWeightParams", ("part_len", *_SCRATCH))
INITIAL = Kernel("bwd_initial", "bwd_general.cu", "BwdInitialParams")
REDUCE = Kernel("bwd_reduce", "bwd_general.cu", "BwdReduceParams")
KERNELS = (DZ, DX, WEIGHT, INITIAL, REDUCE)

SOURCES = bind_sources(
    KERNELS, "cupyconv/_backward_plan.py (CONSTANTS, FIELDS, KERNELS)", CONSTANTS, FIELDS
)


@dataclass(frozen=True)
class BackwardPlan:
    """The launches of one backward call, in order, and what they need besides the call's
    arrays: ``n_parts`` blocks of dweight partials (``[n_parts, dim, width + 1]``, accumulation
    dtype), and a scratch array of dz with ``scratch_strides`` (None: no scratch)."""

    launches: tuple[Launch, ...]
    n_parts: int
    scratch_strides: tuple[int, int, int] | None


def all_backward_instances(dtypes=tuple(C_TYPES)) -> dict:
    """Every backward template instance for these x dtypes, by source."""
    found: dict = {}
    for d in dtypes:
        t = C_TYPES[d]
        for k in KERNELS:
            found.setdefault(k.source, []).append(f"{k.template}<{t}>")
    return found


_plans: dict[tuple, BackwardPlan] = {}


def plan_backward(x: Array, width: int, has_seq: bool, dinit: bool) -> BackwardPlan:
    """The kernels of a backward call on x [batch, dim, seqlen] (dim > 0), with dinitial_states
    when ``dinit``; memoised per layout. Without tokens only the states' gradient and the
    (zero) reductions run."""
    key = (x.dtype_name, width, has_seq, dinit, x.shape, x.strides)
    plan = _plans.get(key)
    if plan is None:
        plan = remember(_plans, key, _plan_backward(x, width, has_seq, dinit))
    return plan


def _grid(items: int, per_block: int) -> int:
    return max(1, min(-(-items // per_block), MAX_GRID))


def _plan_backward(x: Array, width: int, has_seq: bool, dinit: bool) -> BackwardPlan:
    batch, dim, seqlen = x.shape
    if batch * seqlen == 0:
        return _finish([], x, width, dinit, 0, None)
    t = C_TYPES[x.dtype_name]
    _, x_c, x_l = x.strides
    channels_fastest = abs(x_c) < abs(x_l) and seqlen > 1
    if channels_fastest:  # dz laid out [batch, seqlen, dim]
        scratch = (seqlen * dim, 1, dim)
    else:
        scratch = (dim * seqlen, seqlen, 1)
    fields = dict(zip(_SCRATCH, scratch))
    n_parts = -(-(batch * seqlen) // PART_LEN)
    elements = _grid(batch * dim * seqlen, GENERAL_THREADS)
    block = (GENERAL_THREADS, 1)
    launches = [
        DZ.launch(f"bwd_dz<{t}>", elements, block, channels_fastest=channels_fastest, **fields),
        DX.launch(f"bwd_dx<{t}>", elements, block, channels_fastest=channels_fastest, **fields),
        WEIGHT.launch(
            f"bwd_weight<{t}>",
            min(n_parts * dim, MAX_GRID),
            (CONSTANTS["WEIGHT_THREADS"], 1),
            part_len=PART_LEN,
            **fields,
        ),  # fmt: skip
    ]
    return _finish(launches, x, width, dinit, n_parts, scratch)


def _finish(launches: list, x: Array, width: int, dinit: bool, n_parts: int, scratch):
    """The main kernel's launches, then bwd_initial (when dinit) and bwd_reduce."""
    batch, dim, _ = x.shape
    t = C_TYPES[x.dtype_name]
    block = (GENERAL_THREADS, 1)
    if dinit and width > 1 and batch > 0:
        launches.append(INITIAL.launch(f"bwd_initial<{t}>", _grid(batch * dim, 64), (64, 1)))
    warps = GENERAL_THREADS // 32
    launches.append(REDUCE.launch(f"bwd_reduce<{t}>", _grid(dim * (width + 1), warps), block))
    return BackwardPlan(tuple(launches), n_parts, scratch)


# ---- the typed argument builder --------------------------------------------------------------

_ZEROS = {n: (0,) * n for n in (1, 2, 3)}


def _strides(a: Array | None, n: int) -> tuple[int, ...]:
    return _ZEROS[n] if a is None else a.strides


def backward_args(
    launch: Launch, plan: BackwardPlan, x, weight, bias, seq_idx, initial_states, dout,
    dfinal_states, dx, dweight, dbias, dinitial_states, partials, scratch, width, silu,
) -> ParamBlock:  # fmt: skip
    """The kernel arguments: the thirteen pointers (0 when absent), then the kernel's struct:
    FIELDS, then the plan's fields."""
    arrays = (
        x, weight, bias, seq_idx, initial_states, dout, dfinal_states, dx, dweight, dbias,
        dinitial_states, partials, scratch,
    )  # fmt: skip
    return pack((
        *(0 if a is None else a.ptr for a in arrays),
        *x.shape, width, *x.strides, *weight.strides, *_strides(bias, 1),
        *_strides(seq_idx, 2), *_strides(initial_states, 3), *dout.strides,
        *_strides(dfinal_states, 3), *dx.strides, *_strides(dinitial_states, 3),
        *dweight.strides, *_strides(dbias, 1),
        dtype_code(weight), dtype_code(bias), dtype_code(seq_idx), dtype_code(initial_states),
        dtype_code(dfinal_states), int(silu), plan.n_parts, *launch.plan_fields,
    ))  # fmt: skip
