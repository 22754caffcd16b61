"""Run under torchrun (2 gloo ranks): one float32 step of Thunder's fsdp (ZeRO2 and ZeRO3) and of FSDP2 through
ThunderFX with the loss in the trace (``LossModel``), without the transform (Thunder's own loss) and with it (the
chunked loss); prints one ``RESULT {json}`` line per mode and rank: the loss and the largest difference of every
gradient shard relative to that shard's largest magnitude, and whether the chunked loss was put in the trace."""

import sys

import torch

from configs import SOFTCAP_TIED
from support import exit_worker
from thunder_fsdp_mem.training import litgpt_models, modes, runtime


def _step(mode: str, shard: str, rank):
    trainer = modes.build(mode, SOFTCAP_TIED, rank, shard=shard, executors="default", dtype=torch.float32, loss="trace")
    idx, targets = litgpt_models.batch(SOFTCAP_TIED, seed=rank.rank)
    targets[0, :17] = -100
    loss = trainer.model(idx, targets)
    loss.backward()
    grads = [getattr(p.grad, "_local_tensor", p.grad).clone() for p in trainer.model.parameters()]
    chunked = trainer.transform is not None and any(
        r.pass_name == "chunked loss" and r.outcome.value == "applied" for r in trainer.transform.rewrites
    )
    return loss.detach(), grads, chunked


def main() -> None:
    rank = runtime.init_distributed("cpu")
    for mode, shard in (("thunder-fsdp", "zero2"), ("thunder-fsdp", "zero3"), ("fsdp2-thunder", "zero2")):
        loss, grads, _ = _step(mode, shard, rank)
        loss_m, grads_m, chunked = _step(mode + "+mem", shard, rank)
        errors = [
            ((a - b).abs().max() / a.abs().max().clamp(min=1e-30)).item() for a, b in zip(grads, grads_m) if a.numel()
        ]
        row = {
            "mode": mode,
            "shard": shard,
            "rank": rank.rank,
            "loss": loss.item(),
            "loss_mem": loss_m.item(),
            "n_grads": len(grads),
            "n_grads_mem": len(grads_m),
            "largest_error": max(errors),
            "chunked": chunked,
        }
        runtime.print_result(row)
    exit_worker()


if __name__ == "__main__":
    main(*sys.argv[1:])
