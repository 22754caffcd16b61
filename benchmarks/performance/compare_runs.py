"""``compare``'s driver: each mode in a fresh ``torchrun`` of its own
(``-m benchmarks.performance.compare --worker MODE``), up to ``--jobs`` at once, its ranks' ``RESULT`` lines merged
into one row.

Entry point: ``run_all(args, chosen, on_row) -> list[dict]``. With ``--jobs`` the modes take turns on the devices
through a lock file (``compare_worker``); a mode that failed or retried allocations beside another is measured
again alone at the end. A mode past ``--timeout`` is ended with every rank it started (a session of its own).
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.performance.compare_table import merge, row
from benchmarks.launch import torchrun
from benchmarks.variants import split_variant
from thunder_fsdp_mem.training import modes as mode_table
from thunder_fsdp_mem.training import runtime
from thunder_fsdp_mem.units import format_bytes


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
            return row(mode, status="skipped: needs CUDA")
        nproc = 1 if split_variant(mode).base in mode_table.SINGLE_MODES else args.nproc_per_node
        progress(i, mode, f"running on {nproc} rank(s), compiling first...")
        start = time.perf_counter()
        result = _run_mode(args, mode, nproc, lock)
        peak = format_bytes(result["peak_bytes"]) if result.get("peak_bytes") else "-"
        progress(i, mode, f"{result['status']}, peak {peak} ({time.perf_counter() - start:.0f} s)")
        return result

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
        done = rows[mode]
        if lock is not None and (done["status"] not in ("ok", "skipped: needs CUDA") or done["alloc_retries"]):
            progress(i, mode, "measuring again alone (it failed or retried allocations beside other modes)")
            rows[mode] = one(i, mode, None)
            on_row([rows[m] for m in chosen])
    return [rows[m] for m in chosen]


def _run_mode(args, mode: str, nproc: int, lock: str | None) -> dict:
    cmd = torchrun(nproc, "-m", "benchmarks.performance.compare", "--worker", mode, *_forwarded(args))
    if lock is not None:
        cmd += ["--turn-lock", lock]
    # A session of its own: at the timeout torchrun and every rank it started end together.
    with subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    ) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, _ = proc.communicate()
            ranks = runtime.read_results(stdout)
            return row(
                mode,
                status=f"timeout after {args.timeout:g} s",
                estimated_peak_bytes=max((r["estimated_peak_bytes"] or 0 for r in ranks), default=None),
            )
    ranks = runtime.read_results(stdout)
    if not ranks:
        return row(mode, status=f"error: {_last_line(stderr)}")
    return merge(mode, ranks)


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
    if args.vectorize_window_masks:
        out.append("--vectorize-window-masks")
    if args.n_layers is not None:
        out += ["--n-layers", str(args.n_layers)]
    if args.memory_cap_gb is not None:
        out += ["--memory-cap-gb", str(args.memory_cap_gb)]
    return out


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith(("W1", "warnings.warn"))]
    errors = [ln for ln in lines if "Error" in ln or "error" in ln]
    return (errors or lines or ["no output"])[-1][:300]
