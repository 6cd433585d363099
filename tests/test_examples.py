"""Every script in examples/ runs to completion (exit code 0) in a fresh interpreter.

Each example ends with an assertion against the reference; the GPU examples exit 0 with a
one-line reason where their GPU stack is missing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
EXPECTED = {
    "quickstart_numpy",  # the CPU path on numpy arrays
    "decode_update",  # prefill, then token-by-token decode on numpy arrays
    "torch_forward",  # CUDA torch tensors, channel-last, final states
    "torch_mamba_block",  # a Mamba-style block trained with AdamW (CUDA, else CPU tensors)
    "decode_graph",  # a state pool with a padding row, the update replayed from a CUDA graph
    "cupy_forward",  # plain CuPy arrays and an output buffer
    "jax_forward",  # JAX arrays on a GPU
    "jax_train",  # jax.jit of jax.value_and_grad through cupyconv.jax
    "compat_switch",  # causal_conv1d code switched over by cupyconv.compat.install()
}


def test_the_examples_are_there():
    assert EXPECTED <= {path.stem for path in EXAMPLES}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_runs(path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, (
        f"{path.name} exited with {proc.returncode}\n"
        f"--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"
    )
    if proc.stdout.startswith("skipped:"):  # a GPU example without its GPU: one line of reason
        assert proc.stdout.count("\n") == 1, proc.stdout
