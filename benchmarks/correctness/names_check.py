"""Does the report name each of its largest tensors by what it is? A check over models and modes the tests do not
name, on the meta device (no GPU).

    python -m benchmarks.correctness.names_check [--models pythia-14m Qwen2.5-0.5B ...] [--n-layers 2]
        [--block-size 512]

For each model, mode (``jit``, ``thunder-fsdp``, ``fsdp2``) and executors (``default``, ``fused``) it traces a
step as ``thunder-fsdp-mem report`` does and takes the 20 largest allocations of the forward and of the backward
traces, and those alive at the step's peak. Each must be named (``Allocation.label``):
- not by a bare trace name (``t521``);
- where a module is named, by a module the model has (or a parameter it has);
- where the name says the module's own op and Thunder recorded a line of code for it, by a module whose class's
  code (or whose parent's, which calls it) holds that line (the line tells the class; the trace's parameter
  reads tell which of its instances);
- the head's output as ``logits (lm_head)``, with the vocabulary as its last dimension.
It prints one line per case (or why it could not be traced) and every name that breaks a rule; the exit code is
1 if any does.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys

from thunder_fsdp_mem.analysis.timeline import is_trace_name
from thunder_fsdp_mem.analysis.categories import Category
from thunder_fsdp_mem.analysis.phases import Stage
from thunder_fsdp_mem.predict.emulate import trace_step
from thunder_fsdp_mem.training import litgpt_models

MODELS = ("pythia-14m", "stablecode-completion-alpha-3b", "Qwen2.5-0.5B", "phi-2", "falcon-7b")
MODES = ("jit", "thunder-fsdp", "fsdp2")


def check(spec: litgpt_models.ModelSpec, mode: str, executors: str) -> tuple[int, list[str]]:
    """(names checked, the names that break a rule, each with why) for one case."""
    options = {"mode": mode, "executors": executors}
    if mode != "jit":
        options.update(shard="zero3", world_size=2)
    step = trace_step(spec, **options)
    from litgpt import GPT
    import torch

    with torch.device("meta"):
        gpt = GPT(spec.config())
    modules = dict(gpt.named_modules())
    parameters = {q for q, _ in gpt.named_parameters()} | {q for q, _ in gpt.named_buffers()}
    chosen = list(step.live_at_peak)
    for stage in (Stage.FORWARD, Stage.BACKWARD):
        made = [a for p in step.phases if p.stage is stage and p.timeline is not None for a in p.timeline.allocations]
        chosen += sorted(made, key=lambda a: -a.nbytes)[:20]
    wrong = []
    for a in {id(a): a for a in chosen}.values():
        why = _broken(a, modules, parameters, spec)
        if why:
            wrong.append(f"{a.label!r} ({a.name}, {a.op or a.symbol}, {a.source}): {why}")
    return len(chosen), sorted(set(wrong))


def _broken(a, modules: dict, parameters: set[str], spec: litgpt_models.ModelSpec) -> str | None:
    label = a.label
    if is_trace_name(label):
        return "a bare trace name"
    if a.role == "logits" and label.startswith("logits ("):
        if a.shape[-1:] != (spec.config().padded_vocab_size,):
            return "the logits without the vocabulary as last dimension"
        return None
    module = a.module if a.module is not None else a.after
    if module is None or a.role in ("loss", "cotangent"):
        return None
    if a.role in ("gradient", "parameter") or a.category is Category.GATHERED_PARAMETER:
        return None if module in parameters else f"{module} is no parameter of the model"
    if module not in modules:
        return f"{module} is no module of the model"
    if a.module is not None and a.source:
        filename, _, line = a.source.rpartition(":")
        holders = {type(m) for m in modules.values() if _holds(type(m), filename, int(line))}
        around = [modules[m] for m in _ancestors(module) if m in modules]  # a module's call is in its parent's code
        if holders and not any(isinstance(m, cls) for m in around for cls in holders):
            return f"the line is in {', '.join(sorted(c.__name__ for c in holders))}'s code, not {module}'s"
    return None


def _ancestors(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), -1, -1)]


def _holds(cls: type, filename: str, line: int) -> bool:
    for klass in cls.__mro__[:-2]:
        try:
            lines, first = inspect.getsourcelines(klass)
            if os.path.realpath(inspect.getsourcefile(klass)) == os.path.realpath(filename):
                if first <= line < first + len(lines):
                    return True
        except (OSError, TypeError):
            continue
    return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), help=f"litgpt names (default: {' '.join(MODELS)})")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--executors", nargs="+", default=["default", "fused"], help="default: default fused")
    p.add_argument("--n-layers", type=int, default=2, help="default 2")
    p.add_argument("--block-size", type=int, default=512, help="default 512")
    args = p.parse_args(argv)
    total = bad = 0
    for name in args.models:
        spec = litgpt_models.ModelSpec(name=name, n_layers=args.n_layers, block_size=args.block_size)
        for mode in args.modes:
            for executors in args.executors:
                try:
                    checked, wrong = check(spec, mode, executors)
                except Exception as e:  # noqa: BLE001 - a model Thunder cannot trace in a mode: said, not checked
                    print(f"{name} {mode} {executors}: not traced: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                total, bad = total + checked, bad + len(wrong)
                print(f"{name} {mode} {executors}: {checked} names, {len(wrong)} wrong", flush=True)
                for w in wrong:
                    print(f"    {w}")
    print(f"total: {total} names, {bad} wrong")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
