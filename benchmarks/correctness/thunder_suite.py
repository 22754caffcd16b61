"""Thunder's own test files with ``FSDPMemoryTransform()`` in every ``thunder.jit`` and ThunderFX compile, against
the same files without it: does any test change its outcome, and does the transform ever warn or raise?

    python -m benchmarks.correctness.thunder_suite [--files test_networks test_grad ...] [--jobs 2] [-k EXPR]
        [--out suite.json]

Each run is one ``pytest --pyargs thunder.tests.<file> ...`` (``--jobs`` pytest-xdist workers, each file on one),
its outcomes read from its JUnit XML; the run with the transform loads
``benchmarks/correctness/thunder_suite_plugin.py``, which adds it and records what it did. It prints the per-test
differences (a test that passed without the transform and failed with it, or the other way, with the failing run's
message), the counts of each run, how many compilations took the transform and every warning or exception of the
transform; the exit code is 1 if an outcome changed or the transform raised. ``--out`` keeps, besides, every failure's
message and the end of its traceback. Thunder's test files import test-only packages: ``pip install -e '.[sweep]'``. On
CPU (no GPU), the CUDA tests skip themselves.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
FILES = ("test_networks", "test_grad", "test_transforms", "test_dynamo", "test_autocast", "test_jit_general")


def run_files(
    files: list[str], *, ours: bool, jobs: int, keyword: str | None, workdir: Path
) -> tuple[dict, dict, dict]:
    """(test id -> outcome, test id -> why it failed, what the plugin recorded) of one pytest run over Thunder's
    ``files``."""
    xml = workdir / ("with.xml" if ours else "without.xml")
    record = workdir / ("record-with" if ours else "record-without")
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "--junitxml",
        str(xml),
        "-o",
        "junit_family=xunit1",
        "--pyargs",
        *(f"thunder.tests.{f}" for f in files),
    ]
    if jobs > 1:
        cmd += ["-n", str(jobs), "--dist", "loadfile"]
    if keyword:
        cmd += ["-k", keyword]
    if ours:
        cmd += ["-p", "benchmarks.correctness.thunder_suite_plugin"]
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        THUNDER_SUITE_RECORD=str(record),
    )
    subprocess.run(cmd, cwd=workdir, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    return outcomes(xml), failures(xml), _merged(workdir, record.name)


def outcomes(xml: Path) -> dict[str, str]:
    """Test id (``classname::name``, or ``file::name``) -> passed, failed, error or skipped, from a JUnit XML
    report."""
    return {test: outcome for test, outcome, _ in _cases(xml)}


def failures(xml: Path) -> dict[str, dict[str, str]]:
    """Test id -> the message and the end of the traceback of each test that failed or erred, from a JUnit XML
    report: what a changed outcome is judged by."""
    return {test: why for test, outcome, why in _cases(xml) if outcome in ("failed", "error")}


def _cases(xml: Path):
    if not xml.exists():
        return
    for case in ET.parse(xml).getroot().iter("testcase"):
        found = {child.tag: child for child in case}
        kind = next((k for k in ("error", "failure", "skipped") if k in found), None)
        # --pyargs runs leave the class name empty: the file tells, from the package on
        where = (case.get("classname") or case.get("file") or "").rpartition("site-packages/")[2]
        why = {}
        if kind is not None:
            why = {"message": (found[kind].get("message") or "")[:500], "tail": (found[kind].text or "")[-2000:]}
        yield f"{where}::{case.get('name')}", {"failure": "failed", None: "passed"}.get(kind, kind), why


def _merged(workdir: Path, prefix: str) -> dict:
    merged = {"jitted": 0, "transformed": 0, "warnings": [], "raised": []}
    for path in workdir.glob(prefix + ".*"):
        part = json.loads(path.read_text())
        for key in merged:
            merged[key] += part[key]
    return merged


def compare(without: dict[str, str], with_: dict[str, str]) -> list[tuple[str, str, str]]:
    """(test, outcome without, outcome with) for every test whose outcome differs (or that ran in one run only)."""
    return [
        (test, without.get(test, "absent"), with_.get(test, "absent"))
        for test in sorted(set(without) | set(with_))
        if without.get(test) != with_.get(test)
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--files", nargs="+", default=list(FILES), help=f"Thunder's test files (default: {' '.join(FILES)})")
    p.add_argument("--jobs", type=int, default=2, help="pytest-xdist workers per run (default 2)")
    p.add_argument("-k", dest="keyword", default=None, help="pytest's -k expression, to run a part (default: all)")
    p.add_argument("--out", type=Path, default=None, help="write both runs' outcomes and the record as JSON here")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        without, failed_without, _ = run_files(
            args.files, ours=False, jobs=args.jobs, keyword=args.keyword, workdir=workdir
        )
        with_, failed_with, record = run_files(
            args.files, ours=True, jobs=args.jobs, keyword=args.keyword, workdir=workdir
        )
    changed = compare(without, with_)
    for test, before, after in changed:
        print(f"changed: {test}: {before} without the transform, {after} with it")
        for label, failed in (("without", failed_without), ("with", failed_with)):
            if test in failed:
                first = (failed[test]["message"].splitlines() or [""])[0]
                print(f"  {label} the transform: {first}")
    for label, found in (("without the transform", without), ("with it", with_)):
        counts = Counter(found.values())
        print(
            f"{label}: {len(found)} tests, "
            + ", ".join(f"{counts.get(k, 0)} {k}" for k in ("passed", "failed", "error", "skipped"))
        )
    print(
        f"the transform: added to {record['jitted']} compilations, ran {record['transformed']} times, "
        f"{len(record['warnings'])} warnings, {len(record['raised'])} exceptions"
    )
    for w in record["warnings"]:
        print(f"warning: {w['test']}: {w['message']}")
    for e in record["raised"]:
        print(f"raised: {e['test']}: {e['error']}")
    print(f"{len(changed)} outcomes changed")
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "files": args.files,
                    "keyword": args.keyword,
                    "without": without,
                    "with": with_,
                    "failures": {"without": failed_without, "with": failed_with},
                    "record": record,
                    "changed": changed,
                },
                indent=1,
            )
        )
    return 1 if changed or record["raised"] else 0


if __name__ == "__main__":
    sys.exit(main())
