"""estimate_step() against MemTracker's measured peak of the same forward and backward (plain thunder.jit)."""

import functools

import pytest
import thunder
import torch

from configs import BY_NAME
from support import memtracker_peak
from thunder_fsdp_mem import estimate_step
from thunder_fsdp_mem.analysis.optimizer import anticipated_adamw, anticipated_adamw_step
from thunder_fsdp_mem.analysis.step import estimate_traces
from thunder_fsdp_mem.training import litgpt_models

TOLERANCE = 0.03


@functools.cache
def _compiled(family, dtype):
    spec = BY_NAME[family]
    model = litgpt_models.build(spec, dtype=dtype)
    idx, targets = litgpt_models.batch(spec)
    jitted = thunder.jit(model)
    jitted(idx, targets).backward()  # compile, and leave the traces of a run
    return jitted, idx, targets


def _jitted_step(family, dtype):
    """The jitted model of ``family`` after one run (compiled once per module), without gradients."""
    jitted, idx, targets = _compiled(family, dtype)
    for p in jitted.parameters():
        p.grad = None
    return jitted, idx, targets


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("family", ["neox", "llama", "gemma"])
def test_estimate_matches_memtracker(family, dtype):
    jitted, idx, targets = _jitted_step(family, dtype)
    measured = memtracker_peak(jitted, idx, targets, tracked=(jitted,))
    estimate = estimate_step(jitted)
    assert abs(estimate.peak_bytes - measured) <= TOLERANCE * measured, (estimate.peak_bytes, measured)
    # The breakdown is consistent with the peak it explains.
    assert estimate.peak_bytes == max(estimate.forward_peak_bytes, estimate.backward_peak_bytes)
    assert sum(a.nbytes for a in estimate.live_at_peak) == estimate.peak_bytes
    params = sum(p.numel() * p.element_size() for p in jitted.parameters())
    assert estimate.gradient_bytes == params
    assert estimate.saved_bytes > 0


def test_function_that_has_not_run_is_an_error():
    jitted = thunder.jit(lambda x: x * 2)
    with pytest.raises(RuntimeError, match="call the jitted function once first"):
        estimate_step(jitted)


def test_plain_function_is_a_type_error():
    with pytest.raises(TypeError, match="thunder.jit"):
        estimate_step(lambda x: x)


def test_eager_loss_and_optimizer_state_match_memtracker():
    # The loss computed eagerly on the logits, as Thunder's benchmark does, with AdamW's state alive.
    spec = BY_NAME["neox"]
    gpt = litgpt_models.build(spec, dtype=torch.float32).gpt
    idx, targets = litgpt_models.batch(spec)
    jitted = thunder.jit(gpt)
    optimizer = torch.optim.AdamW(jitted.parameters(), lr=1e-3)

    def forward_loss_backward(idx, targets):
        logits = jitted(idx)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        loss.backward()
        return loss

    forward_loss_backward(idx, targets)
    optimizer.step()  # the state exists from here on
    optimizer.zero_grad(set_to_none=True)
    measured = memtracker_peak(
        lambda *a: forward_loss_backward(*a).detach().requires_grad_(), idx, targets, tracked=(jitted, optimizer)
    )
    estimate = estimate_step(jitted, loss="cross_entropy", optimizer=optimizer)
    params = list(jitted.parameters())
    # AdamW: two float32 moments per parameter and a float32 step count per parameter.
    assert estimate.optimizer_state_bytes == 2 * sum(p.numel() * 4 for p in params) + 4 * len(params)
    assert abs(estimate.peak_bytes - measured) <= TOLERANCE * measured, (estimate.peak_bytes, measured)


@pytest.mark.parametrize(
    "make",
    [
        lambda params: torch.optim.AdamW(params, lr=1e-3),
        lambda params: torch.optim.Adam(params, lr=1e-3, amsgrad=True),
    ],
    ids=["adamw", "adam-amsgrad"],
)
def test_adam_state_before_its_first_step_is_the_state_it_creates(make):
    jitted, idx, targets = _jitted_step("llama", torch.bfloat16)
    optimizer = make(jitted.parameters())
    before = estimate_step(jitted, optimizer=optimizer)
    jitted(idx, targets).backward()
    optimizer.step()  # the real state is created here
    after = estimate_step(jitted, optimizer=optimizer)
    assert before.optimizer_state_bytes == after.optimizer_state_bytes > 0
    assert before.peak_bytes == after.peak_bytes


def test_other_optimizers_without_state_warn_and_count_nothing():
    jitted, _, _ = _jitted_step("neox", torch.float32)
    with pytest.warns(UserWarning, match="SGD has no state yet"):
        estimate = estimate_step(jitted, optimizer=torch.optim.SGD(jitted.parameters(), lr=0.1, momentum=0.9))
    assert estimate.optimizer_state_bytes == 0


def test_unknown_loss_is_a_value_error():
    jitted, _, _ = _jitted_step("neox", torch.float32)
    with pytest.raises(ValueError, match="cross_entropy"):
        estimate_step(jitted, loss="mse")


def test_bad_arguments_name_themselves():
    jitted, _, _ = _jitted_step("neox", torch.bfloat16)
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer or None; got str"):
        estimate_step(jitted, optimizer="adam")
    with pytest.raises(ValueError, match="device_type must be None or one of cuda, cpu; got 'tpu'"):
        estimate_step(jitted, device_type="tpu")
    with pytest.raises(ValueError, match="loss must be None or one of cross_entropy"):
        estimate_step(jitted, loss="mse")


def test_the_optimizer_step_matches_memtracker_on_cpu():
    # A real AdamW step (after a first one made its state), measured by MemTracker: the parameters, their
    # gradients, the state, the loss the caller holds and the step's own temporaries (torch's single-tensor loop on
    # CPU) are the estimate's optimizer phase.
    from torch.distributed._tools.mem_tracker import MemTracker

    jitted, idx, targets = _jitted_step("neox", torch.float32)
    optimizer = torch.optim.AdamW(jitted.parameters(), lr=1e-4)
    jitted(idx, targets).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    loss = jitted(idx, targets)
    loss.backward()
    state = [t for per in optimizer.state.values() for t in per.values() if isinstance(t, torch.Tensor)]
    grads = [p.grad for p in jitted.parameters()]
    mt = MemTracker()
    mt.track_external(jitted, idx, targets, loss, *state, *grads)
    with mt:
        optimizer.step()
    measured = mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    estimate = estimate_step(jitted, optimizer=optimizer)
    assert estimate.optimizer_peak_bytes == measured
    # What a memory budget counts from the traces alone (AdamW's state and step anticipated) is the same step.
    forward, backward = thunder.last_traces(jitted)[-1], thunder.last_backward_traces(jitted)[-1]
    anticipated = estimate_traces(
        forward,
        backward,
        held=anticipated_adamw(forward, backward),
        optimizer_step=anticipated_adamw_step(forward, backward),
    )
    assert anticipated.optimizer_peak_bytes == measured


def test_timeline_by_category_adds_up_to_the_points_and_to_each_phases_peak(predicted_step):
    _, step = predicted_step
    timeline = step.timeline()
    n = len(timeline.points)
    assert all(len(series) == n for _, series in timeline.categories)
    assert [sum(series[i] for _, series in timeline.categories) for i in range(n)] == list(timeline.points)
    # At each traced phase's peak the split is what the walk found alive there (Phase.live_at_peak, made apart).
    for phase, start in zip(step.phases, timeline.starts):
        if phase.timeline is None:
            continue
        expected: dict = {}
        for a in phase.live_at_peak:
            expected[a.category] = expected.get(a.category, 0) + a.nbytes
        at = start + phase.peak_index
        assert {c: series[at] for c, series in timeline.categories if series[at]} == expected, phase.name
