"""One training step of a litgpt model under FSDP2 (``fully_shard``) through ThunderFX, per rank, composed from the
ThunderFX traces of its blocks and what FSDP2 holds outside them. Traced on the meta device: no GPU, no memory
for the model, no other ranks.

Entry points: ``compose_step(spec, *, world_size, shard, ...) -> StepMemory``; ``fit_budget(spec, config, ...)``,
the ``MemoryConfig.saved_budget`` each block's transform needs for the step to fit a per-rank budget.

The set-up is ``benchmarks/performance/compare.py``'s (``modes._fsdp2``): ``fully_shard`` on each Block, ``lm_head``,
``wte``, ``ln_f`` and then the root, bf16 parameters, ``reshard_after_forward`` for zero3 only; the whole model under
``torch.compile(backend=ThunderCompiler(...))``; the loss eager cross-entropy on the logits, or (``loss="trace"``)
in the step: ``LossModel`` is the root and keeps ``lm_head`` (``modes.shard_fsdp2(..., root=LossModel(gpt))``).

How such a step runs, and how it is composed here:

- Dynamo does not trace FSDP2's hooks, so it breaks the graph at every unit: each Block's forward is one ThunderFX
  graph, compiled once and run for every block (``thunderfx.trace_blocks`` traces and analyses it); ``wte``,
  ``ln_f`` and ``lm_head`` are ``torch.nn`` modules and run eagerly. The eager units run on the meta device under
  ``saved_tensors_hooks``, which shows what autograd saves; their backward allocates a gradient for each input and
  parameter.
- FSDP2's holdings follow its code in torch 2.11 (``_fully_shard/_fsdp_param_group.py``, ``_fsdp_collectives.py``):
  - every parameter's shard is its first dimension padded to a multiple of the world size, divided by it; AdamW
    keeps two moments of the shard's size;
  - before a unit's forward, its shards are all-gathered into one buffer of world size x shard bytes and copied
    out into the unsharded parameters; the buffer is freed when the next unit's copy-out is done (the last one
    after the root's forward): ``wait_for_unshard`` drops it before the copy-out, but its local
    ``prev_all_gather_state`` holds it until the function returns. zero3 frees the unsharded parameters after each
    unit's forward and gathers them again before its backward (buffer freed at once), prefetching the unit that
    runs next in the backward; zero2 keeps them until the unit's backward is done;
  - after a unit's backward, its unsharded gradients are copied into a reduce-scatter input (world size x shard
    bytes); the reduce-scatter's output, the sharded gradient, is allocated and kept, and only then are the
    unsharded gradients freed (``foreach_reduce`` clears its list, but the parameters' ``grad`` still hold them);
    the input is freed when the next unit's reduce-scatter starts (the last at the end of the backward).
- The caller holds the logits until ``backward`` returns; the loss is ``eager_loss.loss_allocations``.
- With the loss in the step, the root's pre-forward gathers the head's weight before any other unit and FSDP2
  keeps a root gathered through the backward; after ``ln_f`` the head, its soft-cap and the loss are one ThunderFX
  graph (``thunderfx.trace_tail``, which the transform chunks), whose backward runs first; the root's gradients
  are reduce-scattered last, in FSDP2's final callback (the root's input, the token ids, takes no gradient to hook).

What each unit, FSDP2, autograd and the caller hold is kept in ``holdings.Holdings``, the same ledger ``estimate_step``
composes its step with, and the step is ``phases.step_memory`` of its phases. ``_compose`` walks the step: the
persistent state, each unit's forward (``_Forward``) between FSDP2's gathers, the loss, each unit's backward
(``_Backward``) between FSDP2's gathers and reduce-scatters, the optimizer's step. The units, what the ledger holds
and FSDP2's own collectives are ``fsdp2_units``'.

Limitations: litgpt's plain ``GPT.forward`` only (embedding, blocks, final norm, head); configurations with
``rope_indices`` are refused, and so is ``final_logit_softcapping`` with the eager loss; ``scale_embeddings``'
product is not counted; a head tied to the embedding is not modelled (the composed model is untied).
Parameters are bf16 or fp32 as given, with no mixed-precision casts. The optimizer's own step and allocator
rounding are not modelled, as in ``estimate_step``.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch
from litgpt import GPT

from thunder_fsdp_mem.analysis.caching_allocator import over_cap
from thunder_fsdp_mem.analysis.categories import Category
from thunder_fsdp_mem.analysis.timeline import Allocation
from thunder_fsdp_mem.analysis.provenance import is_head
from thunder_fsdp_mem.analysis.eager_loss import loss_allocations
from thunder_fsdp_mem.analysis.holdings import Holder, Holdings, Key, Role
from thunder_fsdp_mem.analysis.optimizer import adam_step_allocation
from thunder_fsdp_mem.analysis.phases import Stage, StepMemory, step_memory
from thunder_fsdp_mem.analysis.symbols import dtype_name
from thunder_fsdp_mem.config import MemoryConfig
from thunder_fsdp_mem.loss.modules import LossModel
from thunder_fsdp_mem.predict.fsdp2_units import (
    AUTOGRAD,
    CALLER,
    Collectives,
    Held,
    Unit,
    hold_persistent,
    placed_timeline,
    record,
    renamed,
    tensor_record,
    unplaced,
    units,
)
from thunder_fsdp_mem.predict.meta import as_on
from thunder_fsdp_mem.predict.thunderfx import BlockTraces, trace_blocks, trace_tail
from thunder_fsdp_mem.training import litgpt_models, runtime
from thunder_fsdp_mem.transform import FSDPMemoryTransform

UNSUPPORTED = ("final_logit_softcapping", "rope_indices")
LOSSES = ("eager", "trace")


def compose_step(
    spec: litgpt_models.ModelSpec,
    *,
    world_size: int,
    shard: str,
    device_type: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    micro_batch_size: int = 1,
    executors="default+cat",
    transform: FSDPMemoryTransform | None = None,
    loss: str = "eager",
) -> StepMemory:
    """The estimated memory per rank of one step of ``spec`` under FSDP2 and ThunderFX on ``world_size`` ranks of
    ``device_type``; ``shard`` zero2 or zero3; ``executors``: ``runtime.executors``' choice, or Thunder's
    executors as a list; ``transform``: the ``FSDPMemoryTransform`` to compile the blocks with (None: without it);
    ``loss``: ``eager`` (cross-entropy on the logits after the model) or ``trace`` (``LossModel`` as the root: the
    head and the loss in one ThunderFX graph, which the transform chunks)."""
    if shard not in runtime.SHARDS:
        raise ValueError(f"shard must be one of {', '.join(runtime.SHARDS)}; got {shard!r}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int; got {world_size!r}")
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {', '.join(LOSSES)}; got {loss!r}")
    config = spec.config()
    refused = unsupported(config, loss)
    if refused:
        raise NotImplementedError(f"{spec.name}: the fsdp2 composition does not model {', '.join(refused)}")
    chosen = runtime.executors(executors) if isinstance(executors, str) else list(executors)
    with as_on(device_type, chosen):
        torch.manual_seed(0)
        with torch.device("meta"):
            gpt = GPT(config)
        gpt = gpt.to(dtype)
        idx, targets = litgpt_models.batch(spec, micro_batch_size=micro_batch_size, device="meta")
        blocks = trace_blocks(gpt, idx, chosen, transform, device_type)
        tail = None
        if loss == "trace":
            x = torch.empty(*idx.shape, config.n_embd, dtype=dtype, device="meta")
            tail = trace_tail(LossModel(gpt), x, targets, chosen, transform, device_type)
        return _compose(gpt, world_size, shard == "zero3", blocks, tail, idx, targets, device_type)


def fit_budget(
    spec: litgpt_models.ModelSpec, config: MemoryConfig, *, world_size: int, shard: str, rounds: int = 3, **options
) -> tuple[StepMemory, MemoryConfig, FSDPMemoryTransform]:
    """``config.memory_budget``, a per-rank budget for the whole step, turned into what each block may save: FSDP2
    compiles every block alone, so its transform cannot see the step. The step's peak is where every block's saved
    tensors are alive (the loss, the first blocks' backward), so each block saves its share of the excess less
    (``MemoryConfig.saved_budget``), for up to ``rounds`` rounds while the composed step is over the budget (or,
    with ``config.memory_cap``, misses the cap in the caching allocator's replay: ``caching_allocator.over_cap``).
    Returns the step, the config its blocks ran with (no step budget, no cap: a saved budget), and their transform
    (whose ``rewrites`` say what it did). ``options``: ``compose_step``'s."""
    with warnings.catch_warnings():  # the blocks' unmet saved budgets: the plan says what it reached, once
        warnings.filterwarnings("ignore", message="FSDPMemoryTransform: pass '.*' could not meet")
        return _fit_budget(spec, config, world_size=world_size, shard=shard, rounds=rounds, **options)


def _fit_budget(spec, config: MemoryConfig, *, world_size: int, shard: str, rounds: int, **options):
    budget, cap = config.memory_budget, config.memory_cap
    config = dataclasses.replace(config, memory_budget=None, memory_cap=None)
    blocks = spec.config().n_layer
    transform = FSDPMemoryTransform(config)
    step = compose_step(spec, world_size=world_size, shard=shard, transform=transform, **options)
    for _ in range(rounds):
        excess = step.peak_bytes - budget
        if cap is not None and excess <= 0:
            excess = over_cap(step, cap)
        saved = _block_saved(step)
        target = max(0, saved - -(-excess // blocks))
        if excess <= 0 or saved == 0 or target == config.saved_budget:
            break
        config = dataclasses.replace(config, saved_budget=target)
        transform = FSDPMemoryTransform(config)
        step = compose_step(spec, world_size=world_size, shard=shard, transform=transform, **options)
    return step, config, transform


def _block_saved(step: StepMemory) -> int:
    """What one block's forward saves for backward beyond its inputs (``step.forward`` is the block's)."""
    f = step.forward
    return sum(
        f.allocations[i].nbytes
        for i in set(f.outputs.values())
        if f.allocations[i].category is Category.SAVED and not f.allocations[i].external
    )


def unsupported(config, loss: str = "eager") -> list[str]:
    """The fields of a litgpt ``Config`` that the composition does not model and that ``config`` sets (with the loss
    in the step, the head's soft-cap is in the traced graph)."""
    fields = [name for name in UNSUPPORTED if loss == "eager" or name != "final_logit_softcapping"]
    return [name for name in fields if getattr(config, name, None) is not None]


def _compose(
    gpt, world_size: int, zero3: bool, blocks: BlockTraces, tail: BlockTraces | None, idx, targets, device_type: str
) -> StepMemory:
    """Walks one step in the order it runs, keeping the ledger of what FSDP2, the model, autograd and the caller
    hold: the persistent state, each unit's forward between FSDP2's gathers, the loss, each unit's backward
    between FSDP2's gathers and reduce-scatters, the optimizer's step. ``tail``: the graph of the head and the loss
    (the loss in the step: the head's weight is the root unit's), None for the eager loss."""
    ledger, model_units = Holdings(), units(gpt, world_size, loss_in_step=tail is not None)
    hold_persistent(ledger, model_units, gpt, (idx, targets), device_type)
    fsdp = Collectives(ledger, zero3)
    forward = _Forward(ledger, fsdp, blocks, tail)
    logits = forward.run(model_units, idx)
    fsdp.forward_done()
    saved_bytes = sum(ledger[k].nbytes for k in ledger.held_by(Role.SAVED) if k.kind is not Held.INPUT)
    if tail is None:
        _loss(ledger, logits)
    _Backward(ledger, fsdp, blocks, tail, model_units, forward.inputs).run()
    fsdp.backward_done()
    _optimizer_step(ledger, model_units, gpt, device_type)
    return step_memory(
        ledger.phases,
        forward=blocks.forward,
        backward=blocks.backward,
        persistent_bytes=ledger.bytes(Held.SHARD, Held.BUFFER, Held.INPUT),
        saved_bytes=saved_bytes,
        gradient_bytes=ledger.bytes(Held.GRADIENT),
        optimizer_state_bytes=ledger.bytes(Held.ADAM),
    )


def _loss(ledger: Holdings, logits_key: Key) -> None:
    log_softmax, grad_nll, grad_logits = loss_allocations(ledger[logits_key])
    ledger.phase(Stage.LOSS, "loss", extra=(log_softmax, grad_nll, grad_logits), symbol=grad_logits.symbol)
    ledger.hold(Key(Held.INCOMING_GRADIENT, "lm_head"), grad_logits, AUTOGRAD)


def _optimizer_step(ledger: Holdings, model_units: list[Unit], gpt, device_type: str) -> None:
    """AdamW's step over the shards, in the model's order of parameters, as torch runs it on the device
    (``optimizer.adam_step_bytes``); the caller still holds the logits."""
    kind = "foreach" if device_type == "cuda" else "single tensor"
    shards = {f"{unit.path}.{name}": shard for unit in model_units for name, shard in unit.shards.items()}
    sizes = [(shards[q].nbytes, shards[q].dtype) for q, _ in gpt.named_parameters() if q in shards]
    temporaries = adam_step_allocation("AdamW", sizes, kind)
    ledger.phase(Stage.OPTIMIZER, Stage.OPTIMIZER.value, extra=(temporaries,), symbol=temporaries.symbol)


class _Forward:
    """Each unit's forward after FSDP2 gathers it: the eager units run on meta under ``saved_tensors_hooks``, which
    shows what autograd saves; each block as its ThunderFX forward trace says. ``inputs``: each unit's float input,
    what its backward returns a gradient for."""

    def __init__(self, ledger: Holdings, fsdp: Collectives, blocks: BlockTraces, tail: BlockTraces | None):
        self.ledger, self.fsdp, self.blocks, self.tail = ledger, fsdp, blocks, tail
        self.inputs: dict[str, Allocation] = {}

    def run(self, model_units: list[Unit], idx: torch.Tensor) -> Key:
        """The forward of every unit in turn; returns the key of the logits (of the loss, with the loss in the
        step: the root unit, gathered first, runs the head and the loss after the final norm)."""
        wte, *blocks, ln_f, last = model_units
        if self.tail is not None:
            self.fsdp.gather(last, forward=True)
        x, key = self._eager(wte, idx, Key(Held.INPUT, item="token ids"))
        for unit in blocks:
            key = self._block(unit, key)
        x, key = self._eager(ln_f, torch.empty_like(x), key)
        if self.tail is not None:
            return self._block(last, key, self.tail, reshard=False)  # FSDP2 keeps the root gathered
        _, key = self._eager(last, x, key)
        return key

    def _eager(self, unit: Unit, x: torch.Tensor, x_key: Key) -> tuple[torch.Tensor, Key]:
        """Run an eager unit on meta and hold what autograd saves; returns its output and the output's key."""
        ledger = self.ledger
        self.fsdp.gather(unit, forward=True)
        params = {p.untyped_storage()._cdata for p in unit.module.parameters()}
        saved: dict[int, torch.Tensor] = {}

        def pack(t):
            saved.setdefault(t.untyped_storage()._cdata, t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = unit.module(x)
        kind = type(unit.module).__name__
        out_key = Key(Held.ACTIVATION, unit.name)
        name = f"logits ({unit.path})" if is_head(unit.path) else f"output of {unit.name}"
        out_record = tensor_record(name, out, Category.TEMPORARY, f"{kind} (eager)")
        ledger.phase(Stage.FORWARD, f"forward: {unit.name}", extra=(out_record,), symbol=f"{kind} (eager)")
        ledger.hold(out_key, out_record, CALLER)
        holder = Holder(Role.SAVED, unit.name)
        for j, (storage, t) in enumerate(saved.items()):
            if storage == x.untyped_storage()._cdata:
                ledger.hold(x_key, ledger[x_key], holder)
            elif storage not in params and storage != out.untyped_storage()._cdata:
                ledger.hold(
                    Key(Held.SAVED, unit.name, j),
                    tensor_record(f"saved by {unit.name}", t, Category.SAVED, f"{kind} (eager)"),
                    holder,
                )
        self._done(unit, x_key if x.is_floating_point() else None)
        return out, out_key

    def _block(self, unit: Unit, x_key: Key, traces: BlockTraces | None = None, *, reshard: bool = True) -> Key:
        """A unit that runs a ThunderFX graph (``traces``: the blocks' where None) between FSDP2's gather and its
        reshard (zero3; ``reshard`` False: the root's, which FSDP2 keeps gathered)."""
        ledger, blocks = self.ledger, traces or self.blocks
        path = unit.path if traces is None else None  # the tail's names are the model's already
        self.fsdp.gather(unit, forward=True)
        ledger.phase(Stage.FORWARD, f"forward: {unit.name}", placed_timeline(blocks.forward, path), inside=[x_key])
        holder = Holder(Role.SAVED, unit.name)
        outputs = blocks.forward.outputs
        output = outputs[blocks.output]
        out_key = Key(Held.ACTIVATION, unit.name, output)
        ledger.hold(
            out_key,
            unplaced(renamed(blocks.forward.allocations[output], f"output of {unit.name}", Category.TEMPORARY)),
            CALLER,
        )
        for name in blocks.saved:
            i = outputs[name]
            a = blocks.forward.allocations[i]
            if a.name == blocks.activation:
                ledger.hold(x_key, ledger[x_key], holder)
            elif not a.external:  # parameters and rope tables are held by FSDP2 and the model
                ledger.hold(Key(Held.SAVED, unit.name, i), renamed(a, a.name, a.category, path), holder)
        self._done(unit, x_key, reshard=reshard)
        return out_key

    def _done(self, unit: Unit, x_key: Key | None, *, reshard: bool = True) -> None:
        """After a unit's forward: the model's ``forward`` lets go of the unit's input (autograd keeps what it
        saved) and zero3 reshards the unit."""
        if x_key is not None:
            self.inputs[unit.name] = self.ledger[x_key]
            self.ledger.release(x_key, CALLER)
        if self.fsdp.zero3 and reshard:
            self.fsdp.reshard(unit)


class _Backward:
    """Each unit's backward, last unit first, between FSDP2's gather (zero3) and its reduce-scatter: a block's as
    its ThunderFX backward trace says, an eager unit's a gradient for its float input and each parameter. The
    gradient of a unit's input goes to the unit before it; its parameters' wait for the reduce-scatter."""

    def __init__(
        self,
        ledger: Holdings,
        fsdp: Collectives,
        blocks: BlockTraces,
        tail: BlockTraces | None,
        model_units: list[Unit],
        inputs: dict[str, Allocation],
    ):
        self.ledger, self.fsdp, self.blocks, self.tail = ledger, fsdp, blocks, tail
        self.units, self.inputs = model_units, inputs

    def run(self) -> None:
        """Last unit first. With the loss in the step the root's backward (the head and the loss) comes first and
        its reduce-scatter last: FSDP2 runs the root's post-backward in its final callback, its input being the
        token ids, which take no gradient."""
        order = list(reversed(self.units))
        for i, unit in enumerate(order):
            following = order[i + 1] if i + 1 < len(order) else None
            self.fsdp.pre_backward(unit, following)
            if unit.is_block:
                self._block(unit)
            elif self.tail is not None and i == 0:
                self._block(unit, self.tail)
                continue
            else:
                self._eager(unit)
            self.fsdp.post_backward(unit)
        if self.tail is not None:
            self.fsdp.post_backward(order[0])

    def _block(self, unit: Unit, traces: BlockTraces | None = None) -> None:
        ledger, blocks = self.ledger, traces or self.blocks
        saved = ledger.held_by(Role.SAVED, unit.name)
        incoming = Key(Held.INCOMING_GRADIENT, unit.name)
        ledger.phase(
            Stage.BACKWARD,
            f"backward: {unit.name}",
            placed_timeline(blocks.backward, unit.path if traces is None else None),
            inside=[*saved, incoming],
        )
        self._done(unit, saved)
        made = [a for a in blocks.backward.allocations if a.end is None and not a.external]
        shape = self.inputs[unit.name].shape
        self._hold_gradients(unit, [a for a in made if a.shape != shape], [a for a in made if a.shape == shape])

    def _eager(self, unit: Unit) -> None:
        """An eager unit's backward: a gradient for its float input and each parameter, made while the incoming
        gradient and what it saved are alive."""
        kind = f"{type(unit.module).__name__} backward"
        params = [
            record(
                f"gradient of {unit.path}.{n}",
                p.numel() * p.element_size(),
                Category.GRADIENT,
                tuple(p.shape),
                dtype_name(p),
                kind,
            )
            for n, p in unit.module.named_parameters()
        ]
        x = self.inputs.get(unit.name)
        inputs = (
            []
            if x is None
            else [record(f"gradient of {unit.name}'s input", x.nbytes, Category.TEMPORARY, x.shape, x.dtype, kind)]
        )
        self.ledger.phase(Stage.BACKWARD, f"backward: {unit.name}", extra=(*params, *inputs), symbol=kind)
        self._done(unit, self.ledger.held_by(Role.SAVED, unit.name))
        self._hold_gradients(unit, params, inputs)

    def _done(self, unit: Unit, saved: list[Key]) -> None:
        for key in saved:
            self.ledger.release(key, Holder(Role.SAVED, unit.name))
        self.ledger.release(Key(Held.INCOMING_GRADIENT, unit.name), AUTOGRAD)

    def _hold_gradients(self, unit: Unit, params: list[Allocation], inputs: list[Allocation]) -> None:
        """The gradient of the unit's input goes to the unit before it; the parameters' wait for the
        reduce-scatter."""
        i = self.units.index(unit)
        if inputs and i > 0:
            before = self.units[i - 1].name
            self.ledger.hold(
                Key(Held.INCOMING_GRADIENT, before),
                renamed(inputs[0], f"gradient of {before}'s output", Category.TEMPORARY),
                AUTOGRAD,
            )
        for j, a in enumerate(params):
            self.ledger.hold(
                Key(Held.UNSHARDED_GRADIENT, unit.name, j), renamed(a, a.name, Category.GRADIENT), AUTOGRAD
            )
