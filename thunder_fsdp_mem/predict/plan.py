"""A memory budget for FSDP2 from Python, in one call.

``plan_fsdp2(model, memory_budget=..., tokens=...) -> MemoryConfig``: the configuration of ``FSDPMemoryTransform``
under which a litgpt model's FSDP2 step through ThunderFX fits ``memory_budget`` bytes per rank::

    config = plan_fsdp2(model, memory_budget=60 * 2**30, tokens=8192)   # model: LossModel(gpt) or gpt, sharded
    backend = ThunderCompiler(transforms=[FSDPMemoryTransform(config)])
    model = torch.compile(model, backend=backend)

FSDP2 compiles every block alone, so a block's transform cannot see the step it is part of: the step's budget has
to become what each block may save for backward (``MemoryConfig.saved_budget``). This composes the step on the
meta device as it will run (``fsdp2.fit_budget``: the blocks' ThunderFX traces with the transform, FSDP2's
gathered parameters and buffers, the loss, AdamW's state and step) and lowers the blocks' saved budget until the
composed peak fits. What it reads from ``model``: the litgpt ``Config``, the world size (the parameters' device
mesh), zero2 or zero3 (FSDP2's ``reshard_after_forward`` on the blocks), the parameters' dtype, and where the loss
is (a ``LossModel``: in the step, its head and loss one ThunderFX graph that the transform chunks; a ``GPT``: eager
cross-entropy on the logits after it); each can be given instead. ``executors`` must be those the model is
compiled with (Thunder's defaults when ``ThunderCompiler`` is given none).

Every rank computes the same plan from the same arguments (tracing on the meta device depends on shapes only), so
the ranks' transforms make the same choices and issue the same collectives. Call it before ``torch.compile``: it
resets Dynamo, whose compiled code it would otherwise mix with its own.

Limitations: what ``fsdp2.compose_step`` models (litgpt's ``GPT`` with the wrapping of
``benchmarks/performance/compare.py``: each Block, ``wte``, ``ln_f``, ``lm_head`` or a ``LossModel`` root, the root;
AdamW); parameters computed in their own dtype (a ``MixedPrecisionPolicy`` whose ``param_dtype`` differs from the
parameters' is refused); a litgpt configuration known by name (``Config.from_name``), with any of its fields changed.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Sequence

import torch

from thunder_fsdp_mem.config import MemoryConfig
from thunder_fsdp_mem.loss.modules import LossModel
from thunder_fsdp_mem.predict import fsdp2
from thunder_fsdp_mem.analysis.caching_allocator import over_cap
from thunder_fsdp_mem.training import litgpt_models
from thunder_fsdp_mem.units import format_bytes, parse_bytes

log = logging.getLogger(__name__)


def plan_fsdp2(
    model,
    *,
    memory_budget: int | str,
    tokens: int,
    micro_batch_size: int = 1,
    world_size: int | None = None,
    shard: str | None = None,
    dtype: torch.dtype | None = None,
    executors: str | Sequence | None = None,
    device_type: str = "cuda",
    memory_cap: int | str | None = None,
    config: MemoryConfig | None = None,
    loss: str | None = None,
) -> MemoryConfig:
    """The ``MemoryConfig`` whose blocks' saved budget makes ``model``'s FSDP2 step fit ``memory_budget`` bytes per
    rank (see the module's docstring).

    model: a litgpt ``GPT`` or a ``LossModel`` of one (under ``fully_shard`` or not, compiled or not) or a litgpt
        ``Config``.
    memory_budget: the per-rank peak of allocated bytes (an int, or a size: ``"60GiB"``, ``"64GB"``).
    tokens, micro_batch_size: the step's sequence length and sequences per rank.
    world_size, shard (``zero2``/``zero3``), dtype: as the model says where None (a ``Config`` says nothing: then
        1, ``zero2`` and bfloat16).
    executors: Thunder's executors the model is compiled with: a list, or ``default``, ``default+cat``, ``fused``
        (``runtime.executors``); None: Thunder's defaults, as ``ThunderCompiler()`` uses.
    device_type: the device the step runs on (``cuda``: Thunder's CUDA kernels, AdamW's foreach step).
    memory_cap: the most the caching allocator may reserve (the GPU's memory): the plan must then also run in the
        allocator's replay under it (``MemoryConfig.memory_cap``).
    config: the other options of the transform (``MemoryConfig()`` where None); its budgets are replaced.
    loss: ``trace`` (the loss in the compiled step: ``LossModel`` as FSDP2's root) or ``eager`` (after the model);
        None: ``trace`` for a ``LossModel``, else ``eager``.

    Where the budget cannot be met, the plan nearest to it is returned with a warning that names its predicted
    peak (``config.strict``: raises)."""
    base = config if config is not None else MemoryConfig()
    budget = _bytes("memory_budget", memory_budget)
    cap = _bytes("memory_cap", memory_cap) if memory_cap is not None else None
    litgpt_config, gpt, found_loss = _litgpt(model)
    if loss is not None and loss not in fsdp2.LOSSES:
        raise ValueError(f"loss must be one of {', '.join(fsdp2.LOSSES)}, got {loss!r}")
    options = {  # compose_step's, each None as the model says
        "world_size": world_size if world_size is not None else _world_size(gpt),
        "shard": shard if shard is not None else _shard(gpt),
        "dtype": dtype if dtype is not None else _dtype(gpt),
        "executors": executors if executors is not None else "default",
        "device_type": device_type,
        "micro_batch_size": micro_batch_size,
        "loss": loss if loss is not None else found_loss,
    }
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
        raise ValueError(f"tokens must be a positive int, got {tokens!r}")
    spec = litgpt_models.ModelSpec.from_config(litgpt_config, block_size=tokens)
    wanted = dataclasses.replace(base, memory_budget=budget, memory_cap=cap, saved_budget=None)
    step, planned, _ = fsdp2.fit_budget(spec, wanted, **options)
    short = over_cap(step, cap) if cap is not None else 0
    log.info(
        "plan_fsdp2: %s, %d rank(s), %s, %d tokens, %s loss: each block saves at most %s; predicted peak %s",
        litgpt_config.name,
        options["world_size"],
        options["shard"],
        tokens,
        options["loss"],
        _saved(planned),
        format_bytes(step.peak_bytes),
    )
    if step.peak_bytes > budget or short > 0:
        message = (
            f"plan_fsdp2: could not meet the budget of {format_bytes(budget)}: the plan nearest to it has a "
            f"predicted peak of {format_bytes(step.peak_bytes)}"
            + (f" and its allocator replay misses the cap by {format_bytes(short)}" if short > 0 else "")
        )
        if base.strict:
            raise RuntimeError(message)
        warnings.warn(message, stacklevel=2)
    return planned


def _saved(config: MemoryConfig) -> str:
    return "what it saves without a budget" if config.saved_budget is None else format_bytes(config.saved_budget)


def _bytes(name: str, value) -> int:
    if isinstance(value, str):
        return parse_bytes(value)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    raise ValueError(f"{name} must be a number of bytes (an int >= 1) or a size such as '60GiB', got {value!r}")


def _litgpt(model):
    """(the litgpt ``Config``, the ``GPT`` or None, where the loss is) of ``model``."""
    from litgpt import GPT, Config

    if isinstance(model, Config):
        return model, None, "eager"
    inner = getattr(model, "_orig_mod", model)  # torch.compile's wrapper
    if isinstance(inner, LossModel) and isinstance(inner.gpt, GPT):
        return inner.gpt.config, inner.gpt, "trace"
    if isinstance(inner, GPT):
        return inner.config, inner, "eager"
    raise TypeError(f"model must be a litgpt GPT, a LossModel of one, or a litgpt Config, got {type(model).__name__}")


def _world_size(gpt) -> int:
    from torch.distributed.tensor import DTensor

    if gpt is not None:
        for p in gpt.parameters():
            if isinstance(p, DTensor):
                return p.device_mesh.size()
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() and gpt is not None else 1


def _fsdp_group(module):
    """FSDP2's parameter group of ``module`` (None where ``fully_shard`` was not applied to it)."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, FSDPModule):
        return None
    return module._get_fsdp_state()._fsdp_param_group


def _shard(gpt) -> str:
    """zero3 where FSDP2 reshards the blocks after their forward, else zero2."""
    groups = [g for g in (_fsdp_group(b) for b in gpt.transformer.h) if g is not None] if gpt is not None else []
    if not groups:
        return "zero2"
    return "zero3" if groups[0]._reshard_after_forward else "zero2"


def _dtype(gpt) -> torch.dtype:
    if gpt is None:
        return torch.bfloat16
    dtype = next(gpt.parameters()).dtype
    group = next((g for g in (_fsdp_group(m) for m in gpt.modules()) if g is not None), None)
    computed = group.mp_policy.param_dtype if group is not None else None
    if computed is not None and computed != dtype:
        raise NotImplementedError(
            f"plan_fsdp2: parameters in {dtype} computed in {computed} (FSDP2's "
            "MixedPrecisionPolicy) are not modelled; keep the parameters in the dtype they are "
            "computed in"
        )
    if dtype not in litgpt_models.DTYPES.values():
        raise NotImplementedError(f"plan_fsdp2: parameters in {dtype} are not modelled")
    return dtype
