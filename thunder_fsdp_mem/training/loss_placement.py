"""Where a training step computes its loss, by name (``LOSSES``), for the benchmark's ``@loss=`` option.

- ``eager``: the model returns logits; ``cross_entropy`` runs eagerly after it (as Thunder's
  ``benchmark_litgpt.py`` does).
- ``trace``: the model and its loss are one module (``loss.modules.LossModel``), compiled together.
- ``liger``, ``cce``: the compiled model stops at the final norm (``loss.modules.HiddenStates``); Liger-Kernel's
  ``LigerFusedLinearCrossEntropyLoss`` or Cut Cross-Entropy's ``linear_cross_entropy`` then runs eagerly on the
  hidden states and the head's weight. These are the baselines to beat, installed with ``pip install .[bench]``;
  ``available(loss)`` says whether one is importable. Cut Cross-Entropy takes no bias on the head.
- ``cce-exact``: Cut Cross-Entropy with ``filter_eps=None``. By default its backward skips every block of the
  vocabulary whose gradient falls below a threshold, so its time depends on the logits and its gradients are not
  exact; this row does the work that ``chunked`` does, to tell the two apart.
- ``chunked``: the same, with the package's own ``chunked_linear_cross_entropy`` (``loss.function``) after the
  compiled hidden states, its chunk count its default.
- ``view``, ``litgpt``: the loss as users write it inside their own module, compiled with the model
  (``UserLoss``): ``F.cross_entropy(gpt(idx).view(-1, V), targets.view(-1))``, or litgpt's
  ``chunked_cross_entropy(gpt(idx), targets)`` at the chunk size litgpt's pretrain and finetune use. The transform
  chunks both in the trace, as it does ``LossModel``'s.
"""

from __future__ import annotations

import importlib.util

import torch

from thunder_fsdp_mem.loss.function import chunked_linear_cross_entropy

LOSSES = ("eager", "trace", "view", "litgpt", "liger", "cce", "cce-exact", "chunked")
# The packages of the external losses.
EXTERNAL = {"liger": "liger_kernel", "cce": "cut_cross_entropy", "cce-exact": "cut_cross_entropy"}
OUTSIDE = ("liger", "cce", "cce-exact", "chunked")  # a fused linear cross-entropy after the compiled hidden states
INSIDE = ("trace", "view", "litgpt")  # compiled with the model: the step's module takes (idx, targets)
USER_FORMS = ("view", "litgpt")  # ``UserLoss``'s


def available(loss: str) -> bool:
    """Whether ``loss`` can run here: the built-in ones always; an external one where its package imports."""
    return loss not in EXTERNAL or importlib.util.find_spec(EXTERNAL[loss]) is not None


class ExternalLoss(torch.nn.Module):
    """``body(idx)`` (the hidden states, compiled as the mode compiles) and an external fused linear cross-entropy
    on them with ``gpt.lm_head``, soft-capped as the model's config says. ``gpt`` is registered (its parameters,
    and under FSDP2 its head, belong to this module); ``body`` is called, not registered twice."""

    def __init__(self, gpt: torch.nn.Module, kind: str, *, ignore_index: int = -100):
        super().__init__()
        if kind not in OUTSIDE:
            raise ValueError(f"a loss after the hidden states must be one of {', '.join(OUTSIDE)}, got {kind!r}")
        if kind.startswith("cce") and gpt.lm_head.bias is not None:
            raise ValueError("Cut Cross-Entropy takes no bias on the head")
        self.gpt = gpt
        self.kind = kind
        self.ignore_index = ignore_index
        self.softcap = gpt.config.final_logit_softcapping
        object.__setattr__(self, "body", None)  # ``set_body``: not a submodule, its parameters are ``gpt``'s
        if kind == "liger":
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

            self._liger = LigerFusedLinearCrossEntropyLoss(ignore_index=ignore_index, softcap=self.softcap)

    def set_body(self, body) -> None:
        """The compiled hidden states (``HiddenStates(gpt)`` compiled as the mode compiles)."""
        object.__setattr__(self, "body", body)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        hidden = self.body(idx)
        head = self.gpt.lm_head
        if self.kind == "liger":
            flat = hidden.reshape(-1, hidden.size(-1))
            return self._liger(head.weight, flat, targets.reshape(-1), head.bias)
        if self.kind == "chunked":
            return chunked_linear_cross_entropy(
                hidden, head.weight, targets, head.bias, ignore_index=self.ignore_index, softcap=self.softcap
            )
        from cut_cross_entropy import linear_cross_entropy

        # ``filter_eps`` None: every block's gradient computed (``cce-exact``); "high" is Cut Cross-Entropy's default.
        filter_eps = None if self.kind == "cce-exact" else "high"
        return linear_cross_entropy(
            hidden, head.weight, targets, ignore_index=self.ignore_index, softcap=self.softcap, filter_eps=filter_eps
        )


class UserLoss(torch.nn.Module):
    """A user's own module around ``gpt`` with the loss written the usual way (``form``: ``view`` or ``litgpt``, the
    module docstring), so that the benchmark measures what the transform does with it, not with ``LossModel``."""

    def __init__(self, gpt: torch.nn.Module, form: str):
        super().__init__()
        if form not in USER_FORMS:
            raise ValueError(f"a user's loss form must be one of {', '.join(USER_FORMS)}, got {form!r}")
        self.gpt = gpt
        self.form = form

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.gpt(idx)
        if self.form == "view":
            return torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        from litgpt.utils import chunked_cross_entropy

        return chunked_cross_entropy(logits, targets)
