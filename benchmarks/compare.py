"""Every FSDP mode side by side: peak memory, step time and the estimate, one fresh ``torchrun`` per mode.

    python benchmarks/compare.py --nproc-per-node 2 --model stablecode-completion-alpha-3b --block-size 8192 \\
        [--n-layers N] [--micro-batch-size 1] [--shard zero2|zero3] [--modes all|m1,m2,...] [--steps 10] \\
        [--warmup 3] [--device cuda|cpu] [--memory-cap-gb 80] [--timeout 3600] [--json out.json] [--plot out.png]

A mode may carry its own options, so that one table holds several: ``thunder-fsdp+mem@w=0.1@ag=1@ex=fused``. A
Thunder mode takes ``ex``: its executors (``default``, ``default+cat``, ``fused``: ``runtime.executors``; else
``--executors``'s). A +mem mode also takes the transform's ``w``: ``recompute_weight``, ``ag``:
``max_inflight_allgathers``, ``rs``: ``max_inflight_reduce_scatters``, ``fold``: ``fold_casts``, 0 or 1, ``fr``:
``fusion_rematerialize``, 0 or 1 (1, the default: Thunder's rematerialized results; 0: bit for bit), and
``budget``: ``memory_budget``, a per-rank peak (``60GB``; under FSDP2 each block's share comes from the prediction,
``fsdp2.fit_budget``); on CUDA with ``--memory-cap-gb`` the cap is the transform's ``memory_cap`` too, as a user
tells it the GPU's size, so that the plan also runs under the cap in the caching allocator's replay. A
torch.compile mode takes ``amb``: its ``activation_memory_budget``, 0 to 1 (``inductor@amb=0.5``);
``inductor+ckpt`` checkpoints every block.

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
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import difflib
import fcntl
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from thunder_fsdp_mem.training import modes as mode_table  # noqa: E402
from thunder_fsdp_mem.training import runtime  # noqa: E402
from thunder_fsdp_mem.config import DEFAULT_RECOMPUTE_WEIGHT, MemoryConfig  # noqa: E402
from thunder_fsdp_mem.units import format_bytes, parse_bytes  # noqa: E402


class UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise UsageError(message)


def parser() -> argparse.ArgumentParser:
    p = _Parser(description="Peak memory and step time of every FSDP mode, side by side.")
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
    p.add_argument("--json", metavar="PATH", help="write the config and rows as JSON (after each mode)")
    p.add_argument("--plot", metavar="PATH", help="write a bar chart of peak memory per mode (PNG or SVG)")
    p.add_argument(
        "--timeout",
        type=float,
        default=3600,
        help="seconds a mode may take, compilation included, before its processes are ended and its row "
        "says so (default 3600)",
    )
    p.add_argument("--worker", metavar="MODE", help=argparse.SUPPRESS)
    p.add_argument("--turn-lock", metavar="PATH", help=argparse.SUPPRESS)
    p.add_argument(
        "--inject-oom", metavar="RANK", type=int, default=None, help=argparse.SUPPRESS
    )  # tests: this rank's first backward symbol raises torch's OOM
    return p


# --- the driver ------------------------------------------------------------------------------------------------


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
    valid = mode_table.valid_modes(args.nproc_per_node)
    if args.modes == "all":
        return list(valid)
    chosen = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in chosen if split_variant(m).base not in valid]
    if unknown or not chosen:
        raise UsageError(f"unknown mode {', '.join(unknown) or repr(args.modes)}; valid modes: {', '.join(valid)}")
    for m in chosen:
        variant = split_variant(m)
        if variant.memory and not variant.base.endswith("+mem"):
            raise UsageError(
                f"mode {m!r}: only +mem modes take the transform's options "
                f"({', '.join(k for k in VARIANT_KEYS if k not in ('ex', 'amb'))})"
            )
        if variant.executors is not None and variant.base not in mode_table.THUNDER_MODES:
            raise UsageError(f"mode {m!r}: only Thunder's modes take @ex")
        if variant.amb is not None and variant.base not in mode_table.INDUCTOR_MODES:
            raise UsageError(f"mode {m!r}: only torch.compile's modes take @amb")
        try:
            MemoryConfig(**variant.memory)
        except (TypeError, ValueError) as e:
            raise UsageError(f"mode {m!r}: {e}") from None
    return chosen


VARIANT_KEYS = {
    "w": "recompute_weight",
    "ag": "max_inflight_allgathers",
    "rs": "max_inflight_reduce_scatters",
    "fold": "fold_casts",
    "fr": "fusion_rematerialize",
    "budget": "memory_budget",
    "ex": "executors",
    "amb": "amb",
}


def _executor_choice(value: str) -> str:
    if value not in runtime.EXECUTOR_CHOICES:
        raise ValueError(value)
    return value


def _fraction(value: str) -> float:
    fraction = float(value)
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(value)
    return fraction


_PARSE = {
    "w": float,
    "ag": int,
    "rs": int,
    "fold": lambda v: {"0": False, "1": True}[v],
    "fr": lambda v: {"0": False, "1": True}[v],
    "ex": _executor_choice,
    "budget": parse_bytes,
    "amb": _fraction,
}
_EXPECTED = {
    "fold": "0 or 1",
    "fr": "0 or 1",
    "ex": f"one of {', '.join(runtime.EXECUTOR_CHOICES)}",
    "amb": "a number from 0 to 1",
    "budget": "a size (60GB, 55.9GiB)",
}


@dataclasses.dataclass(frozen=True, slots=True)
class Variant:
    """A mode with its own options: ``base``, the mode; ``memory``, ``MemoryConfig`` options of a +mem mode;
    ``executors``, a Thunder mode's executors (None: ``--executors``'); ``amb``: a torch.compile mode's
    ``activation_memory_budget`` (None: its default)."""

    base: str
    memory: dict
    executors: str | None = None
    amb: float | None = None


def split_variant(mode: str) -> Variant:
    """``thunder-fsdp+mem@w=0.1@ag=1@ex=fused`` -> ``Variant``: a mode with its own executors (``ex``), and for a +mem
    mode its own recompute weight (``w``), windows (``ag``: all-gathers, ``rs``: reduce-scatters), folded casts
    (``fold``: 0 or 1), fusion rematerialization (``fr``: 0 or 1) or memory budget (``budget``), so that one table
    can hold several."""
    base, *parts = mode.split("@")
    options = {}
    for part in parts:
        key, _, value = part.partition("=")
        if key not in VARIANT_KEYS:
            raise UsageError(f"mode {mode!r}: unknown option {key!r}; known: {', '.join(VARIANT_KEYS)}")
        try:
            options[VARIANT_KEYS[key]] = _PARSE[key](value)
        except (KeyError, ValueError):
            raise UsageError(f"mode {mode!r}: {key} must be {_EXPECTED.get(key, 'a number')}, got {value!r}") from None
    executors = options.pop("executors", None)
    amb = options.pop("amb", None)
    return Variant(base, options, executors, amb)


def run_all(args, chosen: list[str], on_row=lambda rows: None) -> list[dict]:
    """One row per mode, in the order of ``chosen``; ``on_row`` sees the rows finished so far after each mode."""
    rows: dict[str, dict] = {}
    total = len(chosen)

    def progress(i: int, mode: str, text: str) -> None:
        sys.stderr.write(f"[{i}/{total}] {mode}: {text}\n")  # one write per line: modes may run at once
        sys.stderr.flush()

    def one(i: int, mode: str, lock: str | None) -> dict:
        if split_variant(mode).base in mode_table.CUDA_ONLY and args.device != "cuda":
            progress(i, mode, "skipped (needs CUDA)")
            return _row(mode, status="skipped: needs CUDA")
        nproc = 1 if split_variant(mode).base in mode_table.SINGLE_MODES else args.nproc_per_node
        progress(i, mode, f"running on {nproc} rank(s), compiling first...")
        start = time.perf_counter()
        row = _run_mode(args, mode, nproc, lock)
        peak = format_bytes(row["peak_bytes"]) if row.get("peak_bytes") else "-"
        progress(i, mode, f"{row['status']}, peak {peak} ({time.perf_counter() - start:.0f} s)")
        return row

    with tempfile.TemporaryDirectory() as tmp:
        lock = str(Path(tmp) / "turn.lock") if args.jobs > 1 else None
        with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
            futures = {pool.submit(one, i, mode, lock): mode for i, mode in enumerate(chosen, start=1)}
            for future in concurrent.futures.as_completed(futures):
                rows[futures[future]] = future.result()
                on_row([rows[m] for m in chosen if m in rows])
    # Waiting modes hold little device memory, but not none (their contexts; the parameters of a Thunder mode while
    # it compiles): a failure, or an allocation that had to be retried, is measured again with the devices alone.
    for i, mode in enumerate(chosen, start=1):
        row = rows[mode]
        if lock is not None and (row["status"] not in ("ok", "skipped: needs CUDA") or row["alloc_retries"]):
            progress(i, mode, "measuring again alone (it failed or retried allocations beside other modes)")
            rows[mode] = one(i, mode, None)
            on_row([rows[m] for m in chosen])
    return [rows[m] for m in chosen]


def _run_mode(args, mode: str, nproc: int, lock: str | None) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(Path(__file__).resolve()),
        "--worker",
        mode,
        *_forwarded(args),
    ]
    if lock is not None:
        cmd += ["--turn-lock", lock]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    # A session of its own: at the timeout torchrun and every rank it started end together.
    with subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    ) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, _ = proc.communicate()
            ranks = runtime.read_results(stdout)
            return _row(
                mode,
                status=f"timeout after {args.timeout:g} s",
                estimated_peak_bytes=max((r["estimated_peak_bytes"] or 0 for r in ranks), default=None),
            )
    ranks = runtime.read_results(stdout)
    if not ranks:
        return _row(mode, status=f"error: {_last_line(stderr)}")
    return _merge(mode, ranks)


def _forwarded(args) -> list[str]:
    out = [
        "--model",
        args.model,
        "--block-size",
        str(args.block_size),
        "--micro-batch-size",
        str(args.micro_batch_size),
        "--shard",
        args.shard,
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--device",
        args.device,
        "--dtype",
        args.dtype,
        "--executors",
        args.executors,
        "--recompute-weight",
        repr(args.recompute_weight),
    ]
    if args.inject_oom is not None:
        out += ["--inject-oom", str(args.inject_oom)]
    if args.n_layers is not None:
        out += ["--n-layers", str(args.n_layers)]
    if args.memory_cap_gb is not None:
        out += ["--memory-cap-gb", str(args.memory_cap_gb)]
    return out


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith(("W1", "warnings.warn"))]
    errors = [ln for ln in lines if "Error" in ln or "error" in ln]
    return (errors or lines or ["no output"])[-1][:300]


def _row(mode: str, *, status: str, **fields) -> dict:
    row = {
        "mode": mode,
        "peak_bytes": None,
        "reserved_bytes": None,
        "alloc_retries": None,
        "step_ms": None,
        "tokens_per_s": None,
        "estimated_peak_bytes": None,
        "status": status,
        "setup_s": None,
    }
    row.update(fields)
    return row


def _merge(mode: str, ranks: list[dict]) -> dict:
    """One row from every rank's: the maximum over ranks; a failure on any rank is the row's status."""

    def worst(key):
        values = [r[key] for r in ranks if r.get(key) is not None]
        return max(values) if values else None

    bad = [r["status"] for r in ranks if r["status"] != "ok"]
    if bad:  # what it would have needed, where the traces tell, and what the device held when it ran out
        oom = {k: worst(k) for k in ("allocated_at_oom_bytes", "reserved_at_oom_bytes") if any(k in r for r in ranks)}
        return _row(
            mode, status="OOM" if "OOM" in bad else bad[0], estimated_peak_bytes=worst("estimated_peak_bytes"), **oom
        )

    return _row(
        mode,
        status="ok",
        peak_bytes=worst("peak_bytes"),
        reserved_bytes=worst("reserved_bytes"),
        alloc_retries=worst("alloc_retries"),
        step_ms=worst("step_ms"),
        tokens_per_s=min(r["tokens_per_s"] for r in ranks),
        estimated_peak_bytes=worst("estimated_peak_bytes"),
        setup_s=worst("setup_s"),
        **{
            k: ranks[0][k]
            for k in (
                "rewrites",
                "estimated_peak_phase",
                "gathered_at_peak",
                "gathered_at_peak_bytes",
                "saved_budget",
                "memory_cap",
            )
            if k in ranks[0]
        },
    )


def table(rows: list[dict]) -> str:
    baseline = next((r for b in mode_table.BASELINES for r in rows if r["mode"] == b and r["peak_bytes"]), None)
    base = baseline["peak_bytes"] if baseline else None
    lines = [
        f"| mode | status | peak allocated | vs {baseline['mode'] if baseline else 'torch.compile'} | "
        "peak reserved | alloc retries | step | "
        "tokens/s | estimated peak | estimate error |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        peak, est = r["peak_bytes"], r["estimated_peak_bytes"]
        cells = [
            r["mode"],
            r["status"],
            format_bytes(peak) if peak else "-",
            f"{peak / base:.2f}x" if peak and base else "-",
            format_bytes(r["reserved_bytes"]) if r["reserved_bytes"] else "-",
            str(r["alloc_retries"]) if r["alloc_retries"] is not None else "-",
            f"{r['step_ms']:.0f} ms" if r["step_ms"] else "-",
            f"{r['tokens_per_s']:.0f}" if r["tokens_per_s"] else "-",
            format_bytes(est) if est else "-",
            f"{100 * (est - peak) / peak:+.1f}%" if est and peak else "-",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(rows)), 4))
    names = [r["mode"] for r in rows]
    values = [(r["peak_bytes"] or 0) / 2**30 for r in rows]
    bars = ax.bar(names, values, color=["#4c72b0" if r["status"] == "ok" else "#c44e52" for r in rows])
    for bar, r in zip(bars, rows):
        label = format_bytes(r["peak_bytes"], precision=1) if r["status"] == "ok" else r["status"].split(":")[0]
        ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom")
    ax.set_ylabel("peak allocated per rank (GiB)")
    ax.set_title(title)
    ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path)


def main(argv=None) -> int:
    try:
        args = parser().parse_args(argv)
        if args.worker:
            return worker(args)
        chosen = validate(args)
    except UsageError as e:
        print(f"compare.py: error: {e}", file=sys.stderr)
        return 2
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


# --- one mode, on every rank -------------------------------------------------------------------------------------


def worker(args) -> int:
    """Build, compile and warm up, then measure. With ``--jobs``, a mode that compiles without the device
    (``thunder.jit``) builds and compiles before its turn, then parks its parameters in host memory so that it
    holds no device memory while it waits; every other mode does everything in its turn. Prints one ``RESULT``
    line; a rank that fails exits non-zero so that ``torchrun`` stops the others instead of leaving them waiting in
    a collective."""
    import torch

    started = time.perf_counter()
    rank = runtime.init_distributed(args.device)
    result = _row(args.worker, status="ok", rank=rank.rank)
    if args.memory_cap_gb is not None and args.device == "cuda":
        total = torch.cuda.get_device_properties(rank.device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_cap_gb * 1e9 / total), rank.device)
    ahead = args.turn_lock is not None and split_variant(args.worker).base in mode_table.COMPILES_AHEAD
    setup = None
    if ahead:
        with _failures_as_status(result):
            setup = _setup(args, rank, result)
            setup[0].park()
    waited = time.perf_counter()
    with _turn(args.turn_lock, rank, result):
        waited = time.perf_counter() - waited
        if result["status"] == "ok":
            with _failures_as_status(result):
                if setup is None:
                    setup = _setup(args, rank, result)
                trainer, idx, targets = setup
                trainer.unpark(rank.device)
                for _ in range(args.warmup):
                    trainer.step(idx, targets)
                result["setup_s"] = time.perf_counter() - started - waited
                result.update(_measure(args, trainer, idx, targets, rank))
                if trainer.transform is not None:
                    result["rewrites"] = [dataclasses.asdict(r) for r in trainer.transform.rewrites]
    runtime.print_result(result)
    if result["status"] != "ok":
        return 1
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


def _setup(args, rank, result: dict):
    """The mode's model, optimizer and batch; compiled ahead where the compiler allows, and estimated from the
    compiled traces (so that an OOM row still says what it needed)."""
    from thunder_fsdp_mem.training import models

    spec = models.ModelSpec(name=args.model, n_layers=args.n_layers, block_size=args.block_size)
    variant = split_variant(args.worker)
    executors = variant.executors or args.executors
    memory = MemoryConfig(**{"recompute_weight": args.recompute_weight, **variant.memory})
    if memory.memory_budget is not None and args.memory_cap_gb is not None and args.device == "cuda":
        memory = dataclasses.replace(memory, memory_cap=int(args.memory_cap_gb * 1e9))
        result["memory_cap"] = memory.memory_cap
    if variant.base == "fsdp2-thunder+mem" and memory.memory_budget is not None:
        memory = _fsdp2_block_budget(args, spec, rank, executors, memory)
        result["saved_budget"] = memory.saved_budget
    probe = _injected_oom(rank.rank) if args.inject_oom == rank.rank else None
    trainer = mode_table.build(
        variant.base,
        spec,
        rank,
        shard=args.shard,
        executors=executors,
        dtype=models.DTYPES[args.dtype],
        memory=memory,
        activation_memory_budget=variant.amb,
        probe=probe,
    )
    idx, targets = models.batch(spec, micro_batch_size=args.micro_batch_size, device=rank.device, seed=rank.rank)
    trainer.precompile(idx)
    result.update(_estimate(trainer))
    return trainer, idx, targets


def _injected_oom(rank: int):
    """For tests: a Thunder transform whose first probe in a backward trace raises torch's out-of-memory error, as
    the allocator would there, on one rank while the others go on into their collectives."""
    import torch

    from thunder_fsdp_mem.predict.probes import MemoryProbeTransform

    def probe(tag: int, index: int) -> None:
        if transform.kinds[tag] == "backward":
            raise torch.OutOfMemoryError(f"injected on rank {rank} (compare.py --inject-oom)")

    transform = MemoryProbeTransform(probe)
    return transform


def _fsdp2_block_budget(args, spec, rank, executors: str, memory: MemoryConfig) -> MemoryConfig:
    """FSDP2 compiles each block alone: the step's budget becomes what each block may save, as a user gets it from
    Python (``plan_fsdp2``, the prediction on the meta device); every rank finds the same."""
    from thunder_fsdp_mem import plan_fsdp2
    from thunder_fsdp_mem.training import models

    return plan_fsdp2(
        spec.config(),
        memory_budget=memory.memory_budget,
        memory_cap=memory.memory_cap,
        tokens=args.block_size,
        micro_batch_size=args.micro_batch_size,
        world_size=rank.world_size,
        shard=args.shard,
        dtype=models.DTYPES[args.dtype],
        executors=executors,
        device_type=args.device,
        config=memory,
    )


@contextmanager
def _failures_as_status(result: dict):
    """A failing mode is a row (OOM, or the error's first line); the other modes still run."""
    import torch

    try:
        yield
    except torch.OutOfMemoryError:
        result["status"] = "OOM"
        if torch.cuda.is_available():  # the most allocated and reserved before the failing request
            result["allocated_at_oom_bytes"] = torch.cuda.max_memory_allocated()
            result["reserved_at_oom_bytes"] = torch.cuda.max_memory_reserved()
    except Exception as e:  # noqa: BLE001
        result["status"] = f"error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]


@contextmanager
def _turn(lock_path: str | None, rank, result: dict):
    """This mode's turn on the devices, with ``--jobs``: rank 0 holds an exclusive lock on the host's lock file
    and tells the other ranks through the process group's store; it lets go once every rank is done, or at once
    if it failed (it then exits, ``torchrun`` stops the others, and the lock goes with the processes)."""
    if lock_path is None:
        yield
        return
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store() if dist.is_initialized() else None
    handle = None
    if rank.rank == 0:
        handle = open(lock_path, "a")
        fcntl.flock(handle, fcntl.LOCK_EX)
        if store is not None:
            store.set("compare/turn", "1")
    else:
        store.wait(["compare/turn"], timedelta(hours=12))
    try:
        yield
    finally:
        if store is not None:
            store.add("compare/done", 1)
        if handle is not None:
            while result["status"] == "ok" and store is not None and store.add("compare/done", 0) < rank.world_size:
                time.sleep(0.05)
            fcntl.flock(handle, fcntl.LOCK_UN)
            handle.close()


def _measure(args, trainer, idx, targets, rank) -> dict:
    import torch

    times = []
    if args.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        retries_before = torch.cuda.memory_stats().get("num_alloc_retries", 0)
        for _ in range(args.steps):
            start = time.perf_counter()
            trainer.step(idx, targets)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        peak = torch.cuda.max_memory_allocated()
        reserved = torch.cuda.max_memory_reserved()
        retries = torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries_before
    else:  # timed alone, then measured (not MemTracker: Dynamo would run FSDP2's step eagerly)
        from thunder_fsdp_mem.predict.cpu_memory import REPEATS, CPUMemory

        for _ in range(args.steps):
            start = time.perf_counter()
            trainer.step(idx, targets)
            times.append(time.perf_counter() - start)
        peaks = []
        for _ in range(REPEATS):
            with CPUMemory(trainer.model, trainer.optimizer, idx, targets) as memory:
                trainer.step(idx, targets)
            peaks.append(memory.peak_bytes)
        peak = min(peaks)
        reserved = retries = None
    step_s = statistics.median(times)
    return {
        "peak_bytes": int(peak),
        "reserved_bytes": reserved,
        "alloc_retries": retries,
        "step_ms": step_s * 1e3,
        "tokens_per_s": args.micro_batch_size * args.block_size * rank.world_size / step_s,
    }


def _estimate(trainer) -> dict:
    """``estimate_step`` of the ThunderModule, compiled but not yet run, with the eager cross-entropy and the state
    the optimizer will hold, where the mode has a ThunderModule: the peak, and how many gathered parameters (and
    their bytes) are alive at it."""
    if trainer.jitted is None:
        return {}
    from thunder_fsdp_mem import estimate_step
    from thunder_fsdp_mem.analysis.categories import Category

    step = estimate_step(trainer.jitted, loss="cross_entropy", optimizer=trainer.optimizer)
    gathered = [a for a in step.live_at_peak if a.category is Category.GATHERED_PARAMETER]
    return {
        "estimated_peak_bytes": step.peak_bytes,
        "estimated_peak_phase": step.peak_phase,
        "gathered_at_peak": len(gathered),
        "gathered_at_peak_bytes": sum(a.nbytes for a in gathered),
    }


if __name__ == "__main__":
    raise SystemExit(main())
