"""Run under torchrun (2 gloo ranks): a NeoX-family GPT under FSDP2 (zero2) through ThunderFX, compiled with the
default ``FSDPMemoryTransform`` and with ``plan_fsdp2``'s configuration for a budget below its peak, the loss eager
after the model and in the step (``LossModel`` as the root, the plan finding that out from the model it is given);
prints one ``RESULT {json}`` line per rank and loss with the budget and both steps' peaks as measured
(``cpu_memory``, the least of ``REPEATS`` steps) and as predicted."""

import dataclasses

import torch
from litgpt import GPT
from thunder.dynamo import ThunderCompiler

from configs import BY_NAME
from support import exit_worker
from thunder_fsdp_mem import FSDPMemoryTransform, LossModel, MemoryConfig, plan_fsdp2
from thunder_fsdp_mem.predict import fsdp2
from thunder_fsdp_mem.predict.cpu_memory import REPEATS, CPUMemory
from thunder_fsdp_mem.training import litgpt_models, modes, runtime

SPEC = dataclasses.replace(BY_NAME["neox"], n_layers=4, block_size=1024)  # the blocks' saved tensors dominate
EXECUTORS = "default"


def measured_peak(config: MemoryConfig, rank, loss: str) -> int:
    torch.manual_seed(0)
    gpt = GPT(SPEC.config()).to(torch.bfloat16)
    model = modes.shard_fsdp2(gpt, "zero2", root=LossModel(gpt) if loss == "trace" else None)
    if config.saved_budget is None and config.memory_budget is not None:  # the user's one call
        config = plan_fsdp2(
            model, memory_budget=config.memory_budget, tokens=SPEC.block_size, executors=EXECUTORS, device_type="cpu"
        )
    backend = ThunderCompiler(executors=runtime.executors(EXECUTORS), transforms=[FSDPMemoryTransform(config)])
    trainer = modes.Trainer(
        "fsdp2-thunder+mem",
        torch.compile(model, backend=backend),
        torch.optim.AdamW(model.parameters(), lr=1e-4),
        loss=loss,
    )
    idx, targets = litgpt_models.batch(SPEC, seed=rank.rank)
    trainer.step(idx, targets)
    peaks = []
    for _ in range(REPEATS):
        with CPUMemory(trainer.model, trainer.optimizer, idx, targets) as memory:
            trainer.step(idx, targets)
        peaks.append(memory.peak_bytes)
    return min(peaks), config


def main() -> None:
    rank = runtime.init_distributed("cpu")
    for loss in ("eager", "trace"):
        options = dict(world_size=rank.world_size, shard="zero2", device_type="cpu", executors=EXECUTORS, loss=loss)
        predicted = fsdp2.compose_step(SPEC, transform=FSDPMemoryTransform(), **options).peak_bytes
        budget = int(0.92 * predicted)  # reachable: the least the blocks can save gives 0.89 of it
        unbudgeted, _ = measured_peak(MemoryConfig(), rank, loss)
        budgeted, config = measured_peak(MemoryConfig(memory_budget=budget), rank, loss)
        planned = fsdp2.compose_step(SPEC, transform=FSDPMemoryTransform(config), **options).peak_bytes
        runtime.print_result(
            {
                "rank": rank.rank,
                "loss": loss,
                "budget": budget,
                "predicted": predicted,
                "unbudgeted": unbudgeted,
                "budgeted": budgeted,
                "planned": planned,
                "saved_budget": config.saved_budget,
            }
        )
    exit_worker()


if __name__ == "__main__":
    main()
