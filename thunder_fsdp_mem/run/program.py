"""A Python program run in this process as ``python script.py args`` or ``python -m module args`` would run it:
``sys.argv`` and ``sys.path[0]`` as Python sets them, ``__name__ == "__main__"``. ``run_program(command) -> int``
returns its exit code: 0 when it returns, the code of its ``SystemExit`` (a message: printed to stderr, 1), and
1 with the traceback printed, as Python prints it, when it raises."""

from __future__ import annotations

import importlib.util
import os
import runpy
import sys
import traceback


class ProgramError(ValueError):
    """The command names no program that can be run (the message says what is wrong)."""


def run_program(command: list[str]) -> int:
    """Run ``command`` (``["script.py", *args]`` or ``["-m", "module", *args]``) here and return its exit code;
    ``sys.argv`` and ``sys.path`` are as they were after it (a caller in the same process keeps its own)."""
    argv, path = sys.argv, list(sys.path)
    try:
        return _run(command)
    finally:
        sys.argv, sys.path[:] = argv, path


def _run(command: list[str]) -> int:
    if not command:
        raise ProgramError("no program given: thunder-fsdp-mem run [options] -- script.py [args...] (or -m module)")
    if command[0] == "-m":
        if len(command) < 2:
            raise ProgramError("-m needs a module name: -m package.module [args...]")
        module, args = command[1], command[2:]
        if _find(module) is None:
            raise ProgramError(f"no module named {module}")
        sys.argv = [module, *args]  # runpy sets argv[0] to the module's file
        sys.path.insert(0, os.getcwd())
        return _exit_code(lambda: runpy.run_module(module, run_name="__main__", alter_sys=True))
    script, args = command[0], command[1:]
    if not os.path.isfile(script):
        raise ProgramError(f"no such file: {script}")
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    return _exit_code(lambda: runpy.run_path(script, run_name="__main__"))


def _find(module: str):
    """The module's spec, as ``python -m`` looks for it (the working directory first); None where there is none."""
    sys.path.insert(0, os.getcwd())
    try:
        return importlib.util.find_spec(module)
    except ImportError:  # a parent package that does not exist
        return None
    finally:
        sys.path.pop(0)


def _exit_code(run) -> int:
    try:
        run()
    except SystemExit as e:
        if e.code is None:
            return 0
        if isinstance(e.code, int):
            return e.code
        print(e.code, file=sys.stderr)
        return 1
    except Exception as e:  # the program's failure, reported as Python reports it: the runner's block still follows
        traceback.print_exception(type(e), e, _program_frames(e.__traceback__))
        return 1
    return 0


def _program_frames(tb):
    """The traceback from the program's first frame on: without the runner's and runpy's frames above it."""
    ours = {os.path.abspath(__file__), os.path.abspath(runpy.__file__), "<frozen runpy>"}

    def runners(frame) -> bool:
        name = frame.f_code.co_filename
        return name in ours or os.path.abspath(name) in ours

    while tb is not None and tb.tb_next is not None and runners(tb.tb_frame):
        tb = tb.tb_next
    return tb
