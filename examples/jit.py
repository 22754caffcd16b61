"""thunder.jit on one device, the loss in the step (``LossModel``), with the transform: ``python examples/jit.py``.

A small model (pythia-14m's shape, two layers) so that it runs on any CPU in seconds; any litgpt model name works.
"""

import torch
from litgpt import GPT, Config

torch.manual_seed(0)
gpt = GPT(Config.from_name("pythia-14m", n_layer=2, block_size=128))
idx = torch.randint(0, gpt.config.vocab_size, (1, 128))
targets = torch.roll(idx, -1, dims=1)

# README: thunder.jit
import thunder
from thunder_fsdp_mem import FSDPMemoryTransform, LossModel, MemoryConfig

transform = FSDPMemoryTransform()  # or FSDPMemoryTransform(MemoryConfig(memory_budget=60 * 2**30))
model = thunder.jit(LossModel(gpt), transforms=[transform])
model(idx, targets).backward()
print(transform.summary())  # what each pass did to each forward/backward pair
# README end

assert isinstance(transform.config, MemoryConfig) and transform.pairs == 1
