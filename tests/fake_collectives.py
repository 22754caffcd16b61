"""Collectives without a process group, for hand-built traces: ops of a test executor that carry the names of the
torch executor's distributed prims (what the passes and checks key on) and compute on one process: a
reduce-scatter's future holds a copy of its input, a wait returns what its future holds, an all-gather doubles its
shard."""

import torch
from thunder.core.proxies import TensorProxy
from thunder.extend import OperatorExecutor

collectives = OperatorExecutor("thunder_fsdp_mem_test_collectives", version="0.1")

reduce_scatter = collectives.register_operator(
    "torch_reduce_scatter_prim_impl", meta=lambda a: TensorProxy(like=a), fn=lambda a: a.clone()
)
all_gather = collectives.register_operator(
    "torch_all_gather_prim_impl",
    meta=lambda a: TensorProxy(like=a, shape=(2 * a.shape[0], *a.shape[1:])),
    fn=lambda a: torch.cat([a, a]),
)
wait = collectives.register_operator("torch_wait_prim_impl", meta=lambda f: TensorProxy(like=f), fn=lambda f: f)
