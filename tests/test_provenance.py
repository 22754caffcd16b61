"""Every tensor named by what it is, in the three modes (the issue's names: the logits, a saved attention output,
a gathered parameter), on the meta device as the report traces them; and the rules of ``provenance`` on traces
whose origins are known by construction."""

from __future__ import annotations

import re

import pytest
import torch

from thunder_fsdp_mem.analysis import provenance
from thunder_fsdp_mem.analysis.categories import Category
from thunder_fsdp_mem.analysis.phases import Stage
from thunder_fsdp_mem.predict.emulate import trace_step
from thunder_fsdp_mem.training import litgpt_models

SPEC = litgpt_models.ModelSpec(name="pythia-14m", n_layers=2, block_size=64)
BARE = re.compile(r"[a-z_]{1,4}\d+")  # a name Thunder made up (t521, ft2434)


@pytest.fixture(scope="module", params=["jit", "thunder-fsdp", "fsdp2"])
def step(request):
    options = {"mode": request.param, "executors": "default"}
    if request.param != "jit":
        options.update(shard="zero3", world_size=2)
    return request.param, trace_step(SPEC, **options)


def _made(estimate, stage: Stage):
    """Every allocation the step's traces of ``stage`` made, as the step places them (FSDP2: at each block)."""
    return [a for p in estimate.phases if p.stage is stage and p.timeline is not None for a in p.timeline.allocations]


def test_the_tables_built_from_thunder_hold_the_names_they_replaced():
    # The literal names as they were before they were built from Thunder's objects (lightning-thunder 0.2.7).
    assert provenance._SHAPES == set(
        "unsqueeze squeeze reshape view expand broadcast_in_dim transpose permute t convert_element_type to "
        "contiguous stride_order".split()
    )
    assert provenance._NO_CODE == {"python_del", "python_return", "clear_mutable_collection"}
    in_transit = {"true_divide", "div", "convert_element_type", "to", "reshape", "view", "mul"}
    assert provenance._IN_TRANSIT == {"torch_reduce_scatter_prim_impl", "torch_wait_prim_impl"} | in_transit


def test_the_logits_are_the_heads_output(step):
    _, estimate = step
    config = SPEC.config()
    logits = [a for p in estimate.phases for a in (*p.outside, *p.extra) if a.label == "logits (lm_head)"]
    logits += [a for a in _made(estimate, Stage.FORWARD) if a.label == "logits (lm_head)"]
    assert logits and {a.shape for a in logits} == {(1, SPEC.block_size, config.padded_vocab_size)}


def test_a_saved_attention_output_is_its_blocks_attention(step):
    # the attention's output (batch, heads, tokens, head size), saved for backward, in each block: the module is
    # the block's attention, whose parameters the trace reads around it, not a neighbour's
    _, estimate = step
    config = SPEC.config()
    shape = (1, config.n_head, SPEC.block_size, config.head_size)
    attention = [a for a in _made(estimate, Stage.FORWARD) if a.shape == shape and "sdpa" in a.op]
    assert {a.label.partition(":")[0] for a in attention} == {"transformer.h.0.attn", "transformer.h.1.attn"}


def test_a_gathered_parameter_is_named_after_itself(step):
    mode, estimate = step
    labels = {a.label for a in _made(estimate, Stage.FORWARD) if a.category is Category.GATHERED_PARAMETER}
    labels |= {a.label for p in estimate.phases for a in p.outside if a.category is Category.GATHERED_PARAMETER}
    if mode == "jit":
        assert not labels
    else:
        assert "transformer.h.1.attn.qkv.weight (gathered)" in labels, sorted(labels)


def test_no_bare_trace_name_among_the_largest(step):
    _, estimate = step
    for stage in (Stage.FORWARD, Stage.BACKWARD):
        largest = sorted(_made(estimate, stage), key=lambda a: -a.nbytes)[:20]
        assert not [a.label for a in largest if BARE.fullmatch(a.label)]
    assert not [a.label for a in estimate.live_at_peak if BARE.fullmatch(a.label)]


def test_gradients_are_named_after_their_parameters(step):
    mode, estimate = step
    if mode == "fsdp2":  # FSDP2's reduce-scatter output per unit; the block graph's gradient of each parameter
        labels = {a.label for a in _made(estimate, Stage.BACKWARD) if a.role == "gradient"}
        assert "gradient of transformer.h.0.mlp.fc.weight" in labels, sorted(labels)
    else:
        gradients = [a for a in estimate.backward.allocations if a.category is Category.GRADIENT]
        assert {a.label for a in gradients} >= {
            "gradient of lm_head.weight",
            "gradient of transformer.h.1.mlp.fc.weight",
        }


# --- the rules, on a small module traced by thunder.jit ----------------------------------------------------------


class _Norm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(8))

    def forward(self, x):
        centred = x - x.mean(-1, keepdim=True)  # runs before the weight is read
        return centred * self.weight


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = _Norm(), _Norm()
        self.lm_head = torch.nn.Linear(8, 16, bias=False)

    def forward(self, x):
        return self.lm_head(self.second(torch.exp(self.first(x)).tanh()))


def test_the_rules_on_a_small_module():
    import thunder
    from thunder_fsdp_mem.analysis.liveness import analyze
    from thunder_fsdp_mem.analysis.provenance import scopes_of

    net = _Net()
    jitted = thunder.jit(net)
    y = jitted(torch.randn(2, 8, requires_grad=True))
    y.sum().backward()
    trace = thunder.last_traces(jitted)[-1]
    names = {"t_" + q.replace(".", "_"): q for q, _ in net.named_parameters()}
    timeline = analyze(trace, parameter_names=names, scopes=scopes_of(net))
    by_op = {}
    for a in timeline.allocations:
        by_op.setdefault(a.op, []).append(a.label)
    # the two norms' subtractions: each norm's own, though neither has read its weight yet
    assert by_op["sub"] == ["first: sub", "second: sub"]
    assert by_op["exp"] == ["model: exp"]  # the model's own code (its forward)
    assert by_op["tanh"] == ["model: tanh"]
    assert by_op["linear"] == ["logits (lm_head)"]
