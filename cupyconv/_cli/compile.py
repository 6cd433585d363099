"""Offline compilation with NVRTC (no GPU needed): programs compiled in parallel processes, and
the compile check that stands in for running the kernels where there is no GPU."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor

from cupyconv._compile import Source, compile_offline

#: Most instances per NVRTC program: a program compiles its instances one after the other (its
#: headers parsed once), the programs run in parallel processes, the largest first.
PER_PROGRAM = 8


def programs(instances: dict[Source, Iterable[str]]) -> list[tuple[Source, list[str]]]:
    """(source, up to PER_PROGRAM instance names) jobs covering ``instances``."""
    jobs = []
    for source, names in instances.items():
        names = sorted(names)
        jobs += [(source, names[i : i + PER_PROGRAM]) for i in range(0, len(names), PER_PROGRAM)]
    return sorted(jobs, key=lambda job: -len(job[1]))


def _compile(source: Source, names: list[str], arch: str) -> int:
    """Compile one program (in a worker process); the instances it compiled."""
    compile_offline(source, names, arch)
    return len(names)


def compile_all(
    instances: dict[Source, Iterable[str]],
    archs: Iterable[str],
    progress: Callable[[int], None] = lambda n: None,
) -> int:
    """Compile every instance of ``instances`` for every arch of ``archs`` offline, programs in
    parallel processes (one per CPU core); ``progress(n)`` after each program of n instances.
    Returns the instances compiled; raises RuntimeError with NVRTC's log on the first failure."""
    jobs = [(source, names, arch) for arch in archs for source, names in programs(instances)]
    workers = min(len(jobs), os.cpu_count() or 1)
    if workers <= 1:
        done = 0
        for job in jobs:
            done += _compile(*job)
            progress(len(job[1]))
        return done
    # spawn: the parent may hold threads (CuPy, torch) that a forked child must not inherit.
    context = multiprocessing.get_context("spawn")
    done = 0
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        for count in pool.map(_compile, *zip(*jobs)):
            done += count
            progress(count)
    return done


def compile_check_instances() -> tuple[dict, dict]:
    """The compile check's instances: (every forward family for bfloat16 at widths 4 and 64,
    for sm_80 and sm_90), (every backward family without seq_idx at widths 4 and 64, the
    update at width 4 and the varlen states, bfloat16, for sm_90)."""
    from cupyconv._backward_plan import all_backward_instances
    from cupyconv._forward_plan import all_forward_instances
    from cupyconv._update_plan import all_update_instances
    from cupyconv._varlen_plan import all_varlen_instances

    forward = all_forward_instances(dtypes=("bfloat16",), widths=(4, 64))
    others = all_backward_instances(dtypes=("bfloat16",), widths=(4, 64))
    others = {s: [n for n in names if "true" not in n] for s, names in others.items()}
    others |= all_update_instances(("bfloat16",), (4,)) | all_varlen_instances(("bfloat16",))
    return forward, others
