"""The runner's command, ``thunder-fsdp-mem run`` and ``python -m thunder_fsdp_mem.run`` (under ``torchrun`` too):
``main(argv) -> int``
reads the runner's options (one per ``MemoryConfig`` field, ``--executors``, ``--json``), runs the program with the
transform injected (``inject``, ``program``), and on rank 0 prints what was done (``record``) to stderr. It returns the
program's exit code; a mistake in the runner's own command line prints one line and returns 2."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from thunder_fsdp_mem.config import BUDGET_LOSSES, BUDGET_OPTIMIZERS, SIZE_FIELDS, MemoryConfig
from thunder_fsdp_mem.run.inject import injected
from thunder_fsdp_mem.run.program import ProgramError, run_program
from thunder_fsdp_mem.run.record import as_json, record, render
from thunder_fsdp_mem.training.runtime import EXECUTOR_CHOICES
from thunder_fsdp_mem.units import parse_bytes

PROG = "thunder-fsdp-mem run"
USAGE = f"{PROG} [options] -- script.py [args...]  (or -- -m module [args...])"
EXAMPLES = """examples:
  thunder-fsdp-mem run -- train.py --lr 3e-4
  thunder-fsdp-mem run --executors fused --json run.json -- -m mypackage.train
  torchrun --standalone --nproc-per-node 1 -m thunder_fsdp_mem.run -- \\
      $(python -c 'import thunder.benchmarks.benchmark_litgpt as b; print(b.__file__)') \\
      --model_name stablecode-completion-alpha-3b --distributed_mode fsdp2 --shard_mode zero2 \\
      --compile thunder_inductor_cat_cudnn_dynamo --max_iters 10 --warmup_iters 3
"""
_CHOICES = {"budget_loss": BUDGET_LOSSES, "budget_optimizer": BUDGET_OPTIMIZERS}


class UsageError(Exception):
    """A mistake in the runner's command line: one line, exit 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        usage=USAGE,
        description="Run a Python program unmodified with FSDPMemoryTransform added to every Thunder function it "
        "builds (thunder.jit, ThunderCompiler, thunder.compile, Thunder's fsdp), after the program's own transforms; "
        "at exit rank 0 prints what each transform did and the memory CUDA measured.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--executors",
        choices=EXECUTOR_CHOICES,
        default=None,
        help="give every Thunder function this executor list instead of the program's (fused: attention kernels, "
        "then one fusion executor; said in the output as a change of the program's configuration). Default: the "
        "program's",
    )
    parser.add_argument(
        "--json", metavar="PATH", help="write the record as JSON to PATH on rank 0 ({rank} in PATH: on every rank)"
    )
    options = parser.add_argument_group("the transform's configuration (MemoryConfig; default: its defaults)")
    helps = _field_helps()
    for f in dataclasses.fields(MemoryConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.name in SIZE_FIELDS:
            options.add_argument(flag, metavar="SIZE", help=f"{helps[f.name]} (60GiB, 80GB)")
        elif f.name in _CHOICES:
            options.add_argument(flag, choices=[*_CHOICES[f.name], "none"], help=helps[f.name])
        elif isinstance(f.default, bool) or f.default is None:
            options.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=helps[f.name])
        else:
            options.add_argument(flag, type=type(f.default), metavar="N", help=f"{helps[f.name]} (default {f.default})")
    parser.add_argument("program", nargs=argparse.REMAINDER, help="the program and its arguments, after --")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = build_parser().parse_args(argv)
        config = _config(args)
        command = args.program[1:] if args.program[:1] == ["--"] else args.program
        if not command:
            raise UsageError(f"no program given: {USAGE}")
    except (UsageError, ValueError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    with injected(config, executors=args.executors) as injection:
        try:
            code = run_program(command)
        except ProgramError as e:
            print(f"{PROG}: error: {e}", file=sys.stderr)
            return 2
    done = record(injection, code)
    rank = os.environ.get("RANK", "0")
    if rank == "0":
        print(render(done), file=sys.stderr)
    if args.json and (rank == "0" or "{rank}" in args.json):
        with open(args.json.replace("{rank}", rank), "w") as f:
            json.dump(as_json(done), f, indent=2)
    return code


def _config(args) -> MemoryConfig:
    """The ``MemoryConfig`` of the options given; the defaults for the rest (its checks name a wrong value)."""
    given = {}
    for f in dataclasses.fields(MemoryConfig):
        value = getattr(args, f.name)
        if value is None:
            continue
        if f.name in SIZE_FIELDS:
            try:
                value = parse_bytes(value)
            except ValueError as e:
                raise UsageError(f"--{f.name.replace('_', '-')}: {e}") from None
        elif f.name in _CHOICES and value == "none":
            value = None
        given[f.name] = value
    return MemoryConfig(**given)


def _field_helps() -> dict[str, str]:
    """Each field's first sentence, read from ``MemoryConfig``'s docstring (one place says what a field does)."""
    helps, name = {}, None
    for line in (MemoryConfig.__doc__ or "").splitlines():
        stripped = line.strip()
        head, _, rest = stripped.partition(": ")
        if line.startswith("    ") and not line.startswith("        ") and head.isidentifier() and rest:
            name, helps[head] = head, rest
        elif name is not None and line.startswith("        "):
            helps[name] += " " + stripped
    return {k: v.split(". ")[0].rstrip(".").replace("``", "").replace("%", "%%") for k, v in helps.items()}
