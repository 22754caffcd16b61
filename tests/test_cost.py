"""cost: what running an op again costs, against figures worked out by hand from the ops' shapes and a device's
rates."""

from types import MappingProxyType

import pytest
import thunder
import thunder.torch as ltorch
import torch
from thunder.executors.sdpaex import sdpea_gradfwd, sdpfa_gradfwd

from thunder_fsdp_mem.training.cudnn_attention import cudnn_forward
from thunder_fsdp_mem.analysis.cost import (
    ATTENTION,
    H200,
    DeviceRates,
    op_flops,
    op_seconds,
    op_traffic,
    traffic_equivalent,
)

RATES = DeviceRates(name="test", matmul_flops=MappingProxyType({"bf16": 1e12, "f32": 1e11}), bandwidth=1e11)


def _bsym(fn, *args, name):
    return next(b for b in thunder.trace()(fn, *args).bound_symbols if b.sym.name == name)


def test_a_linear_is_its_flops_or_its_traffic_whichever_is_longer():
    x, w = torch.randn(2, 64, 128, dtype=torch.bfloat16), torch.randn(256, 128, dtype=torch.bfloat16)
    linear = _bsym(lambda a, b: ltorch.linear(a, b), x, w, name="linear")
    assert op_flops(linear) == (2 * 2 * 64 * 256 * 128, "bf16")
    assert op_traffic(linear) == (2 * 64 * 128 + 256 * 128 + 2 * 64 * 256) * 2
    # 8.4 MFLOP at 1 TFLOP/s is 8.4 us; 164 KB at 100 GB/s is 1.6 us: arithmetic bound.
    assert op_seconds(linear, RATES) == pytest.approx(2 * 2 * 64 * 256 * 128 / 1e12)
    slow_memory = DeviceRates(name="slow", matmul_flops=MappingProxyType({"bf16": 1e12}), bandwidth=1e9)
    assert op_seconds(linear, slow_memory) == pytest.approx(op_traffic(linear) / 1e9)  # now bound by traffic


def test_the_traffic_equivalent_of_an_op_is_its_time_at_the_bandwidth():
    x, w = torch.randn(2, 64, 128, dtype=torch.bfloat16), torch.randn(256, 128, dtype=torch.bfloat16)
    linear = _bsym(lambda a, b: ltorch.linear(a, b), x, w, name="linear")
    # Arithmetic bound (8.4 us): what 100 GB/s moves in that time, 838,861 bytes, more than its own 164 KB.
    assert traffic_equivalent(linear, RATES) == round(2 * 2 * 64 * 256 * 128 / 1e12 * 1e11)
    tanh = _bsym(lambda a: ltorch.tanh(a), x, name="tanh")
    assert traffic_equivalent(tanh, RATES) == op_traffic(tanh) == 2 * 2 * 64 * 128 * 2  # no arithmetic counted


def test_causal_attention_is_half_the_full_matrix():
    q = k = v = torch.randn(1, 4, 256, 32, dtype=torch.bfloat16)
    flash = _bsym(
        lambda a, b, c: sdpfa_gradfwd(a, b, c, 0.0, True),
        q,
        k,
        v,
        name="sdpafx_grad_forward_scaled_dot_product_efficient_attention",
    )
    assert op_flops(flash) == (0.5 * 4 * 4 * 256 * 256 * 32, "bf16")
    efficient = _bsym(
        lambda a, b, c: sdpea_gradfwd(a, b, c, None, 0.0, False),
        q,
        k,
        v,
        name="sdpaex_grad_forward_scaled_dot_product_efficient_attention",
    )
    assert op_flops(efficient) == (4 * 4 * 256 * 256 * 32, "bf16")
    cudnn = _bsym(lambda a, b, c: cudnn_forward(a, b, c, 0.0, True, None), q, k, v, name="cudnn_sdpa_forward")
    assert op_flops(cudnn) == op_flops(flash)


def test_the_attention_kernels_are_thunders_sdpa_forwards_and_the_packages_cudnn_one():
    # The cuDNN forward is the package's own op, named by a literal in cost (analysis imports nothing of training).
    assert ATTENTION == {sdpea_gradfwd.id, sdpfa_gradfwd.id, cudnn_forward.id}


def test_views_cost_nothing_and_elementwise_ops_their_traffic():
    x = torch.randn(64, 64)
    assert op_seconds(_bsym(lambda a: ltorch.reshape(a, (4096,)), x, name="reshape"), H200) == 0
    exp = _bsym(lambda a: ltorch.exp(a), x, name="exp")
    assert op_flops(exp) == (0.0, "") and op_seconds(exp, RATES) == pytest.approx(2 * 64 * 64 * 4 / 1e11)


def test_rates_are_validated():
    with pytest.raises(ValueError, match="DeviceRates.bandwidth must be positive"):
        DeviceRates(name="x", matmul_flops={"bf16": 1.0}, bandwidth=0)
    with pytest.raises(ValueError, match="DeviceRates.matmul_flops must give a positive rate"):
        DeviceRates(name="x", matmul_flops={}, bandwidth=1.0)
