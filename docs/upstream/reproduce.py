"""Thunder's rematerialization leaves float32 intermediates saved in a ThunderFX block: a reproducer on CPU.

    python reproduce.py            # lightning-thunder 0.2.7 (tested with 0.2.7.dev20260201), torch 2.11, litgpt

It compiles one GPT-NeoX block of litgpt (parallel residual, two LayerNorms, a GELU MLP; stablecode-3b's shape,
narrowed) through ThunderFX with two executors, as Thunder runs it on CUDA: attention by an operator executor
(here ``cpu_attention``, torch's CPU flash kernels; on CUDA the sdpa or cuDNN executor), everything else by
Thunder's torch.compile fusion executor. Attention splits the block into two fusions each way. It prints the
bytes the forward saves for backward, and those in float32, with Thunder's ``rematerialize`` as it is and with
the change in ``rematerialization.patch`` (beside this file) applied in-process.

Why (``README.md`` beside this file): ``rematerialize`` takes producer/consumer fusion pairs in order and replaces
each updated fusion in ``new_bsyms``, but ``find_external_producer_outputs`` counts a producer output's other
readers in ``static_consumer_info``, the map of the *original* symbols, while it is given the *updated* consumer.
Once a backward fusion has been updated by one pair, its original counts as another reader of every later
producer's outputs, and nothing more is rematerialized into it.
"""

from __future__ import annotations

import contextlib
import sys
import types
from pathlib import Path
from unittest.mock import patch

import torch
import thunder
import thunder.core.rematerialization as rematerialization
import thunder.torch as ltorch
from thunder.core import dtypes
from thunder.core.proxies import TensorProxy
from thunder.core.transforms import get_grad, put_grads
from thunder.extend import OperatorExecutor, register_executor

sys.path.insert(0, str(Path(__file__).parent))
from patching import apply_patch  # noqa: E402  (beside this file)

PATCH = Path(__file__).with_name("rematerialization.patch")
CALLERS = ("thunder.executors.torch_compile", "thunder.executors.nvfuserex_impl")  # who imported rematerialize


# --- the proposed change, applied in-process ----------------------------------------------------------------


def patched_rematerialization() -> types.ModuleType:
    """Thunder's ``thunder.core.rematerialization`` with ``rematerialization.patch`` applied, as a new module."""
    source = Path(rematerialization.__file__).read_text()
    module = types.ModuleType(rematerialization.__name__)
    module.__file__ = rematerialization.__file__
    exec(compile(apply_patch(source, PATCH.read_text()), rematerialization.__file__, "exec"), module.__dict__)
    return module


@contextlib.contextmanager
def fixed_rematerialization():
    """Within it, Thunder's fusion executors call the patched ``rematerialize``."""
    fixed = patched_rematerialization().rematerialize
    with contextlib.ExitStack() as stack:
        for name in CALLERS:
            if name in sys.modules:
                stack.enter_context(patch(f"{name}.rematerialize", new=fixed))
        yield


# --- attention by an operator executor on CPU, as Thunder's sdpa executor does on CUDA ---------------------------

cpu_attention = OperatorExecutor("cpu_attention", version="0")
register_executor(cpu_attention)


def _forward_meta(q, k, v, is_causal, scale):
    return TensorProxy(like=q), TensorProxy(like=q, shape=q.shape[:3], dtype=dtypes.float32)


def _forward(q, k, v, is_causal, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)


def _backward(g, q, k, v, out, lse, is_causal, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        g, q, k, v, out, lse, 0.0, is_causal, scale=scale
    )


forward = cpu_attention.register_operator("cpu_attention_forward", meta=_forward_meta, fn=_forward)
backward = cpu_attention.register_operator(
    "cpu_attention_backward",
    fn=_backward,
    meta=lambda g, q, k, v, out, lse, is_causal, scale: (TensorProxy(like=q), TensorProxy(like=k), TensorProxy(like=v)),
)


def _takes(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None):
    return attn_mask is None and dropout_p == 0.0


def _grad(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None):
    out, lse = forward(q, k, v, is_causal, scale)
    put_grads((q, k, v), backward(get_grad(out), q, k, v, out, lse, is_causal, scale))
    return out


cpu_attention.register_implementation(
    ltorch.scaled_dot_product_attention,
    checker=_takes,
    grad_transform=_grad,
    execution_transform=lambda q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None: forward(
        q, k, v, is_causal, scale
    )[0],
)


# --- the block -------------------------------------------------------------------------------------------------


def run_block(transforms=(), *, tokens: int = 256, width: int = 256):
    """One forward and backward of a NeoX block compiled by ThunderFX (bf16, CPU), with Thunder ``transforms``:
    its forward and backward execution traces, its output and the gradients of its input and parameters."""
    from litgpt import GPT, Config
    from thunder.dynamo import ThunderCompiler
    from thunder.executors.torch_compile import torch_compile_ex

    config = Config.from_name(
        "stablecode-completion-alpha-3b",
        n_layer=1,
        n_embd=width,
        n_head=4,
        intermediate_size=4 * width,
        padded_vocab_size=512,
        block_size=tokens,
    )
    torch.manual_seed(0)
    gpt = GPT(config).to(torch.bfloat16)
    block = gpt.transformer.h[0]
    x = torch.randn(1, tokens, width, dtype=torch.bfloat16, requires_grad=True)
    cotangent = torch.randn(1, tokens, width, dtype=torch.bfloat16)
    cos, sin = gpt.cos[:tokens].unsqueeze(0), gpt.sin[:tokens].unsqueeze(0)
    torch._dynamo.reset()
    backend = ThunderCompiler(executors=[cpu_attention, torch_compile_ex], transforms=list(transforms))
    y = torch.compile(block, backend=backend)(x, cos, sin)
    y.backward(cotangent)
    torch._dynamo.reset()
    (fn,) = [f for info in backend.subgraph_infos for f in info.thunder_compiled_fns]
    grads = [x.grad, *(p.grad for p in block.parameters())]
    return thunder.last_traces(fn)[-1], thunder.last_backward_traces(fn)[-1], y.detach(), grads


def saved_for_backward(forward_trace) -> list[TensorProxy]:
    """What the forward trace returns for backward (its return's second value), parameters and inputs included."""
    leaves, _ = thunder.core.pytree.tree_flatten(forward_trace.bound_symbols[-1].args[1])
    return [t for t in leaves if isinstance(t, TensorProxy)]


def _bytes(tensors) -> int:
    return sum(t.numel() * t.dtype.bytes for t in tensors)


def main() -> None:
    for label, context in (
        ("Thunder as it is", contextlib.nullcontext()),
        ("with rematerialization.patch", fixed_rematerialization()),
    ):
        with context:
            forward_trace, *_ = run_block()
        saved = saved_for_backward(forward_trace)
        fusions = sum(1 for b in forward_trace.bound_symbols if b.sym.is_fusion)
        f32 = [t for t in saved if t.dtype == dtypes.float32]
        print(
            f"{label:<30} forward fusions {fusions}; saved for backward {_bytes(saved):>9,} bytes, of which "
            f"float32 {_bytes(f32):>9,} ({', '.join(str(tuple(t.shape)) for t in f32) or 'none'})"
        )


if __name__ == "__main__":
    main()
