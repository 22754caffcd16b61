"""The training set-ups we compare, by name: how each wraps and compiles a litgpt model.

``build(mode, spec, rank, ...) -> Trainer`` gives a model ready for ``Trainer.step(idx, targets)`` (forward,
cross-entropy loss, backward, AdamW step, ``zero_grad``). The loss is computed eagerly on the logits as Thunder's
``benchmark_litgpt.py`` does, or, as ``loss`` says (``loss_placement.LOSSES``), compiled with the model or by an
external fused loss after it. The FSDP2 wrapping is ``benchmark_litgpt.py``'s: each Block, ``lm_head``, ``wte``,
``ln_f``, then the root (``shard_fsdp2``), computed in the parameters' dtype; ``reshard_after_forward`` is on for zero3.
``inductor+ckpt`` is torch.compile with every Block under activation checkpointing (``checkpoint_wrapper``,
non-reentrant), the least memory torch offers; torch.compile's modes take ``activation_memory_budget``, its
partitioner's budget (``torch._functorch.config``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import thunder
from litgpt import GPT

from thunder_fsdp_mem.config import MemoryConfig
from thunder_fsdp_mem.loss.modules import HiddenStates, LossModel
from thunder_fsdp_mem.training import litgpt_models, loss_placement, runtime
from thunder_fsdp_mem.transform import FSDPMemoryTransform

DISTRIBUTED_MODES = (
    "thunder-fsdp",
    "thunder-fsdp+mem",
    "fsdp2-thunder",
    "fsdp2-thunder+mem",
    "fsdp2-inductor",
    "fsdp2-eager",
    "fsdp1-inductor",
)
SINGLE_MODES = ("thunder", "thunder+mem", "inductor", "inductor+ckpt", "eager")
WHAT_EACH_RUNS = {  # what ``benchmarks/performance/compare.py --help`` says of each mode
    "thunder-fsdp": "thunder.jit under Thunder's fsdp (thunder.distributed.fsdp)",
    "thunder-fsdp+mem": "the same with FSDPMemoryTransform",
    "fsdp2-thunder": "FSDP2 (fully_shard per block) compiled by ThunderFX (ThunderCompiler)",
    "fsdp2-thunder+mem": "the same with FSDPMemoryTransform in ThunderCompiler's transforms",
    "fsdp2-inductor": "FSDP2 compiled by torch.compile (Inductor): the baseline of the distributed rows",
    "fsdp2-eager": "FSDP2 without compilation",
    "fsdp1-inductor": "FSDP1 (FullyShardedDataParallel) compiled by torch.compile (CUDA only)",
    "thunder": "thunder.jit on one device (--nproc-per-node 1)",
    "thunder+mem": "the same with FSDPMemoryTransform (--nproc-per-node 1)",
    "inductor": "torch.compile on one device: the baseline of the one-device rows (--nproc-per-node 1)",
    "inductor+ckpt": "torch.compile with every block checkpointed (--nproc-per-node 1)",
    "eager": "no compilation, one device (--nproc-per-node 1)",
}
CUDA_ONLY = frozenset({"fsdp1-inductor"})
COMPILES_AHEAD = frozenset({"thunder-fsdp", "thunder-fsdp+mem", "thunder", "thunder+mem"})  # Trainer.precompile
BASELINES = ("fsdp2-inductor", "inductor")  # torch.compile's rows: what the other rows are measured against
THUNDER_MODES = frozenset(
    {"thunder-fsdp", "thunder-fsdp+mem", "fsdp2-thunder", "fsdp2-thunder+mem", "thunder", "thunder+mem"}
)
INDUCTOR_MODES = frozenset({"fsdp2-inductor", "fsdp1-inductor", "inductor", "inductor+ckpt"})


def valid_modes(nproc: int) -> tuple[str, ...]:
    """Modes that make sense for ``nproc`` processes per node: the single-GPU rows only with 1."""
    return DISTRIBUTED_MODES + (SINGLE_MODES if nproc == 1 else ())


@dataclass
class Trainer:
    """A model wrapped for one mode, with its optimizer. ``jitted`` is the ThunderModule when there is one
    (what ``estimate_step`` reads)."""

    mode: str
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    jitted: torch.nn.Module | None = None
    backend: object | None = None
    transform: object | None = None  # the FSDPMemoryTransform of a +mem mode
    loss: str = "eager"  # where the step computes its loss (``loss_placement.LOSSES``)

    def precompile(self, idx: torch.Tensor, targets: torch.Tensor) -> bool:
        """Compile for ``idx`` without running anything on the device, where the compiler can: ``thunder.jit``
        traces and transforms on proxies, so the first step then finds its program in the cache. Dynamo compiles
        while it runs the step, so the other modes compile in their first step. True if it compiled here."""
        if self.jitted is None:
            return False
        args = (idx, targets) if self.loss in loss_placement.INSIDE else (idx,)
        thunder.compile_data(self.jitted).get_computation_and_inputs(*args)
        return True

    def park(self) -> None:
        """Move the parameters and buffers to host memory and give the device's cached memory back, so that the
        process holds no device memory while it waits (before its first step: there is no optimizer state yet).
        The tensors keep their identity: compiled programs and the optimizer still refer to them."""
        self._move(torch.device("cpu"))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def unpark(self, device: torch.device) -> None:
        """Undo ``park``: parameters and buffers back on ``device`` (nothing to do where they already are)."""
        self._move(device)

    def _move(self, device: torch.device) -> None:
        for t in (*self.model.parameters(), *self.model.buffers()):
            if t.device != device:
                t.data = t.data.to(device)

    def step(
        self, idx: torch.Tensor, targets: torch.Tensor, after_backward: Callable[[], None] | None = None
    ) -> torch.Tensor:
        """One training step; ``after_backward`` is called between the backward and the optimizer step."""
        if self.loss == "eager":
            logits = self.model(idx)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        else:
            loss = self.model(idx, targets)
        loss.backward()
        if after_backward is not None:
            after_backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()


def build(
    mode: str,
    spec: litgpt_models.ModelSpec,
    rank: runtime.Rank,
    *,
    shard: str = "zero2",
    executors: str = "default+cat",
    dtype: torch.dtype = torch.bfloat16,
    memory: MemoryConfig = MemoryConfig(),
    probe=None,
    activation_memory_budget: float | None = None,
    loss: str = "eager",
) -> Trainer:
    """``memory``: the ``MemoryConfig`` of the +mem modes (the others run without the transform). ``probe``: a
    Thunder transform listed after every other one (``probes.MemoryProbeTransform``), for the modes that compile
    with Thunder. ``activation_memory_budget``: torch.compile's, for its modes (None: its default, 1.0).
    ``loss``: where the step computes its loss (``loss_placement.LOSSES``): ``trace`` compiles the model with its
    loss (the user's forms ``view`` and ``litgpt`` too);
    ``liger``/``cce``/``chunked`` (single-device modes and FSDP2) compile the model up to its final norm and run
    that fused loss after it."""
    if loss not in loss_placement.LOSSES:
        raise ValueError(f"loss must be one of {', '.join(loss_placement.LOSSES)}, got {loss!r}")
    if loss in loss_placement.OUTSIDE and mode in ("thunder-fsdp", "thunder-fsdp+mem", "fsdp1-inductor"):
        raise ValueError(f"mode {mode} shards the head's weight where an external loss cannot gather it")
    if probe is not None and mode not in THUNDER_MODES:
        raise ValueError(f"mode {mode} does not compile with Thunder: nothing to probe")
    if activation_memory_budget is not None:
        if mode not in INDUCTOR_MODES:
            raise ValueError(f"mode {mode} does not compile with torch.compile: it has no activation_memory_budget")
        if not 0.0 <= activation_memory_budget <= 1.0:
            raise ValueError(f"activation_memory_budget must be between 0 and 1, got {activation_memory_budget!r}")
        import torch._functorch.config

        torch._functorch.config.activation_memory_budget = activation_memory_budget
    builders: dict[str, Callable[..., Trainer]] = {
        "thunder-fsdp": lambda: _thunder(mode, spec, rank, executors, dtype, loss, shard=shard, mem=None, probe=probe),
        "thunder-fsdp+mem": lambda: _thunder(
            mode, spec, rank, executors, dtype, loss, shard=shard, mem=memory, probe=probe
        ),
        "fsdp2-thunder": lambda: _fsdp2(
            mode, spec, rank, shard, dtype, loss, compiler=("thunder", executors, None, probe)
        ),
        "fsdp2-thunder+mem": lambda: _fsdp2(
            mode, spec, rank, shard, dtype, loss, compiler=("thunder", executors, memory, probe)
        ),
        "fsdp2-inductor": lambda: _fsdp2(mode, spec, rank, shard, dtype, loss, compiler=("inductor",)),
        "fsdp2-eager": lambda: _fsdp2(mode, spec, rank, shard, dtype, loss, compiler=None),
        "fsdp1-inductor": lambda: _fsdp1(mode, spec, rank, shard, dtype, loss),
        "thunder": lambda: _thunder(mode, spec, rank, executors, dtype, loss, shard=None, mem=None, probe=probe),
        "thunder+mem": lambda: _thunder(mode, spec, rank, executors, dtype, loss, shard=None, mem=memory, probe=probe),
        "inductor": lambda: _plain(mode, spec, rank, dtype, loss, compile_=True),
        "inductor+ckpt": lambda: _plain(mode, spec, rank, dtype, loss, compile_=True, checkpointed=True),
        "eager": lambda: _plain(mode, spec, rank, dtype, loss, compile_=False),
    }
    if mode not in builders:
        raise ValueError(f"unknown mode {mode!r}; valid modes: {', '.join(builders)}")
    if mode in CUDA_ONLY and rank.device.type != "cuda":
        raise ValueError(f"mode {mode} needs CUDA")
    if rank.device.type == "cpu":
        _cpu_inductor()
    return builders[mode]()


def _cpu_inductor() -> None:
    """Inductor on CPU as the CPU runs need it (they are for correctness, not speed): scalar code, because its
    vectorized C++ code for bf16 reductions does not compile in torch 2.11 (``conflicting declaration 'auto
    at_BFloat16_tmp_acc0_vec'``); and compilation in the calling thread, with no pool of compile workers whose
    threads run beside the caller's (a Thunder trace made meanwhile in the same process once failed with
    ``dictionary changed size during iteration``)."""
    import torch._inductor.config

    torch._inductor.config.cpp.simdlen = 1
    torch._inductor.config.compile_threads = 1


def _gpt(spec: litgpt_models.ModelSpec, rank: runtime.Rank, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.device(rank.device):
        gpt = spec.gpt()
    return gpt.to(dtype)


def _adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-4)


def _with_loss(gpt: GPT, loss: str, compile_body: Callable[[torch.nn.Module], torch.nn.Module]):
    """(the module a step calls, the compiled part of it): the model itself (``eager``), the model and its loss
    (``trace``), or a fused loss after the compiled hidden states (``liger``, ``cce``, ``chunked``)."""
    if loss == "eager":
        compiled = compile_body(gpt)
        return compiled, compiled
    if loss in loss_placement.INSIDE:
        compiled = compile_body(_inside(gpt, loss))
        return compiled, compiled
    model = loss_placement.ExternalLoss(gpt, loss)
    model.set_body(compile_body(HiddenStates(gpt)))
    return model, model.body


def _inside(gpt: GPT, loss: str) -> torch.nn.Module:
    """The model with its loss in one module: ``LossModel`` (``trace``) or the user's own
    (``loss_placement.UserLoss``)."""
    return LossModel(gpt) if loss == "trace" else loss_placement.UserLoss(gpt, loss)


def _thunder(mode, spec, rank, executors, dtype, loss, *, shard: str | None, mem, probe) -> Trainer:
    """``mem``: the MemoryConfig of the transform, None for none."""
    transform = FSDPMemoryTransform(mem) if mem is not None else None
    transforms = [t for t in (transform, probe) if t is not None]
    model, jitted = _with_loss(
        _gpt(spec, rank, dtype),
        loss,
        lambda m: thunder.jit(m, executors=runtime.executors(executors), transforms=transforms),
    )
    if shard is not None:  # Thunder's FSDPTransform comes last; it does nothing after the optimization
        jitted = model = runtime.thunder_fsdp(jitted, shard=shard, device=rank.device)
    return Trainer(mode, model, _adamw(model), jitted=jitted, transform=transform, loss=loss)


def shard_fsdp2(gpt: GPT, shard: str, root: torch.nn.Module | None = None) -> torch.nn.Module:
    """``fully_shard`` on each Block, ``lm_head``, ``wte``, ``ln_f`` and the root, as ``benchmark_litgpt.py`` wraps
    a litgpt model; ``shard``: zero2, or zero3 (``reshard_after_forward``). The parameters are computed in the dtype
    they are in (bf16 in every benchmark: the ``MixedPrecisionPolicy`` casts nothing then). ``root``: a module
    holding ``gpt`` and its loss (``LossModel``, ``loss_placement.ExternalLoss``), the root unit then, which keeps the
    head (no unit of its own, whose hooks would break Dynamo's graph between the head and the loss) and, where the
    embedding shares the head's weight, the embedding. Returns the root."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dtype = next(gpt.parameters()).dtype
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)
    reshard = shard == "zero3"
    for block in gpt.transformer.h:
        fully_shard(block, mp_policy=policy, reshard_after_forward=reshard)
    own = [gpt.transformer.ln_f]
    if root is None:
        own += [gpt.lm_head, gpt.transformer.wte]
    elif gpt.transformer.wte.weight is not gpt.lm_head.weight:
        own.append(gpt.transformer.wte)
    for module in own:
        fully_shard(module, mp_policy=policy, reshard_after_forward=reshard)
    root = gpt if root is None else root
    fully_shard(root, mp_policy=policy, reshard_after_forward=reshard)
    return root


def _fsdp2(mode, spec, rank, shard, dtype, loss, *, compiler) -> Trainer:
    backend = transform = None
    if compiler is not None and compiler[0] == "thunder":
        from thunder.dynamo import ThunderCompiler

        _, executors, mem, probe = compiler
        transform = FSDPMemoryTransform(mem) if mem is not None else None
        transforms = [t for t in (transform, probe) if t is not None]  # fresh: ThunderCompiler appends to it
        backend = ThunderCompiler(executors=runtime.executors(executors), transforms=transforms)

    def compile_body(module):
        if compiler is None:
            return module
        return torch.compile(module, backend=backend) if backend is not None else torch.compile(module)

    gpt = _gpt(spec, rank, dtype)
    if loss == "eager":
        root = shard_fsdp2(gpt, shard)
        model = compile_body(root)
    elif loss in loss_placement.INSIDE:
        root = shard_fsdp2(gpt, shard, _inside(gpt, loss))
        model = compile_body(root)
    else:
        root = model = shard_fsdp2(gpt, shard, loss_placement.ExternalLoss(gpt, loss))
        model.set_body(compile_body(HiddenStates(gpt)))
    return Trainer(mode, model, _adamw(root), backend=backend, transform=transform, loss=loss)


def _fsdp1(mode, spec, rank, shard, dtype, loss) -> Trainer:
    import functools

    from litgpt.model import Block
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    gpt = _gpt(spec, rank, dtype)
    strategy = ShardingStrategy.FULL_SHARD if shard == "zero3" else ShardingStrategy.SHARD_GRAD_OP
    wrapped = FullyShardedDataParallel(
        gpt,
        sharding_strategy=strategy,
        use_orig_params=True,
        device_id=rank.device,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
    )
    if loss != "eager":
        raise ValueError(f"mode {mode} runs the eager loss only")
    return Trainer(mode, torch.compile(wrapped), _adamw(wrapped))


def _plain(mode, spec, rank, dtype, loss, *, compile_: bool, checkpointed: bool = False) -> Trainer:
    gpt = _gpt(spec, rank, dtype)
    if checkpointed:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, block in enumerate(gpt.transformer.h):
            gpt.transformer.h[i] = checkpoint_wrapper(block)
    model, _ = _with_loss(gpt, loss, torch.compile if compile_ else (lambda m: m))
    return Trainer(mode, model, _adamw(gpt), loss=loss)
