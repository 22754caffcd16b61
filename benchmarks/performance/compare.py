"""Every FSDP mode side by side: peak memory, step time and the estimate, one fresh ``torchrun`` per mode.

    python -m benchmarks.performance.compare --nproc-per-node 2 --model stablecode-completion-alpha-3b \\
        --block-size 8192 [--n-layers N] [--micro-batch-size 1] [--shard zero2|zero3] [--modes all|m1,m2,...] \\
        [--steps 10] [--warmup 3] [--device cuda|cpu] [--memory-cap-gb 80] [--timeout 3600] [--json out.json] \\
        [--plot out.png]

A mode may carry its own options, so that one table holds several: ``thunder-fsdp+mem@w=0.1@ag=1@ex=fused``. A
Thunder mode takes ``ex``: its executors (``default``, ``default+cat``, ``default+inductor``, ``fused``:
``runtime.executors``; else ``--executors``'s). A +mem mode also takes the transform's ``w``: ``recompute_weight``,
``ag``: ``max_inflight_allgathers``, ``rs``: ``max_inflight_reduce_scatters``, ``fold``: ``fold_casts``, 0 or 1,
``fr``: ``fusion_rematerialize``, 0 or 1 (1, the default: Thunder's rematerialized results; 0: bit for bit),
``chunk``: ``chunk_loss``, 0 or 1 (with ``@loss=trace``: 1, the default, chunks the loss), and ``budget``:
``memory_budget``, a per-rank peak (``60GB``; under FSDP2 each block's share comes from the prediction,
``fsdp2.fit_budget``); on CUDA with ``--memory-cap-gb`` the cap is the transform's ``memory_cap`` too, as a user
tells it the GPU's size, so that the plan also runs under the cap in the caching allocator's replay. A torch.compile
mode takes ``amb``: its ``activation_memory_budget``, 0 to 1 (``inductor@amb=0.5``); ``inductor+ckpt`` checkpoints
every block. Any mode takes ``loss``: where the step computes its loss (``eager``, the default: cross-entropy on the
logits after the compiled model; ``trace``: the model and its loss compiled together,
``thunder_fsdp_mem.LossModel``, which a +mem mode chunks; ``liger``, ``cce``: Liger-Kernel's or Cut Cross-Entropy's
fused linear cross-entropy after the model compiled up to its final norm, from ``pip install .[bench]``, a mode
skipped with a line where the package is absent; ``chunked``: the package's own ``chunked_linear_cross_entropy``
there; these three not under Thunder's fsdp or FSDP1; ``view``, ``litgpt``: the loss as users write it in their own
module, compiled with the model, ``F.cross_entropy`` on viewed logits or litgpt's ``chunked_cross_entropy``).
``--vectorize-window-masks`` gives every mode's sliding-window attention the mask fix of
``thunder_fsdp_mem.vectorize_window_masks`` (the same mask, without litgpt's per-row loop).

Per mode and rank: the litgpt model in bf16 with AdamW; a training step is forward, cross-entropy on the logits
(eager, as Thunder's ``benchmark_litgpt.py``), backward, optimizer step, ``zero_grad``. After ``--warmup`` steps
the peak statistics are reset and ``--steps`` steps are measured: ``max_memory_allocated``,
``max_memory_reserved``, ``num_alloc_retries``, the median step time and tokens/s (on CPU: the least peak of
``cpu_memory.REPEATS`` more steps, from the allocations torch's profiler records, gloo's own buffers left out,
``thunder_fsdp_mem.predict.cpu_memory``; nothing for reserved/retries). For modes with a ThunderModule
(Thunder's fsdp, plain ``thunder.jit``), the estimate is ``estimate_step`` with the eager loss and the optimizer's
state. Rows are the maximum over ranks.

``--jobs N`` runs up to N modes at once to save the minutes Thunder spends compiling 32 layers: each mode still
has its own processes, and the modes take turns on the devices (a lock on the host): one mode warms up and is
measured at a time. A ``thunder.jit`` mode builds and compiles before its turn (compilation runs on the host),
then moves its parameters to host memory while it waits; Dynamo compiles as it runs, so those modes do
everything in their turn. What a waiting mode still holds on a device (its CUDA context, and a Thunder mode's
parameters while it compiles) can only make another mode fail or retry allocations, never change its peak: such
a mode is measured again alone at the end. Per-process peaks do not depend on the other processes; step times
can, a little, through the host's CPUs.

Entry point: ``main(argv) -> int`` (the options, checked: ``parser``, ``validate``). The work is in
``compare_runs`` (a ``torchrun`` per mode, its ranks merged), ``compare_worker`` (one mode on one rank, run as
``--worker MODE``), ``compare_table`` (the rows, the table and the chart) and ``variants`` (a mode's ``@`` options).
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
from pathlib import Path

from benchmarks.performance.compare_runs import run_all
from benchmarks.performance.compare_table import plot, table
from benchmarks.performance.compare_worker import worker
from benchmarks.options import UsageError, UsageParser
from benchmarks.variants import chosen_modes, split_variant
from thunder_fsdp_mem.config import DEFAULT_RECOMPUTE_WEIGHT, MemoryConfig
from thunder_fsdp_mem.training import modes as mode_table
from thunder_fsdp_mem.training import runtime


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default after its help (where it has one); the modes' list as written."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def _modes_help() -> str:
    width = max(map(len, mode_table.WHAT_EACH_RUNS))
    lines = [f"  {mode:<{width}}  {what}" for mode, what in mode_table.WHAT_EACH_RUNS.items()]
    return "\n".join(
        [
            "modes (--modes all: every one that runs at --nproc-per-node on --device):",
            *lines,
            "",
            "a mode's own options, after @ (several allowed): ex=default|default+cat|default+inductor|fused",
            "(Thunder's executors),",
            "loss=eager|trace|view|litgpt|liger|cce|cce-exact|chunked;",
            "+mem modes: w= (recompute weight), ag=, rs= (collectives in flight),",
            "fold=0|1, fr=0|1 (fusion rematerialize), chunk=0|1, budget=60GB; torch.compile modes: amb=0..1",
            "(activation_memory_budget). e.g. --modes fsdp2-inductor,fsdp2-thunder+mem@budget=60GB,inductor@amb=0.5",
        ]
    )


def parser() -> argparse.ArgumentParser:
    p = UsageParser(
        description="Peak memory and step time of every FSDP mode, side by side.",
        epilog=_modes_help(),
        formatter_class=_Help,
    )
    p.add_argument("--nproc-per-node", type=int, default=2, help="ranks (GPUs) per mode; 1 adds the single-GPU rows")
    p.add_argument("--model", default="stablecode-completion-alpha-3b", help="litgpt configuration name")
    p.add_argument("--n-layers", type=int, default=None, help="override the number of blocks")
    p.add_argument("--block-size", type=int, default=8192, help="sequence length of a step")
    p.add_argument("--micro-batch-size", type=int, default=1, help="sequences per rank and step")
    p.add_argument(
        "--shard",
        choices=runtime.SHARDS,
        default="zero2",
        help="zero2 keeps parameters gathered from forward to backward, zero3 re-gathers",
    )
    p.add_argument("--modes", default="all", help="'all' or a comma-separated list of modes")
    p.add_argument("--steps", type=int, default=10, help="measured steps (median step time)")
    p.add_argument("--warmup", type=int, default=3, help="steps before measuring (compilation happens here)")
    p.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cuda (NCCL) or cpu (gloo, the profiler's allocations)",
    )
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="parameter dtype")
    p.add_argument(
        "--recompute-weight",
        type=float,
        default=DEFAULT_RECOMPUTE_WEIGHT,
        help="MemoryConfig.recompute_weight of the +mem modes",
    )
    p.add_argument(
        "--executors",
        choices=runtime.EXECUTOR_CHOICES,
        default="default+cat",
        help="Thunder's executors (a mode's @ex= overrides): its defaults, plus torch.compile for cat (the "
        "seed's setting), or fused (sdpa, then one fusion executor: nvFuser or torch.compile)",
    )
    p.add_argument(
        "--memory-cap-gb",
        type=float,
        default=None,
        help="cap each rank's GPU memory at this many GB (80 emulates an H100); OOM becomes a row",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="modes run at once; they take turns on the devices, only thunder.jit compiles meanwhile",
    )
    p.add_argument(
        "--vectorize-window-masks",
        action="store_true",
        help="every mode's sliding-window attention builds its mask by one comparison, not litgpt's loop "
        "(vectorize_window_masks: the same mask bit for bit)",
    )
    p.add_argument("--json", metavar="PATH", help="write the config and rows as JSON (after each mode)")
    p.add_argument("--plot", metavar="PATH", help="write a bar chart of peak memory per mode (PNG or SVG)")
    p.add_argument(
        "--timeout",
        type=float,
        default=3600,
        help="seconds a mode may take, compilation included, before its processes are ended and its row says so",
    )
    p.add_argument("--worker", metavar="MODE", help=argparse.SUPPRESS)
    p.add_argument("--turn-lock", metavar="PATH", help=argparse.SUPPRESS)
    p.add_argument(
        "--inject-oom", metavar="RANK", type=int, default=None, help=argparse.SUPPRESS
    )  # tests: this rank's first backward symbol raises torch's OOM
    return p


def validate(args) -> list[str]:
    from litgpt.config import name_to_config

    if args.model not in name_to_config:
        close = difflib.get_close_matches(args.model, list(name_to_config), n=3, cutoff=0.5)
        hint = f"; closest: {', '.join(close)}" if close else ""
        raise UsageError(f"unknown model {args.model!r}{hint}")
    if not args.timeout > 0:
        raise UsageError(f"--timeout must be more than 0 seconds, got {args.timeout}")
    for field in ("nproc_per_node", "block_size", "micro_batch_size", "steps", "jobs"):
        if getattr(args, field) < 1:
            raise UsageError(f"--{field.replace('_', '-')} must be at least 1, got {getattr(args, field)}")
    if args.warmup < 0:
        raise UsageError(f"--warmup must be 0 or more, got {args.warmup}")
    try:
        MemoryConfig(recompute_weight=args.recompute_weight)
    except ValueError as e:
        raise UsageError(f"--recompute-weight: {e}") from None
    if args.n_layers is not None and args.n_layers < 1:
        raise UsageError(f"--n-layers must be at least 1, got {args.n_layers}")
    if args.device == "cuda":
        import torch

        count = torch.cuda.device_count()
        if args.nproc_per_node > count:
            raise UsageError(f"--nproc-per-node {args.nproc_per_node} is more than the {count} GPUs present")
    return chosen_modes(args.modes, mode_table.valid_modes(args.nproc_per_node))


def _installed(chosen: list[str]) -> list[str]:
    """The modes whose loss can run here; one line for each left out (an external loss not installed)."""
    from thunder_fsdp_mem.training import loss_placement

    kept = []
    for mode in chosen:
        loss = split_variant(mode).loss
        if loss_placement.available(loss):
            kept.append(mode)
        else:
            print(
                f"compare.py: skipped {mode}: {loss_placement.EXTERNAL[loss]} is not installed (pip install .[bench])"
            )
    return kept


def main(argv=None) -> int:
    try:
        args = parser().parse_args(argv)
        if args.worker:
            return worker(args)
        chosen = validate(args)
    except UsageError as e:
        print(f"compare.py: error: {e}", file=sys.stderr)
        return 2
    chosen = _installed(chosen)
    config = {k: v for k, v in vars(args).items() if k not in ("worker", "turn_lock", "json", "plot", "jobs")}
    config["alloc_conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")  # the workers inherit it

    def save(rows):
        if args.json:
            Path(args.json).write_text(json.dumps({"config": config, "rows": rows}, indent=1))

    rows = run_all(args, chosen, on_row=save)
    print(table(rows))
    if args.plot:
        title = f"{args.model}, {args.block_size} tokens, {args.shard}, {args.nproc_per_node} rank(s)"
        plot(rows, args.plot, title)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
