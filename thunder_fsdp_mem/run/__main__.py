"""``python -m thunder_fsdp_mem.run [options] -- program...``, under ``torchrun`` too: the program's exit code."""

import os
import sys

from thunder_fsdp_mem.run.command import main


def run() -> None:
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    if "RANK" in os.environ:  # as cli.__main__.run_as_rank: no interpreter teardown that can abort a finished rank
        os._exit(code)
    raise SystemExit(code)


if __name__ == "__main__":
    run()
