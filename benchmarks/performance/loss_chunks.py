"""The eager loss alone: ``chunked_linear_cross_entropy`` at several chunk counts beside Liger's and Cut
Cross-Entropy's fused linear cross-entropy, forward and backward on one model's head, so that the default chunk
count is chosen from measurements. Per row: the median time of ``--steps`` forward+backward passes (after
``--warmup``) and the peak allocated above what the inputs hold.

    python -m benchmarks.performance.loss_chunks --model Llama-3.2-1B --tokens 8192 --chunks 0 32 16 8 4 2 \
        --json loss-chunks.json

``--chunks 0`` is the function's default count. A diagnosis of the loss alone; the step's figures (Table 18a) are
``compare.py``'s, where the loss is one part of a training step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from thunder_fsdp_mem.training import loss_placement


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="Llama-3.2-1B", help="litgpt configuration name (its head's shape)")
    p.add_argument("--tokens", type=int, default=8192, help="rows of hidden states")
    p.add_argument("--chunks", type=int, nargs="+", default=[0], help="chunk counts of ours (0: the default)")
    p.add_argument(
        "--external", nargs="*", default=["liger", "cce"], help="fused losses beside ours: liger, cce, cce-exact"
    )
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--profile", type=int, default=0, help="list each row's N longest kernels (torch.profiler)")
    p.add_argument("--json", default=None)
    return p


def _loss_fn(kind: str, chunks: int, softcap):
    from thunder_fsdp_mem.loss.function import chunked_linear_cross_entropy

    if kind == "chunked":
        return lambda h, w, t: chunked_linear_cross_entropy(h, w, t, softcap=softcap, chunks=chunks or None)
    if kind == "liger":
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss(softcap=softcap)
        return lambda h, w, t: liger(w, h, t)
    from cut_cross_entropy import linear_cross_entropy

    filter_eps = None if kind == "cce-exact" else "high"  # ``loss_placement``: cce-exact computes every block
    return lambda h, w, t: linear_cross_entropy(h, w, t, softcap=softcap, filter_eps=filter_eps)


def measure(kind: str, chunks: int, args, config) -> dict:
    import torch

    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(args.tokens, config.n_embd, device=device, dtype=torch.bfloat16, generator=gen)
    weight = (0.02 * torch.randn(config.padded_vocab_size, config.n_embd, device=device, generator=gen)).bfloat16()
    targets = torch.randint(0, config.padded_vocab_size, (args.tokens,), device=device, generator=gen)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    fn = _loss_fn(kind, chunks, config.final_logit_softcapping)
    times = []
    for i in range(args.warmup + args.steps):
        hidden.grad = weight.grad = None
        if i == args.warmup:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn(hidden, weight, targets).backward()
        torch.cuda.synchronize()
        if i >= args.warmup:
            times.append((time.perf_counter() - start) * 1e3)
    row = {
        "loss": kind,
        "chunks": chunks,
        "ms": statistics.median(times),
        "peak_above_inputs_mib": (torch.cuda.max_memory_allocated() - base) / 2**20,
    }
    if args.profile:

        def step():
            hidden.grad = weight.grad = None
            fn(hidden, weight, targets).backward()

        row["kernels"] = _kernels(step, args.profile)
    return row


def _kernels(step, top: int, n: int = 3) -> list[tuple[str, float, float]]:
    """The ``top`` kernels of ``step`` by GPU time: (name, ms a step, launches a step), over ``n`` profiled steps."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            entry = totals.setdefault(ev.name, [0.0, 0.0])
            entry[0] += ev.device_time_total / 1e3 / n
            entry[1] += 1 / n
    return sorted(((name, ms, count) for name, (ms, count) in totals.items()), key=lambda t: -t[1])[:top]


def main(argv=None) -> int:
    from litgpt import Config

    args = parser().parse_args(argv)
    config = Config.from_name(args.model)
    rows = [("chunked", c) for c in args.chunks]
    rows += [(kind, 0) for kind in args.external if loss_placement.available(kind)]
    results = []
    for kind, chunks in rows:
        row = measure(kind, chunks, args, config)
        results.append(row)
        label = f"chunked, {chunks or 'default'} chunks" if kind == "chunked" else kind
        print(f"{label:<24} {row['ms']:8.2f} ms  peak above inputs {row['peak_above_inputs_mib']:9.1f} MiB", flush=True)
        for name, ms, count in row.get("kernels", []):
            print(f"    {ms:8.3f} ms {count:5.1f}x  {name[:120]}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "tokens": args.tokens, "rows": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
