"""``thunder-fsdp-mem``: the command line. ``main(argv=None) -> int`` returns the exit code; user errors print one
line to stderr and exit with 2. Thunder, torch and litgpt are imported where they are first needed, so that
``--help`` and usage errors answer at once."""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import os
import shutil
import sys
import time
import warnings
from contextlib import contextmanager

DEFAULT_MODEL = "pythia-70m"
DEFAULT_MODE = "fsdp2"


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, no usage dump
        raise _UsageError(message)


def _parser() -> argparse.ArgumentParser:
    from thunder_fsdp_mem.analysis.step import DEVICE_TYPES
    from thunder_fsdp_mem.predict.emulate import MODES
    from thunder_fsdp_mem.training.runtime import EXECUTOR_CHOICES, SHARDS

    parser = _Parser(prog="thunder-fsdp-mem", description="Where the memory of a Thunder training step goes.")
    sub = parser.add_subparsers(dest="command", required=True)
    report = sub.add_parser(
        "report", help="memory report of one training step of a litgpt model, predicted on the meta device"
    )
    report.add_argument("--model", default=DEFAULT_MODEL, help=f"litgpt configuration name (default {DEFAULT_MODEL})")
    report.add_argument("--n-layers", type=int, default=None, help="number of blocks (default: the model's)")
    report.add_argument("--block-size", type=int, default=512, help="sequence length (default 512)")
    report.add_argument("--micro-batch-size", type=int, default=1, help="sequences per step and rank (default 1)")
    report.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="parameter dtype (default bf16)")
    report.add_argument(
        "--mode",
        choices=MODES,
        default=DEFAULT_MODE,
        help="fsdp2: FSDP2 (fully_shard) through ThunderFX; thunder-fsdp: Thunder's fsdp; jit: "
        f"thunder.jit on one device (default {DEFAULT_MODE})",
    )
    report.add_argument(
        "--shard",
        choices=SHARDS,
        default=None,
        help="FSDP sharding: zero2, or zero3 (FSDP2's reshard_after_forward) (default zero2)",
    )
    report.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="ranks, emulated by a fake process group or composed per rank (default 2; jit: 1)",
    )
    report.add_argument(
        "--device",
        choices=DEVICE_TYPES,
        default="cuda",
        help="the device whose run is predicted (default cuda: Thunder's CUDA attention kernels)",
    )
    report.add_argument(
        "--executors",
        choices=EXECUTOR_CHOICES,
        default="default+cat",
        help="Thunder's executors: its defaults, with torch.compile's for rotary's cat first as in "
        "benchmarks/compare.py (default default+cat)",
    )
    report.add_argument(
        "--memory-cap",
        metavar="SIZE",
        default=None,
        help="the memory a rank may reserve (a GPU's size, or the limit of torch.cuda."
        "set_per_process_memory_fraction; 80GB emulates an H100 on an H200): replays PyTorch's "
        "caching allocator over the step and says whether it runs out under it; with "
        "--memory-budget, the plan must run under it too (--device cuda)",
    )
    report.add_argument(
        "--memory-budget",
        metavar="SIZE",
        default=None,
        help="plan the step with FSDPMemoryTransform fitting this per-rank peak (60GB, 55.9GiB): it "
        "recomputes matmuls and attention in backward where it must; shows what, and the "
        "predicted added time (implies --transform)",
    )
    report.add_argument(
        "--fit",
        metavar="SIZE",
        default=None,
        help="instead of one step, the largest sequence length (a power of two, at "
        "--micro-batch-size) and the largest micro-batch (at --block-size) whose predicted peak "
        "fits SIZE per rank (80GB, 141GiB), without the transform and with it at that budget",
    )
    report.add_argument(
        "--transform",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="also plan the step with FSDPMemoryTransform and show both (default: without only)",
    )
    report.add_argument(
        "--fusion-rematerialize",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="MemoryConfig.fusion_rematerialize, on by default: backward fusions recompute what "
        "Thunder's rematerialization means them to (results Thunder's rematerialized ones); "
        "--no-fusion-rematerialize plans with it off (results bit for bit the untransformed "
        "run's). Either implies --transform",
    )
    report.add_argument("--top", type=int, default=10, help="allocation patterns to list at the peak (default 10)")
    report.add_argument(
        "--measure",
        action="store_true",
        help="also run one step for real, a probe after every symbol, and show it beside the "
        "prediction (under torchrun for fsdp2 and thunder-fsdp: torchrun --nproc-per-node W -m "
        "thunder_fsdp_mem.cli report --measure ...)",
    )
    report.add_argument("--json", metavar="PATH", help="also write the report as JSON to PATH")
    report.add_argument("--plot", metavar="PATH", help="also write the memory timeline to PATH (.png, .svg, .pdf)")
    report.add_argument(
        "--snapshot",
        metavar="PATH",
        help="also write the predicted step to PATH as a PyTorch memory snapshot (the pickle of "
        "torch.cuda.memory._dump_snapshot: open it on pytorch.org/memory_viz); beside it, "
        "with --transform, the plan without the transform (NAME-without-transform.pickle) "
        "and, with --measure on CUDA, the recorded step (NAME-measured.pickle)",
    )
    report.add_argument("-v", "--verbose", action="store_true", help="show tracebacks of internal errors")
    return parser


def main(argv: list[str] | None = None) -> int:
    _quiet_imports()
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
    if args.world_size is not None and args.world_size < 1:
        raise _UsageError(f"--world-size must be at least 1, got {args.world_size}")
    if args.fusion_rematerialize is not None:
        args.transform = True
    else:
        args.fusion_rematerialize = True
    if args.memory_budget is not None:
        args.memory_budget = _size(args.memory_budget, "--memory-budget")
        args.transform = True
        if args.measure and args.mode == "fsdp2":
            raise _UsageError(
                "--measure with --memory-budget runs --mode jit or thunder-fsdp; under FSDP2 each "
                "block's share of the budget comes from the prediction: benchmarks/compare.py "
                "--modes fsdp2-thunder+mem@budget=SIZE measures it"
            )
    if args.memory_cap is not None:
        args.memory_cap = _size(args.memory_cap, "--memory-cap")
        if args.device != "cuda":
            raise _UsageError("--memory-cap limits CUDA's caching allocator: it needs --device cuda")
    if args.fit is not None:
        args.fit = _size(args.fit, "--fit")
        clashing = [
            o
            for o, on in (
                ("--measure", args.measure),
                ("--memory-budget", args.memory_budget is not None),
                ("--snapshot", args.snapshot),
                ("--plot", args.plot),
                ("--memory-cap", args.memory_cap is not None),
            )
            if on
        ]
        if clashing:
            raise _UsageError(f"--fit searches many steps and shows no single one: drop {', '.join(clashing)}")
    if args.measure:
        _validate_measure(args)
    if args.mode == "jit":
        if args.shard is not None:
            raise _UsageError("--shard applies to --mode fsdp2 and thunder-fsdp, not to --mode jit (one device)")
        if args.world_size not in (None, 1):
            raise _UsageError(
                f"--mode jit runs on one device; --world-size {args.world_size} needs --mode fsdp2 or thunder-fsdp"
            )
        args.world_size = 1
    else:
        args.shard = args.shard or "zero2"
        args.world_size = args.world_size or 2
    for path, option in ((args.json, "--json"), (args.plot, "--plot"), (args.snapshot, "--snapshot")):
        if not path:
            continue
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise _UsageError(f"cannot write {option} {path}: no such directory {folder}")
        if os.path.isdir(path):
            raise _UsageError(f"cannot write {option} {path}: it is a directory; name a file in it")
        if not os.access(folder, os.W_OK):
            raise _UsageError(f"cannot write {option} {path}: the directory {folder} is not writable")
    if args.plot and os.path.splitext(args.plot)[1].lower() not in (".png", ".svg", ".pdf"):
        raise _UsageError(f"--plot {args.plot}: the file name must end in .png, .svg or .pdf")
    from litgpt.config import name_to_config

    if args.model not in name_to_config:
        close = difflib.get_close_matches(args.model, list(name_to_config), n=3, cutoff=0.5)
        hint = f"; closest: {', '.join(close)}" if close else "; see litgpt's list of configurations"
        raise _UsageError(f"unknown litgpt model {args.model!r}{hint}")
    if args.mode == "fsdp2":
        from thunder_fsdp_mem.predict import fsdp2
        from thunder_fsdp_mem.training import models

        refused = fsdp2.unsupported(models.ModelSpec(name=args.model, block_size=args.block_size).config())
        if refused:
            raise _UsageError(
                f"{args.model}: --mode fsdp2 does not model {', '.join(refused)}; use --mode thunder-fsdp"
            )


def _size(text: str, option: str) -> int:
    """A size a person typed, in bytes, more than 0."""
    from thunder_fsdp_mem.units import parse_bytes

    try:
        size = parse_bytes(text)
    except ValueError as e:
        raise _UsageError(f"{option}: {e}") from None
    if size == 0:
        raise _UsageError(f"{option} must be more than 0 bytes")
    return size


def _validate_measure(args) -> None:
    """``--measure`` runs where the step can run: one process per rank under torchrun, a GPU for cuda."""
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    if args.mode != "jit" and "RANK" not in os.environ:
        raise _UsageError(
            f"--measure --mode {args.mode} runs one process per rank: torchrun --nproc-per-node "
            f"{args.world_size or 2} -m thunder_fsdp_mem.cli report --measure ..."
        )
    if args.mode == "jit" and ranks != 1:
        raise _UsageError(f"--measure --mode jit runs one process; torchrun started {ranks}")
    if args.world_size is not None and args.world_size != ranks:
        raise _UsageError(f"--world-size {args.world_size} but torchrun started {ranks} processes")
    if args.mode != "jit":
        args.world_size = ranks
    import torch

    if args.device == "cuda" and torch.cuda.device_count() < int(os.environ.get("LOCAL_WORLD_SIZE", "1")):
        raise _UsageError(
            f"--measure --device cuda needs a GPU per process, {torch.cuda.device_count()} here; "
            "--device cpu measures on CPU (gloo)"
        )


def _measure(args, spec, memory):
    """Every rank runs the step; rank 0 gets every rank's measurement, the others None."""
    import torch.distributed as dist

    from thunder_fsdp_mem.predict.measure import gather, measure_step
    from thunder_fsdp_mem.training import models, runtime

    rank = runtime.init_distributed(args.device)
    try:
        measured = measure_step(
            spec,
            rank,
            mode=args.mode,
            shard=args.shard,
            executors=args.executors,
            dtype=models.DTYPES[args.dtype],
            micro_batch_size=args.micro_batch_size,
            memory=memory,
            snapshot=bool(args.snapshot),
        )
        return gather(measured)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _report(args) -> int:
    from thunder_fsdp_mem.config import MemoryConfig
    from thunder_fsdp_mem.predict.emulate import plan_step, trace_step
    from thunder_fsdp_mem.report import build_report, render_json, render_plot, render_text
    from thunder_fsdp_mem.training import models

    spec = models.ModelSpec(name=args.model, n_layers=args.n_layers, block_size=args.block_size)
    n_layers = spec.config().n_layer
    if args.fit is not None:
        return _fit(args, spec, n_layers)
    cap = args.memory_cap if args.memory_budget is not None else None
    plans = (
        [
            None,
            MemoryConfig(
                memory_budget=args.memory_budget, memory_cap=cap, fusion_rematerialize=args.fusion_rematerialize
            ),
        ]
        if args.transform
        else [None]
    )
    steps = []
    transform = None
    measured = None
    if args.measure:
        try:
            shown = os.environ.get("RANK", "0") == "0"
            with _progress(1, "compiling and measuring one step", shown=shown) as advance:
                measured = _measure(args, spec, plans[-1])
                advance()
        except Exception as e:  # noqa: BLE001 - the run failed (out of memory, a bug): one line unless -v
            if args.verbose:
                raise
            print(
                f"thunder-fsdp-mem: the measured step failed: {type(e).__name__}: {_first_line(e)} (run with -v "
                f"for the traceback)",
                file=sys.stderr,
            )
            return 1
        if measured is None:  # not rank 0: rank 0 reports
            return 0
    try:
        what = "one block" if args.mode == "fsdp2" else f"{n_layers} layer{'s' if n_layers != 1 else ''}"
        with _progress(len(plans), f"tracing {what} on the meta device") as advance:
            options = dict(
                mode=args.mode,
                shard=args.shard,
                world_size=args.world_size,
                device_type=args.device,
                dtype=models.DTYPES[args.dtype],
                micro_batch_size=args.micro_batch_size,
                executors=args.executors,
            )
            for config in plans:
                if config is None:
                    steps.append(trace_step(spec, **options))
                else:
                    step, transform = plan_step(spec, config, **options)
                    steps.append(step)
                advance()
    except Exception as e:  # noqa: BLE001 - a model Thunder cannot trace, or a bug: one line unless -v
        if args.verbose:
            raise
        return _failed_tracing(e, args, spec)
    where = "one device" if args.mode == "jit" else f"{args.world_size} ranks, {args.shard}"
    title = (
        f"{args.model}, {n_layers} layers, {args.block_size} tokens x {args.micro_batch_size}, {args.dtype}, "
        f"{args.mode} ({where}), predicted for {args.device} from a trace on the meta device"
    )
    comparison = None
    if measured is not None:
        from thunder_fsdp_mem.predict.comparison import compare

        comparison = compare(steps[-1], measured)
    report = build_report(
        steps[-1],
        title=title,
        top=args.top,
        baseline=steps[0] if args.transform else None,
        measured=comparison,
        rewrites=tuple(transform.rewrites) if transform else (),
        budget=args.memory_budget,
        settings=_settings(args, n_layers),
        caching=args.device == "cuda",
        memory_cap=args.memory_cap,
    )
    color = sys.stdout.isatty()
    print(render_text(report, color=color, width=shutil.get_terminal_size((180, 24)).columns if color else 180))
    try:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(render_json(report), f, indent=2)
        if args.plot:
            render_plot(report, args.plot)
        if args.snapshot:
            _write_snapshots(args.snapshot, steps, measured)
    except OSError as e:  # checked before tracing, yet the file system may still refuse
        option = {args.json: "--json", args.plot: "--plot"}.get(e.filename, "--snapshot")
        raise _UsageError(f"cannot write {option} {e.filename}: {e.strerror or e}") from None
    return 0


def _fit(args, spec, n_layers: int) -> int:
    from litgpt.config import name_to_config

    from thunder_fsdp_mem.config import MemoryConfig
    from thunder_fsdp_mem.predict.fit import fit_step
    from thunder_fsdp_mem.report import fit_json, render_fit
    from thunder_fsdp_mem.training import models

    longest = max(name_to_config[args.model].get("block_size", args.block_size), args.block_size)
    options = dict(
        mode=args.mode,
        shard=args.shard,
        world_size=args.world_size,
        device_type=args.device,
        dtype=models.DTYPES[args.dtype],
        executors=args.executors,
    )
    fits = []
    try:
        for label, config in (
            ("without transform", None),
            ("with transform", MemoryConfig(fusion_rematerialize=args.fusion_rematerialize)),
        ):
            traced = [0]

            def on_trace(label=label, traced=traced) -> None:
                traced[0] += 1
                _say(f"--fit, {label}: {traced[0]} step(s) traced")

            with warnings.catch_warnings():  # a candidate over the budget is what the search looks for
                warnings.simplefilter("ignore", UserWarning)
                fits.append(
                    (
                        label,
                        fit_step(
                            spec,
                            args.fit,
                            config=config,
                            longest=longest,
                            micro_batch_size=args.micro_batch_size,
                            on_trace=on_trace,
                            **options,
                        ),
                    )
                )
    except Exception as e:  # noqa: BLE001 - a model Thunder cannot trace, or a bug: one line unless -v
        if args.verbose:
            raise
        return _failed_tracing(e, args, spec)
    where = "one device" if args.mode == "jit" else f"{args.world_size} ranks, {args.shard}"
    title = (
        f"{args.model}, {n_layers} layer{'s' if n_layers != 1 else ''}, {args.dtype}, {args.mode} ({where}), "
        f"{args.executors} executors, predicted for {args.device}"
    )
    print(render_fit(fits, title=title, block_size=args.block_size, micro_batch_size=args.micro_batch_size))
    if args.json:
        try:
            with open(args.json, "w") as f:
                json.dump({"title": title, "settings": _settings(args, n_layers), **fit_json(fits)}, f, indent=2)
        except OSError as e:
            raise _UsageError(f"cannot write --json {args.json}: {e.strerror or e}") from None
    return 0


def _settings(args, n_layers: int) -> dict[str, object]:
    """What the step was made of, as the report's JSON carries it."""
    return {
        "model": args.model,
        "n_layers": n_layers,
        "block_size": args.block_size,
        "micro_batch_size": args.micro_batch_size,
        "dtype": args.dtype,
        "mode": args.mode,
        "shard": args.shard,
        "world_size": args.world_size,
        "device": args.device,
        "executors": args.executors,
        "transform": args.transform,
        "memory_budget_bytes": args.memory_budget,
        "measured": args.measure,
        "fit_bytes": args.fit,
        "memory_cap_bytes": args.memory_cap,
    }


def _write_snapshots(path: str, steps, measured) -> None:
    """The reported plan's predicted snapshot to ``path``; the plan without the transform (with ``--transform``)
    and the measured step's snapshot (``--measure`` on CUDA) beside it."""
    import pickle

    from thunder_fsdp_mem.analysis.snapshot import predicted_snapshot

    stem = path[: -len(".pickle")] if path.endswith(".pickle") else path
    written = {path: predicted_snapshot(steps[-1])}
    if len(steps) > 1:
        written[f"{stem}-without-transform.pickle"] = predicted_snapshot(steps[0])
    recorded = next((m.snapshot for m in measured or () if m.snapshot is not None), None)
    if recorded is not None:
        written[f"{stem}-measured.pickle"] = recorded
    for target, snapshot in written.items():
        with open(target, "wb") as f:
            pickle.dump(snapshot, f)
        _say(f"memory snapshot written to {target}")


def _failed_tracing(e: Exception, args, spec) -> int:
    print(f"thunder-fsdp-mem: {_tracing_failure(e, args, spec)} (run with -v for the traceback)", file=sys.stderr)
    return 1


def _tracing_failure(e: Exception, args, spec) -> str:
    """What a failure while tracing on the meta device says to the user: Thunder cannot trace the model (the error
    comes from Thunder's own code), the model needs values the meta device does not have (an op whose output shape
    depends on the data, as a mixture of experts' routing), or an internal error of ours."""
    error = f"{type(e).__name__}: {_first_line(e)}"
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


def _first_line(e: Exception) -> str:
    return str(e).splitlines()[0] if str(e) else ""


@contextmanager
def _progress(total: int, what: str, *, shown: bool = True):
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
            _say(f"{what}: {done[0]}/{total} done ({time.perf_counter() - start:.0f} s)")

        _say(f"{what}: 0/{total} ...")
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

    with Progress(*columns, console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task(what, total=total)
        yield lambda: progress.advance(task)


def _say(line: str) -> None:
    sys.stderr.write(f"thunder-fsdp-mem: {line}\n")
    sys.stderr.flush()


def _quiet_imports() -> None:
    """What Thunder and torch print on import that says nothing about the report: Thunder's warning that
    transformer_engine is missing, torch's that no CUDA runtime is found (the report predicts CUDA without one)."""
    warnings.filterwarnings("ignore", message="transformer_engine module not found")
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)


def _run_as_rank() -> None:
    """``torchrun ... -m thunder_fsdp_mem.cli report --measure``: each rank's process ends with its exit code once
    its work is done and its output written, without the interpreter's teardown. Torch's C++ threads of a
    gloo/ThunderFX step at times outlive it and abort the process at exit ("terminate called without an active
    exception", seen in 2 of 3 runs of the suite on a loaded 2-core machine), and torchrun then ends every other
    rank, the one still writing the report among them."""
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    if "RANK" in os.environ and "--measure" in sys.argv:
        _run_as_rank()
    raise SystemExit(main())
