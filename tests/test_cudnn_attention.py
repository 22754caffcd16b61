"""cudnn_attention: which calls the executor takes, and what a CUDA prediction with it holds, against the flash
kernel's prediction (the same tensors saved, the same peak) and against the rule's cases worked out by hand. (Its
kernels need CUDA; they were checked on the H200 against ``F.scaled_dot_product_attention``: ``docs/results.md``.)"""

import pytest
import thunder
import thunder.core.dtypes as dtypes
import torch
import torch.nn.functional as F
from thunder.core import devices
from thunder.core.proxies import TensorProxy
from thunder.core.trace import TraceCtx, tracectx

from thunder_fsdp_mem.training import cudnn_attention, litgpt_models, runtime
from thunder_fsdp_mem.predict.emulate import trace_step


def _proxies(*shapes, dtype=dtypes.bfloat16, device="cuda:0"):
    with tracectx(TraceCtx()):
        return [TensorProxy(shape=s, dtype=dtype, device=devices.Device(device)) for s in shapes]


@pytest.mark.parametrize(
    "case, shapes, dtype, mask, dropout, takes",
    [
        ("litgpt's causal bf16 attention, head size 80", [(1, 32, 64, 80)] * 3, dtypes.bfloat16, None, 0.0, True),
        ("float16, head size 128", [(2, 4, 16, 128)] * 3, dtypes.float16, None, 0.0, True),
        ("float32", [(1, 4, 16, 64)] * 3, dtypes.float32, None, 0.0, False),
        ("dropout", [(1, 4, 16, 64)] * 3, dtypes.bfloat16, None, 0.1, False),
        ("a mask tensor", [(1, 4, 16, 64)] * 3, dtypes.bfloat16, "mask", 0.0, False),
        ("head size 136", [(1, 4, 16, 136)] * 3, dtypes.bfloat16, None, 0.0, False),
        ("head size 84, not a multiple of 8", [(1, 4, 16, 84)] * 3, dtypes.bfloat16, None, 0.0, False),
        (
            "fewer key heads (GQA not expanded)",
            [(1, 8, 16, 64), (1, 2, 16, 64), (1, 2, 16, 64)],
            dtypes.bfloat16,
            None,
            0.0,
            False,
        ),
    ],
)
def test_the_rule_takes_what_cudnn_takes(case, shapes, dtype, mask, dropout, takes):
    q, k, v = _proxies(*shapes, dtype=dtype)
    assert cudnn_attention.rule(q, k, v, q if mask else None, dropout) is takes, case


def test_on_the_cpu_it_claims_nothing_and_thunder_runs_as_without_it():
    q, k, v = (torch.randn(1, 2, 16, 8, dtype=torch.bfloat16) for _ in range(3))
    jitted = thunder.jit(
        lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True), executors=runtime.executors("fused")
    )
    out = jitted(q, k, v)
    assert not any("cudnn" in b.sym.name for b in thunder.last_traces(jitted)[-1].bound_symbols)
    assert torch.equal(
        out, thunder.jit(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True))(q, k, v)
    )


def test_a_cuda_prediction_saves_and_peaks_as_with_the_flash_kernel(monkeypatch):
    spec = litgpt_models.ModelSpec(name="pythia-14m", n_layers=1, block_size=32)
    with_cudnn = trace_step(spec, device_type="cuda", executors="fused")
    forward, backward = with_cudnn.forward.symbols, with_cudnn.backward.symbols
    assert cudnn_attention.FORWARD in forward and cudnn_attention.BACKWARD in backward
    assert not any("sdpafx" in name for name in forward) and not with_cudnn.forward.unknown_symbols
    monkeypatch.setattr(cudnn_attention, "rule", lambda *args: False)  # Thunder's sdpa executor takes it: flash
    with_flash = trace_step(spec, device_type="cuda", executors="fused")
    assert cudnn_attention.FORWARD not in with_flash.forward.symbols
    # cuDNN's log-sum-exp is (B, H, T, 1) where flash's is (B, H, T): the same bytes. Thunder's flash forward also
    # saves four small int64 tensors (cum_seq_q and cum_seq_k of B + 1, the random seed and offset), alive from
    # the forward's end on; every other figure is the same.
    small = 2 * (1 + 1) * 8 + 2 * 8
    assert with_flash.saved_bytes - with_cudnn.saved_bytes == small
    assert with_flash.forward.final_bytes - with_cudnn.forward.final_bytes == small
    assert with_flash.forward.timeline[0] == with_cudnn.forward.timeline[0]
    assert with_flash.backward.peak_bytes - with_cudnn.backward.peak_bytes in (0, small)


def test_it_claims_cuda_calls_that_torch_agrees_to_and_steps_aside_for_deterministic_algorithms(monkeypatch):
    q, k, v = _proxies(*[(1, 4, 16, 64)] * 3)
    assert not cudnn_attention.choose(q, k, v, None, 0.0, True, None)  # no CUDA here: torch does not agree
    monkeypatch.setattr(cudnn_attention, "torch_agrees", lambda *args, **kwargs: True)
    assert cudnn_attention.choose(q, k, v, None, 0.0, True, None)
    assert not cudnn_attention.choose(q, k, v, None, 0.1, True, None)  # the rule still applies
    assert not cudnn_attention.choose(*_proxies(*[(1, 4, 16, 64)] * 3, device="cpu"), None, 0.0, True, None)
    torch.use_deterministic_algorithms(True)
    try:
        assert not cudnn_attention.choose(q, k, v, None, 0.0, True, None)
    finally:
        torch.use_deterministic_algorithms(False)
