"""The OpInfo sweep's fast subset (``benchmarks/correctness/opinfo_sweep.py``): ops the cast folding rewrites, at small
odd lengths where ATen's CPU kernels run their scalar tails, jitted with and without the transform and compared bit
for bit; and the same check catching a fold that is wrong there (CPU ``rsqrt``, out of the table, put back)."""

import dataclasses
import json

import pytest
import torch

from benchmarks.correctness import opinfo_sweep
from thunder_fsdp_mem.passes import casts

FOLDED = ("exp", "sigmoid", "sqrt", "sin", "true_divide", "mul")


def _cases(names, dtype_name, lengths, views=2):
    by_name = {o.name: o for o in opinfo_sweep._opinfos()}
    cases = []
    for name in names:
        for sample in opinfo_sweep.samples(
            by_name[name], opinfo_sweep.DTYPES[dtype_name], "cpu", lengths, own=False, views=views
        ):
            cases.append(opinfo_sweep.Case(by_name[name], dtype_name, len(cases), sample))
    return cases


@pytest.mark.parametrize("dtype_name", ["bf16", "f16"])
def test_folded_ops_at_small_lengths_are_the_same_bits(dtype_name):
    cases = _cases(FOLDED, dtype_name, (7,))
    assert len(cases) == 2 * len(FOLDED)
    outcomes = opinfo_sweep.check(cases, "default", attribute=False)
    assert {o.status for o in outcomes} == {"same"}


def test_a_fold_wrong_at_small_lengths_is_caught(monkeypatch):
    # ATen's bf16 rsqrt on CPU differs from "float32 rsqrt, then round" outside its vectorized body.
    folds = dict(casts.FOLDABLE["cpu"], bf16=casts.FOLDABLE["cpu"]["bf16"] | {"rsqrt"})
    monkeypatch.setitem(casts.FOLDABLE, "cpu", folds)
    outcomes = opinfo_sweep.check(_cases(["rsqrt"], "bf16", (3, 17), views=1), "default", attribute=False)
    assert {o.status for o in outcomes} == {"differ"}


def test_bitwise_equal_tells_bits_apart():
    a = torch.tensor([1.0, float("nan"), -0.0], dtype=torch.bfloat16)
    assert opinfo_sweep.bitwise_equal(a, a.clone())
    assert not opinfo_sweep.bitwise_equal(a, torch.tensor([1.0, float("nan"), 0.0], dtype=torch.bfloat16))
    assert not opinfo_sweep.bitwise_equal(a, a.float())
    assert dataclasses.is_dataclass(opinfo_sweep.Outcome)


def test_resume_runs_only_the_cases_the_log_lacks(tmp_path, capsys):
    # a log holding every bf16 `neg` case but the last, as a sweep cut short leaves it (one case twice)
    neg = next(o for o in opinfo_sweep._opinfos() if o.name == "neg")
    n = len(list(opinfo_sweep.samples(neg, torch.bfloat16, "cpu")))
    assert n > 2
    log = tmp_path / "sweep.jsonl"
    rows = [opinfo_sweep.Outcome("neg", "bf16", i, "default", "same", "logged") for i in [0, *range(n - 1)]]
    log.write_text("".join(json.dumps(dataclasses.asdict(r)) + "\n" for r in rows))
    assert opinfo_sweep.main(["--ops", "neg", "--dtypes", "bf16", "--log", str(log), "--resume"]) == 0
    added = [json.loads(line) for line in log.read_text().splitlines()[len(rows) :]]
    assert [(r["op"], r["sample"], r["status"]) for r in added] == [("neg", n - 1, "same")]
    assert f"same {n}," in capsys.readouterr().out  # the counts cover the log's cases once each


def test_resume_needs_a_log():
    with pytest.raises(SystemExit):
        opinfo_sweep.main(["--ops", "neg", "--resume"])
