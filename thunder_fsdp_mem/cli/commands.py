"""The commands of ``thunder-fsdp-mem``: ``main(argv=None) -> int`` parses the command line (``parser``), checks it
(``validate``) and runs ``report`` (``run_report``: one step traced on the meta device, planned with the transform
and measured where asked, its report printed and written), ``fit`` (``run_fit``: ``predict.largest_step``'s search for
the largest step that fits, without the transform and with it) or ``run`` (``thunder_fsdp_mem.run``: a program run with
the transform injected, which reads its own command line). It returns the exit code: user errors print one line to
stderr and exit with 2. Thunder, torch and litgpt are imported where they are first needed, so that ``--help`` and usage
errors answer at once."""

from __future__ import annotations

import json
import os
import shutil
import sys
import warnings

from thunder_fsdp_mem.cli.console import failed_tracing, first_line, plain_warnings, progress, quiet_imports, say
from thunder_fsdp_mem.cli.parser import FIT_DEPRECATED, UsageError, build_parser
from thunder_fsdp_mem.cli.validate import validate


def main(argv: list[str] | None = None) -> int:
    quiet_imports()
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["run"]:  # the runner parses its own options, and the program's are not ours to read
        from thunder_fsdp_mem.run.command import main as run_main

        return run_main(argv[1:])
    try:
        args = build_parser().parse_args(argv)
        validate(args)
        with plain_warnings():
            if args.fit is None:
                return run_report(args)
            if args.command == "report":
                say(FIT_DEPRECATED)
            return run_fit(args)
    except UsageError as e:
        print(f"thunder-fsdp-mem: error: {e}", file=sys.stderr)
        return 2


def run_report(args) -> int:
    """``thunder-fsdp-mem report``: the step without the transform (and with it, under ``--transform`` or a
    budget), measured beside where asked; prints the report and writes its JSON, plot and snapshots."""
    from thunder_fsdp_mem.config import MemoryConfig
    from thunder_fsdp_mem.report.contents import build_report
    from thunder_fsdp_mem.training import litgpt_models

    spec = litgpt_models.ModelSpec(
        name=args.model,
        n_layers=args.n_layers,
        block_size=args.block_size,
        vectorized_window_masks=args.vectorize_window_masks,
    )
    n_layers = spec.config().n_layer
    cap = args.memory_cap if args.memory_budget is not None else None
    plans = [None]
    if args.transform:
        plans.append(
            MemoryConfig(
                memory_budget=args.memory_budget, memory_cap=cap, fusion_rematerialize=args.fusion_rematerialize
            )
        )
    measured = None
    if args.measure:
        try:
            with progress(1, "compiling and measuring one step", shown=os.environ.get("RANK", "0") == "0") as advance:
                measured = _measure(args, spec, plans[-1])
                advance()
        except Exception as e:  # noqa: BLE001 - the run failed (out of memory, a bug): one line unless -v
            if args.verbose:
                raise
            say(f"the measured step failed: {type(e).__name__}: {first_line(e)} (run with -v for the traceback)")
            return 1
        if measured is None:  # not rank 0: rank 0 reports
            return 0
    try:
        steps, transform = _trace_plans(args, spec, plans, n_layers)
    except Exception as e:  # noqa: BLE001 - a model Thunder cannot trace, or a bug: one line unless -v
        return failed_tracing(e, args, spec)
    title = (
        f"{args.model}, {n_layers} layers, {args.block_size} tokens x {args.micro_batch_size}, {args.dtype}, "
        f"{args.mode} ({_where(args)}), predicted for {args.device} from a trace on the meta device"
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
    _print_and_write(args, report, steps, measured)
    return 0


def run_fit(args) -> int:
    """``thunder-fsdp-mem fit SIZE`` (and the deprecated ``report --fit SIZE``): the largest sequence length and
    micro-batch whose predicted step fits, without the transform and with it at that budget; prints the table and
    writes its JSON."""
    from litgpt.config import name_to_config

    from thunder_fsdp_mem.config import MemoryConfig
    from thunder_fsdp_mem.predict.largest_step import fit_step, longest_for
    from thunder_fsdp_mem.report.fit_table import fit_json, render_fit
    from thunder_fsdp_mem.training import litgpt_models

    spec = litgpt_models.ModelSpec(
        name=args.model,
        n_layers=args.n_layers,
        block_size=args.block_size,
        vectorized_window_masks=args.vectorize_window_masks,
    )
    n_layers = spec.config().n_layer
    longest = longest_for(name_to_config[args.model].get("block_size"), args.block_size)
    fits = []
    try:
        for label, config in (
            ("without transform", None),
            ("with transform", MemoryConfig(fusion_rematerialize=args.fusion_rematerialize)),
        ):
            traced = [0]

            def on_trace(label=label, traced=traced) -> None:
                traced[0] += 1
                say(f"fit, {label}: {traced[0]} step(s) traced")

            with warnings.catch_warnings():  # a candidate over the budget is what the search looks for
                warnings.simplefilter("ignore", UserWarning)
                found = fit_step(
                    spec,
                    args.fit,
                    config=config,
                    longest=longest.tokens,
                    micro_batch_size=args.micro_batch_size,
                    on_trace=on_trace,
                    **_step_options(args),
                )
            fits.append((label, found))
    except Exception as e:  # noqa: BLE001 - a model Thunder cannot trace, or a bug: one line unless -v
        return failed_tracing(e, args, spec)
    title = (
        f"{args.model}, {n_layers} layer{'s' if n_layers != 1 else ''}, {args.dtype}, {args.mode} ({_where(args)}), "
        f"{args.executors} executors, predicted for {args.device}"
    )
    print(
        render_fit(
            fits,
            title=title,
            block_size=args.block_size,
            micro_batch_size=args.micro_batch_size,
            longest=longest,
            width=shutil.get_terminal_size((DEFAULT_WIDTH, 24)).columns,
        )
    )
    if args.json:
        try:
            with open(args.json, "w") as f:
                json.dump(
                    {"title": title, "settings": _settings(args, n_layers), **fit_json(fits, longest)}, f, indent=2
                )
        except OSError as e:
            raise UsageError(f"cannot write --json {args.json}: {e.strerror or e}") from None
    return 0


def _step_options(args) -> dict[str, object]:
    """``emulate.trace_step``'s options (but the micro-batch, which the fit search varies) from the command line."""
    from thunder_fsdp_mem.training import litgpt_models

    return dict(
        mode=args.mode,
        shard=args.shard,
        world_size=args.world_size,
        device_type=args.device,
        dtype=litgpt_models.DTYPES[args.dtype],
        executors=args.executors,
        **({"loss": args.loss} if args.loss != "eager" else {}),
    )


def _where(args) -> str:
    return "one device" if args.mode == "jit" else f"{args.world_size} ranks, {args.shard}"


def _trace_plans(args, spec, plans, n_layers: int):
    """Each plan's step traced on the meta device (None: without the transform; a ``MemoryConfig``: planned with
    it), with a progress bar; and the transform of the last plan made with it (None if none)."""
    from thunder_fsdp_mem.predict.emulate import plan_step, trace_step

    steps, transform = [], None
    options = dict(_step_options(args), micro_batch_size=args.micro_batch_size)
    what = "one block" if args.mode == "fsdp2" else f"{n_layers} layer{'s' if n_layers != 1 else ''}"
    with progress(len(plans), f"tracing {what} on the meta device") as advance:
        for config in plans:
            if config is None:
                steps.append(trace_step(spec, **options))
            else:
                step, transform = plan_step(spec, config, **options)
                steps.append(step)
            advance()
    return steps, transform


def _measure(args, spec, memory):
    """Every rank runs the step; rank 0 gets every rank's measurement, the others None."""
    import torch.distributed as dist

    from thunder_fsdp_mem.predict.measure import gather, measure_step
    from thunder_fsdp_mem.training import litgpt_models, runtime

    rank = runtime.init_distributed(args.device)
    try:
        measured = measure_step(
            spec,
            rank,
            mode=args.mode,
            shard=args.shard,
            executors=args.executors,
            dtype=litgpt_models.DTYPES[args.dtype],
            micro_batch_size=args.micro_batch_size,
            memory=memory,
            snapshot=bool(args.snapshot),
            loss=args.loss,
        )
        return gather(measured)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


DEFAULT_WIDTH = 100  # columns of the text report when piped without COLUMNS


def _print_and_write(args, report, steps, measured) -> None:
    """The report as text on stdout, as wide as ``COLUMNS`` or the terminal says (``DEFAULT_WIDTH`` when piped
    without ``COLUMNS``), with the terminal's styles where it prints to one; its JSON, plot and
    snapshots where asked. A file refused at the end is a usage error, as it is when checked before tracing."""
    from thunder_fsdp_mem.report.as_json import render_json
    from thunder_fsdp_mem.report.plot import render_plot
    from thunder_fsdp_mem.report.text import render_text

    color = sys.stdout.isatty()
    print(render_text(report, color=color, width=shutil.get_terminal_size((DEFAULT_WIDTH, 24)).columns))
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
        raise UsageError(f"cannot write {option} {e.filename}: {e.strerror or e}") from None


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
        say(f"memory snapshot written to {target}")
