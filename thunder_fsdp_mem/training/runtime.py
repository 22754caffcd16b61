"""Process set-up shared by the CLI and the benchmarks: devices, process groups, executors, Thunder's fsdp.

Nothing here reads the environment except ``init_distributed``, which reads what ``torchrun`` sets.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from thunder_fsdp_mem.thunder_internals import implementations, renamed_fusion, set_implementations
from thunder_fsdp_mem.training.cudnn_attention import cudnn_attention_ex

EXECUTOR_CHOICES = ("default", "default+cat", "default+inductor", "fused")
SHARDS = ("zero2", "zero3")


@dataclass(frozen=True, slots=True)
class Rank:
    rank: int
    world_size: int
    device: torch.device


def init_distributed(device_type: str) -> Rank:
    """Join the process group ``torchrun`` describes (NCCL on CUDA, gloo on CPU); a single process without
    ``torchrun`` is rank 0 of 1 and starts no group."""
    if "RANK" not in os.environ:
        device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
        return Rank(0, 1, device)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return Rank(dist.get_rank(), dist.get_world_size(), device)


RESULT = "RESULT "


def print_result(row: dict) -> None:
    """One worker's result, as one line in a single write: the ranks of a ``torchrun`` share its stdout, and
    two ``print``s can interleave their text and newlines."""
    sys.stdout.write(f"{RESULT}{json.dumps(row)}\n")
    sys.stdout.flush()


def read_results(text: str) -> list[dict]:
    """Every result ``print_result`` wrote into ``text``, also where two ranks' lines ran together."""
    decoder, rows, at = json.JSONDecoder(), [], text.find(RESULT)
    while at >= 0:
        row, end = decoder.raw_decode(text, at + len(RESULT))
        rows.append(row)
        at = text.find(RESULT, end)
    return rows


def executors(choice: str) -> list:
    """Thunder's executors for ``choice``, one of ``EXECUTOR_CHOICES``:

    - ``default``: Thunder's defaults (nvFuser among them when a matching build is installed);
    - ``default+cat``: the defaults with a torch.compile executor for rotary's ``cat`` first (the seed's
      ``thunder_inductor_cat``; it claims CUDA tensors only);
    - ``default+inductor``: the defaults with Thunder's whole torch.compile executor first, as
      ``benchmark_litgpt.py``'s ``thunder_inductor`` lists it (it claims attention ahead of the attention executors,
      without a grad rule: ``attention``);
    - ``fused``: Thunder's strongest configuration: attention through torch's cuDNN kernels where torch would run
      them (``cudnn_attention``), then Thunder's attention executors (cuDNN's where installed, sdpa), then
      one fusion executor for the rest (nvFuser where a matching build is installed, else Thunder's torch.compile
      executor without the distributed prims, ``_compile_executor``), then the other defaults without
      ``torchcompile_xentropy`` (the fusion executor fuses the loss too).

    Thunder 0.2.7 names the fusions of every torch.compile executor ``TorchCompile0``, ``TorchCompile1``...
    When two of them claim regions of one trace (``torchcompile_cat`` and the default ``torchcompile_xentropy``
    once the loss is jitted with the model), the second region's callable replaces the first's and the step
    fails (``to_be_compiled() takes 2 positional arguments but 3 were given``). Our cat executor claims exactly
    what ``torch_compile_cat_ex`` claims and names its fusions ``TorchCompileCat0``...
    """
    import thunder

    if choice not in EXECUTOR_CHOICES:
        raise ValueError(f"executors must be one of {', '.join(EXECUTOR_CHOICES)}; got {choice!r}")
    chosen = list(thunder.get_default_executors())
    if choice == "default+cat":
        chosen.insert(0, _cat_executor())
    elif choice == "default+inductor":
        from thunder.executors.torch_compile import torch_compile_ex

        chosen.insert(0, torch_compile_ex)
    elif choice == "fused":
        from thunder.executors.torch_compile import torch_compile_xentropy_ex

        fusion = thunder.nvfuser_executor or _compile_executor()
        attention = [cudnn_attention_ex, *(ex for ex in chosen if ex.name in ("cudnn", "sdpa"))]
        rest = [ex for ex in chosen if ex not in (*attention, fusion, torch_compile_xentropy_ex)]
        chosen = [*attention, fusion, *rest]
    return chosen


_COMPILE_EX = None


def _compile_executor():
    """Thunder's ``torch_compile_ex`` (what the torch executor runs, on any device) less the distributed prims
    (all-gather, wait, reduce-scatter, pack...): under Thunder's fsdp a region that holds an asynchronous
    collective fails in Dynamo, and the FSDP passes schedule the collectives as symbols of their own."""
    global _COMPILE_EX
    if _COMPILE_EX is None:
        from thunder.distributed.prims import PrimIDs as DistributedPrimIDs
        from thunder.executors.torch_compile import TorchCompileExecutor, torch_compile_ex

        _COMPILE_EX = TorchCompileExecutor(name="torchcompile_fused")
        set_implementations(
            _COMPILE_EX,
            {
                op: info
                for op, info in implementations(torch_compile_ex).items()
                if not isinstance(op, DistributedPrimIDs)
            },
        )
    return _COMPILE_EX


_CAT_EX = None


def _cat_executor():
    global _CAT_EX
    if _CAT_EX is None:
        from thunder.core.symbol import Symbol
        from thunder.executors.torch_compile import TorchCompileExecutor, torch_compile_cat_ex

        class _CatExecutor(TorchCompileExecutor):
            def fuse(self, region, fusion_counter):
                bsym = super().fuse(region, fusion_counter)
                new = bsym.sym.name.replace("TorchCompile", "TorchCompileCat", 1)
                return renamed_fusion(bsym, Symbol(new, meta=None, is_fusion=True, executor=self))

        _CAT_EX = _CatExecutor(name="torchcompile_cat_named", required_ops=torch_compile_cat_ex.required_ops)
        set_implementations(_CAT_EX, dict(implementations(torch_compile_cat_ex)))
    return _CAT_EX


def thunder_fsdp(jitted, *, shard: str, device: torch.device):
    """``thunder.distributed.fsdp`` with ``shard`` one of ``zero2``/``zero3``."""
    from thunder.distributed import fsdp

    return fsdp(jitted, device=device, sharding_strategy=fsdp_type(shard))


def fsdp_type(shard: str):
    """Thunder's ``FSDPType`` of ``shard``, one of ``SHARDS``."""
    from thunder.distributed import FSDPType

    if shard not in SHARDS:
        raise ValueError(f"shard must be one of {', '.join(SHARDS)}; got {shard!r}")
    return FSDPType.ZERO2 if shard == "zero2" else FSDPType.ZERO3
