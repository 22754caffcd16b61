"""Thunder's own benchmark script, ``thunder/benchmarks/benchmark_litgpt.py`` (shipped in the lightning-thunder
wheel), run unmodified: each row one fresh ``torchrun`` of it, plain or through the runner (``thunder-fsdp-mem run``),
side by side with torch.compile, on one GPU::

    python -m benchmarks.performance.litgpt_script --n-layers 12 --block-size 8192 --out $OUT/script.jsonl \\
        [--model stablecode-completion-alpha-3b] [--distributed-mode fsdp2] [--shard-mode zero2] \\
        [--rows inductor thunder_inductor_cat_cudnn_dynamo thunder_inductor_cat_cudnn_dynamo+ours ...] \\
        [--max-iters 10] [--warmup-iters 3] [--timeout 900]

A row is the script's ``--compile`` option, then what the runner adds: ``+ours`` runs it through the runner with
the transform's defaults, ``+fused`` also with ``--executors fused`` (the runner's change of the program's
executors). ``inductor+ours`` is torch.compile through the runner: a program that builds no Thunder function.

Figures are the script's own (``--return_metrics_as_json``): ``memory_used_GB``, ``max_memory_allocated`` over the
whole run / 1e9, and ``average_iter_time`` over the iterations after the warm-up; through the runner also its
record (``max_memory_reserved``, allocation retries, each transform's line). A row that runs out of memory says so.
Each row is appended to ``--out`` (JSON lines) as it ends, so that a cut run keeps what it measured; the table
(``x tc``: the row's figure over the ``inductor`` row's) is printed at the end.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.launch import torchrun
from benchmarks.options import UsageError, UsageParser

DEFAULT_ROWS = (
    "inductor",
    "thunder_inductor_cat_cudnn_dynamo",
    "thunder_inductor_cat_cudnn_dynamo+ours",
    "thunder_inductor_dynamo",
    "thunder_inductor_dynamo+ours",
    "thunder_dynamo",
    "thunder_dynamo+ours",
    "thunder_inductor_cat_cudnn_dynamo+fused",
    "inductor+ours",
)
RUNNER = ("-m", "thunder_fsdp_mem.run")
_OOM = ("OutOfMemoryError", "CUDA out of memory")


def script_path() -> str:
    """Where the installed lightning-thunder keeps ``benchmark_litgpt.py`` (found without importing it: the module
    sets up CUDA when imported)."""
    spec = importlib.util.find_spec("thunder.benchmarks.benchmark_litgpt")
    if spec is None or spec.origin is None:
        raise UsageError("thunder/benchmarks/benchmark_litgpt.py is not installed with lightning-thunder")
    return spec.origin


def command(row: str, args, json_path: str, record_path: str) -> list[str]:
    """The ``torchrun`` command of ``row`` (see the module's docstring)."""
    compile_option, *extras = row.split("+")
    unknown = set(extras) - {"ours", "fused"}
    if unknown or ("fused" in extras and "ours" in extras):
        raise UsageError(f"row {row!r}: a --compile option, then +ours or +fused")
    script = [
        script_path(),
        "--model_name", args.model,
        "--n_layers", str(args.n_layers),
        "--block_size", str(args.block_size),
        "--distributed_mode", args.distributed_mode,
        "--shard_mode", args.shard_mode,
        "--compile", compile_option,
        "--max_iters", str(args.max_iters),
        "--warmup_iters", str(args.warmup_iters),
        "--return_metrics_as_json", "True",
        "--json_path", json_path,
    ]  # fmt: skip
    if not extras:
        return torchrun(1, *script)
    runner = [*RUNNER, "--json", record_path]
    if "fused" in extras:
        runner += ["--executors", "fused"]
    return torchrun(1, *runner, "--", *script)


def run_row(row: str, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        metrics, record = os.path.join(tmp, "metrics.json"), os.path.join(tmp, "record.json")
        cmd = command(row, args, metrics, record)
        started = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            out, code = proc.stdout + proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as e:
            out, code = f"{e.stdout or ''}{e.stderr or ''}timed out after {args.timeout} s", None
        result = {"row": row, "command": " ".join(cmd), "exit_code": code, "seconds": time.perf_counter() - started}
        if os.path.exists(metrics):
            result["metrics"] = json.loads(Path(metrics).read_text())
        if os.path.exists(record):
            result["record"] = json.loads(Path(record).read_text())
        result["out_of_memory"] = any(s in out for s in _OOM)
        result["tail"] = out[-3000:]
        return result


def table(rows: list[dict]) -> str:
    """The rows as a markdown table, each figure beside the ``inductor`` row's."""
    base = next((r.get("metrics") for r in rows if r["row"] == "inductor" and r.get("metrics")), None)
    lines = [
        "| row | memory_used_GB | x tc | iter ms | x tc | max reserved GiB | transform |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        m = r.get("metrics")
        if m is None:
            why = "out of memory" if r["out_of_memory"] else f"failed (exit {r['exit_code']})"
            lines.append(f"| {r['row']} | {why} | | | | | |")
            continue
        mem, ms = m["memory_used_GB"], m["average_iter_time"]
        rel_mem = f"{mem / base['memory_used_GB']:.2f}" if base else ""
        rel_ms = f"{ms / base['average_iter_time']:.3f}" if base else ""
        rec = r.get("record") or {}
        reserved = f"{rec['cuda']['max_reserved'] / 2**30:.2f}" if rec.get("cuda") else ""
        changed = sum(1 for c in rec.get("compiled", ()) if c["applied"] or c["notes"])
        what = f"{changed} of {len(rec['compiled'])} functions changed" if rec else ""
        lines.append(f"| {r['row']} | {mem:.2f} | {rel_mem} | {ms:.1f} | {rel_ms} | {reserved} | {what} |")
    return "\n".join(lines)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = UsageParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="stablecode-completion-alpha-3b", help="litgpt model name (the script's)")
    p.add_argument("--n-layers", type=int, required=True, help="the script's --n_layers")
    p.add_argument("--block-size", type=int, required=True, help="the script's --block_size (tokens)")
    p.add_argument("--distributed-mode", default="fsdp2", help="the script's --distributed_mode (default fsdp2)")
    p.add_argument("--shard-mode", default="zero2", help="the script's --shard_mode (default zero2)")
    p.add_argument("--rows", nargs="+", default=list(DEFAULT_ROWS), help="COMPILE[+ours|+fused] (module docstring)")
    p.add_argument("--max-iters", type=int, default=10, help="the script's --max_iters (default 10)")
    p.add_argument("--warmup-iters", type=int, default=3, help="the script's --warmup_iters (default 3)")
    p.add_argument("--timeout", type=int, default=900, help="seconds one row may take (default 900)")
    p.add_argument("--out", type=Path, required=True, help="append each row as a JSON line here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse(argv)
        for row in args.rows:
            command(row, args, "", "")  # every row checked before the first runs
    except UsageError as e:
        print(f"litgpt_script: error: {e}", file=sys.stderr)
        return 2
    rows = []
    for row in args.rows:
        result = run_row(row, args)
        rows.append(result)
        with args.out.open("a") as f:
            f.write(json.dumps(result) + "\n")
        m = result.get("metrics") or {}
        print(f"{row}: exit {result['exit_code']}, {m.get('memory_used_GB')} GB, {m.get('average_iter_time')} ms, "
              f"{result['seconds']:.0f} s", flush=True)  # fmt: skip
        if result.get("record"):
            print("  " + "\n  ".join(c["line"] for c in result["record"]["compiled"][:3]), flush=True)
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
