"""benchmarks/performance/profile_step.py: a step's phases as the profiler sees them. The ops of an eager step land in
the phase that ran them, by the op names torch's own profiler records; kernels are named by kind."""

from types import SimpleNamespace

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks.performance import profile_step


def test_each_op_of_a_step_lands_in_the_phase_that_ran_it():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16))
    trainer = SimpleNamespace(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), loss="eager")
    idx, targets = torch.randint(0, 16, (1, 4)), torch.randint(0, 16, (1, 4))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        times = profile_step.one_step(
            trainer,
            idx,
            targets,
            sync=lambda: None,
            mark=lambda phase: record_function(profile_step.PHASE_MARK + phase),
        )
    events = prof.events()
    marks = [
        (ev.time_range.start, ev.time_range.end, ev.name[len(profile_step.PHASE_MARK) :])
        for ev in events
        if ev.name.startswith(profile_step.PHASE_MARK)
    ]
    assert [m[2] for m in marks] == list(profile_step.PHASES)
    optimizer_ops = ("aten::_foreach_mul_", "aten::_foreach_lerp_", "aten::lerp_", "aten::addcdiv_")
    phases = {}
    for ev in events:
        if ev.name in (
            "aten::embedding",
            "aten::addmm",
            "aten::mm",
            "aten::nll_loss_forward",
            "aten::nll_loss_backward",
            *optimizer_ops,
        ):
            phases.setdefault(ev.name, set()).add(profile_step.phase_of(ev.time_range.start, marks))
    assert phases["aten::embedding"] == phases["aten::addmm"] == phases["aten::nll_loss_forward"] == {"forward"}
    assert phases["aten::nll_loss_backward"] == phases["aten::mm"] == {"backward"}
    assert {p for name in optimizer_ops for p in phases.get(name, ())} == {"optimizer"}
    assert set(times) == {"forward_ms", "backward_ms", "optimizer_ms", "step_ms"}
    assert abs(times["forward_ms"] + times["backward_ms"] + times["optimizer_ms"] - times["step_ms"]) < 1e-6
    assert all(t > 0 for t in times.values())
    assert profile_step.phase_of(marks[0][0] - 1.0, marks) == "outside"


def test_kernels_are_named_by_kind():
    assert profile_step.kind_of("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16") == "attention"
    assert profile_step.kind_of("nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_NNT") == "matmul"
    assert profile_step.kind_of("triton_red_fused__to_copy_add_expand_mul_rsqrt_sub_unsqueeze_var_mean_0") == "triton"
    assert profile_step.kind_of("void at::native::reduce_kernel<128, 4>") == "other aten"
    assert profile_step.annotation(SimpleNamespace(name="Optimizer.step#AdamW.step"))
    assert not profile_step.annotation(SimpleNamespace(name="nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_NNT"))
