"""The runner (``thunder_fsdp_mem.run``): unmodified programs run with the transform in every Thunder function they
build. Each program writes what it computed (and what Thunder was given) to a file, so that a run through the
runner is compared with the same program run plainly: the same bits, the program's own transforms kept and ours
after them, its exit code passed through."""

import json
import textwrap

import pytest
import torch

from thunder_fsdp_mem.cli.commands import main as cli_main
from thunder_fsdp_mem.run.command import main
from thunder_fsdp_mem.run.program import run_program

LITGPT = """
    import sys, thunder, torch
    sys.path.insert(0, {tests!r})
    from configs import NEOX
    from thunder_fsdp_mem.training import litgpt_models
    spec = litgpt_models.ModelSpec(name=NEOX.name, n_layers=1, block_size=NEOX.block_size, overrides=NEOX.overrides)
    model = litgpt_models.build(spec, dtype=torch.float32)
    jitted = thunder.jit(model)
    idx, targets = litgpt_models.batch(spec)
    loss = jitted(idx, targets)
    loss.backward()
    cd = thunder.compile_data(jitted)
    torch.save({{"loss": loss.detach(), "grads": {{n: p.grad for n, p in jitted.named_parameters()}},
                "transforms": [type(t).__name__ for t in cd.transforms],
                "executors": [e.name for e in cd.executors_list if not e.name.startswith("__ad_hoc")]}}, sys.argv[1])
"""
FX = """
    import sys, thunder, torch
    from thunder.core.transform_common import Transform
    from thunder.dynamo import ThunderCompiler
    {imports}
    class Mine(Transform):
        pass
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    backend = ThunderCompiler(transforms=[{transforms}])
    out = torch.compile(model, backend=backend)(torch.randn(3, 8))
    out.sum().backward()
    fns = [fn for info in backend.subgraph_infos for fn in info.thunder_compiled_fns]
    torch.save({{"out": out.detach(), "transforms": [[type(t).__name__ for t in thunder.compile_data(fn).transforms]
                                                     for fn in fns]}}, sys.argv[1])
"""


def _script(tmp_path, name: str, body: str, **fields) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body.format(**fields)))
    return str(path)


def test_a_jitted_litgpt_step_keeps_its_bits_and_the_runner_says_what_it_did(tmp_path, capsys):
    tests = str(__import__("pathlib").Path(__file__).parent)
    script = _script(tmp_path, "train.py", LITGPT, tests=tests)
    assert run_program([script, str(tmp_path / "plain.pt")]) == 0
    record = tmp_path / "record.json"
    # The chunked loss rounds differently by design (test_loss): off, every pass keeps Thunder's bits.
    assert main(["--no-chunk-loss", "--json", str(record), "--", script, str(tmp_path / "ours.pt")]) == 0
    plain, ours = torch.load(tmp_path / "plain.pt"), torch.load(tmp_path / "ours.pt")
    assert torch.equal(plain["loss"], ours["loss"])
    assert all(torch.equal(plain["grads"][n], ours["grads"][n]) for n in plain["grads"])
    assert ours["transforms"] == [*plain["transforms"], "FSDPMemoryTransform"]
    assert ours["executors"] == plain["executors"]  # the program's, untouched
    done = json.loads(record.read_text())
    (compiled,) = done["compiled"]
    assert compiled["kind"] == "thunder.jit" and compiled["pairs"] == 1 and compiled["own"] is False
    assert compiled["saved_after"] < compiled["saved_before"] and "rematerialization" in compiled["applied"]
    # On CPU Thunder's torch executor claims attention without a grad rule: the probabilities are saved, and said.
    assert any("attention executor left as it was" in n and "probabilities" in n for n in compiled["notes"])
    block = capsys.readouterr().err.splitlines()
    assert block[0] == "thunder-fsdp-mem run: FSDPMemoryTransform (chunk_loss=False) in 1 Thunder function(s)"
    assert block[1].startswith("  function 0 (thunder.jit): estimated peak ")
    assert done["cuda"] is None and done["exit_code"] == 0


@pytest.mark.parametrize("own", [False, True], ids=["program-transform-kept", "program-passes-ours"])
def test_thundercompiler_subgraphs_take_one_transform_after_the_programs_own(tmp_path, capsys, own):
    imports = "from thunder_fsdp_mem import FSDPMemoryTransform, MemoryConfig" if own else ""
    transforms = "Mine(), FSDPMemoryTransform(MemoryConfig(reorder=False))" if own else "Mine()"
    script = _script(tmp_path, "fx.py", FX, imports=imports, transforms=transforms)
    assert run_program([script, str(tmp_path / "plain.pt")]) == 0
    record = tmp_path / "record.json"
    assert main(["--json", str(record), script, str(tmp_path / "ours.pt")]) == 0  # no "--": the first positional
    plain, ours = torch.load(tmp_path / "plain.pt"), torch.load(tmp_path / "ours.pt")
    assert torch.equal(plain["out"], ours["out"])
    assert ours["transforms"] and all(t.count("FSDPMemoryTransform") == 1 for t in ours["transforms"])
    assert all(t.index("Mine") < t.index("FSDPMemoryTransform") for t in ours["transforms"])
    compiled = json.loads(record.read_text())["compiled"]
    assert [c["kind"] for c in compiled] == ["ThunderFX subgraph"] * len(ours["transforms"])
    assert all(c["own"] is own for c in compiled)
    assert ("the program's own transform" in capsys.readouterr().err) is own


def test_exit_codes_and_failures_pass_through(tmp_path, capsys, monkeypatch):
    exits = _script(tmp_path, "exits.py", "import sys\nsys.exit(int(sys.argv[1]))\n")
    assert main(["--", exits, "3"]) == 3
    assert "the program exited with 3" in capsys.readouterr().err
    raises = _script(tmp_path, "raises.py", "def f():\n    raise ValueError('broken')\nf()\n")
    assert main(["--", raises]) == 1
    err = capsys.readouterr().err
    assert "ValueError: broken" in err and 'raises.py", line 2, in f' in err and "runpy" not in err
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "tool.py").write_text("import sys\nprint('args', sys.argv[1:])\n")
    monkeypatch.chdir(tmp_path)
    assert main(["--", "-m", "pkg.tool", "--flag", "1"]) == 0
    out, err = capsys.readouterr()
    assert "args ['--flag', '1']" in out
    assert "the program built no Thunder function: nothing was transformed" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "no program given"),
        (["--memory-budget", "2Gx", "--", "x.py"], "--memory-budget: cannot read '2Gx' as a size"),
        (["--recompute-weight", "-1", "--", "x.py"], "MemoryConfig.recompute_weight must be a finite number >= 0"),
        (["--executors", "fast", "--", "x.py"], "argument --executors: invalid choice: 'fast'"),
        (["--", "no-such-file.py"], "no such file: no-such-file.py"),
        (["--", "-m", "no_such.module"], "no module named no_such.module"),
    ],
)
def test_a_wrong_command_line_is_one_line_and_exit_2(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("thunder-fsdp-mem run: error: ") and message in err


def test_executors_replaced_everywhere_and_said(tmp_path, capsys):
    tests = str(__import__("pathlib").Path(__file__).parent)
    script = _script(tmp_path, "train.py", LITGPT, tests=tests)
    record = tmp_path / "record.json"
    assert (
        cli_main(["run", "--executors", "default+cat", "--json", str(record), "--", script, str(tmp_path / "a.pt")])
        == 0
    )
    ran = torch.load(tmp_path / "a.pt")
    done = json.loads(record.read_text())
    assert ran["executors"][: len(done["executors"])] == done["executors"]
    assert done["executors"][0] == "torchcompile_cat_named" and done["program_executors"]
    # A pass before autograd (the loss chunked, LossModel's cross-entropy) is applied, and what it did said.
    (compiled,) = done["compiled"]
    assert "chunked loss" in compiled["applied"] and any(
        n.startswith("chunked loss: f32 logits") for n in compiled["notes"]
    )
    err = capsys.readouterr().err
    assert "executors changed from the program's: [" in err and "replaced by [torchcompile_cat_named" in err


FSDP = """
    import os, sys, thunder, torch, torch.distributed as dist
    from thunder.distributed import FSDPType, fsdp
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    jitted = fsdp(thunder.jit(model), device=torch.device("cpu"), sharding_strategy=FSDPType.ZERO3)
    jitted(torch.randn(4, 8)).sum().backward()
    dist.destroy_process_group()
"""


@pytest.mark.slow
def test_under_torchrun_every_rank_runs_the_program_and_rank_0_says_what_was_done(tmp_path):
    import os
    import subprocess
    from pathlib import Path

    from benchmarks.launch import torchrun

    script = _script(tmp_path, "fsdp.py", FSDP)
    root = str(Path(__file__).resolve().parent.parent)
    cmd = torchrun(2, "-m", "thunder_fsdp_mem.run", "--json", str(tmp_path / "r{rank}.json"), "--", script)
    env = dict(os.environ, PYTHONPATH=root, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Thunder's fsdp jits the module again with its transform added: still one function, with one transform.
    assert proc.stderr.count("thunder-fsdp-mem run: FSDPMemoryTransform (the defaults) in 1 Thunder function(s)") == 1
    for rank in (0, 1):
        (compiled,) = json.loads((tmp_path / f"r{rank}.json").read_text())["compiled"]
        assert compiled["kind"] == "thunder.jit" and "all-gathers" in compiled["applied"], compiled
