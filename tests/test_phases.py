"""phases: a step's phases and its memory, on a hand-built timeline with hand-computed figures."""

from thunder_fsdp_mem.analysis.timeline import Allocation, MemoryTimeline
from thunder_fsdp_mem.analysis.categories import Category
from thunder_fsdp_mem.analysis.holdings import held_allocation
from thunder_fsdp_mem.analysis.phases import Phase, Stage, step_memory

# Three bound symbols: the input x (10 bytes) unpacked, y (30 bytes) made, then deleted.
_X = Allocation(name="x", nbytes=10, category=Category.INPUT, symbol="input", start=0, external=True)
_Y = Allocation(name="y", nbytes=30, category=Category.TEMPORARY, symbol="exp", start=1, end=2)
TRACE = MemoryTimeline(
    peak_bytes=40,
    peak_index=1,
    peak_symbol="exp",
    timeline=(10, 40, 10),
    op_peaks=(10, 40, 40),
    live_at_peak=(_Y, _X),
    allocations=(_X, _Y),
    outputs={},
    symbols=("unpack_trivial", "exp", "python_del"),
)
WEIGHT = held_allocation("weight", 100, Category.PARAMETER)


def test_a_traced_phase_adds_what_is_outside_to_each_point():
    phase = Phase(stage=Stage.FORWARD, name="forward", timeline=TRACE, outside=(WEIGHT,))
    assert phase.points() == [110, 140, 140] and phase.peak_bytes == 140
    assert phase.peak_symbol == "exp" and phase.peak_index == 1
    assert phase.category_points() == {
        Category.PARAMETER: [100, 100, 100],
        Category.INPUT: [10, 10, 10],
        Category.TEMPORARY: [0, 30, 30],
    }


def test_the_step_peaks_at_the_first_of_its_highest_phases():
    phases = [
        Phase(stage=Stage.FORWARD, name="forward", timeline=TRACE, outside=(WEIGHT,)),
        Phase(stage=Stage.LOSS, name="loss", timeline=None, outside=(WEIGHT,), extra=(_Y, _X), symbol="loss"),
        Phase(stage=Stage.OPTIMIZER, name="optimizer step", timeline=None, outside=(WEIGHT,), extra=(_X,)),
    ]
    step = step_memory(
        phases,
        forward=TRACE,
        backward=None,
        persistent_bytes=100,
        saved_bytes=0,
        gradient_bytes=0,
        optimizer_state_bytes=0,
    )
    assert (step.peak_bytes, step.peak_stage, step.peak_phase, step.peak_index) == (140, Stage.FORWARD, "forward", 1)
    assert (step.forward_peak_bytes, step.loss_peak_bytes, step.optimizer_peak_bytes) == (140, 140, 110)
    assert step.training_peak_bytes == 140  # the optimizer's step is not training's
    assert sum(a.nbytes for a in step.live_at_peak) == 140
    timeline = step.timeline()
    assert timeline.points == (110, 140, 140, 140, 110) and timeline.starts == (0, 3, 4)
