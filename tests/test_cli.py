"""The CLI: exit codes and one-line errors, and a report whose peak agrees with MemTracker on a real CPU run."""

import json

import pytest
import thunder
import torch

from support import memtracker_peak
from thunder_fsdp_mem import models
from thunder_fsdp_mem.cli import main

SMALL = ["--model", "pythia-14m", "--n-layers", "1", "--block-size", "32"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["report", "--n-layers", "0"], "--n-layers must be at least 1"),
        (["report", "--block-size", "-4"], "--block-size must be at least 1"),
        (["report", "--model", "no-such-model"], "unknown litgpt model"),
        (["report", "--dtype", "fp8"], "invalid choice"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_input_exits_2_with_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_unwritable_json_path_exits_2(tmp_path, capsys):
    assert main(["report", *SMALL, "--json", str(tmp_path / "missing" / "r.json")]) == 2
    assert "cannot write --json" in capsys.readouterr().err


def test_report_peak_matches_a_measured_cpu_run(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["report", *SMALL, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.strip().splitlines()[-1].startswith("Peak per rank:")
    report = json.loads(out.read_text())
    assert isinstance(report["peak_bytes"], int)
    assert {"name", "shape", "dtype", "bytes", "category"} <= set(report["top"][0])

    # The report traces on the meta device; the same step run for real on CPU, measured by MemTracker.
    spec = models.ModelSpec(name="pythia-14m", n_layers=1, block_size=32)
    jitted = thunder.jit(models.build(spec, dtype=torch.bfloat16))
    idx, targets = models.batch(spec)
    jitted(idx, targets).backward()
    for p in jitted.parameters():
        p.grad = None
    measured = memtracker_peak(jitted, idx, targets, tracked=(jitted,))
    assert abs(report["peak_bytes"] - measured) <= 0.03 * measured
