"""MemoryProbeTransform: probes see, after every bound symbol, the live bytes MemTracker measures, and change
no result."""

import pytest
import thunder
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from thunder_fsdp_mem import analyze
from thunder_fsdp_mem.predict.probes import MemoryProbeTransform


def views_and_copies(a, w):
    b = a * 2
    e = b.view(32, 32).t().reshape(1024)
    x = torch.matmul(b.view(4, 16, 16), w)
    return e.sum() + x.sum()


def test_probes_measure_what_analyze_predicts_and_change_nothing():
    a, w = torch.randn(1024), torch.randn(16, 16)
    tracker = MemTracker()
    samples = []
    cpu = torch.device("cpu")

    def record(tag, index):
        samples.append((tag, index, tracker.get_tracker_snapshot("current").get(cpu, {}).get("Total", 0)))

    probe = MemoryProbeTransform(record)
    probed = thunder.jit(views_and_copies, transforms=[probe])
    plain = thunder.jit(views_and_copies)
    tracker.track_external(a, w)
    with tracker:
        result = probed(a, w)
    assert torch.equal(result, plain(a, w))

    assert probe.kinds == ["computation"]  # nothing requires a gradient: one trace, without a backward
    trace = probe.traces[0]  # as the probe received it; the indices are its positions
    assert trace.bound_symbols[-1].sym.name == "python_return"
    timeline = analyze(trace).timeline
    unpacked = max(i for i, b in enumerate(trace.bound_symbols) if b.sym.name == "unpack_trivial")
    checked = [(i, measured) for tag, i, measured in samples if i > unpacked]
    assert [i for i, _ in checked] == list(range(unpacked + 1, len(trace.bound_symbols) - 1)), (
        "a probe after every bound symbol but the return, once each"
    )
    for i, measured in checked:
        assert measured == timeline[i], (i, trace.bound_symbols[i].sym.name)


def test_every_must_be_a_positive_int():
    with pytest.raises(ValueError, match="every"):
        MemoryProbeTransform(lambda tag, i: None, every=0)


def test_every_other_symbol_and_the_last_one_probed_in_forward_and_backward():
    seen = []
    probe = MemoryProbeTransform(lambda tag, i: seen.append((tag, i)), every=2)
    jitted = thunder.jit(lambda x: (x.sin() * 2).cos().sum(), transforms=[probe])
    jitted(torch.randn(8, requires_grad=True)).backward()
    assert probe.kinds == ["forward", "backward"]
    for tag, trace in enumerate(probe.traces):
        last = len(trace.bound_symbols) - 2  # the symbol before the return
        expected = sorted({*range(1, last + 1, 2), last})
        assert [i for t, i in seen if t == tag] == expected, tag
