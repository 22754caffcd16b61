"""``versions``: the installed torch, lightning-thunder and litgpt against the ranges the package's metadata states
(``pyproject.toml``'s): none outside here (CI installs the pins of ``constraints.txt``, inside them); a torch or a
Thunder outside is named with its version and the range, in one line at import."""

import importlib.metadata
import os
import subprocess
import sys
import tomllib

import pytest

from support import ROOT
from thunder_fsdp_mem import versions


@pytest.mark.smoke
def test_the_pinned_environment_is_inside_every_range_and_has_its_pins():
    # PINS: the constraints file this environment was made from (make smoke-stable: constraints-stable.txt, where
    # torch and Thunder were installed before the package, which must have kept them).
    assert versions.outside() == []
    pins = (ROOT / os.environ.get("PINS", "constraints.txt")).read_text().splitlines()
    for name, version in (line.split("==") for line in pins if "==" in line and not line.startswith("#")):
        assert importlib.metadata.version(name).split("+")[0] == version, name


def test_the_ranges_checked_are_pyprojects():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    installed = importlib.metadata.requires(versions.DISTRIBUTION)
    for name in versions.CHECKED:
        (ours,) = [d for d in declared if d.startswith(name)]
        (theirs,) = [r for r in installed if r.startswith(name)]
        assert set(ours.removeprefix(name).split(",")) == set(theirs.removeprefix(name).split(","))


def test_a_version_outside_is_named_with_the_range(monkeypatch):
    real = importlib.metadata.version
    fake = {"torch": "2.13.0", "lightning-thunder": "0.2.5"}
    monkeypatch.setattr(importlib.metadata, "version", lambda name: fake.get(name) or real(name))
    found = versions.outside()
    assert found == ["torch 2.13.0 (supported: <2.12,>=2.10)", "lightning-thunder 0.2.5 (supported: <0.2.8,>=0.2.6)"]


def test_importing_outside_the_range_says_so_in_one_line():
    code = (
        "import importlib.metadata as m; real = m.version; "
        "m.version = lambda n: '2.13.0' if n == 'torch' else real(n); "
        "import thunder_fsdp_mem"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "thunder_fsdp_mem" in line and "torch 2.13.0" in line]
    assert len(lines) == 1 and "not made for this environment: torch 2.13.0 (supported: <2.12,>=2.10)" in lines[0]
