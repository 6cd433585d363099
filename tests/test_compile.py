"""Every kernel instance the dispatcher can produce compiles with NVRTC, without a GPU.

Uses the NVRTC and CUDA headers of the ``cuda-bindings`` / ``nvidia-cuda-nvrtc`` /
``nvidia-cuda-runtime`` wheels. Instances of one dtype are compiled together in one program per
target: sm_80 and sm_90 cubins and compute_90 PTX.
"""

from __future__ import annotations

import pytest

from cupyconv._dispatch import C_TYPES, all_forward_instances

pytest.importorskip("cuda.bindings.nvrtc", reason="needs the cuda-bindings wheel")
pytest.importorskip("cuda.pathfinder", reason="needs the cuda-pathfinder wheel")

ARCHS = ("sm_80", "sm_90", "compute_90")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", list(C_TYPES))
def test_forward_instances_compile(dtype, arch):
    from cupyconv._compile import compile_offline

    names = all_forward_instances(dtypes=(dtype,))
    image = compile_offline("fwd.cu", names, arch)
    assert len(image) > 1000
    if arch.startswith("compute"):
        text = image.decode()
        assert ".entry" in text and text.count(".entry") == len(names)


def test_compile_error_is_reported():
    from cupyconv._compile import compile_offline

    with pytest.raises(RuntimeError, match="failed to compile"):
        compile_offline("fwd.cu", ["fwd_tc<int, 4, false, 8>"], "compute_90")


def test_instance_table_covers_every_width():
    names = all_forward_instances(dtypes=("bfloat16",))
    for seq in ("false", "true"):
        assert f"fwd_tc<__nv_bfloat16, 4, {seq}, 8>" in names
        assert f"fwd_tc<__nv_bfloat16, 17, {seq}, 8>" in names
        assert f"fwd_tc<__nv_bfloat16, 18, {seq}, 8>" not in names  # wider: fwd_wide
        assert f"fwd_wide<__nv_bfloat16, {seq}>" in names
        assert f"fwd_cl<__nv_bfloat16, 8, {seq}, 16>" in names
        assert f"fwd_cl<__nv_bfloat16, 9, {seq}, 16>" not in names  # wider: fwd_general


def test_block_size_matches_the_kernels_shared_memory():
    """fwd_tc (by its vectors per lane) and fwd_cl size their per-warp shared memory for
    tc_block_warps(NV) and CL_BLOCK_WARPS warps: the dispatcher must launch exactly that many."""
    import re

    from cupyconv._compile import kernel_dir
    from cupyconv._dispatch import STAGED_THREADS, TC_BLOCK_WARPS, TC_VECTORS

    text = (kernel_dir() / "fwd.cu").read_text()
    (cl_warps,) = re.findall(r"constexpr int CL_BLOCK_WARPS = (\d+);", text)
    assert STAGED_THREADS == 32 * int(cl_warps)
    rule = r"constexpr int tc_block_warps\(int NV\) \{ return NV > (\d+) \? (\d+) : (\d+); \}"
    (rule,) = re.findall(rule, text)
    above, long_warps, short_warps = map(int, rule)
    assert TC_BLOCK_WARPS == {nv: long_warps if nv > above else short_warps for nv in TC_VECTORS}


def test_param_fields_match_the_kernel_struct():
    """The launcher packs FwdParams field by field: FWD_FIELDS must list the struct's fields in
    its order (all 8-byte, so no padding)."""
    import re

    from cupyconv._compile import kernel_dir
    from cupyconv._dispatch import FWD_FIELDS

    text = (kernel_dir() / "fwd.cu").read_text()
    body = re.search(r"struct FwdParams \{(.*?)\};", text, re.S).group(1)
    body = re.sub(r"//[^\n]*", "", body)
    fields = []
    for decl in body.split(";"):
        decl = decl.strip()
        if decl:
            assert decl.startswith("int64 "), decl
            fields += [f.strip() for f in decl[len("int64 ") :].split(",")]
    assert tuple(fields) == FWD_FIELDS
