"""Helpers shared by the tests: the independent measurement (torch's MemTracker) and 2-rank torchrun."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from torch.distributed._tools.mem_tracker import MemTracker

from benchmarks.launch import torchrun as torchrun_command
from thunder_fsdp_mem.training import runtime

ROOT = Path(__file__).resolve().parent.parent


def memtracker_peak(fn, *args, tracked=(), backward: bool = True) -> int:
    """Peak live tensor bytes on CPU over ``fn(*args)`` (and ``.backward()`` on its result), as MemTracker
    measures them; ``tracked`` (modules, tensors) and ``args`` are counted as alive from the start."""
    mt = MemTracker()
    mt.track_external(*tracked, *[a for a in args if isinstance(a, torch.Tensor)])
    with mt:
        out = fn(*args)
        if backward:
            out.backward()
    return mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def torchrun(script: str, *script_args: str, nproc: int = 2, timeout: int = 900) -> list[dict]:
    """Run ``tests/<script>`` on ``nproc`` gloo ranks; each rank prints one JSON line prefixed ``RESULT ``."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = torchrun_command(nproc, str(ROOT / "tests" / script), *script_args)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise AssertionError(f"torchrun failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return runtime.read_results(proc.stdout)


def saved_bytes(fn, *args, held=()) -> int:
    """Bytes of the storages autograd saves for backward while ``fn(*args)`` runs (through
    ``torch.autograd.graph.saved_tensors_hooks``: eager autograd and Thunder's autograd function alike), less
    those of ``held`` tensors and of ``args`` (parameters and inputs, alive anyway)."""
    local = [getattr(t, "_local_tensor", t) for t in [*held, *args] if isinstance(t, torch.Tensor)]  # DTensor shards
    skip = {t.untyped_storage().data_ptr() for t in local}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(seen.values())


def exit_worker() -> None:
    """End a torchrun worker once its results are written: the process group destroyed, then out without Python's
    teardown. On 2026-12-02 a rank of ``remat_worker.py`` aborted in teardown three runs in a row ("terminate called
    without an active exception", after both ranks had printed their results), then in none of the next five; the
    exit code failed the test for what comes after what it checks."""
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def upstream():
    """``docs/upstream/reproduce.py`` as a module, loaded once (it registers an executor when imported)."""
    import importlib.util

    name = "thunder_fsdp_mem_upstream_reproduce"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "docs" / "upstream" / "reproduce.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
