"""A training loop as a litgpt user writes it, with nothing of this package: ``thunder.jit`` of a module that
computes litgpt's ``chunked_cross_entropy`` on the model's logits. Run it as it is (``python
examples/litgpt_loop.py``), or through the runner, which adds the transform to every Thunder function the program
builds and says what each did (``thunder-fsdp-mem run -- examples/litgpt_loop.py``): the loss is then chunked.
A small model (pythia-14m's shape, two layers) so that it runs on any CPU in seconds.
"""

import thunder
import torch
from litgpt import GPT, Config
from litgpt.utils import chunked_cross_entropy


class Step(torch.nn.Module):
    """The model and its loss, compiled together."""

    def __init__(self, gpt: GPT):
        super().__init__()
        self.gpt = gpt

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return chunked_cross_entropy(self.gpt(idx), targets)  # litgpt's pretrain and finetune call it so


torch.manual_seed(0)
gpt = GPT(Config.from_name("pythia-14m", n_layer=2, block_size=128))
model = thunder.jit(Step(gpt))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
idx = torch.randint(0, gpt.config.vocab_size, (2, 128))
targets = torch.roll(idx, -1, dims=1)
for step in range(3):
    loss = model(idx, targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    print(f"step {step}: loss {loss.item():.4f}")
