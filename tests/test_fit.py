"""predict.fit: the bisection over candidate sizes against hand-made peaks, and ``report --fit`` on a small model:
what it calls the largest fits and the next does not, each figure the one ``report`` predicts for that size."""

import json

import pytest

from thunder_fsdp_mem.cli import main
from thunder_fsdp_mem.predict.fit import Largest, largest, sequence_lengths

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


def test_report_fit_finds_what_fits_and_what_does_not(tmp_path, capsys):
    out = tmp_path / "fit.json"
    small = ["--model", "pythia-14m", "--n-layers", "1", "--mode", "jit", "--device", "cpu", "--block-size", "512"]
    assert main(["report", *small, "--fit", "200MB", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "fits 190.73 MiB per rank" in text
    fit = json.loads(out.read_text())
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
    json_path = tmp_path / "r.json"
    assert main(["report", *small[:-1], "256", "--json", str(json_path)]) == 0
    assert json.loads(json_path.read_text())["peak_bytes"] == without["tokens"]["peak_bytes"]
