"""Thunder's own FSDP (``thunder.distributed.fsdp``) with the transform, the loss in the step: ``torchrun
--nproc-per-node 2 examples/thunder_fsdp.py`` (CUDA with NCCL where there is a GPU per rank, else CPU with gloo).
A small model (pythia-14m's shape, two layers) so that it runs anywhere.
"""

import os

import torch
import torch.distributed as dist
from litgpt import GPT, Config

cuda = torch.cuda.is_available()
device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
dist.init_process_group("nccl" if cuda else "gloo")
torch.manual_seed(0)
gpt = GPT(Config.from_name("pythia-14m", n_layer=2, block_size=128))
idx = torch.randint(0, gpt.config.vocab_size, (1, 128), device=device)
targets = torch.roll(idx, -1, dims=1)

# README: Thunder's fsdp
import thunder
from thunder.distributed import FSDPType, fsdp
from thunder_fsdp_mem import FSDPMemoryTransform, LossModel

jitted = thunder.jit(LossModel(gpt), transforms=[FSDPMemoryTransform()])  # jit first, then shard
model = fsdp(jitted, device=device, sharding_strategy=FSDPType.ZERO3)  # device: the rank's GPU, or the CPU
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
