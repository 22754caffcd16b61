"""Run under torchrun (2 gloo ranks): one step of Thunder's fsdp (ZeRO2) and of FSDP2 through ThunderFX, each with
and without FSDPMemoryTransform; prints one ``RESULT {json}`` line per mode and rank: whether loss and every
gradient shard are bit for bit equal, and the bytes autograd saved for backward with and without it."""

import dataclasses
import sys

import torch

from configs import BY_NAME
from support import exit_worker, saved_bytes
from thunder_fsdp_mem.training import litgpt_models, modes, runtime


def _step(mode: str, spec, rank, dtype):
    trainer = modes.build(mode, spec, rank, shard="zero2", executors="default", dtype=dtype)
    idx, targets = litgpt_models.batch(spec, seed=rank.rank)

    def loss_of(idx):
        logits = trainer.model(idx)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    loss = loss_of(idx)  # compiles
    loss.backward()
    grads = [getattr(p.grad, "_local_tensor", p.grad).clone() for p in trainer.model.parameters()]
    trainer.optimizer.zero_grad(set_to_none=True)
    held = [*trainer.model.parameters(), *trainer.model.buffers()]
    saved = saved_bytes(loss_of, idx, held=held)
    return loss.detach(), grads, saved


def main(family: str, dtype_name: str) -> None:
    rank = runtime.init_distributed("cpu")
    spec = dataclasses.replace(BY_NAME[family], n_layers=1)
    dtype = litgpt_models.DTYPES[dtype_name]
    for mode in ("thunder-fsdp", "fsdp2-thunder"):
        loss, grads, saved = _step(mode, spec, rank, dtype)
        loss_m, grads_m, saved_m = _step(mode + "+mem", spec, rank, dtype)
        row = {
            "mode": mode,
            "rank": rank.rank,
            "loss_equal": bool(torch.equal(loss, loss_m)),
            "grads_equal": len(grads) == len(grads_m) and all(torch.equal(a, b) for a, b in zip(grads, grads_m)),
            "n_grads": len(grads),
            "saved": saved,
            "saved_mem": saved_m,
        }
        runtime.print_result(row)
    exit_worker()


if __name__ == "__main__":
    main(*sys.argv[1:])
