"""``LossModel``: a language model and its mean cross-entropy in one module, so that the compiled program ends in
the loss (``thunder.jit``, Thunder's fsdp, or FSDP2 through ThunderFX) and ``FSDPMemoryTransform`` can chunk it.

Example::

    model = thunder.jit(LossModel(gpt), transforms=[FSDPMemoryTransform()])
    loss = model(idx, targets)   # targets: next token ids, ``ignore_index`` (-100) where no loss is wanted
    loss.backward()

For a litgpt ``GPT`` it runs the model's layers itself up to the final norm, then the output head, the
soft-cap (``final_logit_softcapping``) and the loss together, the way ``GPT.forward`` computes them (training,
no KV cache): under FSDP2 each ``fully_shard`` unit breaks Dynamo's graph, and ``GPT.forward`` returning the
logits would put the head and the loss in two ThunderFX subgraphs, where no pass sees both. Leave ``lm_head`` to
the root's ``fully_shard`` (``training.modes.shard_fsdp2(..., loss_in_step=True)``) so that nothing breaks the
graph between them. Any other module returning logits is called as it is, and so is a ``GPT`` whose class is a
subclass or whose ``GPT.forward`` is not the one this copy was checked against (``litgpt_source``: a warning says
so once; under FSDP2 the head and the loss may then be compiled apart, and the loss is not chunked).
"""

from __future__ import annotations

import torch
from litgpt import GPT
from litgpt.model import do_softcapping

from thunder_fsdp_mem.litgpt_source import is_checked


class LossModel(torch.nn.Module):
    """``gpt(idx)``'s logits (shape (..., vocabulary)) followed by ``cross_entropy`` over every position, the mean
    over the targets that are not ``ignore_index``. The state dict is ``gpt``'s under ``gpt.``."""

    def __init__(self, gpt: torch.nn.Module, *, ignore_index: int = -100):
        super().__init__()
        self.gpt = gpt
        self.ignore_index = ignore_index
        # Decided here, not in forward, where Dynamo and Thunder would trace the check itself.
        self.inline_head = type(gpt) is GPT and is_checked(GPT.forward)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.inline_head:  # the head in the frame of the loss (see above)
            return self.head_loss(hidden_states(self.gpt, idx), targets)
        return self.loss(self.gpt(idx), targets)

    def head_loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """A litgpt ``GPT``'s head, soft-cap and loss, from the final norm's output ``x``: what one ThunderFX graph
        runs under FSDP2 (``predict.thunderfx.trace_tail`` traces it alone)."""
        logits = self.gpt.lm_head(x)
        if self.gpt.config.final_logit_softcapping is not None:
            logits = do_softcapping(logits, self.gpt.config.final_logit_softcapping)
        return self.loss(logits, targets)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean cross-entropy of ``logits`` (..., vocabulary) against ``targets`` over every position."""
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=self.ignore_index
        )


class HiddenStates(torch.nn.Module):
    """A litgpt ``GPT`` up to and with its final norm: what a fused linear cross-entropy outside the compiled model
    (Liger's, Cut Cross-Entropy's) takes with the head's weight. The state dict is ``gpt``'s under ``gpt.``."""

    def __init__(self, gpt: GPT):
        super().__init__()
        self.gpt = gpt

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return hidden_states(self.gpt, idx)


def hidden_states(gpt: GPT, idx: torch.Tensor) -> torch.Tensor:
    """``GPT.forward`` up to and with the final norm (training: no KV cache); ``tests/test_litgpt_source.py`` checks
    it against ``GPT.forward`` bit for bit on every family the tests build."""
    config = gpt.config
    T = idx.size(1)
    if gpt.max_seq_length < T:
        raise ValueError(f"Cannot forward sequence of length {T}, max seq length is only {gpt.max_seq_length}.")
    cos, sin = gpt.cos[:T].unsqueeze(0), gpt.sin[:T].unsqueeze(0)
    x = gpt.transformer.wte(idx)
    if config.scale_embeddings:
        x = x * torch.tensor(config.n_embd**0.5, dtype=x.dtype)
    for i, block in enumerate(gpt.transformer.h):
        if config.rope_indices is not None:
            x = block(x, cos[..., config.rope_indices[i]], sin[..., config.rope_indices[i]], None, None, None)
        else:
            x = block(x, cos, sin, None, None, None)
    return gpt.transformer.ln_f(x)
