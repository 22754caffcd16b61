"""Training curves of several modes on one fixed data stream, side by side: do their losses stay together?

    python -m benchmarks.correctness.curves --model stablecode-completion-alpha-3b --n-layers 12 --block-size 4096 \\
        --steps 200 --modes fsdp2-thunder+mem@ex=fused,fsdp2-thunder+mem@ex=fused@fr=0,fsdp2-inductor \\
        --json curves.json --plot curves.png

Each mode (``benchmarks/performance/compare.py``'s names and ``@`` options) trains the same litgpt model from the same
initialisation (seed 0, bf16, AdamW at ``--lr``) for ``--steps`` steps in a fresh ``torchrun`` of its own; the modes
run at once (``--jobs``; their memory and time are not what this measures). A step is the benchmarks' (forward,
eager cross-entropy, backward, AdamW) with the loss computed in float32, whose value is recorded (a bf16 loss
resolves 0.06 at 10); with ``@loss=`` the loss the step computes, in the logits' dtype. Every rank reads the same
batches:
sequences of a first-order Markov chain over the first ``ACTIVE`` token ids, each token followed by one of
``SUCCESSORS`` tokens drawn for it once from a seeded generator, so the loss falls from about ln(vocabulary) towards
ln(SUCCESSORS) as a model learns the tokens used and then their successors. The stream depends on the seed only, not
on the machine.

Prints, for every two modes, the largest difference between their losses at a step and the step it is at, and the
mean difference over the last 20 steps; ``--json`` keeps every loss, ``--plot`` draws the curves and their
differences from the first mode.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.launch import torchrun
from benchmarks.options import UsageError, UsageParser
from benchmarks.variants import split_variant
from thunder_fsdp_mem.config import MemoryConfig
from thunder_fsdp_mem.training import modes as mode_table
from thunder_fsdp_mem.training import runtime

SUCCESSORS = 8
ACTIVE = 1024  # token ids the chain runs over: learnt within a few hundred steps
SEED = 1234
TAIL = 20


def parser() -> argparse.ArgumentParser:
    p = UsageParser(description="Training curves of several modes on one fixed data stream.")
    p.add_argument("--model", default="stablecode-completion-alpha-3b", help="litgpt configuration name")
    p.add_argument("--n-layers", type=int, default=None, help="number of blocks (default: the model's)")
    p.add_argument("--block-size", type=int, default=4096, help="sequence length of a step (default 4096)")
    p.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    p.add_argument("--lr", type=float, default=3e-4, help="AdamW's learning rate (default 3e-4)")
    p.add_argument(
        "--modes",
        default="fsdp2-thunder+mem@ex=fused,fsdp2-thunder+mem@ex=fused@fr=0,fsdp2-inductor",
        help="comma-separated modes of benchmarks/performance/compare.py (default: FSDP2 through ThunderFX, fused, "
        "with the default transform and with fusion_rematerialize off, and FSDP2 + torch.compile)",
    )
    p.add_argument("--nproc-per-node", type=int, default=1, help="ranks per mode (default 1)")
    p.add_argument("--shard", choices=runtime.SHARDS, default="zero2", help="FSDP sharding (default zero2)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cuda (NCCL) or cpu (gloo)")
    p.add_argument("--jobs", type=int, default=3, help="modes run at once (default 3)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds a mode may take (default 1800)")
    p.add_argument("--json", metavar="PATH", help="write the configuration and every loss as JSON")
    p.add_argument("--plot", metavar="PATH", help="write the curves and their differences (PNG or SVG)")
    p.add_argument("--worker", metavar="MODE", help=argparse.SUPPRESS)
    return p


def stream(vocab_size: int, tokens: int, steps: int, seed: int = SEED) -> list[list[int]]:
    """``steps`` sequences of ``tokens + 1`` token ids (inputs, then targets shifted by one) of the Markov chain
    described in the module's docstring."""
    import random

    rng = random.Random(seed)
    active = min(vocab_size, ACTIVE)
    successors = [[rng.randrange(active) for _ in range(SUCCESSORS)] for _ in range(active)]
    out = []
    for _ in range(steps):
        token = rng.randrange(active)
        sequence = [token]
        for _ in range(tokens):
            token = successors[token][rng.randrange(SUCCESSORS)]
            sequence.append(token)
        out.append(sequence)
    return out


def worker(args) -> int:
    import torch

    from thunder_fsdp_mem.training import litgpt_models

    rank = runtime.init_distributed(args.device)
    variant = split_variant(args.worker)
    spec = litgpt_models.ModelSpec(name=args.model, n_layers=args.n_layers, block_size=args.block_size)
    trainer = mode_table.build(
        variant.base,
        spec,
        rank,
        shard=args.shard,
        executors=variant.executors or "fused",
        memory=MemoryConfig(**variant.memory),
        activation_memory_budget=variant.amb,
        loss=variant.loss,
    )
    for group in trainer.optimizer.param_groups:
        group["lr"] = args.lr
    losses, times = [], []
    for sequence in stream(spec.config().vocab_size, args.block_size, args.steps):
        batch = torch.tensor(sequence, device=rank.device).unsqueeze(0)
        start = time.perf_counter()
        if trainer.loss == "eager":
            logits = trainer.model(batch[:, :-1])
            loss = torch.nn.functional.cross_entropy(
                logits.float().reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1)
            )
        else:  # the loss the model computes, in the logits' dtype
            loss = trainer.model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() if args.device == "cuda" else None
    runtime.print_result(
        {"mode": args.worker, "rank": rank.rank, "losses": losses, "peak_bytes": peak, "seconds": sum(times)}
    )
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


def run_mode(args, mode: str) -> dict:
    cmd = torchrun(
        args.nproc_per_node,
        "-m",
        "benchmarks.correctness.curves",
        "--worker",
        mode,
        "--model",
        args.model,
        "--block-size",
        str(args.block_size),
        "--steps",
        str(args.steps),
        "--lr",
        repr(args.lr),
        "--shard",
        args.shard,
        "--device",
        args.device,
        *(["--n-layers", str(args.n_layers)] if args.n_layers else []),
    )
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"mode": mode, "status": f"timeout after {args.timeout:g} s"}
    ranks = [r for r in runtime.read_results(proc.stdout) if r["rank"] == 0]
    if not ranks:
        last = [ln for ln in proc.stderr.splitlines() if ln.strip()][-1:] or ["no output"]
        return {"mode": mode, "status": f"error: {last[0][:300]}"}
    return {"status": "ok", **ranks[0]}


def differences(rows: list[dict]) -> list[dict]:
    """For every two modes that ran: the largest absolute difference of their losses, at which step, and the mean
    absolute difference over the last ``TAIL`` steps."""
    ok = [r for r in rows if r["status"] == "ok"]
    out = []
    for i, a in enumerate(ok):
        for b in ok[i + 1 :]:
            gaps = [abs(x - y) for x, y in zip(a["losses"], b["losses"])]
            worst = max(range(len(gaps)), key=gaps.__getitem__)
            tail = gaps[-TAIL:]
            out.append(
                {
                    "a": a["mode"],
                    "b": b["mode"],
                    "max_abs": gaps[worst],
                    "at_step": worst + 1,
                    "tail_mean_abs": sum(tail) / len(tail),
                }
            )
    return out


def render(rows: list[dict], pairs: list[dict]) -> str:
    lines = ["| mode | status | first loss | last loss | peak allocated |", "|---|---|---|---|---|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['mode']} | {r['status']} | | | |")
            continue
        peak = f"{r['peak_bytes'] / 2**30:.2f} GiB" if r.get("peak_bytes") else "-"
        lines.append(f"| {r['mode']} | ok | {r['losses'][0]:.4f} | {r['losses'][-1]:.4f} | {peak} |")
    lines += ["", "| modes | largest difference (step) | mean difference, last steps |", "|---|---|---|"]
    lines += [
        f"| {p['a']} vs {p['b']} | {p['max_abs']:.4f} ({p['at_step']}) | {p['tail_mean_abs']:.4f} |" for p in pairs
    ]
    return "\n".join(lines)


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True, height_ratios=(2, 1))
    for r in ok:
        top.plot(range(1, len(r["losses"]) + 1), r["losses"], label=r["mode"], linewidth=1)
    top.set_ylabel("loss")
    top.set_title(title)
    top.legend()
    for r in ok[1:]:
        bottom.plot(
            range(1, len(r["losses"]) + 1),
            [x - y for x, y in zip(r["losses"], ok[0]["losses"])],
            label=f"{r['mode']} - {ok[0]['mode']}",
            linewidth=1,
        )
    bottom.set_ylabel("difference")
    bottom.set_xlabel("step")
    bottom.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


def main(argv=None) -> int:
    try:
        args = parser().parse_args(argv)
        if args.worker:
            return worker(args)
        chosen = [m.strip() for m in args.modes.split(",") if m.strip()]
        for m in chosen:
            if split_variant(m).base not in mode_table.DISTRIBUTED_MODES + mode_table.SINGLE_MODES:
                raise UsageError(f"unknown mode {m!r}")
        for name in ("steps", "block_size", "jobs", "nproc_per_node"):
            if getattr(args, name) < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
    except UsageError as e:
        print(f"curves.py: error: {e}", file=sys.stderr)
        return 2
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        rows = list(pool.map(lambda m: run_mode(args, m), chosen))
    pairs = differences(rows)
    print(render(rows, pairs))
    config = {k: v for k, v in vars(args).items() if k not in ("worker", "json", "plot")}
    if args.json:
        Path(args.json).write_text(json.dumps({"config": config, "rows": rows, "differences": pairs}, indent=1))
    if args.plot:
        layers = f", {args.n_layers} layers" if args.n_layers else ""
        plot(rows, args.plot, f"{args.model}{layers}, {args.block_size} tokens, lr {args.lr:g}")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
