"""A comparison's rows and how they are shown: one row per mode (``row``, every field ``compare`` writes, None
where a mode did not measure it), merged from its ranks' rows (``merge``: the maximum over ranks), rendered as the
Markdown table ``compare`` prints (``table``, each peak against torch.compile's row) and as a bar chart of peak
memory (``plot``).
"""

from __future__ import annotations

from thunder_fsdp_mem.training import modes as mode_table
from thunder_fsdp_mem.units import format_bytes


def row(mode: str, *, status: str, **fields) -> dict:
    out = {
        "mode": mode,
        "peak_bytes": None,
        "reserved_bytes": None,
        "alloc_retries": None,
        "step_ms": None,
        "tokens_per_s": None,
        "estimated_peak_bytes": None,
        "status": status,
        "setup_s": None,
        "first_step_s": None,
    }
    out.update(fields)
    return out


def merge(mode: str, ranks: list[dict]) -> dict:
    """One row from every rank's: the maximum over ranks; a failure on any rank is the row's status."""

    def worst(key):
        values = [r[key] for r in ranks if r.get(key) is not None]
        return max(values) if values else None

    bad = [r["status"] for r in ranks if r["status"] != "ok"]
    if bad:  # what it would have needed, where the traces tell, and what the device held when it ran out
        oom = {k: worst(k) for k in ("allocated_at_oom_bytes", "reserved_at_oom_bytes") if any(k in r for r in ranks)}
        return row(
            mode, status="OOM" if "OOM" in bad else bad[0], estimated_peak_bytes=worst("estimated_peak_bytes"), **oom
        )

    return row(
        mode,
        status="ok",
        peak_bytes=worst("peak_bytes"),
        reserved_bytes=worst("reserved_bytes"),
        alloc_retries=worst("alloc_retries"),
        step_ms=worst("step_ms"),
        tokens_per_s=min(r["tokens_per_s"] for r in ranks),
        estimated_peak_bytes=worst("estimated_peak_bytes"),
        setup_s=worst("setup_s"),
        first_step_s=worst("first_step_s"),
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
        "tokens/s | first step | estimated peak | estimate error |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
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
            f"{r['first_step_s']:.1f} s" if r.get("first_step_s") else "-",
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
