"""Kernel instances compile with NVRTC without a GPU, with the options CuPy passes itself.

Uses the NVRTC and CUDA headers of the ``cuda-bindings`` / ``nvidia-cuda-nvrtc`` /
``nvidia-cuda-runtime`` wheels (the ``cuda13`` or ``cuda12`` extra). The default run compiles
the update and varlen families for sm_90 (``tests/test_main.py`` compiles the default problem's
kernels through the command line). The ``sweep`` marker (run by ``.ci/run``) compiles
bwd_mma_time at every k-step count and the benchmarks' own kernels, and, several instances per
NVRTC program and the programs in parallel processes:

- every instance the dispatchers can produce, of every operator, dtype and width (1420), through
  NVRTC's front end for compute_80 and compute_90 (``-G``: templates, static_asserts and each
  architecture's code paths, without the optimiser, about 0.05 s an instance);
- in full for sm_90 (optimiser and ptxas): every bfloat16 and float32 forward instance, the
  float16 and float64 forward families, the bfloat16 and float64 backward families, every
  backward family of float16 and float32 at width 4;
- in full for sm_80: every forward family and dtype, the bfloat16 backward's families, the
  update of every dtype and varlen;
- the channel-last backward's narrow instances (bwd_channel, bwd_channel_pair, widths 1 to 8)
  for sm_90 with ptxas's register report: none may spill more than a few words.

Compiling every instance in full (about 1.5 s of CPU each, ptxas half of it) would take the
2-core CI machine past its budget.
"""

from __future__ import annotations

import os
import re
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from cupyconv import _backward_plan, _forward_plan, _update_plan, _varlen_plan
from cupyconv._backward_plan import all_backward_instances
from cupyconv._compile import C_TYPES, compile_offline, nvrtc_compile, ptxas_report
from cupyconv._forward_plan import all_forward_instances
from cupyconv._update_plan import all_update_instances
from cupyconv._varlen_plan import all_varlen_instances

# benchmarks/ on the path: the compile checks of mma_rate.py, ceiling_cl.py and tf32_cl.py
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

SOURCES = {
    **_forward_plan.SOURCES, **_backward_plan.SOURCES, **_update_plan.SOURCES,
    **_varlen_plan.SOURCES,
}  # fmt: skip

pytest.importorskip("cuda.bindings.nvrtc", reason="needs the cuda-bindings wheel")
pytest.importorskip("cuda.pathfinder", reason="needs the cuda-pathfinder wheel")

PER_PROGRAM = 8  # instances per NVRTC program in the sweep


def forward_families(dtypes) -> dict:
    """Each forward kernel family for ``dtypes``: widths 4 and 64, and fwd_mma_time (widths 14
    to 16 MMA_TIME_MAX_STEPS - 15) at width 16."""
    instances = all_forward_instances(dtypes=dtypes, widths=(4, 64))
    for source, names in all_forward_instances(dtypes=dtypes, widths=(16,)).items():
        if source is _forward_plan.MMA_TIME.source:
            instances[source] = names
    return instances


def representative() -> dict:
    """Each forward kernel family for each dtype (``forward_families``), and each bfloat16
    backward family (widths 4, 64 and 100), with and without seq_idx."""
    return {
        **forward_families(tuple(C_TYPES)),
        **all_backward_instances(dtypes=("bfloat16",), widths=(4, 64, 100)),
    }


def _compile(file: str, names: list[str], arch: str, front_end: bool) -> tuple[int, int]:
    """Compile ``names`` of ``kernels/<file>`` (in a worker process), through NVRTC's front end
    alone (``-G``) or in full: (instances, image bytes)."""
    image = nvrtc_compile(SOURCES[file].text, file, names, arch, ("-G",) if front_end else ())[0]
    if arch.startswith("compute"):
        assert image.decode().count(".entry") == len(names)
    return len(names), len(image)


def compile_all(instances: dict, arch: str, front_end: bool = False) -> int:
    """Compile every (source, names) of ``instances`` for ``arch`` (``front_end``: ``-G``, no
    optimiser), PER_PROGRAM instances per program, the programs in parallel processes (the
    longest first); the number compiled."""
    jobs = [
        (source.file, names[i : i + PER_PROGRAM])
        for source, names in instances.items()
        for i in range(0, len(names), PER_PROGRAM)
    ]
    jobs.sort(key=lambda job: -max(_cost(n) for n in job[1]))
    with ProcessPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        done = pool.map(_compile, *zip(*[(f, n, arch, front_end) for f, n in jobs]))
        return sum(count for count, _ in done)


def _cost(name: str) -> int:
    """A rough compile cost, to start the slowest programs first: the width of fwd_time and
    bwd_time."""
    return int(name.split(",")[1]) if name.split("<")[0] in ("fwd_time", "bwd_time") else 0


@pytest.mark.sweep
def test_every_family_compiles_for_sm_90():
    """The forward families of float16 and float64 (bfloat16 and float32: every instance, below),
    and for bfloat16 and float64 bwd_time (short and long rows), bwd_channel and
    bwd_channel_pair, the general kernels at width 4, and (bfloat16) bwd_mma at width 64,
    bwd_mma_block and bwd_mma_cl at width 100; bwd_channel one channel a lane at width 12 too, an
    instance the plan takes for every dtype (a 16-bit lane's vector is below cp.async's smallest
    copy). Without the seq_idx instances (the front-end pass has them)."""
    instances = forward_families(("float16", "float64"))
    for dtype in ("bfloat16", "float64"):
        backward = all_backward_instances(dtypes=(dtype,), widths=(4, 64, 100))
        backward[_backward_plan.CHANNEL.source].append(
            _backward_plan._channel_name(dtype, 12, False)
        )
        for source, names in backward.items():
            instances.setdefault(source, []).extend(n for n in names if "true" not in n)
    assert compile_all(instances, "sm_90") == sum(len(n) for n in instances.values())


@pytest.mark.sweep
def test_time_tensor_core_backward_compiles():
    """bwd_mma_time at every k-step count it takes (widths 16 and 31; at 3 k-steps both chunk
    shapes) for sm_90, and at KS 2 for sm_80 (its register transposes, movmatrix, are sm_75 and
    newer)."""
    every = all_backward_instances(("bfloat16",))[_backward_plan.MMA_TIME.source]
    names = all_backward_instances(("bfloat16",), (16, 31))[_backward_plan.MMA_TIME.source]
    assert len(names) == 3 and set(names) == set(every)
    assert len(compile_offline(_backward_plan.MMA_TIME.source, names, "sm_90")) > 1000
    assert len(compile_offline(_backward_plan.MMA_TIME.source, names[:1], "sm_80")) > 1000


def test_update_and_varlen_families_compile():
    """conv_update with its window in registers (widths 1 and 4) and with a run-time width,
    for a 2-byte and the 8-byte dtype; varlen_states for every dtype."""
    for source, names in all_update_instances(("bfloat16", "float64"), (1, 4, 64)).items():
        assert len(compile_offline(source, names, "sm_90")) > 1000
    for source, names in all_varlen_instances().items():
        assert len(compile_offline(source, names, "sm_90")) > 1000


def every_instance() -> dict:
    """Every instance the dispatchers can produce, of every operator, dtype and width."""
    return {
        **all_forward_instances(), **all_backward_instances(), **all_update_instances(),
        **all_varlen_instances(),
    }  # fmt: skip


@pytest.mark.sweep
@pytest.mark.parametrize("arch", ("compute_80", "compute_90"))
def test_every_instance_passes_the_front_end(arch):
    instances = every_instance()
    assert sum(len(n) for n in instances.values()) > 1400
    assert compile_all(instances, arch, front_end=True) == sum(len(n) for n in instances.values())


@pytest.mark.sweep
def test_every_bfloat16_and_float32_forward_instance_compiles_for_sm_90():
    instances = all_forward_instances(dtypes=("bfloat16", "float32"))
    assert compile_all(instances, "sm_90") == sum(len(n) for n in instances.values())


@pytest.mark.sweep
def test_representative_backward_instances_compile_for_sm_90():
    """float16 and float32, every family at width 4 (bfloat16 and float64: their families
    above)."""
    instances = all_backward_instances(dtypes=("float16", "float32"), widths=(4,))
    assert compile_all(instances, "sm_90") == sum(len(n) for n in instances.values())


SPILL_LIMIT = 64  # bytes of spill stores the channel-last narrow backward may have an instance


def _spills(file: str, names: list[str]) -> list[tuple[str, int, int, int]]:
    """(entry, registers, spill store bytes, spill load bytes) of ``names`` of ``kernels/<file>``
    compiled for sm_90 (in a worker process)."""
    import register_census

    return register_census.parse_log(ptxas_report(SOURCES[file], names, "sm_90"))


@pytest.mark.sweep
def test_channel_last_narrow_backward_keeps_its_registers():
    """bwd_channel and bwd_channel_pair at widths 1 to 8 (16-bit and float32 x, no seq_idx):
    ptxas spills at most SPILL_LIMIT bytes in each instance the plan can take, so that no width
    of the channel-last backward's headline range is routed to an instance whose registers
    overflow (bwd_channel_pair at width 8 spilled 1.3 KB and ran at 0.6 of bwd_channel's speed:
    benchmarks/NOTES.md, "bwd_channel_pair at width 8")."""
    table = all_backward_instances(("bfloat16", "float16", "float32"), range(1, 9))
    source = _backward_plan.CHANNEL.source
    assert _backward_plan.CHANNEL_PAIR.source is source
    names = sorted(n for n in table[source] if ", true" not in n)
    assert any(n.startswith("bwd_channel_pair<") for n in names) and len(names) > 20
    halves = [names[0::2], names[1::2]]
    with ProcessPoolExecutor(max_workers=2) as pool:
        rows = [row for part in pool.map(_spills, [source.file] * 2, halves) for row in part]
    assert len(rows) == len(names)
    spilling = [(name, stores) for name, _, stores, _ in rows if stores > SPILL_LIMIT]
    assert not spilling, spilling


@pytest.mark.sweep
def test_representative_instances_compile_for_sm_80():
    """The forward for every dtype, the backward for one (the architecture, not the types, is
    under test), the update of every dtype and varlen."""
    instances = representative()
    instances |= all_update_instances(widths=(4,)) | all_varlen_instances()
    assert compile_all(instances, "sm_80") == sum(len(n) for n in instances.values())


def test_compile_error_is_reported():
    with pytest.raises(RuntimeError, match="fwd_time.cu failed to compile"):
        compile_offline(SOURCES["fwd_time.cu"], ["fwd_time<int, 4, false, 8, 1>"], "compute_90")


def test_front_end_compile_checks_static_assertions():
    """The sweep's front-end compile (-G) instantiates the templates: an instance that breaks a
    static_assert (a tile of 9 steps at width 4) fails it."""
    with pytest.raises(RuntimeError, match="R is a multiple of K"):
        _compile(
            "bwd_channel.cu",
            ["bwd_channel<__nv_bfloat16, 4, false, 9, 4, 3, 4>"],
            "compute_90",
            True,
        )


@pytest.mark.sweep
def test_tensor_core_rate_kernels_build_for_sm_90a():
    """benchmarks/mma_rate.py: its wgmma kernels need an sm_90a target, which it gives beside
    the -arch=sm_90 CuPy appends; NVRTC takes the pair, and ptxas does not serialise the wgmma
    batches (warning C7515), which would make the rate it measures a wrong ceiling."""
    import mma_rate

    ok, log = mma_rate.compile_check()
    assert ok, log
    assert "C7515" not in log, log


@pytest.mark.sweep
def test_channel_last_pattern_kernels_build():
    """benchmarks/ceiling_cl.py: the copy kernels that stand for fwd_mma_cl's memory pattern
    compile for sm_90 with CuPy's options."""
    import ceiling_cl

    ok, log = ceiling_cl.compile_check()
    assert ok, log


@pytest.mark.sweep
def test_tf32_channel_last_kernels_build():
    """benchmarks/tf32_cl.py: the TF32 channel-last forward (float32 and bfloat16 x) and the
    TF32 MMA rate kernels compile for sm_90 with CuPy's options."""
    import tf32_cl

    ok, log = tf32_cl.compile_check()
    assert ok, log


def test_instance_table_covers_every_width():
    instances = all_forward_instances(dtypes=("bfloat16",))
    names = {name for group in instances.values() for name in group}
    t = "__nv_bfloat16"
    for seq in ("false", "true"):
        assert f"fwd_time<{t}, 4, {seq}, 8, 1>" in names
        assert f"fwd_time<{t}, 17, {seq}, 2, 4>" in names
        assert f"fwd_time<{t}, 18, {seq}, 8, 1>" not in names  # wider: fwd_time_wide, fwd_mma
        assert f"fwd_time_wide<{t}, {seq}>" in names
        assert f"fwd_channel<{t}, 8, {seq}, 16, 8>" in names
        assert f"fwd_channel<{t}, 9, {seq}, 16, 8>" not in names  # wider: narrower vectors
    assert f"fwd_channel<{t}, 16, false, 32, 4>" in names
    assert f"fwd_channel<{t}, 9, true, 32, 4>" not in names  # seq_idx: the general kernel
    assert f"fwd_channel<{t}, 17, false, 32, 4>" not in names  # wider: the others
    # widths 9 to 256 on tensor cores, KS 2 to 17: (weights split, channel-last warps a block)
    for split in ("false", "true"):
        assert {f"fwd_mma<{t}, 2, {split}, 0>", f"fwd_mma<{t}, 17, {split}, 0>"} <= names
        assert f"fwd_mma<{t}, 17, {split}, 16>" in names
        assert not {n for n in names if n.startswith((f"fwd_mma<{t}, 1,", f"fwd_mma<{t}, 18,"))}
    # channel-last: fwd_mma_cl with weights of x's dtype up to KS 7 (fwd_mma's form at KS 7 too,
    # where its block does not fit), fwd_mma with split weights and beyond
    assert {f"fwd_mma_cl<{t}, {ks}>" for ks in range(2, 8)} <= names
    assert f"fwd_mma<{t}, 2, true, 8>" in names and f"fwd_mma<{t}, 8, false, 16>" in names
    assert f"fwd_mma<{t}, 7, false, 16>" in names and f"fwd_mma<{t}, 6, false, 16>" not in names
    assert f"fwd_mma<{t}, 5, false, 8>" not in names
    assert not {n for n in names if n.startswith(f"fwd_mma_cl<{t}, 8")}
    # time-contiguous rows on 8-byte boundaries: fwd_mma_time up to MMA_TIME_MAX_STEPS, a chunk
    # shape each
    steps = range(2, _forward_plan.MMA_TIME_MAX_STEPS + 1)
    chunks = (*(c for _, c in _forward_plan.MMA_TIME_CHUNKS), _forward_plan.MMA_TIME_LONG_CHUNK)
    want = {f"fwd_mma_time<{t}, {ks}, {g}, {w}>" for ks in steps for g, w in chunks}
    assert {n for n in names if n.startswith("fwd_mma_time<")} == want
    for source, group in instances.items():  # each instance in its family's file
        assert all(
            source.file == name.split("<")[0] + ".cu" for name in group if "final" not in name
        )


def test_channel_last_tensor_core_backward_blocks_are_the_plans():
    """bwd_mma_cl's block size at KS 6, 9, 10 and 17, both sides of BWD_CL_DX_FROM (its launch
    bounds: .maxntid in the PTX), is the one its plan launches with (``cl_threads``)."""
    names = [f"bwd_mma_cl<__nv_bfloat16, {ks}>" for ks in (6, 9, 10, 17)]
    ptx = compile_offline(_backward_plan.MMA_CL.source, names, "compute_90").decode()
    bounds = re.findall(r"\.entry (\w+)\(.*?\.maxntid (\d+), 1, 1", ptx, re.S)
    assert len(bounds) == len(names)
    for entry, threads in bounds:
        ks = int(re.search(r"bwd_mma_clI13__nv_bfloat16Li(\d+)E", entry)[1])
        assert int(threads) == _backward_plan.cl_threads(ks), entry


def test_programmatic_dependent_launches_wait_before_touching_memory():
    """A kernel launched as a programmatic dependent launch may be scheduled while the kernel
    before it runs: its body must begin with wait_for_previous_kernel() (every backward and
    update kernel), or with final_states_blocks, whose first step it is (every forward kernel).
    The packed-sequence states' kernel is not launched so."""
    from cupyconv._compile import kernel_dir
    from cupyconv._update_plan import LEAN, UPDATE
    from cupyconv._varlen_plan import VARLEN

    waits = "    wait_for_previous_kernel();\n"
    common = (kernel_dir() / "fwd_common.cuh").read_text()
    states = common.split("bool final_states_blocks(", 1)[1].split(") {\n", 1)[1]
    assert states.startswith(waits)
    forward_first = "    if (final_states_blocks(", "    final_states_blocks("
    pdl = set()
    for kernel in (*_forward_plan.KERNELS, *_backward_plan.KERNELS, UPDATE, LEAN, VARLEN):
        if not kernel.pdl:
            continue
        pdl.add(kernel.template)
        text = (kernel_dir() / kernel.file).read_text()
        if kernel in (UPDATE, LEAN):
            head, first = f"{kernel.template}(CONV_UPDATE_PARAMS) {{\n", (waits,)
        else:
            arrays = "FWD_ARRAYS" if kernel in _forward_plan.KERNELS else "BWD_ARRAYS"
            head = f"{kernel.template}({arrays}, const __grid_constant__ {kernel.params} p) {{\n"
            first = (waits,) if arrays == "BWD_ARRAYS" else forward_first
        bodies = text.split(head)[1:]
        assert len(bodies) == (2 if kernel is UPDATE else 1), kernel  # conv_update: two overloads
        assert all(body.startswith(first) for body in bodies), kernel
    operators = (*_forward_plan.KERNELS, *_backward_plan.KERNELS, UPDATE, LEAN)
    assert pdl == {k.template for k in operators}
    assert all(launch_is_pdl(k) for k in operators)


def launch_is_pdl(kernel) -> bool:
    """Whether the Launch a plan makes of ``kernel`` carries its PDL flag."""
    fields = {f: 0 for f in kernel.plan_fields}
    return kernel.launch(f"{kernel.template}<float>", 1, (32, 1), **fields).pdl
