"""Run under torchrun (2 gloo ranks): Thunder's fsdp, ZeRO2 and ZeRO3, with and without FSDPMemoryTransform, for
each model family named; prints one ``RESULT {json}`` line per family, strategy and rank: whether loss and every gradient shard are bit for bit equal,
how many gathered parameters the forward holds at once and saves, with and without, and whether ``gathers.match``
refuses a trace whose all-gather future something other than a wait reads."""

import dataclasses
import sys

import thunder
import torch
import torch.distributed as dist
from thunder.core.prims import PrimIDs

from configs import BY_NAME
from thunder_fsdp_mem import gathers, models, modes, ops, recompute, runtime
from thunder_fsdp_mem.config import MemoryConfig


def _step(mode, spec, rank, shard):
    trainer = modes.build(mode, spec, rank, shard=shard, executors="default", dtype=torch.bfloat16,
                          memory=MemoryConfig(strict=True))
    idx, targets = models.batch(spec, seed=rank.rank)
    logits = trainer.model(idx)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
    loss.backward()
    grads = [p.grad.clone() for p in trainer.model.parameters()]
    return loss.detach(), grads, thunder.last_traces(trainer.jitted)[-1]


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
    saved = sum(1 for t in recompute.saved_tensors(forward) if t.name in future_of)
    return most, saved


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


def main(*families: str) -> None:
    rank = runtime.init_distributed("cpu")
    for family, shard in ((f, s) for f in families for s in ("zero2", "zero3")):
        spec = dataclasses.replace(BY_NAME[family], n_layers=1)
        loss, grads, forward = _step("thunder-fsdp", spec, rank, shard)
        loss_m, grads_m, forward_m = _step("thunder-fsdp+mem", spec, rank, shard)
        most, saved = gathered_at_once(forward)
        most_m, saved_m = gathered_at_once(forward_m)
        row = {"family": family, "shard": shard, "rank": rank.rank, "loss_equal": bool(torch.equal(loss, loss_m)),
               "grads_equal": len(grads) == len(grads_m) and all(torch.equal(a, b) for a, b in zip(grads, grads_m)),
               "n_grads": len(grads), "gathers": len(gathers.match(forward.bound_symbols)),
               "at_once": most, "at_once_mem": most_m, "saved": saved, "saved_mem": saved_m,
               "refuses": refuses_a_future_read_by_another_symbol(forward)}
        runtime.print_result(row)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
