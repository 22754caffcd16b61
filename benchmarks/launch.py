"""How the benchmarks (and the tests' workers) start their ranks: ``torchrun`` through this Python.

Entry point: ``torchrun(nproc, *program)``; a benchmark passes ``"-m", "benchmarks.GROUP.NAME"`` so that its ranks
import it as the package's module, from the working directory they inherit (the repository root).
"""

from __future__ import annotations

import sys


def torchrun(nproc: int, *program: str) -> list[str]:
    """The command that runs ``program`` (``-m MODULE ARGS...`` or ``SCRIPT ARGS...``) on ``nproc`` local ranks of a
    standalone ``torchrun`` job, with the interpreter running this one."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *program]
