"""``thunder-fsdp-mem``: the command line. ``main(argv=None) -> int`` returns the exit code; user errors print one
line to stderr and exit with 2."""

from __future__ import annotations

import argparse
import json
import sys

DEFAULT_MODEL = "pythia-70m"


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, no usage dump
        raise _UsageError(message)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="thunder-fsdp-mem", description="Where the memory of a Thunder training step goes.")
    sub = parser.add_subparsers(dest="command", required=True)
    report = sub.add_parser("report", help="memory report of one training step of a litgpt model")
    report.add_argument("--model", default=DEFAULT_MODEL, help=f"litgpt configuration name (default {DEFAULT_MODEL})")
    report.add_argument("--n-layers", type=int, default=None, help="number of blocks (default: the model's)")
    report.add_argument("--block-size", type=int, default=512, help="sequence length (default 512)")
    report.add_argument("--micro-batch-size", type=int, default=1, help="sequences per step (default 1)")
    report.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="parameter dtype (default bf16)")
    report.add_argument("--top", type=int, default=10, help="allocations to list at the peak (default 10)")
    report.add_argument("--json", metavar="PATH", help="also write the report as JSON to PATH")
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
        _validate(args)
        return _report(args)
    except _UsageError as e:
        print(f"thunder-fsdp-mem: error: {e}", file=sys.stderr)
        return 2


def _validate(args) -> None:
    if args.n_layers is not None and args.n_layers < 1:
        raise _UsageError(f"--n-layers must be at least 1, got {args.n_layers}")
    if args.block_size < 1:
        raise _UsageError(f"--block-size must be at least 1, got {args.block_size}")
    if args.micro_batch_size < 1:
        raise _UsageError(f"--micro-batch-size must be at least 1, got {args.micro_batch_size}")
    if args.top < 0:
        raise _UsageError(f"--top must be 0 or more, got {args.top}")


def _report(args) -> int:
    import thunder

    from thunder_fsdp_mem import models
    from thunder_fsdp_mem.report import build_report, render_json, render_text
    from thunder_fsdp_mem.step import estimate_step

    spec = models.ModelSpec(name=args.model, n_layers=args.n_layers, block_size=args.block_size)
    try:
        spec.config()
    except ValueError as e:
        raise _UsageError(f"{e}; see litgpt's list of configurations") from None
    # Traced on the meta device: Thunder runs every op for its shapes only, so no memory and no compute.
    model = models.build(spec, dtype=models.DTYPES[args.dtype], device="meta")
    idx, targets = models.batch(spec, micro_batch_size=args.micro_batch_size, device="meta")
    jitted = thunder.jit(model)
    jitted(idx, targets).backward()
    step = estimate_step(jitted)
    title = (f"{args.model}, {spec.config().n_layer} layers, {args.block_size} tokens x {args.micro_batch_size}, "
             f"{args.dtype}, thunder.jit, traced on the meta device")
    report = build_report(step, title=title, top=args.top)
    print(render_text(report))
    if args.json:
        try:
            with open(args.json, "w") as f:
                json.dump(render_json(report), f, indent=2)
        except OSError as e:
            raise _UsageError(f"cannot write --json {args.json}: {e.strerror}") from None
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
