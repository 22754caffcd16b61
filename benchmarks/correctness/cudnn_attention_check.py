"""``training.cudnn_attention`` against torch on a GPU: for a few attention shapes, whether Thunder with ``fused``
executors takes the call on cuDNN (forward and backward), and its output and gradients against
``F.scaled_dot_product_attention`` (which runs the same kernels); then a 2-layer stablecode-3b's losses over 3
steps, fused Thunder against torch.compile. Exits 1 where the executor does not take a call it should.

    python -m benchmarks.correctness.cudnn_attention_check
"""

from __future__ import annotations

import sys

import thunder
import torch
import torch.nn.functional as F

from thunder_fsdp_mem.training import cudnn_attention, litgpt_models, modes, runtime

SHAPES = ((1, 32, 8192, 80), (2, 8, 512, 64), (1, 4, 256, 128))


def causal(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def main() -> int:
    torch.manual_seed(0)
    executors = runtime.executors("fused")
    taken = []
    for shape in SHAPES:
        q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        grad = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        expected = causal(q, k, v)
        expected.backward(grad)
        expected_grads = [t.grad for t in (q, k, v)]
        for t in (q, k, v):
            t.grad = None
        jitted = thunder.jit(causal, executors=executors)
        out = jitted(q, k, v)
        out.backward(grad)
        forward = [b.sym.name for b in thunder.last_traces(jitted)[-1].bound_symbols]
        backward = [b.sym.name for b in thunder.last_backward_traces(jitted)[-1].bound_symbols]
        taken.append(cudnn_attention.FORWARD in forward and cudnn_attention.BACKWARD in backward)
        diffs = [(a.float() - b.float()).abs().max().item() for a, b in zip((q.grad, k.grad, v.grad), expected_grads)]
        print(
            f"{shape}: on cuDNN {taken[-1]}, output equal {torch.equal(out, expected)}, gradients of q, k, v "
            f"equal {[d == 0 for d in diffs]}, largest difference {max(diffs):.3g}"
        )
    spec = litgpt_models.ModelSpec(name="stablecode-completion-alpha-3b", n_layers=2, block_size=2048)
    rank = runtime.init_distributed("cuda")
    idx, targets = litgpt_models.batch(spec, device=rank.device)
    losses = {}
    for mode, choice in (("thunder", "fused"), ("inductor", "default")):
        trainer = modes.build(mode, spec, rank, executors=choice)
        losses[mode] = [trainer.step(idx, targets).item() for _ in range(3)]
    print(
        f"2-layer stablecode-3b, 2048 tokens, losses over 3 steps: fused Thunder {losses['thunder']}, "
        f"torch.compile {losses['inductor']}"
    )
    return 0 if all(taken) else 1


if __name__ == "__main__":
    sys.exit(main())
