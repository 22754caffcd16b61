"""predict.largest_step: the bisection over candidate sizes against hand-made peaks, and ``report --fit`` on a small
model: what it calls the largest fits and the next does not, each figure the one ``report`` predicts for that size; the
``fit`` command prints and writes the same, and ``report --fit`` says once, in one line, that it is deprecated."""

import contextlib
import io
import json

import pytest

from thunder_fsdp_mem.cli.commands import main
from thunder_fsdp_mem.predict.largest_step import Largest, largest, sequence_lengths

PEAKS = {256: 10, 512: 20, 1024: 40, 2048: 80, 4096: 160, 8192: 320, 16384: 640}


@pytest.mark.parametrize(
    "capacity, expected",
    [
        (45, Largest(1024, 40, 2048, 80)),
        (40, Largest(1024, 40, 2048, 80)),
        (5, Largest(None, None, 256, 10)),
        (1000, Largest(16384, 640, None, None)),
    ],
)
def test_largest_is_a_bisection_over_the_candidates(capacity, expected):
    asked = []

    def peak_of(size):
        asked.append(size)
        return PEAKS[size]

    assert largest(peak_of, sorted(PEAKS), capacity) == expected
    assert len(asked) <= 4  # 7 candidates: the first, then at most 3 halvings


def test_sequence_lengths_are_powers_of_two_up_to_the_longest():
    assert sequence_lengths(2048) == (256, 512, 1024, 2048)
    assert sequence_lengths(3000) == (256, 512, 1024, 2048)
    assert sequence_lengths(100) == (256,)


def test_the_longest_length_searched_and_why():
    from thunder_fsdp_mem.predict.largest_step import LONGEST, Longest, longest_for

    assert longest_for(2048, 512) == Longest(2048, "the model's configured block size")
    assert longest_for(2048, 5000) == Longest(4096, "--block-size")
    assert longest_for(None, 700) == Longest(512, "--block-size")
    assert longest_for(10**7, 512) == Longest(LONGEST, f"{LONGEST} tokens, the most the CLI takes")


SMALL = ["--model", "pythia-14m", "--n-layers", "1", "--mode", "jit", "--device", "cpu", "--block-size", "512"]


@pytest.fixture(scope="module")
def report_fit(tmp_path_factory):
    """``report --fit 200MB`` on a small model, run once: its exit code, stdout, stderr and JSON."""
    out = tmp_path_factory.mktemp("report_fit") / "fit.json"
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(["report", *SMALL, "--fit", "200MB", "--json", str(out)])
    return code, stdout.getvalue(), stderr.getvalue(), json.loads(out.read_text()) if code == 0 else None


def test_report_fit_finds_what_fits_and_what_does_not(report_fit, tmp_path):
    code, text, _, fit = report_fit
    assert code == 0
    assert "fits 190.73 MiB per rank" in text
    assert fit["capacity_bytes"] == 200 * 10**6
    for plan in fit["plans"]:
        for key in ("tokens", "micro_batch"):
            found = plan[key]
            if found["value"] is not None:
                assert found["peak_bytes"] <= 200 * 10**6
            if found["above"] is not None:
                assert found["above_peak_bytes"] > 200 * 10**6
    # Without the transform: 256 tokens fit and 512 do not; the report of a 256-token step predicts the same peak.
    without = fit["plans"][0]
    assert (without["tokens"]["value"], without["tokens"]["above"]) == (256, 512)
    # the limits searched, and why the longest: pythia-14m's configured block size is 512 tokens
    assert fit["searched"] == {
        "tokens": [256, 512],
        "longest_because": "the model's configured block size",
        "micro_batches": [1, 64],
    }
    assert (
        "Searched sequence lengths of 256 to 512 tokens (the longest: the model's configured block size)"
        in " ".join(text.split())
    )
    json_path = tmp_path / "r.json"
    assert main(["report", *SMALL[:-1], "256", "--json", str(json_path)]) == 0
    assert json.loads(json_path.read_text())["peak_bytes"] == without["tokens"]["peak_bytes"]


def test_report_fit_says_once_and_plainly_that_it_is_deprecated(report_fit):
    _, _, err, _ = report_fit
    noted = [line for line in err.splitlines() if "deprecated" in line]
    assert noted == [
        "thunder-fsdp-mem: note: `report --fit` is deprecated; use `thunder-fsdp-mem fit SIZE` with the same options"
    ]
    assert "Warning" not in err and "Traceback" not in err


def test_the_fit_command_gives_what_report_fit_gives(report_fit, tmp_path, capsys):
    _, text, _, fit = report_fit
    out = tmp_path / "fit.json"
    assert main(["fit", "200MB", *SMALL, "--json", str(out)]) == 0
    captured = capsys.readouterr()
    assert captured.out == text
    assert json.loads(out.read_text()) == fit
    assert "deprecated" not in captured.err


def test_at_80_columns_the_fit_table_keeps_every_plan_figure_and_unit():
    from thunder_fsdp_mem.predict.largest_step import Largest, Longest, StepFit
    from thunder_fsdp_mem.report.fit_table import render_fit

    def fit(tokens, micro_batch):
        return StepFit(
            80 * 10**9,
            Largest(tokens, 71 * 2**30, 2 * tokens, 90 * 2**30),
            Largest(micro_batch, 70 * 2**30, 2 * micro_batch, 88 * 2**30),
        )

    fits = [("without transform", fit(8192, 2)), ("with transform", fit(16384, 4))]
    text = render_fit(
        fits, title="stablecode-3b", block_size=8192, micro_batch_size=1, longest=Longest(16384, "x"), width=80
    )
    assert max(len(line) for line in text.splitlines()) <= 80 and "…" not in text
    assert all(line == line.rstrip() for line in text.splitlines())  # as the report's: no padding after a line
    assert text.count("without transform:") == text.count("with transform:") == 2  # each plan's two rows, named
    for cell in ("8192 tokens (71.00 GiB)", "16384 tokens (90.00 GiB)", "32768 tokens (90.00 GiB)", "2 sequences"):
        assert cell in text, cell
