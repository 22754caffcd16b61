"""Thunder's OpInfos run with and without ``FSDPMemoryTransform``, forward and backward, compared bit for bit.

    python -m benchmarks.correctness.opinfo_sweep [--device cpu|cuda] [--executors default fused]
        [--dtypes float32 bf16 f16] [--ops NAME ...] [--lengths 1 3 7 17 33 67] [--jobs N] [--out sweep.json]
        [--log sweep.jsonl [--resume]]

Every OpInfo of ``thunder.tests.opinfos`` (it imports pytest: ``pip install .[test]``), for each dtype
it supports, for each sample it generates: the op runs inside a pair, its tensor outputs each multiplied by a
second input (so that the forward saves something for backward, as a model's does), and the gradients of every
input that takes one are computed against fixed random cotangents. The pair is ``thunder.jit``-ed twice, with the
same executors, without the transform and with the default one; the outputs and gradients must be equal bit for
bit (a NaN equals a NaN). ``--lengths`` adds, for the elementwise ops, samples of those lengths contiguous, strided
and expanded (where ATen's vectorized loops leave a scalar tail).

A case counts as

- ``same``: equal bit for bit;
- ``differ``: not equal, and Thunder without the transform gives the same bits when run again (the op is
  deterministic): a broken promise;
- ``rematerialized``: with a fusion executor, not equal to the run without the transform, but equal bit for bit
  to Thunder's rematerialization as it means to run (``docs/upstream/rematerialization.patch``): the transform's
  ``fusion_rematerialize`` makes Thunder's own pass do what it intends, which recomputes a fusion's values in
  backward and so may round differently from the forward's (``docs/design.md``);
- ``nondeterministic``: Thunder without the transform differs from itself in one of two more runs (on CUDA
  the sweep asks for deterministic algorithms, ``torch.use_deterministic_algorithms``; ops without one still
  add in any order);
- ``transform failed``: Thunder runs the case, but not with the transform (a crash of ours);
- ``skipped``: Thunder itself does not run the case (the sample or the op is not supported), or it has no tensor
  output.

Prints one line a case that is not ``same`` or ``skipped`` and the counts; ``--out`` writes them as JSON.
``--log`` appends each outcome as it comes, and ``--resume`` skips the cases that log already holds, so a sweep
cut short (a 10-minute device call, a session's end) goes on where it stopped; the counts then cover the log.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import multiprocessing
import os
import sys
import warnings
import zlib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import torch

from tests import support

DTYPES = {"float32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
STATUSES = ("same", "differ", "rematerialized", "nondeterministic", "transform failed", "skipped")


@dataclasses.dataclass(frozen=True)
class Outcome:
    op: str
    dtype: str
    sample: int
    executors: str
    status: str
    detail: str = ""


def _opinfos():
    from thunder.tests import opinfos

    return opinfos.opinfos


def _thunder_dtype(dtype: torch.dtype):
    from thunder.core import dtypes

    return dtypes.to_dtype(dtype)


def samples(
    opinfo, dtype: torch.dtype, device: str, lengths: tuple[int, ...] = (), *, own: bool = True, views: int = 3
) -> Iterator:
    """The OpInfo's own samples for ``dtype`` (unless ``own`` is False), then (for an elementwise op) new values in
    the range of its first sample of more than one value, at each of ``lengths``: contiguous, every other element,
    and a column of an expanded view (the first ``views`` of these)."""
    from thunder.tests.opinfos import SampleInput

    generated = list(opinfo.sample_inputs(device, _thunder_dtype(dtype), requires_grad=opinfo.supports_grad))
    if own:
        yield from generated
    # the pattern of the first sample whose tensors hold more than one value (their range sets the new values')
    spread = [s for s in generated if all(a.numel() > 1 for a in s.args if isinstance(a, torch.Tensor))]
    template = (spread or generated or [None])[0]
    if not lengths or template is None or not _elementwise(opinfo):
        return
    g = torch.Generator().manual_seed(0)
    for n in lengths:
        for view in range(views):
            args = []
            for a in template.args:
                if not isinstance(a, torch.Tensor):
                    args.append(a)
                    continue
                base = _like(a, 2 * n + 1, g).to(device)
                v = (base[:n], base[1 : 2 * n + 1 : 2], base[:n].view(n, 1).expand(n, 3)[:, 1])[view]
                args.append(v.detach().requires_grad_(a.requires_grad))
            yield SampleInput(*args, **template.kwargs)


def _elementwise(opinfo) -> bool:
    from thunder.tests import opinfos

    lists = (opinfos.elementwise_unary_ops, opinfos.elementwise_binary_ops)
    return any(opinfo in group for group in lists)


def _like(a: torch.Tensor, n: int, g: torch.Generator) -> torch.Tensor:
    """``n`` values of ``a``'s dtype, spread as the OpInfo's own samples are (within ``a``'s range)."""
    lo, hi = (float(a.min()), float(a.max())) if a.numel() else (-1.0, 1.0)
    if a.dtype.is_floating_point:
        return (torch.rand(n, generator=g) * (hi - lo) + lo).to(a.dtype)
    return torch.randint(int(lo), int(hi) + 1, (n,), generator=g).to(a.dtype)


def _cloned(tree):
    from torch.utils._pytree import tree_map

    def clone(x):
        if isinstance(x, torch.Tensor):
            return x.detach().clone().requires_grad_(x.requires_grad)
        return x

    return tree_map(clone, tree)


@dataclasses.dataclass(frozen=True)
class Case:
    """One sample of one OpInfo in one dtype."""

    opinfo: object
    dtype: str
    index: int
    sample: object


def _paired(ops: list):
    """Each op of ``ops`` inside a pair, one after the other in one function: each floating tensor output times
    a weight of its own (a second input, a 0-dim tensor that takes a gradient: the forward then saves the output
    for backward)."""

    def pair(inputs, weights):
        from thunder.core import dtypes
        from torch.utils._pytree import tree_flatten

        products = []
        for op, (args, kwargs), w in zip(ops, inputs, weights):
            outputs = [o for o in tree_flatten(op(*args, **kwargs))[0] if isinstance(o, torch.Tensor)]
            products += [o * w if dtypes.is_float_dtype(o.dtype) else o for o in outputs]
        return tuple(products)

    return pair


def run(cases: list[Case], executors: list, transforms: list, seed: int) -> list[torch.Tensor]:
    """The cases' pairs jitted as one function: their outputs, then the gradients of the inputs and weights that
    take one (None where unused) against random cotangents, both drawn from ``seed``."""
    import thunder
    from torch.utils._pytree import tree_flatten

    g = torch.Generator().manual_seed(seed)
    weights = []
    for case in cases:
        w = torch.randn((), generator=g).to(DTYPES[case.dtype])
        device = next((t.device for t in tree_flatten(case.sample.args)[0] if isinstance(t, torch.Tensor)), "cpu")
        weights.append(w.to(device).requires_grad_(bool(case.opinfo.supports_grad)))
    inputs, weights = _cloned(([(c.sample.args, c.sample.kwargs) for c in cases], weights))
    jitted = thunder.jit(_paired([c.opinfo.op for c in cases]), executors=executors, transforms=transforms)
    outputs = list(jitted(inputs, weights))
    leaves = [t for t in tree_flatten((inputs, weights))[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    differentiable = [o for o in outputs if o.requires_grad]
    cotangents = [torch.randn(o.shape, generator=g).to(o.dtype).to(o.device) for o in differentiable]
    grads = []
    if leaves and differentiable:
        grads = torch.autograd.grad(differentiable, leaves, cotangents, allow_unused=True)
    return [o.detach() for o in outputs] + list(grads)


def bitwise_equal(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not (a.dtype.is_floating_point or a.dtype.is_complex):
        return torch.equal(a, b)
    a, b = torch.view_as_real(a) if a.is_complex() else a, torch.view_as_real(b) if b.is_complex() else b
    nan = torch.isnan(a) & torch.isnan(b)
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    same = a.contiguous().view(bits) == b.contiguous().view(bits)
    return bool((same | nan).all())


def _all_equal(xs: list, ys: list) -> bool:
    return len(xs) == len(ys) and all(bitwise_equal(x, y) for x, y in zip(xs, ys))


def check(cases: list[Case], choice: str, *, attribute: bool = True) -> list[Outcome]:
    """The cases jitted together without the transform and with it; where the batch is not the same bit for bit
    (or does not run), each case on its own, unless ``attribute`` is False (then every case gets the batch's
    outcome)."""
    from thunder_fsdp_mem import FSDPMemoryTransform
    from thunder_fsdp_mem.training import runtime

    executors = runtime.executors(choice)
    status, detail = _compare(cases, executors, choice, FSDPMemoryTransform)
    if status == "same" or len(cases) == 1 or not attribute:
        return [Outcome(c.opinfo.name, c.dtype, c.index, choice, status, detail[:300]) for c in cases]
    return [outcome for case in cases for outcome in check([case], choice)]


def _compare(cases: list[Case], executors: list, choice: str, transform) -> tuple[str, str]:
    try:
        plain = run(cases, executors, [], 0)
    except Exception as e:  # noqa: BLE001 - Thunder's own failure to run the case
        return "skipped", f"{type(e).__name__}: {e}"
    if not plain:
        return "skipped", "no tensor output"
    try:
        ours = run(cases, executors, [transform()], 0)
    except Exception as e:  # noqa: BLE001
        return "transform failed", f"{type(e).__name__}: {e}"
    if _all_equal(plain, ours):
        return "same", ""
    if any(not _all_equal(plain, run(cases, executors, [], 0)) for _ in range(2)):
        return "nondeterministic", ""
    if choice != "default":
        with support.upstream().fixed_rematerialization():
            intended = run(cases, executors, [], 0)
        if _all_equal(intended, ours):
            return "rematerialized", ""
    wrong = [i for i, (x, y) in enumerate(zip(plain, ours)) if not bitwise_equal(x, y)]
    return "differ", f"outputs/gradients at {wrong} of {len(plain)}"


def sweep(
    names: list[str] | None,
    dtypes: list[str],
    device: str,
    choices: list[str],
    lengths: tuple[int, ...] = (),
    log: Path | None = None,
    done: frozenset = frozenset(),
) -> list[Outcome]:
    """Every case of the named OpInfos (None: all) in one process, each jitted on its own, but those in ``done``
    (``_key``s); each outcome is also appended to ``log`` as a JSON line as soon as it is known (what a run cut
    short leaves)."""
    from thunder.core import devices

    warnings.filterwarnings("ignore")
    if device.startswith("cuda"):  # CUDA's atomic adds (scatter_add, index_put) otherwise sum in any order
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    found = []
    devicetype = devices.to_device(device).devicetype
    for opinfo in _opinfos():
        if names is not None and opinfo.name not in names:
            continue
        if devicetype not in opinfo.devicetypes():
            continue
        supported = set(opinfo.dtypes())
        for dtype_name in dtypes:
            if _thunder_dtype(DTYPES[dtype_name]) not in supported:
                continue
            torch.manual_seed(zlib.crc32(f"{opinfo.name} {dtype_name}".encode()))  # the same samples in any shard
            try:
                cases = list(samples(opinfo, DTYPES[dtype_name], device, lengths))
            except Exception as e:  # noqa: BLE001 - the OpInfo cannot make samples here
                found.append(Outcome(opinfo.name, dtype_name, -1, "-", "skipped", f"samples: {e}"[:300]))
                continue
            for index, sample in enumerate(cases):
                for choice in choices:
                    if (opinfo.name, dtype_name, index, choice) in done:
                        continue
                    found += check([Case(opinfo, dtype_name, index, sample)], choice)
                    if log is not None:
                        with log.open("a") as f:
                            f.write(json.dumps(dataclasses.asdict(found[-1])) + "\n")
    return found


def _shard(job: tuple) -> list[dict]:
    return [dataclasses.asdict(o) for o in sweep(*job)]


def _key(row: dict) -> tuple:
    return row["op"], row["dtype"], row["sample"], row["executors"]


def logged(log: Path) -> list[dict]:
    """The outcomes a ``--log`` holds, the last of each case (a case run twice counts once)."""
    rows = {}
    if log.exists():
        for line in log.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                rows[_key(row)] = row
    return list(rows.values())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument(
        "--executors", nargs="+", default=["default"], help="executor choices (training.runtime): default, fused"
    )
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    p.add_argument("--ops", nargs="+", default=None, help="OpInfo names (default: every OpInfo)")
    p.add_argument("--lengths", nargs="*", type=int, default=[], help="extra elementwise lengths, e.g. 1 3 7 17 67")
    p.add_argument("--jobs", type=int, default=1, help="processes, each taking the next OpInfo when free (default 1)")
    p.add_argument("--out", type=Path, default=None, help="write every outcome as JSON here")
    p.add_argument("--log", type=Path, default=None, help="append each outcome here as a JSON line as it comes")
    p.add_argument("--resume", action="store_true", help="skip the cases --log already holds, and count them")
    args = p.parse_args(argv)
    if args.resume and args.log is None:
        p.error("--resume needs --log")
    before = logged(args.log) if args.resume else []
    done = frozenset(_key(row) for row in before)
    names = list(dict.fromkeys(args.ops or [o.name for o in _opinfos()]))  # two OpInfos share a name
    # One OpInfo a task, handed to whichever process is free: a few slow OpInfos do not hold up one share.
    jobs = [([name], args.dtypes, args.device, args.executors, tuple(args.lengths), args.log, done) for name in names]
    if args.jobs == 1:
        rows = [row for job in jobs for row in _shard(job)]
    else:
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=context) as pool:
            rows = [row for part in pool.map(_shard, jobs) for row in part]
    asked = [row for row in before if row["op"] in names and row["dtype"] in args.dtypes]
    rows = [row for row in asked if row["executors"] in (*args.executors, "-")] + rows
    for row in rows:
        if row["status"] not in ("same", "skipped"):
            print(json.dumps(row))
    counts = Counter(row["status"] for row in rows)
    print("counts: " + ", ".join(f"{s} {counts.get(s, 0)}" for s in STATUSES) + f" (of {len(rows)} cases)")
    if args.out:
        args.out.write_text(json.dumps({"argv": sys.argv[1:], "counts": counts, "outcomes": rows}, indent=0))
    return 1 if counts.get("differ") or counts.get("transform failed") else 0


if __name__ == "__main__":
    sys.exit(main())
