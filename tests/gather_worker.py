"""Run under torchrun (2 gloo ranks): Thunder's fsdp, ZeRO2 and ZeRO3, with and without FSDPMemoryTransform, for
each model family named; prints one ``RESULT {json}`` line per family, strategy and rank: whether loss and every
gradient shard are bit for bit equal (also with the transform listed after an FSDPTransform in ``thunder.jit``),
how many gathered parameters the forward holds at once and saves and how many reduce-scatters the backward has
in flight at once, with and without, and whether ``gathers.match`` and ``scatters.match`` refuse a trace whose
future something other than a wait reads. ``--executors=fused`` runs Thunder's fusion executors instead of its
defaults (``runtime.executors``), and prints the step's figures only."""

import dataclasses
import os
import sys
import warnings

import thunder
import torch
from thunder.core.prims import PrimIDs

from configs import BY_NAME
from support import exit_worker
from thunder_fsdp_mem import FSDPMemoryTransform, analyze
from thunder_fsdp_mem.analysis import symbols as ops
from thunder_fsdp_mem.config import MemoryConfig
from thunder_fsdp_mem.passes import gathers, mincut, scatters
from thunder_fsdp_mem.training import litgpt_models, modes, runtime


def _step(mode, spec, rank, shard, executors):
    # Bit for bit: on CPU the fusion executor fuses attention decomposed, whose scores are kept from the forward here.
    memory = MemoryConfig(strict=True, recompute_scores=False)
    trainer = modes.build(mode, spec, rank, shard=shard, executors=executors, dtype=torch.bfloat16, memory=memory)
    return _run(trainer.model, spec, rank)


def _step_listed(spec, rank, shard):
    """The transform listed after Thunder's FSDPTransform in one ``thunder.jit``."""
    from thunder.distributed.transforms.fsdp_v2 import FSDPTransform

    model = modes._gpt(spec, rank, torch.bfloat16)  # the model modes.build wraps, initialised the same way
    strategy = runtime.fsdp_type(shard)
    jitted = thunder.jit(
        model,
        executors=runtime.executors("default"),
        transforms=[FSDPTransform(device=rank.device, sharding_strategy=strategy), FSDPMemoryTransform(strict=True)],
    )
    return _run(jitted, spec, rank)


def _run(model, spec, rank):
    idx, targets = litgpt_models.batch(spec, seed=rank.rank, device=rank.device)
    logits = model(idx)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    return loss.detach(), grads, thunder.last_traces(model)[-1], thunder.last_backward_traces(model)[-1]


def gathered_at_once(forward) -> tuple[int, int]:
    """(most gathered parameters in flight or alive at one time, gathered parameters saved for backward), read
    off the trace: a gathered parameter exists from its all-gather to the ``del`` of what its wait returns."""
    found = gathers.match(forward.bound_symbols)
    future_of = {g.gathered: g for g in found}
    issued = {forward.bound_symbols[g.gather].flat_proxy_outs[0].name for g in found}
    alive, most = set(), 0
    for b in forward.bound_symbols:
        if ops.sym_id(b) == ops.ALL_GATHER:
            alive.add(b.flat_proxy_outs[0].name)
        elif b.sym.id == PrimIDs.DEL:
            for a in b.flat_proxy_args:
                if a.name in future_of:
                    alive.discard(forward.bound_symbols[future_of[a.name].gather].flat_proxy_outs[0].name)
        most = max(most, len(alive & issued))
    saved = sum(1 for t in mincut.saved_tensors(forward) if t.name in future_of)
    return most, saved


def scatters_in_flight(backward) -> int:
    """The most reduce-scatters issued and not yet waited for at one time, read off the trace."""
    futures = {b.flat_proxy_outs[0].name for b in backward.bound_symbols if ops.sym_id(b) == ops.REDUCE_SCATTER}
    alive, most = 0, 0
    for b in backward.bound_symbols:
        if ops.sym_id(b) == ops.REDUCE_SCATTER:
            alive += 1
        elif ops.sym_id(b) in ops.WAITS and any(a.name in futures for a in b.flat_proxy_args):
            alive -= 1
        most = max(most, alive)
    return most


def inputs_held_until_waits(backward) -> bool:
    """The liveness model on CUDA keeps each reduce-scatter's input until its wait; on CPU the trace's ``del``
    frees it. In Thunder's backward every reduce-scatter is issued before the first wait, so just before that
    wait the two timelines differ by exactly the bytes of every reduce-scatter's input."""
    bsyms = backward.bound_symbols
    futures = {b.flat_proxy_outs[0].name for b in bsyms if ops.sym_id(b) == ops.REDUCE_SCATTER}
    first_wait = next(
        i for i, b in enumerate(bsyms) if ops.sym_id(b) in ops.WAITS and b.flat_proxy_args[0].name in futures
    )
    inputs = sum(ops.nbytes(ops.tensor_args(b)[0]) for b in bsyms if ops.sym_id(b) == ops.REDUCE_SCATTER)
    on_cuda = analyze(backward, device_type="cuda").timeline[first_wait - 1]
    on_cpu = analyze(backward, device_type="cpu").timeline[first_wait - 1]
    return inputs > 0 and on_cuda - on_cpu == inputs


def scatters_refuse_a_future_read_by_another_symbol(backward) -> bool:
    bsyms = [b for b in backward.bound_symbols if b.sym.id != PrimIDs.DEL]
    s = scatters.match(bsyms)[0]
    exp = next(b for b in bsyms if ops.sym_id(b) in ops.ELEMENTWISE_OPS)
    bsyms[s.wait] = bsyms[s.wait].from_bsym(sym=exp.sym)
    try:
        scatters.match(bsyms)
    except scatters.ScatterError as e:
        return "is not read by one wait" in str(e)
    return False


def transform_warns_and_keeps(forward, backward) -> bool:
    """FSDPMemoryTransform given a forward whose all-gather future an elementwise op reads: one warning naming
    the future, and the all-gathers left as they were (the other passes off, so nothing else changes)."""
    from thunder.core.trace import from_trace

    bsyms = list(forward.bound_symbols)
    g = gathers.match(bsyms)[0]
    exp = next(b for b in bsyms if ops.sym_id(b) in ops.ELEMENTWISE_OPS)
    bsyms[g.wait] = bsyms[g.wait].from_bsym(sym=exp.sym)
    broken = from_trace(forward)
    broken.bound_symbols = bsyms
    future = bsyms[g.gather].flat_proxy_outs[0].name
    transform = FSDPMemoryTransform(MemoryConfig(fold_casts=False, rematerialize=False, reorder=False, scatters=False))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        placeholder = transform.transform_trace_post_optimization(broken)
        new_backward = transform.transform_trace_post_optimization(backward)
    ours = [str(w.message) for w in caught if "FSDPMemoryTransform" in str(w.message)]
    return (
        len(ours) == 1
        and "pass 'all-gathers' refused" in ours[0]
        and future in ours[0]
        and list(placeholder.bound_symbols) == bsyms
        and new_backward is backward
    )


def refuses_a_future_read_by_another_symbol(forward) -> bool:
    bsyms = list(forward.bound_symbols)
    g = gathers.match(bsyms)[0]
    exp = next(b for b in bsyms if b.sym.name == "exp" or ops.sym_id(b) in ops.ELEMENTWISE_OPS)
    bsyms[g.wait] = bsyms[g.wait].from_bsym(sym=exp.sym)  # the future now read by an elementwise op
    try:
        gathers.match(bsyms)
    except gathers.GatherError as e:
        return "is read by" in str(e)
    return False


def main(*args: str) -> None:
    families = [a for a in args if not a.startswith("--executors=")]
    executors = next((a.partition("=")[2] for a in args if a.startswith("--executors=")), "default")
    rank = runtime.init_distributed(os.environ.get("GATHER_WORKER_DEVICE", "cpu"))  # cuda: the same on GPUs
    for family, shard in ((f, s) for f in families for s in runtime.SHARDS):
        spec = dataclasses.replace(BY_NAME[family], n_layers=1)
        loss, grads, forward, backward = _step("thunder-fsdp", spec, rank, shard, executors)
        loss_m, grads_m, forward_m, backward_m = _step("thunder-fsdp+mem", spec, rank, shard, executors)
        most, saved = gathered_at_once(forward)
        most_m, saved_m = gathered_at_once(forward_m)
        row = {
            "family": family,
            "shard": shard,
            "rank": rank.rank,
            "executors": executors,
            "loss_equal": bool(torch.equal(loss, loss_m)),
            "grads_equal": _equal(grads, grads_m),
            "n_grads": len(grads),
            "gathers": len(gathers.match(forward.bound_symbols)),
            "at_once": most,
            "at_once_mem": most_m,
            "saved": saved,
            "saved_mem": saved_m,
            "gathered_again": sum(ops.sym_id(b) == ops.ALL_GATHER for b in backward_m.bound_symbols),
            "fusions": sum(ops.is_fusion(b) for b in (*forward.bound_symbols, *backward.bound_symbols)),
            "scatters": sum(ops.sym_id(b) == ops.REDUCE_SCATTER for b in backward.bound_symbols),
            "scatters_at_once": scatters_in_flight(backward),
            "scatters_at_once_mem": scatters_in_flight(backward_m),
        }
        if executors == "default":
            loss_l, grads_l, forward_l, _ = _step_listed(spec, rank, shard)
            row.update(
                {
                    "listed_equal": bool(torch.equal(loss, loss_l)) and _equal(grads, grads_l),
                    "listed_saved": gathered_at_once(forward_l)[1],
                    "refuses": refuses_a_future_read_by_another_symbol(forward),
                    "warns": transform_warns_and_keeps(forward, backward),
                    "scatters_refuse": scatters_refuse_a_future_read_by_another_symbol(backward),
                    "held": inputs_held_until_waits(backward),
                }
            )
        runtime.print_result(row)
    exit_worker()


def _equal(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


if __name__ == "__main__":
    main(*sys.argv[1:])
