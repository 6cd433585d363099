"""``python -m cupyconv warmup``: compile ahead of time the kernels a model with given shapes
will need.

    python -m cupyconv warmup --dim 5120 --width 4 --dtype bfloat16 --batch 1,8 --seqlen 2048 \\
        --layout cl --ops fwd,bwd,update

For every combination of batch, seqlen, layout and operator the command builds stand-in arrays
of those shapes (``[batch, dim, seqlen]`` x, dout and dx in the layout's memory order,
``[dim, width]`` weight, ``[dim]`` bias; for the update one token ``[batch, dim]`` and a state
``[batch, dim, width - 1]``) and calls ``cupyconv.warmup`` on them, which plans the call as the
model's call would be planned and compiles and loads its kernels without launching anything:

- on a GPU the arrays are empty CuPy arrays; the compiled programs land in CuPy's disk cache
  (``CUPY_CACHE_DIR``, default ``~/.cupy/kernel_cache``), so a later process loads them
  instead of compiling (torch, CuPy and JAX callers share them);
- without a GPU the arrays are CuPy arrays over addresses that are never allocated nor read
  (their shapes, strides and dtypes are what the plans read), the kernel loader is replaced by
  a recorder, and the instances it records are compiled offline with NVRTC for ``--arch``
  (default sm_90): a check that they compile; nothing is cached.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import itertools
from unittest import mock

import numpy as np
from tqdm import tqdm

import cupyconv
from cupyconv._arrays import dense_strides

from .check import numpy_dtype

OPS = ("fwd", "bwd", "update")
LAYOUTS = ("cf", "cl")
DTYPES = ("bfloat16", "float16", "float32", "float64")
#: Memory order (dims outermost first) of x, dout and dx [batch, dim, seqlen], and of states
#: [batch, dim, state_len], in each layout.
ORDER = {"cf": (0, 1, 2), "cl": (0, 2, 1)}


@dataclasses.dataclass(frozen=True)
class Task:
    """One warmup call: operator, batch, seqlen (None for the update) and layout."""

    op: str
    batch: int
    seqlen: int | None
    layout: str

    @property
    def name(self) -> str:
        shape = f"batch {self.batch}" + ("" if self.seqlen is None else f" seqlen {self.seqlen}")
        return f"{self.op} {self.layout} {shape}"


def tasks(args) -> list[Task]:
    """The warmup calls of the options, each once (the update does not depend on seqlen)."""
    found = {}
    for op, batch, seqlen, layout in itertools.product(
        args.ops, args.batch, args.seqlen, args.layout
    ):
        task = Task(op, batch, None if op == "update" else seqlen, layout)
        found.setdefault(task, None)
    return list(found)


_next_address = [1 << 40]


def stand_in(shape, order, dtype):
    """A CuPy array of ``shape`` laid out with its dims outermost first in ``order``, over an
    address range that is never allocated nor read (CuPy makes it without a GPU): what the
    plans read of an array. Each gets its own 4 GiB-aligned range, as allocations are aligned."""
    import cupy
    from cupy.cuda import memory

    dtype = np.dtype(dtype)
    strides = dense_strides(shape, order)
    extent = (sum((n - 1) * s for n, s in zip(shape, strides)) + 1) * dtype.itemsize
    _next_address[0] += 1 << 32
    unowned = memory.UnownedMemory(_next_address[0], extent, None, device_id=0)
    byte_strides = tuple(s * dtype.itemsize for s in strides)
    return cupy.ndarray(shape, dtype, memory.MemoryPointer(unowned, 0), strides=byte_strides)


def cupy_empty(shape, order, dtype):
    """An empty CuPy array of ``shape`` laid out with its dims outermost first in ``order``."""
    import cupy

    memory = cupy.empty(tuple(shape[d] for d in order), dtype=dtype)
    return memory.transpose(tuple(int(d) for d in np.argsort(order)))


def warmup_call(task: Task, args, make) -> tuple[tuple, dict]:
    """(args, kwargs) of ``cupyconv.warmup`` for ``task``, arrays from ``make(shape, order,
    dtype)``."""
    dtype, wdtype = numpy_dtype(args.dtype), numpy_dtype(args.weight_dtype or args.dtype)
    dim, width = args.dim, args.width
    order = ORDER[task.layout]
    weight = make((dim, width), (0, 1), wdtype)
    bias = make((dim,), (0,), wdtype)
    if task.op == "update":
        x = make((task.batch, dim), (0, 1), dtype)
        state = make((task.batch, dim, width - 1), order, dtype)
        return (cupyconv.causal_conv1d_update, x, state, weight, bias, "silu"), {}
    shape = (task.batch, dim, task.seqlen)
    x = make(shape, order, dtype)
    kwargs = {"activation": "silu"}
    if args.seq_idx:
        kwargs["seq_idx"] = make((task.batch, task.seqlen), (0, 1), np.int32)
    states_shape = (task.batch, dim, width - 1)
    if task.op == "fwd":
        if args.states:
            kwargs["initial_states"] = make(states_shape, ORDER["cl"], dtype)
            kwargs["return_final_states"] = True
        return (x, weight, bias), kwargs
    dout = make(shape, order, dtype)
    kwargs["dx"] = make(shape, order, dtype)
    if args.states:
        kwargs["initial_states"] = make(states_shape, ORDER["cl"], dtype)
        kwargs["return_dinitial_states"] = True
    return (cupyconv.causal_conv1d_bwd, x, weight, bias, dout), kwargs


#: Shared memory a block may opt into, by architecture (the plans' limit for the wide tiles).
OPTIN_SHARED_MEMORY = {"sm_80": 166912, "sm_86": 101376, "sm_87": 166912, "sm_89": 101376}
SM90_SHARED_MEMORY = 232448  # sm_90 and the architectures not in the table


@contextlib.contextmanager
def recording(arch: str = "sm_90"):
    """Within: ``cupyconv.warmup`` records the instances it would compile, by source, instead
    of compiling them (and kernels whose launch shape depends on the device's occupancy get a
    stand-in count: the forward's sizes grids, not instances; the shared memory a block may
    have is that of ``arch``). Yields the {source: set of names} filled."""
    from cupyconv import _backward_plan, _forward_plan, _update_plan, _warmup

    found: dict = {}

    def record(source, name, device):
        found.setdefault(source, set()).add(name)

    def resident(count):
        def resident_blocks(device, source, name, threads, smem):
            record(source, name, device)
            return count

        return resident_blocks

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(_warmup, "get_kernel", record))
        limit = OPTIN_SHARED_MEMORY.get(arch, SM90_SHARED_MEMORY)
        # The backward's count is a whole device's (132 SMs x 16 blocks): how many parts a
        # call's dweight comes in, and so whether it needs bwd_reduce, follows it.
        for module, count in ((_forward_plan, 1), (_backward_plan, 132 * 16)):
            stack.enter_context(mock.patch.object(module, "resident_blocks", resident(count)))
            stack.enter_context(
                mock.patch.object(module, "shared_memory_limit", lambda device: limit)
            )
        # an SM holds the opt-in limit and one block's reserved kilobyte (sm_80 to sm_90)
        fit = lambda device, smem, blocks: blocks * (smem + 1024) <= limit + 1024  # noqa: E731
        stack.enter_context(mock.patch.object(_forward_plan, "blocks_fit", fit))
        stack.enter_context(mock.patch.object(_forward_plan, "multiprocessors", lambda device: 132))
        for module in (_forward_plan, _backward_plan, _update_plan):  # plans made with the count
            stack.enter_context(mock.patch.object(module, "_plans", {}))
        yield found


def offline_instances(task_list: list[Task], args) -> dict:
    """{source: sorted instance names} that ``cupyconv.warmup`` would compile for the tasks."""
    with recording(args.arch) as found:
        for task in task_list:
            call_args, kwargs = warmup_call(task, args, stand_in)
            cupyconv.warmup(*call_args, **kwargs)
    return {source: sorted(names) for source, names in found.items()}


def instance_list(instances) -> str:
    names = sorted(name for group in instances for name in group)
    return "\n".join(f"  {name}" for name in names)


def on_gpu(task_list: list[Task], args) -> int:
    """Warm every task up on device 0; print what was compiled and where it is kept."""
    from cupyconv import _compile

    from .env import cache_contents, cupy_cache_dir

    def cached_programs() -> int:
        contents = cache_contents(cache)
        return contents.files if contents is not None else 0

    cache = cupy_cache_dir()
    before_files = cached_programs()
    before = set(_compile._kernels)
    for task in tqdm(task_list, desc="warmup", unit="call", disable=None, leave=False):
        call_args, kwargs = warmup_call(task, args, cupy_empty)
        cupyconv.warmup(*call_args, **kwargs)
    loaded = sorted({(file, name) for (_, file, name) in set(_compile._kernels) - before})
    print(
        f"warmup: {len(task_list)} calls ({', '.join(t.name for t in task_list)}) need "
        f"{len(loaded)} kernel instances, compiled and loaded:"
    )
    print(instance_list([[name for _, name in loaded]]))
    if cache is None:
        print("kernel cache: in memory only (CUPY_CACHE_IN_MEMORY): nothing kept for later runs")
    else:
        # One program per instance; other processes may write the cache at the same time.
        new = min(max(cached_programs() - before_files, 0), len(loaded))
        print(
            f"kernel cache: {cache}: {new} of them compiled now, {len(loaded) - new} loaded from "
            "there; later processes load them from there too"
        )
    return 0


def offline(task_list: list[Task], args, reason: str) -> int:
    """Without a GPU: the instances the tasks need, compiled with NVRTC for ``args.arch``."""
    from .compile import compile_all
    from .env import offline_nvrtc

    instances = offline_instances(task_list, args)
    count = sum(len(n) for n in instances.values())
    version = offline_nvrtc()
    if version is None:
        print(
            f"warmup: no GPU ({reason}) and no NVRTC (cuda-bindings, cuda-pathfinder): cannot "
            f"compile; the {len(task_list)} calls need these {count} kernel instances:"
        )
        print(instance_list(instances.values()))
        return 0
    print(
        f"warmup: no GPU ({reason}): cannot load kernels; compiling the same instances offline "
        f"with NVRTC {version} for {args.arch} instead (a check that they compile; CuPy's disk "
        "cache fills on a GPU)"
    )
    with tqdm(total=count, desc="compile", unit="kernel", disable=None, leave=False) as bar:
        try:
            compile_all(instances, (args.arch,), bar.update)
        except RuntimeError as e:
            print(f"FAILED: {e}")
            return 1
    print(
        f"warmup: {len(task_list)} calls ({', '.join(t.name for t in task_list)}) need {count} "
        f"kernel instances, compiled offline for {args.arch}:"
    )
    print(instance_list(instances.values()))
    return 0


def command(args, gpu, reason: str) -> int:
    """``warmup``: 1 when an instance fails to compile offline, else 0."""
    task_list = tasks(args)
    if gpu is not None:
        return on_gpu(task_list, args)
    if importlib.util.find_spec("cupy") is None:  # the stand-in arrays are CuPy's
        print(f"warmup: no GPU ({reason}): nothing to plan or compile")
        return 0
    return offline(task_list, args, reason)


# ---- options ---------------------------------------------------------------------------------


def int_list(text: str) -> list[int]:
    """'1,8' -> [1, 8]: positive integers."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers; got {text!r}"
        ) from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers; got {text!r}")
    return values


def choice_list(choices: tuple[str, ...]):
    """A parser of comma-separated names, each one of ``choices``."""

    def parse(text: str) -> list[str]:
        values = [v.strip() for v in text.split(",") if v.strip()]
        bad = [v for v in values if v not in choices]
        if not values or bad:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated names out of {', '.join(choices)}; got {text!r}"
            )
        return list(dict.fromkeys(values))

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dim", type=int, required=True, help="channels (dim)")
    parser.add_argument("--width", type=int, default=4, help="filter width (default 4)")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="dtype of x")
    parser.add_argument(
        "--weight-dtype", choices=DTYPES, help="dtype of weight and bias (default: --dtype)"
    )
    parser.add_argument(
        "--batch", type=int_list, default=[1], help="batch sizes, comma-separated (default 1)"
    )
    parser.add_argument(
        "--seqlen", type=int_list, default=[2048], help="sequence lengths (default 2048)"
    )
    parser.add_argument(
        "--layout",
        type=choice_list(LAYOUTS),
        default=["cf"],
        help="cf (x [batch, dim, seqlen] time-contiguous), cl (channel-last: a [batch, seqlen, "
        "dim] buffer viewed as [batch, dim, seqlen]), or both: cf,cl (default cf)",
    )
    parser.add_argument(
        "--ops",
        type=choice_list(OPS),
        default=list(OPS),
        help="operators: fwd (causal_conv1d_fn), bwd (causal_conv1d_bwd), update "
        "(causal_conv1d_update, one token a row); default all",
    )
    parser.add_argument("--seq-idx", action="store_true", help="calls with seq_idx")
    parser.add_argument(
        "--states",
        action="store_true",
        help="forward with initial and final states, backward with dinitial states",
    )
    parser.add_argument(
        "--arch", default="sm_90", help="without a GPU: the architecture to compile for (sm_90)"
    )


def check_arguments(parser: argparse.ArgumentParser, args) -> None:
    if args.dim < 1:
        parser.error(f"--dim must be >= 1; got {args.dim}")
    if not 1 <= args.width <= 256:
        parser.error(f"--width must be between 1 and 256; got {args.width}")
