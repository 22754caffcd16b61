"""Peak memory against step time, one point per measured mode of ``benchmarks/compare.py`` (its ``--json``): the
trade-off a memory budget makes, set beside torch.compile's ``activation_memory_budget`` and full checkpointing.

    python benchmarks/plot_tradeoff.py curve.json --out curve.png

Points of one family are joined in order of peak: Thunder with the transform (``+mem``, each budget), Thunder
without it, torch.compile at each ``activation_memory_budget`` (``@amb=``), torch.compile with every block
checkpointed (``+ckpt``). Rows that did not run (``status`` other than ok) are left out and listed.
"""

from __future__ import annotations

import argparse
import json
import sys


def family(mode: str) -> str:
    if mode.startswith("inductor") or mode.startswith("fsdp2-inductor"):
        return "torch.compile, checkpointed blocks" if "+ckpt" in mode else "torch.compile (activation_memory_budget)"
    return "Thunder + FSDPMemoryTransform (memory budget)" if "+mem" in mode else "Thunder"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json", help="benchmarks/compare.py --json output")
    p.add_argument("--out", required=True, help="the plot (.png, .svg or .pdf)")
    args = p.parse_args(argv)
    with open(args.json) as f:
        data = json.load(f)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in data["rows"] if r.get("status") == "ok" and r.get("step_ms")]
    for r in data["rows"]:
        if r not in ok:
            print(f"left out: {r['mode']} ({r.get('status')})", file=sys.stderr)
    fig, ax = plt.subplots(figsize=(8, 5))
    families: dict[str, list[dict]] = {}
    for r in ok:
        families.setdefault(family(r["mode"]), []).append(r)
    span_x = (max(r["step_ms"] for r in ok) - min(r["step_ms"] for r in ok)) or 1.0
    span_y = max(r["peak_bytes"] for r in ok) / 2**30 or 1.0
    placed: list[tuple[float, float]] = []
    for name, rows in families.items():
        rows.sort(key=lambda r: r["peak_bytes"])
        ax.plot([r["step_ms"] for r in rows], [r["peak_bytes"] / 2**30 for r in rows], marker="o", label=name)
        for r in rows:
            x, y = r["step_ms"], r["peak_bytes"] / 2**30
            # a label near one already placed goes below its point, so that the two do not overlap
            near = any(abs(x - px) / span_x < 0.12 and abs(y - py) / span_y < 0.03 for px, py in placed)
            placed.append((x, y))
            ax.annotate(r["mode"], (x, y), textcoords="offset points", xytext=(4, -9 if near else 3), fontsize=6)
    c = data["config"]
    ax.set_title(f"{c['model']}, {c['n_layers']} layers, {c['block_size']} tokens, {c['nproc_per_node']} rank(s)",
                 fontsize=9)
    ax.set_xlabel("step time (ms, median of the measured steps)")
    ax.set_ylabel("peak allocated per rank (GiB)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
