"""Run under torchrun (2 gloo ranks): Thunder's fsdp, ZeRO2 and ZeRO3, for each ``family:dtype`` given (``neox:bf16``);
prints one ``RESULT {json}`` line per configuration and rank with MemTracker's peak and estimate_step's."""

import sys

import thunder

from configs import BY_NAME
from support import exit_worker, memtracker_peak
from thunder_fsdp_mem import estimate_step
from thunder_fsdp_mem.training import litgpt_models, runtime


def main(configurations: list[str]) -> None:
    rank = runtime.init_distributed("cpu")
    for configuration in configurations:
        family, dtype_name = configuration.split(":")
        for shard in ("zero2", "zero3"):
            spec = BY_NAME[family]
            model = litgpt_models.build(spec, dtype=litgpt_models.DTYPES[dtype_name])
            idx, targets = litgpt_models.batch(spec)
            jitted = runtime.thunder_fsdp(thunder.jit(model), shard=shard, device=rank.device)
            jitted(idx, targets).backward()
            for p in jitted.parameters():
                p.grad = None
            measured = memtracker_peak(jitted, idx, targets, tracked=(jitted,))
            estimate = estimate_step(jitted)
            row = {
                "family": family,
                "dtype": dtype_name,
                "shard": shard,
                "rank": rank.rank,
                "measured": measured,
                "estimated": estimate.peak_bytes,
                "gathered_saved": sum(
                    1
                    for a in estimate.forward.allocations
                    if a.category.value == "gathered parameter" and a.end is None
                ),
            }
            runtime.print_result(row)
    exit_worker()


if __name__ == "__main__":
    main(sys.argv[1:])
