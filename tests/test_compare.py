"""``python -m benchmarks.performance.compare`` on CPU: every mode but the CUDA-only one runs and is measured (the
allocations torch's profiler records, 2 gloo ranks); bad input exits 2 with one line."""

import json
import subprocess
import sys

import pytest

from benchmarks.performance.compare_table import merge
from support import ROOT

CPU = "--device cpu --nproc-per-node 2 --model pythia-14m".split()  # 2 gloo ranks, a small model


def _run(*args, timeout=1500):
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.performance.compare", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _reported_plans(mode: str, tmp_path, *options: str) -> list[dict]:
    """``thunder-fsdp-mem report --transform`` of the comparison's configuration in ``mode`` over 2 fake ranks: the
    plan without the transform, then with it."""
    from thunder_fsdp_mem.cli.commands import main

    out = tmp_path / "report.json"
    report = "report --model pythia-14m --n-layers 2 --block-size 128 --world-size 2 --shard zero2 --device cpu"
    assert main([*report.split(), "--mode", mode, "--transform", *options, "--json", str(out)]) == 0
    return json.loads(out.read_text())["plans"]


@pytest.fixture(scope="module")
def comparison(tmp_path_factory):
    out = tmp_path_factory.mktemp("compare") / "out.json"
    plot = out.with_suffix(".png")
    proc = _run(
        *CPU, *"--n-layers 2 --block-size 128 --steps 3 --warmup 1".split(), "--json", str(out), "--plot", str(plot)
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc, plot


@pytest.mark.slow
def test_every_mode_but_the_cuda_only_one_is_measured(comparison):
    result, proc, plot = comparison
    rows = {r["mode"]: r for r in result["rows"]}
    assert set(rows) == {
        "thunder-fsdp",
        "thunder-fsdp+mem",
        "fsdp2-thunder",
        "fsdp2-thunder+mem",
        "fsdp2-inductor",
        "fsdp2-eager",
        "fsdp1-inductor",
    }
    assert rows.pop("fsdp1-inductor")["status"].startswith("skipped")
    for mode, row in rows.items():
        assert row["status"] == "ok", (mode, row["status"])
        assert row["peak_bytes"] > 0 and row["step_ms"] > 0 and row["tokens_per_s"] > 0
    assert {
        "mode",
        "peak_bytes",
        "reserved_bytes",
        "alloc_retries",
        "step_ms",
        "tokens_per_s",
        "estimated_peak_bytes",
        "status",
    } <= set(result["rows"][0])
    assert result["config"]["model"] == "pythia-14m"
    assert plot.stat().st_size > 0
    # The progress lines and the table.
    assert "[1/7] thunder-fsdp:" in proc.stderr
    assert "| fsdp2-inductor | ok |" in proc.stdout


@pytest.mark.slow
def test_mem_rows_need_no_more_memory_and_are_estimated(comparison):
    # FSDPMemoryTransform saves less for backward; the measured peaks are deterministic on CPU.
    rows = {r["mode"]: r for r in comparison[0]["rows"]}
    assert rows["thunder-fsdp+mem"]["peak_bytes"] <= rows["thunder-fsdp"]["peak_bytes"]
    assert rows["fsdp2-thunder+mem"]["peak_bytes"] <= rows["fsdp2-thunder"]["peak_bytes"]
    for mode in ("thunder-fsdp", "thunder-fsdp+mem"):  # the estimate reads the traces the transform rewrote
        row = rows[mode]
        assert abs(row["estimated_peak_bytes"] - row["peak_bytes"]) <= 0.03 * row["peak_bytes"], row


@pytest.mark.slow
def test_modes_run_at_once_take_turns_and_measure_the_same(comparison, tmp_path):
    # --jobs 2: two modes in flight, thunder-fsdp compiled ahead outside its turn; the measured peaks must be
    # those of the modes run one after the other.
    out = tmp_path / "jobs.json"
    options = "--n-layers 2 --block-size 128 --steps 1 --warmup 1 --modes thunder-fsdp,fsdp2-eager --jobs 2"
    proc = _run(*CPU, *options.split(), "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    alone = {r["mode"]: r for r in comparison[0]["rows"]}
    for row in json.loads(out.read_text())["rows"]:
        assert row["status"] == "ok", row
        # The profiled peaks of one mode differ by up to a KiB from run to run (1024 B seen: small allocations
        # whose timing varies); another mode's memory would be megabytes.
        assert abs(row["peak_bytes"] - alone[row["mode"]]["peak_bytes"]) <= 4096, row["mode"]
        assert row["setup_s"] > 0
        assert 0 < row["first_step_s"] < row["setup_s"]  # compilation and the first step, within the set-up


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "stablecode-alpha", "--device", "cpu"], "closest: "),
        (["--modes", "thunder-fsdp,nope", "--device", "cpu"], "valid modes: thunder-fsdp"),
        (["--device", "cuda", "--nproc-per-node", "64"], "GPUs present"),
        (["--steps", "0", "--device", "cpu"], "--steps must be at least 1"),
        (["--jobs", "0", "--device", "cpu"], "--jobs must be at least 1"),
        (["--modes", "thunder-fsdp@w=0.1", "--device", "cpu"], "only +mem modes take the transform's options"),
        (
            ["--modes", "thunder+mem@ex=nvfuser", "--device", "cpu"],
            "ex must be one of default, default+cat, default+inductor, fused",
        ),
        (["--modes", "fsdp2-inductor@ex=fused", "--device", "cpu"], "only Thunder's modes take @ex"),
        (["--executors", "fast", "--device", "cpu"], "invalid choice: 'fast'"),
        (["--modes", "inductor@amb=2", "--device", "cpu"], "amb must be a number from 0 to 1, got '2'"),
        (["--modes", "thunder-fsdp@amb=0.5", "--device", "cpu"], "only torch.compile's modes take @amb"),
        (["--modes", "thunder-fsdp+mem@budget=lots", "--device", "cpu"], "budget must be a size (60GB, 55.9GiB)"),
        (["--modes", "fsdp2-inductor@budget=60GB", "--device", "cpu"], "only +mem modes take the transform's"),
        (["--modes", "thunder-fsdp+mem@x=1", "--device", "cpu"], "unknown option 'x'"),
        (["--modes", "thunder-fsdp+mem@ag=0", "--device", "cpu"], "max_inflight_allgathers must be an int >= 1"),
        (["--modes", "thunder-fsdp+mem@fold=yes", "--device", "cpu"], "fold must be 0 or 1, got 'yes'"),
        (["--modes", "fsdp2-thunder+mem@fr=2", "--device", "cpu"], "fr must be 0 or 1, got '2'"),
    ],
)
def test_bad_input_exits_2_with_one_line(args, message):
    proc = _run(*args, timeout=300)
    assert proc.returncode == 2
    err = [line for line in proc.stderr.splitlines() if "warn" not in line.lower()]
    assert len(err) == 1 and message in err[0], proc.stderr


@pytest.mark.slow
def test_the_report_predicts_the_measured_thunder_fsdp_rows(comparison, tmp_path, capsys):
    # `thunder-fsdp-mem report` traces on the meta device over 2 fake ranks; the rows were measured
    # on 2 real gloo ranks running the same step (GPT, eager cross-entropy, AdamW).
    without, with_it = _reported_plans("thunder-fsdp", tmp_path)
    rows = {r["mode"]: r for r in comparison[0]["rows"]}
    for plan, mode in ((without, "thunder-fsdp"), (with_it, "thunder-fsdp+mem")):
        measured = rows[mode]["peak_bytes"]
        assert abs(plan["peak_bytes"] - measured) <= 0.03 * measured, (mode, plan["peak_bytes"], measured)


@pytest.mark.slow
def test_the_report_predicts_the_measured_fsdp2_rows(comparison, tmp_path):
    # --mode fsdp2 composes one ThunderFX block graph traced on meta with what FSDP2 holds, per rank; the rows
    # were measured on 2 gloo ranks running FSDP2 (zero2) through ThunderFX, compiled (under MemTracker, a
    # dispatch mode, Dynamo would have run the step eagerly).
    without, with_it = _reported_plans("fsdp2", tmp_path)
    rows = {r["mode"]: r for r in comparison[0]["rows"]}
    for plan, mode in ((without, "fsdp2-thunder"), (with_it, "fsdp2-thunder+mem")):
        measured = rows[mode]["peak_bytes"]
        assert abs(plan["peak_bytes"] - measured) <= 0.03 * measured, (mode, plan["peak_bytes"], measured)


@pytest.mark.slow
def test_the_report_predicts_fsdp2_with_the_loss_in_the_step(tmp_path):
    # LossModel as FSDP2's root (it keeps the head's weight gathered, its gradient reduce-scattered last), the head
    # and the chunked loss one ThunderFX graph after the final norm: measured on 2 gloo ranks, predicted over 2
    # fake ones, both with the transform.
    out = tmp_path / "out.json"
    options = "--n-layers 2 --block-size 128 --steps 3 --warmup 1 --modes fsdp2-thunder+mem@loss=trace"
    proc = _run(*CPU, *options.split(), "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    measured = json.loads(out.read_text())["rows"][0]["peak_bytes"]
    _, with_it = _reported_plans("fsdp2", tmp_path, "--loss", "trace")
    assert abs(with_it["peak_bytes"] - measured) <= 0.03 * measured, (with_it["peak_bytes"], measured)


@pytest.mark.slow
def test_an_oom_on_one_rank_in_a_transformed_step_is_an_oom_row_and_no_rank_hangs():
    # Rank 1 runs out of memory at the start of its backward (compare.py --inject-oom: torch's own error, raised
    # inside the transformed trace) while rank 0 goes on into its reduce-scatters: the row says OOM, and torchrun
    # ends rank 0 instead of leaving it waiting, well within the timeout.
    import time

    start = time.perf_counter()
    options = "--n-layers 1 --block-size 64 --steps 1 --warmup 1 --modes thunder-fsdp+mem --inject-oom 1 --timeout 600"
    proc = _run(*CPU, *options.split(), timeout=700)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| thunder-fsdp+mem | OOM |" in proc.stdout
    assert time.perf_counter() - start < 600


@pytest.mark.slow
def test_a_mode_past_its_timeout_ends_with_its_ranks():
    proc = _run(*CPU, *"--n-layers 1 --block-size 64 --modes fsdp2-eager --timeout 1".split(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| fsdp2-eager | timeout after 1 s |" in proc.stdout


def test_an_oom_row_keeps_the_most_any_rank_held():
    # What each rank's worker reports when it runs out on CUDA (CPU ranks have no such figures): the row keeps the
    # largest, as the other figures of a row are the maximum over ranks.
    oom = {"status": "OOM", "estimated_peak_bytes": 70, "allocated_at_oom_bytes": 75, "reserved_at_oom_bytes": 80}
    waiting = {
        "status": "error: the collective's peer exited",
        "estimated_peak_bytes": 70,
        "allocated_at_oom_bytes": None,
    }
    row = merge("thunder+mem", [waiting, oom])
    assert (row["status"], row["allocated_at_oom_bytes"], row["reserved_at_oom_bytes"]) == ("OOM", 75, 80)
    cpu = {"status": "OOM", "estimated_peak_bytes": 70}
    assert "allocated_at_oom_bytes" not in merge("thunder", [cpu, cpu])


def test_help_lists_every_mode_with_what_it_runs_and_each_default():
    from benchmarks.performance.compare import parser
    from thunder_fsdp_mem.training.modes import valid_modes

    text = parser().format_help()
    for mode in valid_modes(1):  # every mode, the one-device ones included
        assert any(line.split()[:1] == [mode] and len(line.split()) > 1 for line in text.splitlines()), mode
    for option, default in (("--steps", "10"), ("--block-size", "8192"), ("--executors", "default+cat")):
        help_of = text[text.index(f"  {option}") :].split("\n  --")[0]
        assert f"(default: {default})" in " ".join(help_of.split()), option


def test_the_summary_table_never_shortens_a_figure():
    # compare's summary is a Markdown table: cells are written whole, whatever the terminal's width (it wraps
    # lines; nothing is cut with an ellipsis), each figure in its unit
    from benchmarks.performance.compare_table import row, table

    rows = [
        row(
            "fsdp2-inductor",
            status="ok",
            peak_bytes=22_020_096_000,
            reserved_bytes=25_812_000_000,
            alloc_retries=0,
            step_ms=154.2,
            tokens_per_s=53099.4,
        ),
        row(
            "fsdp2-thunder+mem@ex=fused@budget=16.5GiB",
            status="ok",
            peak_bytes=13_979_000_000,
            reserved_bytes=17_459_000_000,
            alloc_retries=3,
            step_ms=182.0,
            tokens_per_s=45058.0,
            estimated_peak_bytes=13_900_000_000,
        ),
    ]
    text = table(rows)
    assert "…" not in text
    for figure in (
        "20.51 GiB",
        "24.04 GiB",
        "13.02 GiB",
        "16.26 GiB",
        "12.95 GiB",
        "0.63x",
        "182 ms",
        "45058",
        "-0.6%",
    ):
        assert f" {figure} |" in text, figure


def test_cut_cross_entropy_with_every_block_computed_is_a_loss_of_its_own():
    # ``@loss=cce-exact``: Cut Cross-Entropy without its gradient filter, the same work as ``chunked``; it needs
    # the same package as ``cce`` and, like it, refuses a head with a bias.
    from litgpt import GPT, Config

    from benchmarks.variants import split_variant
    from thunder_fsdp_mem.training import loss_placement

    assert split_variant("inductor@loss=cce-exact").loss == "cce-exact"
    assert loss_placement.available("cce-exact") == loss_placement.available("cce")
    gpt = GPT(
        Config(n_layer=1, n_embd=8, n_head=2, block_size=4, vocab_size=16, padded_vocab_size=16, lm_head_bias=True)
    )
    with pytest.raises(ValueError, match="no bias on the head"):
        loss_placement.ExternalLoss(gpt, "cce-exact")
