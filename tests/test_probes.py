"""MemoryProbeTransform: probes see, after every bound symbol, the live bytes MemTracker measures, and change
no result."""

import pytest
import thunder
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from thunder_fsdp_mem import analyze
from thunder_fsdp_mem.probes import MemoryProbeTransform


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

    probed = thunder.jit(views_and_copies, transforms=[MemoryProbeTransform(record)])
    plain = thunder.jit(views_and_copies)
    tracker.track_external(a, w)
    with tracker:
        result = probed(a, w)
    assert torch.equal(result, plain(a, w))

    trace = thunder.last_traces(probed)[-1]
    timeline = analyze(trace).timeline
    unpacked = max(i for i, b in enumerate(trace.bound_symbols) if b.sym.name == "unpack_trivial")
    checked = [(i, measured) for tag, i, measured in samples if i > unpacked]
    assert len(checked) >= 8, "a probe after every bound symbol"
    for i, measured in checked:
        assert measured == timeline[i], (i, trace.bound_symbols[i].sym.name)


def test_every_must_be_a_positive_int():
    with pytest.raises(ValueError, match="every"):
        MemoryProbeTransform(lambda tag, i: None, every=0)
