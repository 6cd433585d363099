"""``python -m cupyconv [info|check|bench|warmup]``: the command line (``cupyconv/_cli``).

Without a command: an environment report, every operator checked against the float64 reference
and, on a GPU, a short timing; without a GPU, the CPU path and an NVRTC compile check of the
kernels. Exits 0 when every check passes, 1 otherwise.
"""

from __future__ import annotations

import sys

from cupyconv._cli import main

if __name__ == "__main__":
    sys.exit(main())
