"""What the command line says on stderr besides the report: ``say(line)`` (one line, the program's name first),
``progress(total, what)`` (a bar on a terminal, plain lines elsewhere), ``failed_tracing(e, args, spec)`` (a
failure while tracing as one line that names its likely cause and what to try), ``plain_warnings()`` (every
warning as one plain line) and ``quiet_imports()`` (the warnings Thunder and torch print on import, which say
nothing about the report, silenced)."""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings
from contextlib import contextmanager


def say(line: str) -> None:
    sys.stderr.write(f"thunder-fsdp-mem: {line}\n")
    sys.stderr.flush()


@contextmanager
def progress(total: int, what: str, *, shown: bool = True):
    """A progress bar on stderr over the traces to make (each takes minutes at 32 layers), or, where stderr is no
    terminal (piped, a log), one line as each starts and ends; nothing where not ``shown`` (the ranks but the
    first)."""
    if not shown:
        yield lambda: None
        return
    if not sys.stderr.isatty():
        start, done = time.perf_counter(), [0]

        def advance() -> None:
            done[0] += 1
            say(f"{what}: {done[0]}/{total} done ({time.perf_counter() - start:.0f} s)")

        say(f"{what}: 0/{total} ...")
        yield advance
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
    )

    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(what, total=total)
        yield lambda: bar.advance(task)


@contextmanager
def plain_warnings():
    """Within it, every warning the report's work raises (the transform's, an unmet budget's) is one line on
    stderr, ``thunder-fsdp-mem: warning: ...``: no file path, no source line, no category. Deprecations inside
    Thunder and torch (``torch.is_autocast_cpu_enabled``) say nothing about the report: left out, as Python
    leaves them out of any program but the test runners'."""

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        say(f"warning: {str(message).splitlines()[0] if str(message) else category.__name__}")

    with warnings.catch_warnings():
        for category in (DeprecationWarning, PendingDeprecationWarning, FutureWarning):
            warnings.simplefilter("ignore", category)
        warnings.showwarning = show
        yield


def quiet_imports() -> None:
    """What Thunder and torch print on import that says nothing about the report: Thunder's warning that
    transformer_engine is missing, torch's that no CUDA runtime is found (the report predicts CUDA without one)."""
    warnings.filterwarnings("ignore", message="transformer_engine module not found")
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)


def failed_tracing(e: Exception, args, spec) -> int:
    """``e``, raised while tracing, as one line on stderr; the exit code 1. With ``-v``, ``e`` raised again (its
    traceback)."""
    if args.verbose:
        raise e
    say(f"{_tracing_failure(e, args, spec)} (run with -v for the traceback)")
    return 1


def first_line(e: Exception) -> str:
    return str(e).splitlines()[0] if str(e) else ""


def _tracing_failure(e: Exception, args, spec) -> str:
    """What a failure while tracing on the meta device says to the user: Thunder cannot trace the model (the error
    comes from Thunder's own code), the model needs values the meta device does not have (an op whose output shape
    depends on the data, as a mixture of experts' routing), or an internal error of ours."""
    error = f"{type(e).__name__}: {first_line(e)}"
    moe = "MoE" in getattr(spec.config(), "mlp_class_name", "")
    if "data-independent" in str(e) or "data-dependent" in str(e):
        return (
            f"{args.model} cannot be traced on the meta device: an op's output shape depends on the data"
            f"{' (the experts routing of its mixture of experts)' if moe else ''}; {error}"
        )
    if _raised_in_thunder(e):
        if moe:
            hint = (
                "FSDP2 through ThunderFX splits the graph where Thunder cannot go and runs it (benchmarks/"
                "compare.py --modes fsdp2-thunder), but its experts' routing cannot be traced on the meta "
                "device, so the report cannot predict it"
            )
        elif args.mode != "fsdp2":
            hint = "--mode fsdp2 (FSDP2 through ThunderFX) splits the graph where Thunder cannot go"
        else:
            hint = "Thunder's fsdp traces the model whole: --mode thunder-fsdp"
        return f"Thunder cannot trace {args.model} in --mode {args.mode}: {error}; {hint}"
    return f"internal error while tracing: {error}"


def _raised_in_thunder(e: BaseException) -> bool:
    """Whether the innermost frame of ``e`` (or of what caused it) is in Thunder's package."""
    while e is not None:
        tb = e.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        if tb is not None and f"{os.sep}thunder{os.sep}" in tb.tb_frame.f_code.co_filename:
            return True
        e = e.__cause__
    return False
