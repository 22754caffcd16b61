"""The CLI: exit codes and one-line errors, a report whose peak agrees with MemTracker on a real CPU run, both plans
with --transform, the timeline plot, and repeated layers counted once. (Its thunder-fsdp prediction against
measured 2-rank runs: tests/test_compare.py.)"""

import itertools
import json
import pickle
import re

import pytest
import thunder
import torch

from support import memtracker_peak
from thunder_fsdp_mem.training import litgpt_models
from thunder_fsdp_mem.cli.commands import main

SMALL = ["--model", "pythia-14m", "--n-layers", "1", "--block-size", "32", "--mode", "jit", "--device", "cpu"]
PYTHIA_64 = "report --model pythia-14m --n-layers 1 --block-size 64 --mode jit".split()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["report", "--n-layers", "0"], "--n-layers must be at least 1"),
        (["report", "--block-size", "-4"], "--block-size must be from 1 to 1048576 tokens"),
        (["report", "--model", "no-such-model"], "unknown litgpt model"),
        (["report", "--model", "pythia-70"], "closest: pythia-70m"),
        (["report", "--dtype", "fp8"], "invalid choice"),
        (["report", "--mode", "jit", "--shard", "zero3"], "--shard applies to --mode fsdp2 and thunder-fsdp"),
        (["report", "--mode", "jit", "--world-size", "4"], "--mode jit runs on one device"),
        (["report", "--world-size", "0"], "--world-size must be at least 1"),
        (["report", "--micro-batch-size", "0"], "--micro-batch-size must be at least 1"),
        (["report", "--plot", "timeline.txt"], "must end in .png, .svg or .pdf"),
        (["report", "--executors", "nvfuser"], "(choose from 'default', 'default+cat', 'default+inductor', 'fused')"),
        (
            ["report", "--model", "Gemma-2-2b", "--n-layers", "1", "--block-size", "16"],
            "--mode fsdp2 does not model final_logit_softcapping",
        ),
        (["report", "--fit", "0"], "--fit must be more than 0 bytes"),
        (["report", "--fit", "lots"], "--fit: cannot read 'lots' as a size"),
        (["report", "--fit", "80GB", "--memory-budget", "60GB"], "drop --memory-budget"),
        (["report", "--memory-cap", "lots"], "--memory-cap: cannot read 'lots' as a size"),
        (["report", "--device", "cpu", "--memory-cap", "80GB"], "--memory-cap limits CUDA's caching allocator"),
        (["report", "--fit", "80GB", "--memory-cap", "80GB"], "drop --memory-cap"),
        (["fit", "0"], "fit SIZE must be more than 0 bytes"),
        (["fit", "lots"], "fit SIZE: cannot read 'lots' as a size"),
        (["fit"], "the following arguments are required: SIZE"),
        (["fit", "80GB", "--plot", "fit.png"], "unrecognized arguments: --plot"),
        (["fit", "80GB", "--mode", "jit", "--shard", "zero3"], "--shard applies to --mode fsdp2 and thunder-fsdp"),
        (["frobnicate"], "invalid choice"),
        (["report", "--memory-budget", "1.5"], "a number without a unit is bytes, and 1.5 bytes is less than 1 MiB"),
        (["fit", "1000"], "write the unit (1000GiB, 1000GB) or the bytes (64e9)"),
        (["report", "--block-size", "10000000"], "--block-size must be from 1 to 1048576 tokens"),
        (["report", "--no-transform", "--memory-budget", "60GB"], "--no-transform contradicts --memory-budget"),
        (["report", "--no-transform", "--no-fusion-rematerialize"], "--no-transform contradicts --[no-]fusion"),
        (["report", "--loss", "logits"], "invalid choice"),
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
    assert main(["report", *SMALL, "--plot", str(tmp_path / "missing" / "r.png")]) == 2
    assert "cannot write --plot" in capsys.readouterr().err
    assert main(["report", *SMALL, "--snapshot", str(tmp_path / "missing" / "s.pickle")]) == 2
    assert "cannot write --snapshot" in capsys.readouterr().err
    # A directory with a plot's name: refused before any tracing, one line.
    (tmp_path / "d.png").mkdir()
    assert main(["report", *SMALL, "--plot", str(tmp_path / "d.png")]) == 2
    err = capsys.readouterr().err
    assert "it is a directory" in err and err.count("\n") == 1 and "Traceback" not in err


def test_a_write_refused_at_the_end_is_one_line(capsys):
    # /proc passes the checks as root (it exists; root may write there by its mode bits) but refuses new files:
    # the failure comes after the report is computed, and is still one line with exit 2 (another user is refused
    # before tracing, with the same line).
    assert main(["report", *SMALL, "--plot", "/proc/thunder-fsdp-mem-test.png"]) == 2
    err = capsys.readouterr().err
    assert "cannot write --plot /proc/thunder-fsdp-mem-test.png" in err and "Traceback" not in err


@pytest.mark.smoke
def test_report_peak_matches_a_measured_cpu_run(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["report", *SMALL, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.strip().splitlines()[-1].startswith("Peak per rank:")
    report = json.loads(out.read_text())
    assert isinstance(report["peak_bytes"], int)
    assert {"name", "shape", "dtype", "bytes", "category"} <= set(report["top"][0])
    # traced, held and anticipated tensors spell their dtypes alike (Thunder's short names)
    assert {t["dtype"] for t in report["top"]} <= {"bf16", "f32", "i64"}, [t["dtype"] for t in report["top"]]

    # The report traces on the meta device; the same step run for real on CPU (the GPT, the eager cross-entropy
    # on its logits, the backward, AdamW's step with its state from a first step), measured by MemTracker.
    from litgpt import GPT

    spec = litgpt_models.ModelSpec(name="pythia-14m", n_layers=1, block_size=32)
    torch.manual_seed(0)
    jitted = thunder.jit(GPT(spec.config()).to(torch.bfloat16))
    optimizer = torch.optim.AdamW(jitted.parameters(), lr=1e-4)
    idx, targets = litgpt_models.batch(spec)

    held = []  # the logits stay referenced through the backward, as in modes.Trainer.step

    def step(idx, targets):
        logits = jitted(idx)
        held.append(logits)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    def whole_step(idx, targets):
        step(idx, targets).backward()
        held.clear()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    whole_step(idx, targets)
    state = [t for per in optimizer.state.values() for t in per.values() if isinstance(t, torch.Tensor)]
    measured = memtracker_peak(whole_step, idx, targets, tracked=(jitted, *state), backward=False)
    assert abs(report["peak_bytes"] - measured) <= 0.03 * measured, (report["peak_bytes"], measured)


@pytest.mark.smoke
def test_a_loss_in_the_trace_is_chunked_and_predicted_as_a_cpu_run_measures_it(tmp_path, capsys):
    # pythia-14m's 50304-token vocabulary at 512 tokens: the eager loss holds the peak; in the trace the transform
    # chunks it. The prediction (meta device) against the same step run on CPU, measured by MemTracker.
    from thunder_fsdp_mem import FSDPMemoryTransform, LossModel

    argv = ["report", *SMALL[:4], "--block-size", "512", *SMALL[6:], "--transform"]
    eager, trace = tmp_path / "eager.json", tmp_path / "trace.json"
    assert main([*argv, "--json", str(eager)]) == 0
    assert main([*argv, "--loss", "trace", "--json", str(trace)]) == 0
    eager, trace = json.loads(eager.read_text()), json.loads(trace.read_text())
    assert "--loss trace" in " ".join(capsys.readouterr().out.split("Peak per rank:")[0].split())  # the advice
    predicted = trace["peak_bytes"]  # with --transform: the transformed plan's
    assert predicted < eager["peak_bytes"] * 0.8, (predicted, eager["peak_bytes"])

    from litgpt import GPT

    spec = litgpt_models.ModelSpec(name="pythia-14m", n_layers=1, block_size=512)
    torch.manual_seed(0)
    jitted = thunder.jit(LossModel(GPT(spec.config()).to(torch.bfloat16)), transforms=[FSDPMemoryTransform()])
    optimizer = torch.optim.AdamW(jitted.parameters(), lr=1e-4)
    idx, targets = litgpt_models.batch(spec)

    def whole_step(idx, targets):
        jitted(idx, targets).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    whole_step(idx, targets)
    state = [t for per in optimizer.state.values() for t in per.values() if isinstance(t, torch.Tensor)]
    measured = memtracker_peak(whole_step, idx, targets, tracked=(jitted, *state), backward=False)
    assert abs(predicted - measured) <= 0.03 * measured, (predicted, measured)


def test_transform_shows_both_plans_and_plots_them(tmp_path, capsys):
    out, plot, snapshot = tmp_path / "r.json", tmp_path / "r.svg", tmp_path / "step.pickle"
    assert (
        main(
            [
                "report",
                *SMALL,
                "--n-layers",
                "2",
                "--transform",
                "--json",
                str(out),
                "--plot",
                str(plot),
                "--snapshot",
                str(snapshot),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "without transform" in text and "with transform" in text
    report = json.loads(out.read_text())
    without, with_it = report["plans"]
    assert (without["label"], with_it["label"]) == ("without transform", "with transform")
    # The transform never saves more for backward, and the top level is the plan with it.
    assert with_it["saved_bytes"] < without["saved_bytes"]
    assert report["peak_bytes"] == with_it["peak_bytes"] <= without["peak_bytes"]
    assert plot.read_text().startswith("<?xml") and "without transform" in plot.read_text()
    # Two blocks of the same shapes: their patterns are counted once each, with a count of 2.
    assert any(t["count"] == 2 and t["total_bytes"] == 2 * t["bytes"] for t in report["top"])
    # What the transform did, pass by pass: the saved bytes of the first pair's last applied pass are what the plan
    # without it saves before and the plan with it saves after (the same traces, estimated step by step).
    passes = report["transform_passes"]
    # Before autograd, on a CPU, attention is left decomposed (no attention executor takes CPU tensors), and said;
    # so is the loss, computed eagerly after the compiled model (the report's default, --loss eager).
    assert "What the transform did" in text and [p["pass_name"] for p in passes][:5] == [
        "attention executor",
        "chunked loss",
        "folded casts",
        "fusion rematerialization",
        "rematerialization",
    ]
    assert passes[0]["outcome"] == "left as it was" and "of (T, T) probabilities" in passes[0]["note"]
    assert passes[1]["outcome"] == "left as it was" and "the loss is computed after it" in passes[1]["note"]
    applied = [p for p in passes if p["outcome"] == "applied"]
    assert applied[0]["saved_before"] == without["saved_bytes"] and applied[-1]["saved_after"] == with_it["saved_bytes"]
    # The JSON names the plan of its top-level figures, carries the settings and the versions, and, per plan, the
    # categories at its peak, its top allocations and its timeline (split by category, phases marked).
    assert report["plan"] == "with transform"
    assert report["settings"] == {
        "model": "pythia-14m",
        "n_layers": 2,
        "block_size": 32,
        "micro_batch_size": 1,
        "dtype": "bf16",
        "mode": "jit",
        "shard": None,
        "world_size": 1,
        "device": "cpu",
        "executors": "default+cat",
        "transform": True,
        "memory_budget_bytes": None,
        "measured": False,
        "fit_bytes": None,
        "memory_cap_bytes": None,
    }
    assert report["versions"]["torch"] == torch.__version__ and "lightning-thunder" in report["versions"]
    for plan in report["plans"]:
        assert sum(plan["by_category"].values()) == plan["peak_bytes"] and plan["top"]
        timeline = plan["timeline"]
        assert max(timeline["points"]) == plan["peak_bytes"]
        assert [sum(c) for c in zip(*timeline["categories"].values())] == timeline["points"]
        assert [p["stage"] for p in timeline["phases"]] == ["forward", "loss", "backward", "optimizer step"]
    # Both plans as memory snapshots, each reaching its plan's peak when its events are replayed.
    for path, plan in ((snapshot, with_it), (tmp_path / "step-without-transform.pickle", without)):
        events = pickle.loads(path.read_bytes())["device_traces"][0]
        steps = [
            e["size"] if e["action"] == "alloc" else -e["size"]
            for e in events
            if e["action"] in ("alloc", "free_completed")
        ]
        before = plan["persistent_bytes"] + plan["optimizer_state_bytes"]  # alive before the step: no events
        assert before + max(itertools.accumulate(steps)) == plan["peak_bytes"], path


def test_a_model_thunder_cannot_trace_is_said_so_in_one_line(capsys):
    # Mixtral's mixture-of-experts MLP: Thunder's interpreter refuses its torch.where under thunder.jit; traced as
    # FSDP2's blocks (ThunderFX), its routing needs data the meta device does not have.
    mixtral = ["report", "--model", "Mixtral-8x7B-v0.1", "--n-layers", "1", "--block-size", "16"]
    assert main([*mixtral, "--mode", "jit"]) == 1
    err = capsys.readouterr().err
    assert "Thunder cannot trace Mixtral-8x7B-v0.1 in --mode jit" in err and "cannot predict it" in err
    progress = re.compile(r": \d+/\d+ ")  # stderr is no terminal here: progress lines come before
    assert len([line for line in err.splitlines() if line.strip() and not progress.search(line)]) == 1
    assert "Traceback" not in err
    assert main([*mixtral, "--mode", "fsdp2"]) == 1
    err = capsys.readouterr().err
    assert "cannot be traced on the meta device: an op's output shape depends on the data" in err


def test_a_prediction_beyond_the_device_says_so(capsys):
    # 8 sequences of 2^20 tokens (the longest --block-size takes): the logits alone are 2^23 x 50304 x 2 bytes,
    # 0.8 TB (no host memory for the batch: litgpt_models.batch on meta makes shapes only).
    idx, _ = litgpt_models.batch(litgpt_models.ModelSpec(name="pythia-14m", block_size=10**9), device="meta")
    assert idx.shape == (1, 10**9) and idx.device.type == "meta"
    assert (
        main([*"report --model pythia-14m --n-layers 1 --block-size 1048576 --micro-batch-size 8 --mode jit".split()])
        == 0
    )
    assert "(more than an H200 holds: 140.40 GiB)" in capsys.readouterr().out.strip().splitlines()[-1]


def test_piped_stderr_shows_progress_lines_and_no_import_noise():
    # Run as a user's pipeline would: stderr is no terminal, so progress is plain lines; the warnings Thunder and
    # torch print on import (transformer_engine, no CUDA runtime) are not the report's business.
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "thunder_fsdp_mem.cli", "report", *SMALL], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "thunder-fsdp-mem: tracing 1 layer on the meta device: 0/1 ..." in proc.stderr
    assert "thunder-fsdp-mem: tracing 1 layer on the meta device: 1/1 done" in proc.stderr
    assert "transformer_engine" not in proc.stderr and "No CUDA runtime" not in proc.stderr


def test_fusion_rematerialize_is_on_by_default_and_plans_fsdp2s_fused_blocks_to_save_less(tmp_path, capsys):
    # As on CUDA, attention splits a ThunderFX block into two regions each way, and Thunder's rematerialization
    # skips the second backward region: the pass, on by default, moves the MLP's cheap tail into it; with
    # --no-fusion-rematerialize it does not run.
    def plans(*flags):
        out = tmp_path / "r.json"
        assert (
            main(
                [
                    "report",
                    "--model",
                    "pythia-14m",
                    "--n-layers",
                    "1",
                    "--block-size",
                    "128",
                    "--mode",
                    "fsdp2",
                    "--world-size",
                    "1",
                    "--executors",
                    "fused",
                    *flags,
                    "--json",
                    str(out),
                ]
            )
            == 0
        )
        return json.loads(out.read_text())

    data = plans("--transform")
    without, with_it = data["plans"]
    assert with_it["saved_bytes"] < without["saved_bytes"] and with_it["peak_bytes"] < without["peak_bytes"]
    (moved,) = [p for p in data["transform_passes"] if p["pass_name"] == "fusion rematerialization"]
    assert moved["outcome"] == "applied"
    opted = plans("--no-fusion-rematerialize")
    without, opted_out = opted["plans"]
    assert not [
        p for p in opted["transform_passes"] if p["pass_name"] == moved["pass_name"] and p["outcome"] == "applied"
    ]
    # What the block saves less then is the cut's, through the regions (``passes/regions.py``), bit for bit.
    assert opted_out["saved_bytes"] < without["saved_bytes"]


def test_a_memory_cap_replays_the_caching_allocator(tmp_path, capsys):
    from thunder_fsdp_mem.analysis.snapshot import aligned as rounded

    out = tmp_path / "r.json"
    assert (
        main(
            [
                *PYTHIA_64,
                "--memory-cap",
                "1GB",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    data = json.loads(out.read_text())
    reserved = data["plans"][0]["reserved"]
    assert data["memory_cap_bytes"] == data["settings"]["memory_cap_bytes"] == 10**9
    # blocks of at least 512 bytes, segments of at least 2 MiB: more than the estimate, less than the cap
    assert rounded(data["peak_bytes"]) <= reserved["peak_allocated_bytes"] <= reserved["peak_reserved_bytes"] < 10**9
    assert reserved["out_of_memory_bytes"] is None
    assert "Under a cap of 953.67 MiB per rank, estimate: fits, reserving at most" in text
    assert "reserved (caching allocator, modelled)" in text


def test_a_budget_with_a_cap_is_planned_and_judged_under_the_cap(tmp_path, capsys):
    # pythia-14m's step peaks at 130.85 MiB in AdamW's step, which no recomputation lowers: under a cap of 131 MiB
    # the allocator's replay runs out there (its 24.94 MiB of temporaries find no cached block, and a segment more
    # passes the cap), so a budget of 131 MiB under that cap cannot be met, whatever the plan recomputes.
    out = tmp_path / "r.json"
    assert (
        main(
            [
                *PYTHIA_64,
                "--memory-budget",
                "131MiB",
                "--memory-cap",
                "131MiB",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    text = " ".join(capsys.readouterr().out.split())  # the report's lines wrap at its width
    data = json.loads(out.read_text())
    shown = data["plans"][-1]
    assert shown["peak_bytes"] <= 131 * 2**20 and shown["reserved"]["out_of_memory_bytes"] is not None
    assert "Budget 131.00 MiB per rank under a cap of 131.00 MiB: cannot be met: the plan nearest to it" in text
    assert "The budget's plan is the nearest to the cap the transform reaches" in text
    assert "--memory-budget with this --memory-cap plans a step that runs under it" in text  # without the transform
    # the transform was told of the cap: its rematerialization's note says so
    (remat,) = [p for p in data["transform_passes"] if p["pass_name"] == "rematerialization"]
    assert "reserved under a cap of 131.00 MiB" in remat["note"]
    # and its budget counts the step the report shows, AdamW's step as torch runs it on CUDA (foreach) included,
    # from traces made on the meta device: the peak is there (single-tensor AdamW would peak 11.9 MiB higher)
    assert shown["peak_phase"] == "optimizer step" and abs(remat["peak_after"] - shown["peak_bytes"]) < 1024


def test_a_warning_reaches_the_user_as_one_plain_line(capsys):
    # A budget no plan meets (2 MiB for a step of 130 MiB): the transform's warning, as the CLI prints it.
    assert main([*PYTHIA_64, "--memory-budget", "2MiB"]) == 0
    out, err = capsys.readouterr()
    (line,) = [line for line in err.splitlines() if "FSDPMemoryTransform" in line]
    assert all(line.startswith("thunder-fsdp-mem: ") for line in err.splitlines())
    assert line.startswith("thunder-fsdp-mem: warning: FSDPMemoryTransform: pass 'rematerialization' could not meet")
    assert "UserWarning" not in err and ".py:" not in err and "Traceback" not in err
    # the peak it names is the plan's the report shows (estimated once every pass has run)
    peak = re.search(r"Peak per rank: (\S+ \S+) ", out).group(1)
    assert f"the least reachable is a peak of {peak} " in line, (peak, line)


def test_the_help_examples_are_valid_command_lines():
    # every example under report's and fit's --help parses and passes the checks a run makes first
    import shlex

    from thunder_fsdp_mem.cli.parser import FIT_EXAMPLES, REPORT_EXAMPLES, build_parser
    from thunder_fsdp_mem.cli.validate import validate

    lines = [line.strip() for text in (REPORT_EXAMPLES, FIT_EXAMPLES) for line in text.splitlines()[1:]]
    assert len(lines) == 7
    for line in lines:
        args = build_parser().parse_args(shlex.split(line)[1:])
        validate(args)
    assert args.vectorize_window_masks is False and "--vectorize-window-masks" in REPORT_EXAMPLES


def test_a_block_size_beyond_the_models_is_predicted_and_said_in_one_line(capsys):
    # report and fit take the same limits (fit searches up to --block-size too): beyond the model's configured
    # block size is not refused, and a note says so.
    argv = ["report", "--model", "pythia-14m", "--n-layers", "1", "--block-size", "1024", "--mode", "jit"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "note: --block-size 1024 is beyond pythia-14m's configured block size (512 tokens)" in err
