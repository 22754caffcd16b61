"""Accuracy of ``estimate_step`` against the measured peak of a real forward and backward.

One configuration per process (a fresh ``torchrun`` for Thunder's fsdp), so that no run's caches shape another's:

    python -m benchmarks.correctness.accuracy --device cuda --model stablecode-completion-alpha-3b --n-layers 4 \\
        --block-size 4096 --mode jit
    torchrun --nproc-per-node 2 -m benchmarks.correctness.accuracy --device cuda ... --mode fsdp --shard zero2

and a matrix of them, printed as a Markdown table (and written with ``--out``):

    python -m benchmarks.correctness.accuracy --matrix --device cuda --n-layers 4 32 --block-size 4096 8192 \\
        --modes jit fsdp-zero2 fsdp-zero3 --nproc-per-node 2 --out docs/accuracy-gpu.md

Measured: ``torch.cuda.max_memory_allocated()`` on GPU, the profiler's live bytes on CPU (``CPUMemory``, as
``report --measure``), over one forward and backward
after warm-up (gradients set to None between steps, no optimizer), maximum over ranks. Estimated:
``estimate_step(jitted).peak_bytes``; beside it Thunder's own ``get_alloc_memory`` (the larger of its forward and
backward figures).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.launch import torchrun
from benchmarks.options import add_override
from thunder_fsdp_mem.training import runtime


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--model", default="stablecode-completion-alpha-3b", help="litgpt configuration name")
    p.add_argument("--n-layers", type=int, nargs="+", default=[4])
    p.add_argument("--block-size", type=int, nargs="+", default=[4096])
    p.add_argument("--micro-batch-size", type=int, default=1)
    add_override(p)
    p.add_argument("--transform", action="store_true", help="compile with FSDPMemoryTransform() (default: without)")
    p.add_argument(
        "--vectorize-window-masks",
        action="store_true",
        help="sliding-window masks by one comparison (thunder_fsdp_mem.vectorize_window_masks), not litgpt's loop",
    )
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--mode", choices=("jit", "fsdp"), default="jit", help="one configuration: thunder.jit or fsdp")
    p.add_argument("--shard", choices=runtime.SHARDS, default="zero2")
    p.add_argument("--executors", choices=runtime.EXECUTOR_CHOICES, default="default+cat")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--probe-dump", metavar="DIR", help="also record memory after every bound symbol into DIR")
    p.add_argument("--matrix", action="store_true", help="run every combination, one process each")
    p.add_argument("--modes", nargs="+", default=["jit", "fsdp-zero2"], help="matrix modes: jit fsdp-zero2 fsdp-zero3")
    p.add_argument("--nproc-per-node", type=int, default=2)
    p.add_argument("--parallel", type=int, default=1, help="matrix: single-process runs at once (one GPU each)")
    p.add_argument("--out", help="matrix: write the Markdown table here")
    p.add_argument("--json", help="matrix: write the results as JSON here")
    return p


def run_one(args) -> dict:
    import thunder
    import torch
    from thunder.examine.memory_calculation import get_alloc_memory

    from thunder_fsdp_mem import FSDPMemoryTransform, estimate_step
    from thunder_fsdp_mem.training import litgpt_models

    rank = runtime.init_distributed(args.device)
    spec = litgpt_models.ModelSpec(
        name=args.model,
        n_layers=args.n_layers[0],
        block_size=args.block_size[0],
        overrides=litgpt_models.parse_overrides(args.override),
        vectorized_window_masks=args.vectorize_window_masks,
    )
    model = litgpt_models.build(spec, dtype=litgpt_models.DTYPES[args.dtype], device=rank.device)
    idx, targets = litgpt_models.batch(spec, micro_batch_size=args.micro_batch_size, device=rank.device)
    samples: list[tuple[int, int, int, int]] = []
    transforms = [FSDPMemoryTransform()] if args.transform else []
    if args.probe_dump:
        from thunder_fsdp_mem.predict.probes import MemoryProbeTransform

        def record(tag: int, index: int) -> None:
            samples.append((tag, index, torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()))
            torch.cuda.reset_peak_memory_stats()

        transforms.append(MemoryProbeTransform(record))
    t0 = time.perf_counter()
    jitted = thunder.jit(model, executors=runtime.executors(args.executors), transforms=transforms)
    if args.mode == "fsdp":
        jitted = runtime.thunder_fsdp(jitted, shard=args.shard, device=rank.device)
    params = list(jitted.parameters())

    def step():
        jitted(idx, targets).backward()
        for p in params:
            p.grad = None

    for _ in range(args.warmup):
        step()
    compile_s = time.perf_counter() - t0
    samples.clear()
    if args.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        t1 = time.perf_counter()
        jitted(idx, targets).backward()
        torch.cuda.synchronize()
        step_ms = (time.perf_counter() - t1) * 1e3
        measured = torch.cuda.max_memory_allocated()
        for p in params:
            p.grad = None
    else:  # the profiler's live bytes: MemTracker's dispatch mode would have Dynamo run torch.compile's regions
        # as other programs (``--executors fused``); ``CPUMemory`` sees what the compiled regions allocate
        from thunder_fsdp_mem.predict.cpu_memory import CPUMemory

        before = sum(p.untyped_storage().nbytes() for p in params) + idx.nbytes + targets.nbytes
        t1 = time.perf_counter()
        with CPUMemory(jitted, idx, targets) as memory:
            jitted(idx, targets).backward()
        step_ms = (time.perf_counter() - t1) * 1e3
        measured = memory.peak_bytes
    estimate = estimate_step(jitted)
    forward, backward = thunder.last_traces(jitted)[-1], thunder.last_backward_traces(jitted)[-1]
    thunder_estimate = max(get_alloc_memory(forward)[0], get_alloc_memory(backward)[0])
    result = {
        "model": args.model,
        "n_layers": spec.config().n_layer,
        "block_size": spec.block_size,
        "mode": args.mode if args.mode == "jit" else f"fsdp-{args.shard}",
        "device": args.device,
        "world_size": rank.world_size,
        "rank": rank.rank,
        "executors": args.executors,
        "dtype": args.dtype,
        "measured_peak_bytes": int(measured),
        "estimated_peak_bytes": int(estimate.peak_bytes),
        "thunder_get_alloc_memory_bytes": int(thunder_estimate),
        "allocated_before_step": int(before),
        "estimated_persistent_bytes": int(estimate.persistent_bytes),
        "peak_phase": estimate.peak_phase,
        "peak_symbol": estimate.peak_symbol,
        "compile_s": round(compile_s, 1),
        "step_ms": round(step_ms, 1),
        "forward_bsyms": len(forward.bound_symbols),
        "backward_bsyms": len(backward.bound_symbols),
    }
    if args.probe_dump and rank.rank == 0:
        _dump_probes(Path(args.probe_dump), samples, estimate, forward, backward)
    return result


def _dump_probes(out: Path, samples, estimate, forward, backward) -> None:
    """Measured memory after each bound symbol beside the prediction, and the traces, for offline study."""
    out.mkdir(parents=True, exist_ok=True)
    dump = {"samples": samples}
    for tag, name, timeline, trace in (
        (0, "forward", estimate.forward, forward),
        (1, "backward", estimate.backward, backward),
    ):
        dump[name] = {
            "timeline": timeline.timeline,
            "op_peaks": timeline.op_peaks,
            "symbols": timeline.symbols,
            "lines": [str(b).split("\n")[0][:300] for b in trace.bound_symbols],
        }
        (out / f"{name}_trace.py").write_text(str(trace))
    dump["outside_bytes"] = {phase.name: phase.outside_bytes for phase in estimate.phases}
    (out / "probes.json").write_text(json.dumps(dump))


def run_matrix(args) -> list[dict]:
    runs = []
    for n_layers in args.n_layers:
        for block_size in args.block_size:
            for mode in args.modes:
                runs.append((n_layers, block_size, mode))
    results: list[dict] = []
    single = [r for r in runs if r[2] == "jit"]
    multi = [r for r in runs if r[2] != "jit"]
    for batch_start in range(0, len(single), args.parallel):
        procs = []
        for slot, (n_layers, block_size, mode) in enumerate(single[batch_start : batch_start + args.parallel]):
            env = dict(os.environ)
            if args.device == "cuda":
                env["CUDA_VISIBLE_DEVICES"] = str(slot)
            cmd = [
                sys.executable,
                "-m",
                "benchmarks.correctness.accuracy",
                *_common(args, n_layers, block_size),
                "--mode",
                "jit",
            ]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
        for proc, run in zip(procs, single[batch_start : batch_start + args.parallel]):
            out, err = proc.communicate()
            results.append(_collect(run, out, err, proc.returncode))
    for n_layers, block_size, mode in multi:
        cmd = torchrun(
            args.nproc_per_node,
            "-m",
            "benchmarks.correctness.accuracy",
            *_common(args, n_layers, block_size),
            "--mode",
            "fsdp",
            "--shard",
            mode.split("-")[1],
        )
        proc = subprocess.run(cmd, capture_output=True, text=True)
        results.append(_collect((n_layers, block_size, mode), proc.stdout, proc.stderr, proc.returncode))
    return results


def _common(args, n_layers: int, block_size: int) -> list[str]:
    return [
        "--device",
        args.device,
        "--model",
        args.model,
        "--n-layers",
        str(n_layers),
        "--block-size",
        str(block_size),
        "--micro-batch-size",
        str(args.micro_batch_size),
        "--dtype",
        args.dtype,
        "--executors",
        args.executors,
        "--warmup",
        str(args.warmup),
        *[f"--override={o}" for o in args.override],
        *(["--vectorize-window-masks"] if args.vectorize_window_masks else []),
        *(["--transform"] if args.transform else []),
    ]


def _collect(run, out: str, err: str, returncode: int) -> dict:
    rows = runtime.read_results(out)
    if returncode != 0 or not rows:
        last = (err.strip().splitlines() or ["no output"])[-1]
        print(f"[accuracy] {run}: failed: {last}", file=sys.stderr, flush=True)
        return {"n_layers": run[0], "block_size": run[1], "mode": run[2], "error": last}
    row = max(rows, key=lambda r: r["measured_peak_bytes"])
    row["estimated_peak_bytes"] = max(r["estimated_peak_bytes"] for r in rows)
    print(
        f"[accuracy] {run}: measured {row['measured_peak_bytes'] / 2**30:.2f} GiB, "
        f"estimated {row['estimated_peak_bytes'] / 2**30:.2f} GiB",
        file=sys.stderr,
        flush=True,
    )
    return row


def markdown(results: list[dict]) -> str:
    from thunder_fsdp_mem.units import format_bytes

    lines = [
        "| model | layers | tokens | dtype | mode | measured peak | estimate_step | error "
        "| Thunder get_alloc_memory | its error |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| | {r['n_layers']} | {r['block_size']} | | {r['mode']} | failed: {r['error']} | | | | |")
            continue
        m, e, g = r["measured_peak_bytes"], r["estimated_peak_bytes"], r["thunder_get_alloc_memory_bytes"]
        lines.append(
            f"| {r['model']} | {r['n_layers']} | {r['block_size']} | {r.get('dtype', 'bf16')} | {r['mode']} | "
            f"{format_bytes(m)} | "
            f"{format_bytes(e)} | {100 * (e - m) / m:+.2f}% | {format_bytes(g)} | {100 * (g - m) / m:+.1f}% |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.matrix:
        results = run_matrix(args)
        table = markdown(results)
        print(table)
        if args.out:
            Path(args.out).write_text(table + "\n")
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
        return 0
    result = run_one(args)
    runtime.print_result(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
