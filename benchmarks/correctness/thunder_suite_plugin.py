"""A pytest plugin that adds ``FSDPMemoryTransform()`` to every ``thunder.jit`` of the session (``ThunderCompiler``'s
subgraphs among them) as the runner does (``thunder_fsdp_mem.run.inject``), for
``benchmarks/correctness/thunder_suite.py``. Loaded with ``-p benchmarks.correctness.thunder_suite_plugin`` (the
project's root on ``PYTHONPATH``); it patches before Thunder's test files are collected, so that their
``from thunder import jit`` takes the patched function too.

At the end it writes, to the JSON file ``THUNDER_SUITE_RECORD`` names, how often the transform was added
(``jitted``), how often it ran on a trace (``transformed``), and every warning it gave (``warnings``) and every
exception it raised (``raised``), by test.
"""

from __future__ import annotations

import functools
import json
import os
import traceback

_record = {"jitted": 0, "transformed": 0, "warnings": [], "raised": []}
_current: dict = {"test": ""}


def pytest_configure(config) -> None:
    from thunder_fsdp_mem import FSDPMemoryTransform, MemoryConfig
    from thunder_fsdp_mem.run.inject import injected

    _current["injection"] = injected(MemoryConfig())  # what the runner does: one transform per thunder.jit
    _current["programs"] = _current["injection"].__enter__().programs
    for name in ("transform_traces_pre_prologue", "transform_trace_post_optimization"):
        setattr(FSDPMemoryTransform, name, _watched(getattr(FSDPMemoryTransform, name)))
    warned = FSDPMemoryTransform._warned

    def _warned(self, what: str, message: str) -> None:  # every warning the transform gives (or raises, strict)
        _record["warnings"].append({"test": _current["test"], "message": f"{what}: {message}"[:500]})
        warned(self, what, message)

    FSDPMemoryTransform._warned = _warned


def _watched(method):
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        _record["transformed"] += 1
        try:
            return method(self, *args, **kwargs)
        except Exception as e:
            _record["raised"].append(
                {
                    "test": _current["test"],
                    "error": f"{type(e).__name__}: {e}"[:500],
                    "where": traceback.format_exc()[-1500:],
                }
            )
            raise

    return run


def pytest_runtest_setup(item) -> None:
    _current["test"] = item.nodeid


def pytest_unconfigure(config) -> None:
    _record["jitted"] = sum(p.transform is not None for p in _current["programs"])
    _current["injection"].__exit__(None, None, None)
    path = os.environ.get("THUNDER_SUITE_RECORD")
    if path:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(f"{path}.{worker}", "w") as f:
            json.dump(_record, f)
