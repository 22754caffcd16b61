"""FSDP2 (``fully_shard``) through ThunderFX, the loss in the step, with a per-rank memory budget planned in one
call: ``torchrun --nproc-per-node 2 examples/fsdp2.py`` (CUDA with NCCL where there is a GPU per rank, else CPU
with gloo). A small model (pythia-14m's shape, two layers) so that it runs anywhere.
"""

import os

import torch
import torch.distributed as dist
from litgpt import GPT, Config

cuda = torch.cuda.is_available()
device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
torch.manual_seed(0)
with device:
    gpt = GPT(Config.from_name("pythia-14m", n_layer=2, block_size=128)).to(torch.bfloat16)
    idx = torch.randint(0, gpt.config.vocab_size, (1, 128))
targets = torch.roll(idx, -1, dims=1)

# README: FSDP2
import torch
from thunder.dynamo import ThunderCompiler
from thunder_fsdp_mem import FSDPMemoryTransform, LossModel, plan_fsdp2, shard_fsdp2

model = shard_fsdp2(gpt, "zero2", root=LossModel(gpt))  # fully_shard: Blocks, wte, ln_f; the root keeps lm_head
config = plan_fsdp2(model, memory_budget="60GiB", tokens=idx.size(1))  # or MemoryConfig() for no budget
model = torch.compile(model, backend=ThunderCompiler(transforms=[FSDPMemoryTransform(config)]))
# README end

optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
for step in range(2):
    loss = model(idx, targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if dist.get_rank() == 0:
        print(f"step {step}: loss {loss.item():.4f}")
dist.destroy_process_group()
