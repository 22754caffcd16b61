"""``examples/``: each script runs on CPU as a user runs it (``python``, the runner, ``torchrun`` on 2 gloo ranks),
and the README's snippets are the examples' marked excerpts, character for character (a snippet that drifts from
a script that runs fails here)."""

import os
import re
import subprocess
import sys

import pytest

from support import ROOT, torchrun_command

EXAMPLES = ROOT / "examples"
_REGION = re.compile(r"^# README: (.+?)\n(.*?)^# README end\n", re.M | re.S)


def _excerpts() -> dict[str, str]:
    found = {}
    for path in sorted(EXAMPLES.glob("*.py")):
        for name, body in _REGION.findall(path.read_text()):
            found[f"{path.name}: {name}"] = body
    return found


def _run(*cmd: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def test_the_readmes_snippets_are_the_examples_excerpts():
    blocks = re.findall(r"^```python\n(.*?)^```\n", (ROOT / "README.md").read_text(), re.M | re.S)
    excerpts = _excerpts()
    assert len(excerpts) == 3, sorted(excerpts)
    assert sorted(blocks) == sorted(excerpts.values()), "a README snippet is not an example's excerpt"


@pytest.mark.smoke
def test_the_jit_example_runs_and_says_what_the_transform_did():
    out = _run(sys.executable, "examples/jit.py").stdout
    assert "FSDPMemoryTransform: 1 forward/backward pair(s)" in out and "chunked loss" in out


@pytest.mark.smoke
def test_the_litgpt_loop_runs_as_it_is_and_through_the_runner_which_chunks_its_loss():
    plain = _run(sys.executable, "examples/litgpt_loop.py").stdout
    ran = _run(sys.executable, "-m", "thunder_fsdp_mem.run", "--", "examples/litgpt_loop.py")
    assert plain.count("step ") == ran.stdout.count("step ") == 3
    assert "applied: chunked loss" in ran.stdout + ran.stderr


@pytest.mark.slow
@pytest.mark.smoke
@pytest.mark.parametrize("script", ["fsdp2.py", "thunder_fsdp.py"])
def test_the_distributed_examples_run_on_two_gloo_ranks(script):
    out = _run(*torchrun_command(2, str(EXAMPLES / script)), timeout=900).stdout
    assert "step 1: loss" in out
