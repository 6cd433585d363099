"""The command line of cupyconv: ``python -m cupyconv [COMMAND]``, also installed as the
``cupyconv`` console script.

Commands:

- ``info``: the GPU, the CUDA driver, runtime and NVRTC, the versions of CuPy, torch, JAX and
  the other packages around cupyconv, and the kernel sources and CuPy's kernel cache;
- ``check``: every operator (forward with and without states, backward, the decode update in
  sliding and circular mode on a pool with padding rows, the varlen states) against the float64
  reference on a default problem set; on a GPU through CuPy arrays, without one through the CPU
  path plus an NVRTC compile check of the kernels;
- ``bench``: forward, backward and update tables on the GPU against a device-to-device copy of
  the same bytes, with torch and causal_conv1d as baselines where importable; JSON rows and a
  bar chart on request;
- ``warmup``: compile ahead of time the kernels a model with given shapes will need (without a
  GPU: compile the same instances offline with NVRTC).

Without a command: ``info``, ``check`` and a quick ``bench`` (on a GPU its chart goes to
``cupyconv-bench.png`` in the current directory). Without a GPU every command says
in one line what it cannot do and does the rest. The exit status is 1 when a check fails (or a
kernel fails to compile), else 0.
"""

from __future__ import annotations

import argparse
import sys

import cupyconv

from . import bench, check, env, warmup

__all__ = ["main"]


def _prog() -> str:
    """How the user called us: ``python -m cupyconv`` or the console script ``cupyconv``."""
    return "python -m cupyconv" if sys.argv[0].endswith("__main__.py") else "cupyconv"


def _summary(module) -> str:
    """The first paragraph of a module's docstring, as a subcommand's description."""
    return module.__doc__.split("\n\n")[0].replace("\n", " ")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=_prog(),
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"cupyconv {cupyconv.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.add_parser(
        "info",
        help="environment report: GPU, CUDA, package versions, kernel caches",
        description=_summary(env),
    )
    p = commands.add_parser(
        "check",
        help="every operator against the float64 reference",
        description=check.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--cpu", action="store_true", help="check the CPU path even on a GPU")
    p.add_argument(
        "--no-compile",
        action="store_true",
        help="without a GPU: skip the NVRTC compile check (tens of seconds on a small machine)",
    )
    p = commands.add_parser(
        "bench",
        help="forward, backward and update timings on the GPU",
        description=bench.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_arguments(p)
    p = commands.add_parser(
        "warmup",
        help="compile the kernels of given shapes ahead of time",
        description=warmup.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    warmup.add_arguments(p)
    return parser


DEFAULT_CHART = "cupyconv-bench.png"  # the chart of the command-less run, on a GPU


def run_all(parser: argparse.ArgumentParser, gpu, reason: str) -> int:
    """No command: ``info``, ``check`` and, on a GPU, ``bench --quick`` with its chart in
    DEFAULT_CHART; "ok" at the end when everything passed."""
    env.report(gpu, reason)
    print()
    status = check.command(parser.parse_args(["check"]), gpu, reason)
    print()
    if status:
        print("bench: skipped, the check failed")
    else:
        chart = ["--png", DEFAULT_CHART] if gpu is not None else []
        status = bench.command(parser.parse_args(["bench", "--quick", *chart]), gpu, reason)
    print("ok" if status == 0 else "FAILED")
    return status


def main(argv: list[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "warmup":
        warmup.check_arguments(parser, args)
    gpu, reason = env.probe_gpu()
    if args.command is None:
        return run_all(parser, gpu, reason)
    if args.command == "info":
        env.report(gpu, reason)
        return 0
    module = {"check": check, "bench": bench, "warmup": warmup}[args.command]
    return module.command(args, gpu, reason)
