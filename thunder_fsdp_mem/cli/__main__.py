"""``python -m thunder_fsdp_mem.cli``: ``main``'s exit code; under torchrun with ``report --measure``, each rank's
process ends as soon as its work is done (``run_as_rank``)."""

import os
import sys

from thunder_fsdp_mem.cli.commands import main


def run_as_rank() -> None:
    """``torchrun ... -m thunder_fsdp_mem.cli report --measure``: each rank's process ends with its exit code once
    its work is done and its output written, without the interpreter's teardown. Torch's C++ threads of a
    gloo/ThunderFX step at times outlive it and abort the process at exit ("terminate called without an active
    exception", seen in runs of the test suite on a loaded machine), and torchrun then ends every other rank, the
    one still writing the report among them."""
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    if "RANK" in os.environ and "--measure" in sys.argv:
        run_as_rank()
    raise SystemExit(main())
