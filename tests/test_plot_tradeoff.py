"""benchmarks/performance/plot_tradeoff.py: the points of several runs of one configuration, by family and highest peak
first, against hand-written rows; runs of different configurations, or a file that is not JSON, exit 2 with one line."""

import json
import subprocess
import sys

import pytest

from benchmarks.performance import plot_tradeoff
from support import ROOT

SCRIPT = [sys.executable, "-m", "benchmarks.performance.plot_tradeoff"]  # run from the repository root
GIB = 2**30
CONFIG = {
    "model": "m",
    "n_layers": None,
    "block_size": 32768,
    "micro_batch_size": 1,
    "nproc_per_node": 1,
    "dtype": "bf16",
    "memory_cap_gb": 80.0,
    "modes": "unused",
    "timeout": 570.0,
}


def _run_of(*rows, **config):
    return {
        "config": {**CONFIG, **config},
        "rows": [dict(zip(("mode", "status", "step_ms", "peak_bytes"), r)) for r in rows],
    }


THUNDER = _run_of(("thunder+mem@budget=74GiB", "ok", 2667.1, 71 * GIB), ("thunder", "OOM", None, None))
INDUCTOR = _run_of(
    ("inductor@amb=0.25", "ok", 3139.4, 66 * GIB),
    ("inductor+ckpt", "ok", 3232.0, 33 * GIB),
    ("inductor@amb=0.1", "OOM", None, None),
    ("inductor@amb=0.5", "ok", 3000.0, 70 * GIB),
    ("thunder+mem@budget=70GiB", "ok", 2667.5, 69 * GIB),
    timeout=270.0,
)


def test_runs_of_one_configuration_give_one_curve_per_family_highest_first():
    families, left_out = plot_tradeoff.curves([THUNDER, INDUCTOR])
    P = plot_tradeoff.Point
    assert families == {
        "Thunder + FSDPMemoryTransform (memory budget)": [
            P("thunder+mem@budget=74GiB", 2667.1, 71.0),
            P("thunder+mem@budget=70GiB", 2667.5, 69.0),
        ],
        "torch.compile (activation_memory_budget)": [
            P("inductor@amb=0.5", 3000.0, 70.0),
            P("inductor@amb=0.25", 3139.4, 66.0),
        ],
        "torch.compile, checkpointed blocks": [P("inductor+ckpt", 3232.0, 33.0)],
    }
    assert left_out == ["thunder (OOM)", "inductor@amb=0.1 (OOM)"]


def test_the_plot_is_written_and_what_did_not_run_is_listed(tmp_path):
    paths = []
    for i, run in enumerate((THUNDER, INDUCTOR)):
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps(run))
    out = tmp_path / "plot.png"
    proc = subprocess.run(
        [*SCRIPT, *map(str, paths), "--out", str(out), "--cap-gb", "80"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert proc.stderr.splitlines() == ["left out: thunder (OOM)", "left out: inductor@amb=0.1 (OOM)"]


@pytest.mark.parametrize(
    "other, message",
    [
        (_run_of(("inductor", "ok", 900.0, 66 * GIB), block_size=16384), "the runs differ in"),
        ("not json", "cannot read"),
        (_run_of(("thunder", "OOM", None, None)), "no row ran"),
    ],
)
def test_bad_input_exits_2_with_one_line(tmp_path, other, message):
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(json.dumps(THUNDER if message != "no row ran" else other))
    second.write_text(other if isinstance(other, str) else json.dumps(other))
    proc = subprocess.run(
        [*SCRIPT, str(first), str(second), "--out", str(tmp_path / "p.png")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("left out:")]
    assert len(lines) == 1 and message in lines[0], proc.stderr
