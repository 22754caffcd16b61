"""What the command line asks, checked before any tracing: ``validate(args)`` raises ``UsageError`` with one line
that says what to do instead, and fills in what depends on other options (the shard and world size of a mode,
``--transform`` implied by a budget). ``parse_size`` reads a size a person typed (``80GB``, ``55.9GiB``)."""

from __future__ import annotations

import difflib
import os

from thunder_fsdp_mem.cli.parser import UsageError

MAX_BLOCK_SIZE = 2**20  # tokens: beyond any litgpt model's positions, and a prediction of little use
# The report's options that show one step: the fit search shows none.
_ONE_STEP_OPTIONS = ("--measure", "--memory-budget", "--snapshot", "--plot", "--memory-cap")


def validate(args) -> None:
    """Every check, cheapest first (the model's configuration last: it imports litgpt); raises ``UsageError``."""
    _check_counts(args)
    _check_sizes(args)
    if args.measure:
        _check_measure(args)
    _check_parallelism(args)
    _check_paths(args)
    _check_model(args)


def parse_size(text: str, option: str) -> int:
    """A size a person typed, in bytes, more than 0; a number without a unit is bytes, and must then be at least
    1 MiB (``1.5`` was meant as 1.5 GB or GiB, not as a byte and a half)."""
    from thunder_fsdp_mem.units import parse_bytes

    try:
        size = parse_bytes(text)
    except ValueError as e:
        raise UsageError(f"{option}: {e}") from None
    if size == 0:
        raise UsageError(f"{option} must be more than 0 bytes")
    if size < 2**20 and not any(c.isalpha() for c in text.replace("e", "").replace("E", "")):
        raise UsageError(
            f"{option} {text}: a number without a unit is bytes, and {text} bytes is less than 1 MiB; "
            f"write the unit ({text}GiB, {text}GB) or the bytes (64e9)"
        )
    return size


def _check_counts(args) -> None:
    if args.n_layers is not None and args.n_layers < 1:
        raise UsageError(f"--n-layers must be at least 1, got {args.n_layers}")
    if not 1 <= args.block_size <= MAX_BLOCK_SIZE:
        raise UsageError(f"--block-size must be from 1 to {MAX_BLOCK_SIZE} tokens, got {args.block_size}")
    if args.micro_batch_size < 1:
        raise UsageError(f"--micro-batch-size must be at least 1, got {args.micro_batch_size}")
    if args.top < 0:
        raise UsageError(f"--top must be 0 or more, got {args.top}")
    if args.world_size is not None and args.world_size < 1:
        raise UsageError(f"--world-size must be at least 1, got {args.world_size}")


def _check_sizes(args) -> None:
    """The budget, the cap and the fit's size read as bytes; what each implies or excludes."""
    implying = [
        option
        for option, given in (
            ("--memory-budget", args.memory_budget is not None),
            ("--[no-]fusion-rematerialize", args.fusion_rematerialize is not None),
        )
        if given
    ]
    if getattr(args, "transform", None) is False and implying:
        raise UsageError(f"--no-transform contradicts {implying[0]}, which plans the step with the transform: drop one")
    args.transform = bool(getattr(args, "transform", None)) or bool(implying)
    if args.fusion_rematerialize is None:
        args.fusion_rematerialize = True
    if args.memory_budget is not None:
        args.memory_budget = parse_size(args.memory_budget, "--memory-budget")
        args.transform = True
        if args.measure and args.mode == "fsdp2":
            raise UsageError(
                "--measure with --memory-budget runs --mode jit or thunder-fsdp; under FSDP2 each "
                "block's share of the budget comes from the prediction: benchmarks/performance/compare.py "
                "--modes fsdp2-thunder+mem@budget=SIZE measures it"
            )
    if args.memory_cap is not None:
        args.memory_cap = parse_size(args.memory_cap, "--memory-cap")
        if args.device != "cuda":
            raise UsageError("--memory-cap limits CUDA's caching allocator: it needs --device cuda")
    if args.fit is not None:
        args.fit = parse_size(args.fit, "--fit" if args.command == "report" else "fit SIZE")
        on = (args.measure, args.memory_budget is not None, args.snapshot, args.plot, args.memory_cap is not None)
        clashing = [option for option, given in zip(_ONE_STEP_OPTIONS, on) if given]
        if clashing:
            raise UsageError(f"--fit searches many steps and shows no single one: drop {', '.join(clashing)}")


def _check_measure(args) -> None:
    """``--measure`` runs where the step can run: one process per rank under torchrun, a GPU for cuda."""
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    if args.mode != "jit" and "RANK" not in os.environ:
        raise UsageError(
            f"--measure --mode {args.mode} runs one process per rank: torchrun --nproc-per-node "
            f"{args.world_size or 2} -m thunder_fsdp_mem.cli report --measure ..."
        )
    if args.mode == "jit" and ranks != 1:
        raise UsageError(f"--measure --mode jit runs one process; torchrun started {ranks}")
    if args.world_size is not None and args.world_size != ranks:
        raise UsageError(f"--world-size {args.world_size} but torchrun started {ranks} processes")
    if args.mode != "jit":
        args.world_size = ranks
    import torch

    if args.device == "cuda" and torch.cuda.device_count() < int(os.environ.get("LOCAL_WORLD_SIZE", "1")):
        raise UsageError(
            f"--measure --device cuda needs a GPU per process, {torch.cuda.device_count()} here; "
            "--device cpu measures on CPU (gloo)"
        )


def _check_parallelism(args) -> None:
    """One device under jit; FSDP's shard and world size filled in otherwise."""
    if args.mode == "jit":
        if args.shard is not None:
            raise UsageError("--shard applies to --mode fsdp2 and thunder-fsdp, not to --mode jit (one device)")
        if args.world_size not in (None, 1):
            raise UsageError(
                f"--mode jit runs on one device; --world-size {args.world_size} needs --mode fsdp2 or thunder-fsdp"
            )
        args.world_size = 1
    else:
        args.shard = args.shard or "zero2"
        args.world_size = args.world_size or 2


def _check_paths(args) -> None:
    """The files asked for can be written, before minutes of tracing."""
    for path, option in ((args.json, "--json"), (args.plot, "--plot"), (args.snapshot, "--snapshot")):
        if not path:
            continue
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise UsageError(f"cannot write {option} {path}: no such directory {folder}")
        if os.path.isdir(path):
            raise UsageError(f"cannot write {option} {path}: it is a directory; name a file in it")
        if not os.access(folder, os.W_OK):
            raise UsageError(f"cannot write {option} {path}: the directory {folder} is not writable")
    if args.plot and os.path.splitext(args.plot)[1].lower() not in (".png", ".svg", ".pdf"):
        raise UsageError(f"--plot {args.plot}: the file name must end in .png, .svg or .pdf")


def _check_model(args) -> None:
    """A litgpt configuration (the closest names where not), which the mode can model."""
    from litgpt.config import name_to_config

    if args.model not in name_to_config:
        close = difflib.get_close_matches(args.model, list(name_to_config), n=3, cutoff=0.5)
        hint = f"; closest: {', '.join(close)}" if close else "; see litgpt's list of configurations"
        raise UsageError(f"unknown litgpt model {args.model!r}{hint}")
    configured = name_to_config[args.model].get("block_size")
    if configured and args.block_size > configured:  # allowed, as fit searches up to it: said, not refused
        from thunder_fsdp_mem.cli.console import say

        say(
            f"note: --block-size {args.block_size} is beyond {args.model}'s configured block size ({configured} "
            f"tokens): the step is predicted at {args.block_size} tokens, its rotary tables extended"
        )
    if args.mode == "fsdp2":
        from thunder_fsdp_mem.predict import fsdp2
        from thunder_fsdp_mem.training import litgpt_models

        config = litgpt_models.ModelSpec(name=args.model, block_size=args.block_size).config()
        refused = fsdp2.unsupported(config, getattr(args, "loss", "eager"))
        if refused:
            raise UsageError(f"{args.model}: --mode fsdp2 does not model {', '.join(refused)}; use --mode thunder-fsdp")
