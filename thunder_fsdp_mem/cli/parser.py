"""The command line's grammar: ``build_parser()`` makes the ``thunder-fsdp-mem`` parser with its subcommands,
``report`` (one step's memory) and ``fit`` (the largest step that fits a size), which share the options that make
the step (model, tokens, mode, executors...). A usage error raises ``UsageError`` (one line, exit 2; no usage
dump). The choices come from the modules that define them, imported here so that ``--help`` alone pays for them.
"""

from __future__ import annotations

import argparse

DEFAULT_MODEL = "pythia-70m"
DEFAULT_MODE = "fsdp2"

# What `report --fit` says, once, on stderr, until the option goes (the release after the `fit` command came).
FIT_DEPRECATED = "note: `report --fit` is deprecated; use `thunder-fsdp-mem fit SIZE` with the same options"

# The report's own options, as the fit command's namespace carries them (its JSON's settings are the report's).
REPORT_ONLY_DEFAULTS = dict(
    memory_cap=None, memory_budget=None, transform=False, top=10, measure=False, plot=None, snapshot=None
)


# Shown under each command's --help (tests/test_cli.py parses each line's arguments).
REPORT_EXAMPLES = """examples:
  thunder-fsdp-mem report
  thunder-fsdp-mem report --model stablecode-completion-alpha-3b --n-layers 12 --block-size 8192 --transform
  thunder-fsdp-mem report --mode jit --executors fused --loss trace --transform
  thunder-fsdp-mem report --model Llama-3.2-1B --memory-budget 40GiB --memory-cap 80GB --json report.json
  thunder-fsdp-mem report --model Gemma-2-2b --mode jit --loss trace --vectorize-window-masks --transform
"""
FIT_EXAMPLES = """examples:
  thunder-fsdp-mem fit 80GB --model Llama-3.2-1B
  thunder-fsdp-mem fit 141GiB --model stablecode-completion-alpha-3b --mode thunder-fsdp --shard zero3
"""


class UsageError(Exception):
    """A mistake in the command line: ``main`` prints its message as one line and exits with 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, no usage dump
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="thunder-fsdp-mem", description="Where the memory of a Thunder training step goes.")
    sub = parser.add_subparsers(dest="command", required=True)
    report = sub.add_parser(
        "report",
        help="memory report of one training step of a litgpt model, predicted on the meta device",
        epilog=REPORT_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_step_options(report, report=True)
    _add_report_options(report)
    _add_output_options(report, "also write the report as JSON to PATH")
    fit = sub.add_parser(
        "fit",
        help="the largest sequence length and micro-batch whose predicted step fits a size per rank",
        description="The largest sequence length (a power of two, at --micro-batch-size) and the largest "
        "micro-batch (at --block-size) whose predicted peak fits SIZE per rank, without the transform and with it "
        "at that budget; each candidate is one step traced on the meta device.",
        epilog=FIT_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    fit.add_argument("fit", metavar="SIZE", help="the memory per rank the step must fit (80GB, 141GiB)")
    _add_step_options(fit, report=False)
    _add_output_options(fit, "also write the sizes found as JSON to PATH")
    fit.set_defaults(**REPORT_ONLY_DEFAULTS)
    sub.add_parser(  # listed here; ``commands.main`` hands ``run`` and what follows to ``thunder_fsdp_mem.run``
        "run",
        help="run a program unmodified with the transform in every Thunder function it builds "
        "(thunder-fsdp-mem run --help)",
        add_help=False,
    )
    return parser


def _add_step_options(parser: argparse.ArgumentParser, *, report: bool) -> None:
    """What the step is made of: the model, its tokens, the parallelism, the device, executors and the transform's
    fusion pass (``report``: the report's wording, where it implies --transform)."""
    from thunder_fsdp_mem.analysis.step import DEVICE_TYPES
    from thunder_fsdp_mem.predict.emulate import MODES
    from thunder_fsdp_mem.training.runtime import EXECUTOR_CHOICES, SHARDS

    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"litgpt configuration name, e.g. Llama-3.2-1B (default {DEFAULT_MODEL})",
    )
    parser.add_argument("--n-layers", type=int, default=None, help="number of blocks, e.g. 12 (default: the model's)")
    parser.add_argument(
        "--block-size", type=int, default=512, help="sequence length in tokens, e.g. 8192 (default 512)"
    )
    parser.add_argument(
        "--micro-batch-size", type=int, default=1, help="sequences per step and rank, e.g. 2 (default 1)"
    )
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="parameter dtype (default bf16)")
    parser.add_argument(
        "--mode",
        choices=MODES,
        default=DEFAULT_MODE,
        help="fsdp2: FSDP2 (fully_shard) through ThunderFX; thunder-fsdp: Thunder's fsdp; jit: "
        f"thunder.jit on one device (default {DEFAULT_MODE})",
    )
    parser.add_argument(
        "--shard",
        choices=SHARDS,
        default=None,
        help="FSDP sharding: zero2, or zero3 (FSDP2's reshard_after_forward) (default zero2)",
    )
    parser.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="ranks, emulated by a fake process group or composed per rank, e.g. 8 (default 2; jit: 1)",
    )
    parser.add_argument(
        "--device",
        choices=DEVICE_TYPES,
        default="cuda",
        help="the device whose run is predicted (default cuda: Thunder's CUDA attention kernels)",
    )
    parser.add_argument(
        "--executors",
        choices=EXECUTOR_CHOICES,
        default="default+cat",
        help="Thunder's executors: default, Thunder's own list; default+cat, the same with torch.compile's "
        "executor for rotary's cat first (as benchmarks/performance/compare.py runs); default+inductor, the same with "
        "Thunder's whole torch.compile executor first (benchmark_litgpt.py's thunder_inductor); fused, a fusion "
        "executor (nvFuser when installed, else torch.compile's after sdpa) (default default+cat)",
    )
    parser.add_argument(
        "--loss",
        choices=("eager", "trace"),
        default="eager",
        help="where the step computes its cross-entropy: eager, after the compiled model (as Thunder's benchmarks "
        "do), or trace, compiled with it (thunder_fsdp_mem.LossModel; under fsdp2 the root), where the transform "
        "chunks it (default eager)",
    )
    parser.add_argument(
        "--vectorize-window-masks",
        action="store_true",
        help="build sliding-window masks by one comparison (thunder_fsdp_mem.vectorize_window_masks: litgpt's "
        "masks bit for bit, without its loop of T row writes, which Thunder traces slowly at long T)",
    )
    parser.add_argument(
        "--fusion-rematerialize",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="MemoryConfig.fusion_rematerialize, on by default: backward fusions recompute what "
        "Thunder's rematerialization means them to (results Thunder's rematerialized ones); "
        "--no-fusion-rematerialize plans with it off (results bit for bit the untransformed "
        "run's)" + (". Either implies --transform" if report else ""),
    )


def _add_report_options(report: argparse.ArgumentParser) -> None:
    """The report's own: the transform and its budget, the allocator's cap, a measured run, the plot, the
    snapshot; and ``--fit``, deprecated for the ``fit`` command."""
    report.add_argument(
        "--memory-cap",
        metavar="SIZE",
        default=None,
        help="the memory a rank may reserve (a GPU's size, or the limit of torch.cuda."
        "set_per_process_memory_fraction; 80GB emulates an H100 on an H200): replays PyTorch's "
        "caching allocator over the step and says whether it runs out under it; with "
        "--memory-budget, the plan must run under it too (--device cuda) (default: no cap)",
    )
    report.add_argument(
        "--memory-budget",
        metavar="SIZE",
        default=None,
        help="plan the step with FSDPMemoryTransform fitting this per-rank peak (60GB, 55.9GiB): it "
        "recomputes matmuls and attention in backward where it must; shows what, and the "
        "predicted added time (implies --transform) (default: no budget)",
    )
    report.add_argument(
        "--fit",
        metavar="SIZE",
        default=None,
        help="deprecated: use `thunder-fsdp-mem fit SIZE` (the same search, the same options); this option "
        "goes in the next release",
    )
    report.add_argument(
        "--transform",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also plan the step with FSDPMemoryTransform and show both (default: without only; a budget or "
        "--[no-]fusion-rematerialize implies it)",
    )
    report.add_argument(
        "--top", type=int, default=10, help="allocation patterns to list at the peak, e.g. 20 (default 10)"
    )
    report.add_argument(
        "--measure",
        action="store_true",
        help="also run one step for real, a probe after every symbol, and show it beside the "
        "prediction (under torchrun for fsdp2 and thunder-fsdp: torchrun --nproc-per-node W -m "
        "thunder_fsdp_mem.cli report --measure ...) (default: predicted only)",
    )
    report.add_argument(
        "--plot", metavar="PATH", help="also write the memory timeline to PATH, e.g. step.png (.png, .svg, .pdf)"
    )
    report.add_argument(
        "--snapshot",
        metavar="PATH",
        help="also write the predicted step to PATH as a PyTorch memory snapshot (the pickle of "
        "torch.cuda.memory._dump_snapshot: open it on pytorch.org/memory_viz); beside it, "
        "with --transform, the plan without the transform (NAME-without-transform.pickle) "
        "and, with --measure on CUDA, the recorded step (NAME-measured.pickle); e.g. step.pickle",
    )


def _add_output_options(parser: argparse.ArgumentParser, json_help: str) -> None:
    parser.add_argument("--json", metavar="PATH", help=json_help + ", e.g. report.json")
    parser.add_argument("-v", "--verbose", action="store_true", help="show tracebacks of internal errors")
