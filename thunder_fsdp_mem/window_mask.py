"""``vectorize_window_masks(model)``: litgpt's sliding-window attention (gemma-2, Gemma-3, Mistral's first
releases) with its mask built by one comparison instead of a Python loop, bit for bit the same mask.

In training (no KV cache) litgpt's ``CausalSelfAttention.forward`` builds the window's mask on every call by a loop
of T in-place row writes (``apply_sliding_window_attention``). Thunder traces each write as its own op, and its alias
analysis of them grows quadratically with T: the first call of a 2-layer gemma-2 takes minutes at 2048 tokens.
torch.compile unrolls the same loop. The mask is 0 where ``i - window < j <= i`` and ``-inf`` elsewhere, which one
comparison of two ``arange``s gives exactly::

    from thunder_fsdp_mem import vectorize_window_masks

    vectorize_window_masks(gpt)          # before thunder.jit / fully_shard / torch.compile; returns the count changed
    model = thunder.jit(LossModel(gpt), transforms=[FSDPMemoryTransform()])

Soft-capped attention without a window (gemma-2's global layers) builds its causal mask by an in-place
``masked_fill_`` on every call; Thunder's fusion executor then splits the layer's attention across two regions at
that write, so the backward cannot compute the (T, T) scores again from the query and key (``passes.fusions``) and
the forward keeps them. ``capped_causal_mask`` gives the same mask without the write.

Each attention module with a sliding window or a soft-cap becomes an instance of ``WindowMaskAttention``, a subclass
whose forward builds the mask and hands it to litgpt's own forward with the loop switched off for that call; with a
mask given, a KV
cache (``input_pos`` given), under autocast or with inputs of another dtype than the weights (where q's dtype
is not x's) it is litgpt's forward unchanged. Where litgpt's ``CausalSelfAttention.forward`` is not
the one checked (``litgpt_source``), nothing is changed. ``docs/upstream/`` has the same fix for litgpt itself.
"""

from __future__ import annotations

import torch
from litgpt.model import CausalSelfAttention

from thunder_fsdp_mem.litgpt_source import is_checked


def window_mask(T: int, window: int, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """litgpt's training sliding-window mask, (1, 1, T, T): 0 where key ``j`` is among the ``window`` positions up to
    query ``i`` (``i - window < j <= i``), ``-inf`` elsewhere."""
    i = torch.arange(T, device=device).unsqueeze(1)
    j = torch.arange(T, device=device).unsqueeze(0)
    keep = (j <= i) & (j > i - window)
    return torch.zeros(T, T, dtype=dtype, device=device).masked_fill(~keep, float("-inf")).view(1, 1, T, T)


def capped_causal_mask(T: int, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The causal mask litgpt's soft-capped attention builds where it is given none, (T, T): 0 on and below the
    diagonal, the dtype's most negative finite value above; without its in-place ``masked_fill_``."""
    above = torch.ones(T, T, dtype=torch.bool, device=device).triu(diagonal=1)
    return torch.zeros(T, T, dtype=dtype, device=device).masked_fill(above, torch.finfo(dtype).min)


class WindowMaskAttention(CausalSelfAttention):
    """litgpt's attention with its sliding-window mask built by ``window_mask``, or, soft-capped without a window, its
    causal mask by ``capped_causal_mask`` (the module docstring)."""

    def forward(self, x, cos, sin, mask=None, input_pos=None, input_pos_maxp1=None):
        if mask is not None or input_pos is not None or x.dtype != self.qkv.weight.dtype or _autocast(x.device):
            return super().forward(x, cos, sin, mask, input_pos, input_pos_maxp1)
        # litgpt's masks have the dtype of q, the qkv linear's output: x's, here.
        if self.apply_sliding_window_attention:
            mask = window_mask(x.size(1), self.config.sliding_window_size, dtype=x.dtype, device=x.device)
        else:
            mask = capped_causal_mask(x.size(1), dtype=x.dtype, device=x.device)
        window = self.apply_sliding_window_attention
        self.apply_sliding_window_attention = False
        try:
            return super().forward(x, cos, sin, mask, None, None)
        finally:
            self.apply_sliding_window_attention = window


def _autocast(device: torch.device) -> bool:
    """Whether autocast is on for ``device``'s type; the meta device (a prediction's traces) has none."""
    return device.type != "meta" and torch.is_autocast_enabled(device.type)


def vectorize_window_masks(model: torch.nn.Module) -> int:
    """Make every litgpt attention of ``model`` that applies a sliding window or soft-caps its scores a
    ``WindowMaskAttention`` (in place); returns how many it changed (0 when litgpt's attention is not the one
    checked)."""
    found = [
        module
        for module in model.modules()
        if type(module) is CausalSelfAttention
        and (module.apply_sliding_window_attention or module.config.attention_logit_softcapping is not None)
    ]
    if not found or not is_checked(CausalSelfAttention.forward):
        return 0
    for module in found:
        module.__class__ = WindowMaskAttention
    return len(found)
