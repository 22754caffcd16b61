"""Where a training step's time goes, per mode: the forward (with the loss), the backward and the optimizer step
timed apart, and the GPU's kernels grouped by kind (matmuls, attention, fused Triton kernels, other ATen kernels,
the optimizer's, copies) and by phase from ``torch.profiler``, with the time the GPU sat idle (the profiled steps
drain the device after each phase, as the timed ones do). One process per mode, as in ``compare.py``, under a
one-rank ``torchrun`` for the FSDP2 modes; ``--trace-dir`` keeps each mode's profile as a Chrome trace. Modes take
``compare.py``'s options (``thunder+mem@ex=fused@budget=13GiB``, ``inductor@amb=0.5``, ``@loss=trace``).

    python -m benchmarks.performance.profile_step --n-layers 12 --block-size 8192 \
        --modes thunder@ex=fused,inductor --json profile.json

A diagnosis, not a table for ``docs/results.md``: the profiler's own overhead lengthens the profiled steps, so the
step times to quote are ``compare.py``'s (the unprofiled phase times here are printed beside them).
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict

from benchmarks.launch import torchrun
from benchmarks.variants import split_variant

KINDS = (  # (kind, substrings of the kernel's name), first match wins
    ("attention", ("flash", "fmha", "attention", "attn")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "splitk")),
    ("optimizer", ("multi_tensor", "foreach", "adam")),
    ("triton", ("triton",)),
    ("copy", ("memcpy", "memset", "copy")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, parts in KINDS:
        if any(p in low for p in parts):
            return kind
    return "other aten"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="stablecode-completion-alpha-3b")
    p.add_argument("--n-layers", type=int, default=12)
    p.add_argument("--block-size", type=int, default=8192)
    p.add_argument("--modes", default="thunder@ex=fused,inductor")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--top", type=int, default=25, help="kernels listed per mode")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a smoke run (no GPU kernels)")
    p.add_argument("--vectorize-window-masks", action="store_true", help="as compare.py's")
    p.add_argument("--json", default=None)
    p.add_argument("--trace-dir", default=None, help="write each mode's profiled steps as a Chrome trace here")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.worker is not None:
        return worker(args)
    rows = []
    for mode in args.modes.split(","):
        program = ["-m", "benchmarks.performance.profile_step"]
        cmd = [
            *(torchrun(1, *program) if split_variant(mode).base.startswith("fsdp2") else [sys.executable, *program]),
            "--worker",
            mode,
            "--model",
            args.model,
            "--n-layers",
            str(args.n_layers),
            "--block-size",
            str(args.block_size),
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
            "--top",
            str(args.top),
            "--device",
            args.device,
        ]
        if args.trace_dir:
            cmd += ["--trace-dir", args.trace_dir]
        if args.vectorize_window_masks:
            cmd.append("--vectorize-window-masks")
        done = subprocess.run(cmd, capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("PROFILE ")]
        if done.returncode != 0 or not lines:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            print(f"{mode}: failed: {' | '.join(tail)}", flush=True)
            continue
        row = json.loads(lines[-1][len("PROFILE ") :])
        rows.append(row)
        print(render(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def annotation(ev) -> bool:
    """A range the profiler draws on the GPU's timeline for a CPU-side annotation, not a kernel: its time
    overlaps the kernels it spans (torch 2.11's events do not all carry ``is_user_annotation``)."""
    return bool(getattr(ev, "is_user_annotation", False)) or ev.name.startswith(("Optimizer.", "ProfilerStep"))


def render(row: dict) -> str:
    idle = row["profiled_ms"] - row["busy_ms"]
    out = [
        f"== {row['mode']}: step {row['step_ms']:.1f} ms (forward+loss {row['forward_ms']:.1f}, backward "
        f"{row['backward_ms']:.1f}, optimizer {row['optimizer_ms']:.1f}); profiled step "
        f"{row['profiled_ms']:.1f} ms, GPU busy {row['busy_ms']:.1f} ms, idle {idle:.1f} ms, "
        f"{row['kernels']:.0f} kernels a step"
    ]
    for kind, ms in sorted(row["by_kind"].items(), key=lambda kv: -kv[1]):
        out.append(f"   {kind:<12} {ms:8.2f} ms  {row['count_by_kind'][kind]:6.0f} kernels")
    for phase, kinds in row["by_phase"].items():
        parts = ", ".join(f"{kind} {ms:.2f}" for kind, ms in sorted(kinds.items(), key=lambda kv: -kv[1]))
        out.append(f"   {phase} kernels: {sum(kinds.values()):.2f} ms ({parts})")
    for name, ms, count in row["top"]:
        out.append(f"   {ms:8.2f} ms {count:5.0f}x  {name[:140]}")
    if row.get("contended"):
        out.append("   kernels beside another stream's (ms a step: their time, and of it beside the other stream):")
    for name, ms, beside in row.get("contended", []):
        out.append(f"   {ms:8.2f} ms {beside:6.2f} ms  {name[:130]}")
    return "\n".join(out)


def contended(events: list[dict], steps: int) -> list[tuple[str, float, float]]:
    """From a Chrome trace's ``events``: the kernels (and copies) that ran while another stream's were running (an
    FSDP2 collective's copies beside the compute stream's kernels, which then share the memory bandwidth), as
    ``(name, ms a step, of which ms beside another stream)``, most overlapped first; ``steps``: the profiled steps."""
    gpu = sorted(
        (e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
        key=lambda e: e["ts"],
    )
    starts = [e["ts"] for e in gpu]
    longest = max((e["dur"] for e in gpu), default=0.0)
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for e in gpu:
        start, end, stream = e["ts"], e["ts"] + e["dur"], e.get("args", {}).get("stream")
        beside = 0.0
        for other in gpu[bisect.bisect_left(starts, start - longest) : bisect.bisect_left(starts, end)]:
            if other.get("args", {}).get("stream") != stream:
                beside += max(0.0, min(end, other["ts"] + other["dur"]) - max(start, other["ts"]))
        totals[e["name"]][0] += e["dur"]
        totals[e["name"]][1] += min(beside, e["dur"])
    rows = [(name, us / 1e3 / steps, near / 1e3 / steps) for name, (us, near) in totals.items() if near > 0]
    return sorted(rows, key=lambda r: -r[2])


PHASE_MARK = "profile_step:"
PHASES = ("forward", "backward", "optimizer")


def one_step(trainer, idx, targets, sync, mark=lambda phase: contextlib.nullcontext()) -> dict[str, float]:
    """One training step in three phases, the device drained after each so that each phase's kernels run inside
    its ``mark`` range: the forward with the loss, the backward, the optimizer step. Milliseconds per phase."""
    import torch

    times = {}
    sync()
    start = time.perf_counter()
    with mark("forward"):
        if trainer.loss == "eager":
            logits = trainer.model(idx)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
            del logits
        else:  # the loss computed by the model (in its trace, or a fused loss after it)
            loss = trainer.model(idx, targets)
        sync()
    times["forward_ms"] = (time.perf_counter() - start) * 1e3
    with mark("backward"):
        loss.backward()
        sync()
    times["backward_ms"] = (time.perf_counter() - start) * 1e3 - times["forward_ms"]
    with mark("optimizer"):
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)
        sync()
    times["step_ms"] = (time.perf_counter() - start) * 1e3
    times["optimizer_ms"] = times["step_ms"] - times["forward_ms"] - times["backward_ms"]
    return times


def phase_of(start: float, marks: list[tuple[float, float, str]]) -> str:
    """The phase whose range holds a kernel's start (a phase drains the device before its range ends)."""
    for begin, end, phase in marks:
        if begin <= start <= end:
            return phase
    return "outside"


def worker(args) -> int:
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from thunder_fsdp_mem.config import MemoryConfig
    from thunder_fsdp_mem.training import litgpt_models, modes, runtime

    variant = split_variant(args.worker)
    rank = runtime.init_distributed(args.device)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    spec = litgpt_models.ModelSpec(
        name=args.model,
        n_layers=args.n_layers,
        block_size=args.block_size,
        vectorized_window_masks=args.vectorize_window_masks,
    )
    trainer = modes.build(
        variant.base,
        spec,
        rank,
        executors=variant.executors or "default+cat",
        memory=MemoryConfig(**variant.memory),
        activation_memory_budget=variant.amb,
        loss=variant.loss,
    )
    idx, targets = litgpt_models.batch(spec, device=rank.device)
    for _ in range(args.warmup):
        trainer.step(idx, targets)
    phases = defaultdict(list)
    for _ in range(args.steps):
        for name, ms in one_step(trainer, idx, targets, sync).items():
            phases[name].append(ms)
    n = 3
    sync()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(n):
            one_step(trainer, idx, targets, sync, mark=lambda phase: record_function(PHASE_MARK + phase))
        profiled = (time.perf_counter() - t0) / n
    shared = []
    if args.trace_dir:
        os.makedirs(args.trace_dir, exist_ok=True)
        path = os.path.join(args.trace_dir, "".join(c if c.isalnum() else "_" for c in args.worker) + ".json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            shared = contended(json.load(f)["traceEvents"], n)[: args.top]
    events = prof.events()
    marks = [
        (ev.time_range.start, ev.time_range.end, ev.name[len(PHASE_MARK) :])
        for ev in events
        if ev.name.startswith(PHASE_MARK) and ev.device_type == torch.autograd.DeviceType.CPU
    ]
    per_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    by_phase: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for ev in events:
        # kernels only: not the ranges that annotate the GPU's timeline (``Optimizer.step#AdamW.step``)
        if ev.device_type == torch.autograd.DeviceType.CUDA and not annotation(ev):
            ms = ev.device_time_total / 1e3 / n  # ms a step
            entry = per_name[ev.name]
            entry[0] += ms
            entry[1] += 1 / n
            by_phase[phase_of(ev.time_range.start, marks)][kind_of(ev.name)] += ms
    by_kind: dict[str, float] = defaultdict(float)
    count_by_kind: dict[str, float] = defaultdict(float)
    for name, (ms, count) in per_name.items():
        by_kind[kind_of(name)] += ms
        count_by_kind[kind_of(name)] += count
    top = sorted(((name, ms, count) for name, (ms, count) in per_name.items()), key=lambda t: -t[1])[: args.top]
    row = {
        "mode": args.worker,
        **{k: statistics.median(v) for k, v in phases.items()},
        "profiled_ms": profiled * 1e3,
        "busy_ms": sum(by_kind.values()),
        "kernels": sum(count_by_kind.values()),
        "by_kind": by_kind,
        "by_phase": by_phase,
        "count_by_kind": count_by_kind,
        "top": top,
        "contended": shared,
        "peak_bytes": torch.cuda.max_memory_allocated() if args.device == "cuda" else None,
    }
    sys.stdout.write("PROFILE " + json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
