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


def test_kernels_beside_another_streams_are_found_with_the_time_they_share():
    def kernel(name, ts, dur, stream):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}

    copy = {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": 90.0, "dur": 30.0, "args": {"stream": 25}}
    events = [
        kernel("gelu", 100.0, 40.0, 7),  # 100..140, beside the copy 100..120: 20 us
        kernel("mm", 0.0, 95.0, 7),  # 0..95, beside the copy 90..95: 5 us
        kernel("tail", 150.0, 10.0, 7),  # alone
        copy,  # 90..120: beside mm (5) and gelu (20)
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 500.0},  # not on the GPU
    ]
    rows = profile_step.contended(events, steps=1)
    assert [(name, ms, beside) for name, ms, beside in rows] == [
        ("Memcpy DtoD", 0.03, 0.025),
        ("gelu", 0.04, 0.02),
        ("mm", 0.095, 0.005),
    ]
    halved = profile_step.contended(events, steps=2)
    assert halved[0] == ("Memcpy DtoD", 0.015, 0.0125)
