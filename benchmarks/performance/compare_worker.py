"""``compare``'s worker: one mode on one rank of its ``torchrun``
(``python -m benchmarks.performance.compare --worker MODE``).

Entry point: ``worker(args) -> int``. It builds the mode's model, optimizer and batch (``modes.build``), compiles
and estimates (``estimate_step``, where the mode has a ThunderModule), warms up, then measures ``--steps`` steps:
on CUDA the allocator's peaks and retries, on CPU the least peak of the allocations torch's profiler records
(``cpu_memory.CPUMemory``). It prints one ``RESULT`` line (``runtime.print_result``); a failure (an OOM, an error)
is the row's status, and the rank then exits 1 so that ``torchrun`` ends the others instead of leaving them in a
collective. With ``--jobs`` the mode waits for its turn on the devices (``--turn-lock``).
"""

from __future__ import annotations

import dataclasses
import fcntl
import statistics
import time
from contextlib import contextmanager
from datetime import timedelta

from benchmarks.performance.compare_table import row
from benchmarks.variants import split_variant
from thunder_fsdp_mem.config import MemoryConfig
from thunder_fsdp_mem.training import loss_placement
from thunder_fsdp_mem.training import modes as mode_table
from thunder_fsdp_mem.training import runtime


def worker(args) -> int:
    """Build, compile and warm up, then measure. With ``--jobs``, a mode that compiles without the device
    (``thunder.jit``) builds and compiles before its turn, then parks its parameters in host memory so that it
    holds no device memory while it waits; every other mode does everything in its turn. Prints one ``RESULT``
    line; a rank that fails exits non-zero so that ``torchrun`` stops the others instead of leaving them waiting in
    a collective."""
    import torch

    started = time.perf_counter()
    rank = runtime.init_distributed(args.device)
    result = row(args.worker, status="ok", rank=rank.rank)
    if args.memory_cap_gb is not None and args.device == "cuda":
        total = torch.cuda.get_device_properties(rank.device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_cap_gb * 1e9 / total), rank.device)
    ahead = args.turn_lock is not None and split_variant(args.worker).base in mode_table.COMPILES_AHEAD
    setup = None
    if ahead:
        with _failures_as_status(result):
            setup = _setup(args, rank, result)
            setup[0].park()
    waited = time.perf_counter()
    with _turn(args.turn_lock, rank, result):
        waited = time.perf_counter() - waited
        if result["status"] == "ok":
            with _failures_as_status(result):
                if setup is None:
                    setup = _setup(args, rank, result)
                trainer, idx, targets = setup
                trainer.unpark(rank.device)
                for i in range(args.warmup):
                    start = time.perf_counter()
                    trainer.step(idx, targets)
                    if i == 0:  # what the user waits for: compilation (ahead or in the step) and one step
                        _synchronize(rank.device)
                        result["first_step_s"] = result.pop("precompile_s", 0.0) + time.perf_counter() - start
                result["setup_s"] = time.perf_counter() - started - waited
                result.update(_measure(args, trainer, idx, targets, rank))
                if trainer.transform is not None:
                    result["rewrites"] = [dataclasses.asdict(r) for r in trainer.transform.rewrites]
    runtime.print_result(result)
    if result["status"] != "ok":
        return 1
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


def _setup(args, rank, result: dict):
    """The mode's model, optimizer and batch; compiled ahead where the compiler allows, and estimated from the
    compiled traces (so that an OOM row still says what it needed)."""
    from thunder_fsdp_mem.training import litgpt_models

    spec = litgpt_models.ModelSpec(
        name=args.model,
        n_layers=args.n_layers,
        block_size=args.block_size,
        vectorized_window_masks=args.vectorize_window_masks,
    )
    variant = split_variant(args.worker)
    executors = variant.executors or args.executors
    memory = MemoryConfig(**{"recompute_weight": args.recompute_weight, **variant.memory})
    if memory.memory_budget is not None and args.memory_cap_gb is not None and args.device == "cuda":
        memory = dataclasses.replace(memory, memory_cap=int(args.memory_cap_gb * 1e9))
        result["memory_cap"] = memory.memory_cap
    if variant.base == "fsdp2-thunder+mem" and memory.memory_budget is not None:
        memory = _fsdp2_block_budget(args, spec, rank, executors, memory, variant.loss)
        result["saved_budget"] = memory.saved_budget
    probe = _injected_oom(rank.rank) if args.inject_oom == rank.rank else None
    trainer = mode_table.build(
        variant.base,
        spec,
        rank,
        shard=args.shard,
        executors=executors,
        dtype=litgpt_models.DTYPES[args.dtype],
        memory=memory,
        activation_memory_budget=variant.amb,
        probe=probe,
        loss=variant.loss,
    )
    idx, targets = litgpt_models.batch(spec, micro_batch_size=args.micro_batch_size, device=rank.device, seed=rank.rank)
    start = time.perf_counter()
    if trainer.precompile(idx, targets):
        result["precompile_s"] = time.perf_counter() - start
    result.update(_estimate(trainer))
    return trainer, idx, targets


def _synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _injected_oom(rank: int):
    """For tests: a Thunder transform whose first probe in a backward trace raises torch's out-of-memory error, as
    the allocator would there, on one rank while the others go on into their collectives."""
    import torch

    from thunder_fsdp_mem.predict.probes import MemoryProbeTransform

    def probe(tag: int, index: int) -> None:
        if transform.kinds[tag] == "backward":
            raise torch.OutOfMemoryError(f"injected on rank {rank} (compare.py --inject-oom)")

    transform = MemoryProbeTransform(probe)
    return transform


def _fsdp2_block_budget(args, spec, rank, executors: str, memory: MemoryConfig, loss: str) -> MemoryConfig:
    """FSDP2 compiles each block alone: the step's budget becomes what each block may save, as a user gets it from
    Python (``plan_fsdp2``, the prediction on the meta device); every rank finds the same. ``loss``: the mode's
    (``loss_placement.LOSSES``): the forms compiled with the model are planned as ``LossModel`` (the transform chunks
    them alike); a fused loss after the hidden states is planned as the eager one, whose logits it never holds (a plan
    that saves less than it could)."""
    from thunder_fsdp_mem import plan_fsdp2
    from thunder_fsdp_mem.training import litgpt_models

    return plan_fsdp2(
        spec.config(),
        memory_budget=memory.memory_budget,
        memory_cap=memory.memory_cap,
        tokens=args.block_size,
        micro_batch_size=args.micro_batch_size,
        world_size=rank.world_size,
        shard=args.shard,
        dtype=litgpt_models.DTYPES[args.dtype],
        executors=executors,
        device_type=args.device,
        config=memory,
        loss="trace" if loss in loss_placement.INSIDE else "eager",
    )


@contextmanager
def _failures_as_status(result: dict):
    """A failing mode is a row (OOM, or the error's first line); the other modes still run."""
    import torch

    try:
        yield
    except torch.OutOfMemoryError:
        result["status"] = "OOM"
        if torch.cuda.is_available():  # the most allocated and reserved before the failing request
            result["allocated_at_oom_bytes"] = torch.cuda.max_memory_allocated()
            result["reserved_at_oom_bytes"] = torch.cuda.max_memory_reserved()
    except Exception as e:  # noqa: BLE001
        result["status"] = f"error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]


@contextmanager
def _turn(lock_path: str | None, rank, result: dict):
    """This mode's turn on the devices, with ``--jobs``: rank 0 holds an exclusive lock on the host's lock file
    and tells the other ranks through the process group's store; it lets go once every rank is done, or at once
    if it failed (it then exits, ``torchrun`` stops the others, and the lock goes with the processes)."""
    if lock_path is None:
        yield
        return
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store() if dist.is_initialized() else None
    handle = None
    if rank.rank == 0:
        handle = open(lock_path, "a")
        fcntl.flock(handle, fcntl.LOCK_EX)
        if store is not None:
            store.set("compare/turn", "1")
    else:
        store.wait(["compare/turn"], timedelta(hours=12))
    try:
        yield
    finally:
        if store is not None:
            store.add("compare/done", 1)
        if handle is not None:
            while result["status"] == "ok" and store is not None and store.add("compare/done", 0) < rank.world_size:
                time.sleep(0.05)
            fcntl.flock(handle, fcntl.LOCK_UN)
            handle.close()


def _measure(args, trainer, idx, targets, rank) -> dict:
    import torch

    times = []
    if args.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        retries_before = torch.cuda.memory_stats().get("num_alloc_retries", 0)
        for _ in range(args.steps):
            start = time.perf_counter()
            trainer.step(idx, targets)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        peak = torch.cuda.max_memory_allocated()
        reserved = torch.cuda.max_memory_reserved()
        retries = torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries_before
    else:  # timed alone, then measured (not MemTracker: Dynamo would run FSDP2's step eagerly)
        from thunder_fsdp_mem.predict.cpu_memory import REPEATS, CPUMemory

        for _ in range(args.steps):
            start = time.perf_counter()
            trainer.step(idx, targets)
            times.append(time.perf_counter() - start)
        peaks = []
        for _ in range(REPEATS):
            with CPUMemory(trainer.model, trainer.optimizer, idx, targets) as memory:
                trainer.step(idx, targets)
            peaks.append(memory.peak_bytes)
        peak = min(peaks)
        reserved = retries = None
    step_s = statistics.median(times)
    return {
        "peak_bytes": int(peak),
        "reserved_bytes": reserved,
        "alloc_retries": retries,
        "step_ms": step_s * 1e3,
        "tokens_per_s": args.micro_batch_size * args.block_size * rank.world_size / step_s,
    }


def _estimate(trainer) -> dict:
    """``estimate_step`` of the ThunderModule, compiled but not yet run, with the eager cross-entropy and the state
    the optimizer will hold, where the mode has a ThunderModule: the peak, and how many gathered parameters (and
    their bytes) are alive at it."""
    if trainer.jitted is None or trainer.loss in loss_placement.OUTSIDE:
        return {}  # an external loss runs outside every trace: an estimate would leave it out
    from thunder_fsdp_mem import estimate_step
    from thunder_fsdp_mem.analysis.categories import Category

    # The eager loss is counted on the logits; a loss in the trace is in the traces; an external loss is not seen.
    loss = "cross_entropy" if trainer.loss == "eager" else None
    step = estimate_step(trainer.jitted, loss=loss, optimizer=trainer.optimizer)
    gathered = [a for a in step.live_at_peak if a.category is Category.GATHERED_PARAMETER]
    return {
        "estimated_peak_bytes": step.peak_bytes,
        "estimated_peak_phase": step.peak_phase,
        "gathered_at_peak": len(gathered),
        "gathered_at_peak_bytes": sum(a.nbytes for a in gathered),
    }
