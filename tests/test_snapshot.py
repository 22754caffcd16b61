"""The predicted step as a PyTorch memory snapshot: its events, replayed as the CUDA allocator's history is, reach
the estimated peak and end with what the step keeps; what is alive before the step is the model's parameters (its
shards) and AdamW's state, counted from the model itself; frames point at litgpt's source lines; and
``torch.cuda._memory_viz`` reads and renders it on CPU."""

import base64
import linecache
import pickle
from pathlib import Path

import pytest
import torch
import torch.cuda._memory_viz as memory_viz

from thunder_fsdp_mem.analysis.snapshot import predicted_snapshot
from thunder_fsdp_mem.training import litgpt_models

SPEC = litgpt_models.ModelSpec(name="pythia-14m", n_layers=1, block_size=32)
WORLD_SIZE = {"jit": 1, "thunder-fsdp": 2, "fsdp2": 2}  # as conftest.PREDICTED traces them


def _replay(snapshot: dict) -> tuple[int, int, int]:
    """Live bytes before the first event, at the highest point and after the last, as the viewer reconstructs them:
    what was alive before recording is what is alive at the end, less what the events allocated, plus what they
    freed. Each allocation lies inside a segment."""
    segments = snapshot["segments"]
    events = snapshot["device_traces"][0]
    end = sum(b["size"] for seg in segments for b in seg["blocks"] if b["state"] == "active_allocated")
    start = (
        end
        - sum(e["size"] for e in events if e["action"] == "alloc")
        + sum(e["size"] for e in events if e["action"] == "free_completed")
    )
    live = peak = start
    open_blocks: dict[int, int] = {}
    for e in events:
        if e["action"] == "alloc":
            assert e["addr"] not in open_blocks, "an address is given out twice"
            open_blocks[e["addr"]] = e["size"]
            live += e["size"]
            assert (
                any(
                    seg["address"] <= e["addr"] and e["addr"] + e["size"] <= seg["address"] + seg["total_size"]
                    for seg in segments
                )
                or len(segments) > 1
            )  # a real allocator may have freed the segment since
        elif e["action"] == "free_requested":
            assert open_blocks.get(e["addr"], e["size"]) == e["size"]
            open_blocks.pop(e["addr"], None)
        elif e["action"] == "free_completed":
            live -= e["size"]
        peak = max(peak, live)
    assert live == end
    return start, peak, end


def _model_bytes(world_size: int) -> tuple[int, int, int]:
    """One rank's parameter bytes, the buffers' bytes and the number of parameters of ``SPEC`` in bf16."""
    with torch.device("meta"):
        model = litgpt_models.build(SPEC, dtype=torch.bfloat16)
    params = list(model.parameters())
    return (
        sum(-(-p.numel() // world_size) * p.element_size() for p in params),
        sum(b.numel() * b.element_size() for b in model.buffers()),
        len(params),
    )


@pytest.fixture
def step(predicted_step):
    options, estimate = predicted_step
    return options["mode"], estimate


def test_replay_reaches_the_estimated_peak(step):
    mode, estimate = step
    snapshot = predicted_snapshot(estimate)
    start, peak, end = _replay(snapshot)
    assert peak == estimate.peak_bytes
    # Before the step: the parameters (one rank's shards), AdamW's two moments of each and the rotary buffers, in
    # bf16, beside the batch's token ids and AdamW's step counters (a float32 scalar per parameter, where kept).
    params, buffers, n_params = _model_bytes(WORLD_SIZE[mode])
    batch = 2 * SPEC.block_size * 8
    assert 0 < start - (3 * params + buffers) <= batch + 4 * n_params, (start, params, buffers)
    # After it, the gradients are there as well; the memory the optimizer's step took is gone.
    assert end >= start + params - batch
    assert end < estimate.peak_bytes


def test_frames_name_the_op_its_source_line_and_the_phase(step):
    mode, estimate = step
    events = predicted_snapshot(estimate)["device_traces"][0]
    allocs = [e for e in events if e["action"] == "alloc"]
    phases = {p.name for p in estimate.phases}
    assert all(e["frames"][-1]["filename"] == "predicted step" and e["frames"][-1]["name"] in phases for e in allocs)
    logits_bytes = SPEC.block_size * SPEC.config().padded_vocab_size * 2
    if mode == "fsdp2":  # the head runs eagerly, outside Thunder's traces: named by its phase
        assert any(e["size"] == logits_bytes and e["frames"][-1]["name"] == "forward: lm_head" for e in allocs)
    else:  # the logits: made by F.linear (the source line Thunder records), in the module lm_head
        logits = max((e for e in allocs if e.get("category") == "output"), key=lambda e: e["size"])
        op, module = logits["frames"][:2]
        assert logits["size"] == logits_bytes
        assert "F.linear(" in linecache.getline(op["filename"], op["line"]), op
        assert module["name"] == "logits (lm_head)", module
    # Every source line a frame names is a line of that file.
    assert all(linecache.getline(f["filename"], f["line"]) for e in allocs for f in e["frames"] if f["line"])


def test_memory_viz_reads_and_renders_it(step, tmp_path):
    _, estimate = step
    snapshot = predicted_snapshot(estimate)
    path = tmp_path / "predicted.pickle"
    path.write_bytes(pickle.dumps(snapshot))
    loaded = pickle.loads(path.read_bytes())
    # segsum checks the segment's accounting (blocks add up to the segment); trace walks every event.
    # The viewer colours the blocks alive at the end as "unknown": with categories on the events, it needs that one
    # among them (without it, it stops loading).
    assert "unknown" in {e.get("category") for e in loaded["device_traces"][0]}
    summary = memory_viz.segsum(loaded)
    assert "segments: 1" in summary
    text = memory_viz.trace(loaded)
    assert text.count("free") >= sum(e["action"] == "free_requested" for e in loaded["device_traces"][0])
    for render in (memory_viz.trace_plot, memory_viz.segment_plot):
        html = render(loaded)
        encoded = html.split('"base64": "')[1].split('"')[0]
        assert pickle.loads(base64.b64decode(encoded)) == loaded


DATA = Path(__file__).resolve().parent.parent / "docs" / "data"


def test_a_recorded_cuda_snapshot_renders_beside_the_predicted_one_and_they_agree():
    # stablecode-3b, 8 layers, 8192 tokens, the transform on, one H200 (docs/accuracy.md): the allocator's history
    # of the measured step (report --measure --snapshot) and the prediction's snapshot, read and rendered alike.
    measured, predicted = (
        pickle.loads((DATA / f"snapshot-stablecode-8L-8192-jit-mem-{kind}-2026-12-01.pickle").read_bytes())
        for kind in ("measured", "predicted")
    )
    peaks = []
    for snapshot in (measured, predicted):
        memory_viz.segsum(snapshot)
        memory_viz.trace(snapshot)
        for render in (memory_viz.trace_plot, memory_viz.segment_plot):
            assert "snapshot.pickle" in render(snapshot)
        peaks.append(_replay(snapshot)[1])
    assert abs(peaks[1] - peaks[0]) <= 0.01 * peaks[0], peaks  # within 1% (-0.28%: cuBLAS's workspace)
