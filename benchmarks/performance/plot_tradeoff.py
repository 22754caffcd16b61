"""Peak memory against step time, one point per measured mode of ``benchmarks/performance/compare.py`` (its ``--json``):
the trade-off a memory budget makes, set beside torch.compile's ``activation_memory_budget`` and full checkpointing.

    python -m benchmarks.performance.plot_tradeoff curve.json --out curve.png
    python -m benchmarks.performance.plot_tradeoff thunder.json inductor.json --out headline.png --cap-gb 80

Points of one family are joined in order of peak: Thunder with the transform (``+mem``, each budget), Thunder
without it, torch.compile at each ``activation_memory_budget`` (``@amb=``), torch.compile with every block
checkpointed (``+ckpt``). Rows that did not run (``status`` other than ok) are left out and listed. Several files
(runs of one configuration, where one command could not hold every mode) are plotted together, and the title says
how many runs; files of different configurations (model, layers, tokens, ranks, dtype, cap) are refused.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass


# what runs plotted together must share
SAME = ("model", "n_layers", "block_size", "micro_batch_size", "nproc_per_node", "dtype", "memory_cap_gb")


def family(mode: str) -> str:
    if mode.startswith("inductor") or mode.startswith("fsdp2-inductor"):
        return "torch.compile, checkpointed blocks" if "+ckpt" in mode else "torch.compile (activation_memory_budget)"
    return "Thunder + FSDPMemoryTransform (memory budget)" if "+mem" in mode else "Thunder"


@dataclass(frozen=True)
class Point:
    mode: str
    step_ms: float
    peak_gib: float


def curves(runs: list[dict]) -> tuple[dict[str, list[Point]], list[str]]:
    """The points of every run that ran, by family, highest peak first; and what was left out, as 'mode (status)'.
    Raises ValueError where the runs are not of one configuration."""
    configs = {tuple(run["config"].get(k) for k in SAME) for run in runs}
    if len(configs) > 1:
        raise ValueError(f"the runs differ in {', '.join(SAME)}: {sorted(configs, key=str)}")
    families: dict[str, list[Point]] = {}
    left_out = []
    for r in (r for run in runs for r in run["rows"]):
        if r.get("status") == "ok" and r.get("step_ms"):
            families.setdefault(family(r["mode"]), []).append(Point(r["mode"], r["step_ms"], r["peak_bytes"] / 2**30))
        else:
            left_out.append(f"{r['mode']} ({r.get('status')})")
    for points in families.values():
        points.sort(key=lambda q: q.peak_gib, reverse=True)
    return families, left_out


def _layers(model: str) -> int | str:
    """The model's own number of blocks (a run without ``--n-layers``)."""
    try:
        from litgpt import Config

        return Config.from_name(model).n_layer
    except (ImportError, ValueError):
        return "all"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json", nargs="+", help="benchmarks/performance/compare.py --json output (one or more runs)")
    p.add_argument("--out", required=True, help="the plot (.png, .svg or .pdf)")
    p.add_argument("--cap-gb", type=float, help="draw the memory cap (GB, as compare.py's --memory-cap-gb)")
    args = p.parse_args(argv)
    runs = []
    for path in args.json:
        try:
            with open(path) as f:
                runs.append(json.load(f))
        except (OSError, ValueError) as e:
            print(f"plot_tradeoff: cannot read {path}: {e}", file=sys.stderr)
            return 2
    try:
        families, left_out = curves(runs)
    except (ValueError, KeyError, TypeError) as e:
        print(f"plot_tradeoff: {e}", file=sys.stderr)
        return 2
    for what in left_out:
        print(f"left out: {what}", file=sys.stderr)
    points = [q for qs in families.values() for q in qs]
    if not points:
        print("plot_tradeoff: no row ran (nothing to plot)", file=sys.stderr)
        return 2
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    span_x = (max(q.step_ms for q in points) - min(q.step_ms for q in points)) or 1.0
    span_y = max(q.peak_gib for q in points) or 1.0
    placed: list[tuple[float, float]] = []
    for name, qs in families.items():
        ax.plot([q.step_ms for q in qs], [q.peak_gib for q in qs], marker="o", label=name)
        for q in qs:
            # a label near one already placed goes below its point (points come highest first), away from that one
            near = any(
                abs(q.step_ms - px) / span_x < 0.12 and abs(q.peak_gib - py) / span_y < 0.03 for px, py in placed
            )
            placed.append((q.step_ms, q.peak_gib))
            ax.annotate(
                q.mode, (q.step_ms, q.peak_gib), textcoords="offset points", xytext=(4, -9 if near else 3), fontsize=6
            )
    if args.cap_gb:
        cap = args.cap_gb * 1e9 / 2**30
        ax.axhline(cap, color="grey", linestyle="--", linewidth=0.8)
        ax.annotate(
            f"cap {args.cap_gb:g} GB",
            (min(q.step_ms for q in points), cap),
            textcoords="offset points",
            xytext=(0, 3),
            fontsize=6,
            color="grey",
        )
    c = runs[0]["config"]
    title = (
        f"{c['model']}, {c['n_layers'] or _layers(c['model'])} layers, {c['block_size']} tokens, "
        f"{c['nproc_per_node']} rank(s)"
    )
    if len(runs) > 1:
        title += f"; {len(runs)} runs"
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("step time (ms, median of the measured steps)")
    ax.set_ylabel("peak allocated per rank (GiB)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
