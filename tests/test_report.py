"""report: the name of a group of allocations alive at the peak (the layers' numbers as a range). The rendered
report is checked through the CLI (tests/test_cli.py, tests/test_measure.py)."""

import itertools
import re

import pytest

from thunder_fsdp_mem.report.contents import pattern_name


@pytest.mark.parametrize(
    "names, expected",
    [
        ([f"block {i}.mlp.fc.weight (gathered)" for i in range(32)], "block [0-31].mlp.fc.weight (gathered)"),
        ([f"t_transformer_h_{i}_attn_qkv_weight" for i in (3, 1, 2)], "t_transformer_h_[1-3]_attn_qkv_weight"),
        (
            [f"block {i}.norm_{j}.weight" for i in (0, 2, 4, 6, 8) for j in (1, 2)],
            "block [0,2,4,6,...].norm_[1-2].weight",
        ),
        (["block 7.attn.proj.weight (shard)"], "block 7.attn.proj.weight (shard)"),
        # a trace's own names carry no layer; names that differ in one word: its variants; in more: the first and
        # how many more
        (["t813", "t802"], "t813"),
        (
            [f"AdamW {k} of block {i}.mlp.fc.weight" for i in (0, 1) for k in ("exp_avg", "exp_avg_sq")],
            "AdamW exp_avg/exp_avg_sq of block [0-1].mlp.fc.weight",
        ),
        (
            ["AdamW exp_avg of lm_head.weight", "AdamW exp_avg of wte.weight", "AdamW exp_avg_sq of wte.weight"],
            "AdamW exp_avg of lm_head.weight and 2 more",
        ),
        (["transformer.h.0: add", "add after transformer.h.0"], "transformer.h.0: add and 1 more"),
    ],
)
def test_pattern_name(names, expected):
    assert pattern_name(names) == expected


@pytest.fixture(scope="module")
def report():
    from thunder_fsdp_mem.predict.emulate import trace_step
    from thunder_fsdp_mem.report.contents import build_report
    from thunder_fsdp_mem.training import litgpt_models

    step = trace_step(litgpt_models.ModelSpec(name="Llama-3.2-1B", n_layers=2, block_size=4096), mode="jit")
    return build_report(step, title="Llama-3.2-1B, 2 layers, 4096 tokens", top=10)


@pytest.mark.parametrize("width", [80, 120, 180, 250])
def test_no_figure_is_ever_cut(report, width):
    # Llama-3.2-1B's logits are 1 x 4096 x 128256: the shape and the source lines that were once cut at 180
    # columns. Every field of every row appears whole, at every width: in one table where all fit (250 columns),
    # else in two stacked ones, joined by the row's number.
    from thunder_fsdp_mem.report.tables import short_source
    from thunder_fsdp_mem.report.text import render_text
    from thunder_fsdp_mem.units import format_bytes

    text = render_text(report, width=width)
    lines = text.splitlines()[:-1]  # the last line, the peak, is one line whatever its length (what users grep)
    assert max(len(line) for line in lines) <= width
    table = text[text.index("Largest allocations") : text.index(report.advice[0].text[:30])]
    assert (sum(line.startswith("─") for line in table.splitlines()) == 1) == (width >= 250)
    for t in report.shown.top:
        assert format_bytes(t.nbytes) in table and format_bytes(t.total_bytes) in table and f"x{t.count}" in table
        for field in ("x".join(map(str, t.shape)), t.dtype, t.category.value, t.symbol, short_source(t.source)):
            assert re.search(rf"(?<!\S){re.escape(field)}(?!\S)", table), field
    # a name too long for its column is shortened in the middle, the one place a cell may be shortened, and never
    # into a name another row has
    _check_names(report.shown.top, _top_rows(table))
    assert "1x4096x128256" in table


def test_a_peak_in_the_eager_loss_is_advised_against_with_its_saving(report):
    # Worked out by hand: the eager cross-entropy holds its log_softmax, the nll_loss gradient and the logits'
    # gradient, each the logits' size (1 x 4096 x 128256 bf16); without them the loss phase is that much lower, and
    # the peak falls to whichever phase is then highest.
    from thunder_fsdp_mem.analysis.phases import Stage
    from thunder_fsdp_mem.report.text import render_text

    step = report.shown.step
    assert step.peak_stage is Stage.LOSS
    held = 3 * 4096 * 128256 * 2
    loss = next(p for p in step.phases if p.stage is Stage.LOSS)
    others = max(p.peak_bytes for p in step.phases if p is not loss)
    (chunked, *_) = report.advice
    assert "--loss trace" in chunked.text and "chunks it" in chunked.text
    assert chunked.saving_bytes == step.peak_bytes - max(others, loss.peak_bytes - held)
    assert chunked.text in render_text(report, width=120 * 10)


def test_rows_are_named_by_module_and_op_with_the_trace_name_beside(report):
    rows = {t.name: t for t in report.shown.top}
    made = [t for t in report.shown.top if t.trace_name.startswith("t") and t.name != t.trace_name]
    assert made, rows.keys()  # rows a trace allocated are named after what made them...
    assert any("transformer.h.[0-1]." in t.name for t in made), [t.name for t in made]  # ...layers as a range
    assert "logits (lm_head)" in rows  # the logits: the head's linear


def test_the_optimizer_state_is_named_alike_in_every_mode():
    # thunder.jit's estimate (AdamW's anticipated state of the module's parameters) and the FSDP2 composition
    # (its state of each unit's shards) name each moment after the parameter's qualified name.
    from thunder_fsdp_mem.analysis.categories import Category
    from thunder_fsdp_mem.predict.emulate import trace_step
    from thunder_fsdp_mem.predict.fsdp2 import compose_step
    from thunder_fsdp_mem.training import litgpt_models

    spec = litgpt_models.ModelSpec(name="pythia-14m", n_layers=1, block_size=32)

    def state(step):
        return {
            a.name
            for phase in step.phases
            for a in (*phase.outside, *phase.extra)
            if a.category is Category.OPTIMIZER_STATE and "exp_avg" in a.name
        }

    jit = state(trace_step(spec, mode="jit", device_type="cpu"))
    fsdp2 = state(compose_step(spec, world_size=1, shard="zero2", device_type="cpu"))
    assert "AdamW exp_avg of transformer.h.0.attn.qkv.weight" in jit
    assert jit == fsdp2


@pytest.fixture(scope="module")
def two_plans():
    """pythia-14m's step without the transform and with it (another number of symbols in each trace)."""
    from thunder_fsdp_mem.config import MemoryConfig
    from thunder_fsdp_mem.predict.emulate import plan_step, trace_step
    from thunder_fsdp_mem.report.contents import build_report
    from thunder_fsdp_mem.training import litgpt_models

    spec = litgpt_models.ModelSpec(name="pythia-14m", n_layers=1, block_size=32)
    without = trace_step(spec, mode="jit", device_type="cpu")
    with_it, _ = plan_step(spec, MemoryConfig(), mode="jit", device_type="cpu")
    return build_report(with_it, title="pythia-14m", baseline=without)


def test_plot_is_in_the_labels_unit_from_zero_with_the_phases_lined_up(two_plans):
    from thunder_fsdp_mem.report.plot import plot_figure

    plans = two_plans.plans
    timelines = [p.step.timeline() for p in plans]
    assert len(timelines[0].points) != len(timelines[1].points)
    fig = plot_figure(two_plans)
    line_axes, stacked = fig.axes
    peak = max(p.step.peak_bytes for p in plans)
    assert 2**20 <= peak < 2**30
    assert line_axes.get_ylabel().endswith("(MiB)") and stacked.get_ylabel().endswith("(MiB)")
    assert line_axes.get_ylim()[0] == 0 and stacked.get_ylim()[0] == 0
    lines = line_axes.get_lines()[:2]
    assert [line.get_label() for line in lines] == ["without transform", "with transform"]
    assert max(max(line.get_ydata()) for line in lines) * 2**20 == pytest.approx(peak)
    # Phase k of one plan lies after phase k-1 of the other: the forward, the loss, the backward and the optimizer
    # step line up although the transform changed the traces' lengths.
    spans = []
    for line, timeline in zip(lines, timelines):
        xs = list(line.get_xdata())
        ends = [*timeline.starts[1:], len(xs)]
        spans.append([(min(xs[a:b]), max(xs[a:b])) for a, b in zip(timeline.starts, ends)])
    for k in range(1, len(spans[0])):
        assert max(s[k - 1][1] for s in spans) < min(s[k][0] for s in spans), k


@pytest.mark.parametrize("predicted_step", ["jit"], indirect=True)  # one device on CPU: single-tensor AdamW
def test_a_peak_in_the_optimizers_step_is_advised_against_with_its_saving(predicted_step):
    # On CPU AdamW steps one parameter at a time (single tensor): at its peak it holds wte's exp_avg_sq.sqrt() and
    # that scaled while lm_head's denominator, the parameter before it, is still bound: three bf16 tensors of
    # 50304 x 128, beside the parameters, gradients and state. Without them the peak falls to the next highest
    # phase at most.
    from thunder_fsdp_mem.analysis.phases import Stage
    from thunder_fsdp_mem.report.contents import build_report

    _, step = predicted_step
    assert step.peak_stage is Stage.OPTIMIZER
    held = 3 * 50304 * 128 * 2
    others = max(p.peak_bytes for p in step.phases if p.stage is not Stage.OPTIMIZER)
    (fused, *_) = build_report(step, title="pythia-14m").advice
    assert "AdamW(..., fused=True)" in fused.text and "single tensor" in fused.text
    assert fused.saving_bytes == min(held, step.peak_bytes - others)


@pytest.fixture(scope="module")
def planned():
    # a budget's plan beside the step without the transform: three columns of figures, and every pass's record;
    # replayed under a cap of the budget, which neither plan's peak meets (each plan's cell: out of memory)
    from thunder_fsdp_mem import MemoryConfig
    from thunder_fsdp_mem.predict.emulate import plan_step, trace_step
    from thunder_fsdp_mem.report.contents import build_report
    from thunder_fsdp_mem.training import litgpt_models

    spec = litgpt_models.ModelSpec(name="pythia-14m", n_layers=2, block_size=512)
    baseline = trace_step(spec, mode="jit")
    budget = int(0.9 * baseline.peak_bytes)
    step, transform = plan_step(spec, MemoryConfig(memory_budget=budget), mode="jit")
    rewrites = tuple(transform.rewrites)
    return build_report(
        step, title="pythia-14m", baseline=baseline, rewrites=rewrites, budget=budget, caching=True, memory_cap=budget
    )


@pytest.mark.parametrize("width", [80, 120])
def test_every_figure_of_every_table_appears_whole(planned, width):
    from thunder_fsdp_mem.report.text import render_text
    from thunder_fsdp_mem.report.contents import summary_rows
    from thunder_fsdp_mem.units import format_bytes

    text = render_text(planned, width=width)
    lines = text.splitlines()[:-1]  # the last line, the peak, is one line whatever its length (what users grep)
    assert max(len(line) for line in lines) <= width, [line for line in lines if len(line) > width]
    named = [re.sub(r"^ *\d+   ", "", line) for line in lines if "…" in line]  # after a row's number, if any
    assert all("  " not in line[: line.find("…")] for line in named)  # only names, in the middle
    figures = {format_bytes(b) for p in planned.plans for _, _, b in summary_rows(p.step)}
    figures |= {format_bytes(b) for p in planned.plans for _, b in p.by_category}
    figures |= {format_bytes(p.reserved.peak_reserved_bytes) for p in planned.plans}
    for r in planned.rewrites:
        figures |= {format_bytes(b) for b in (r.peak_before, r.peak_after, r.saved_before, r.saved_after) if b}
    figures |= {format_bytes(t.total_bytes) for t in planned.shown.top}
    missing = [f for f in figures if f not in text]
    assert missing == [], missing
    assert len(planned.rewrites) >= 8 and all(r.pass_name.split()[0] in text for r in planned.rewrites)


TOP_HEADERS = ("name", "count", "shape", "dtype", "size each", "total", "category", "symbol", "source", "trace name")
FIT_HEADERS = ("plan: the largest", "that fits (peak)", "the next (peak)")
SIZE = r"\d+(?:\.\d\d)? (?:B|KiB|MiB|GiB|TiB)"


@pytest.mark.parametrize(
    "family, model, tokens",
    [("report", "Llama-3.2-1B", 4096), ("planned", "pythia-14m", 512)],  # Llama; GPT-NeoX, with the transform
)
def test_at_80_columns_report_and_fit_keep_every_column_unit_and_name(family, model, tokens, request):
    # What an 80-column terminal shows of `report` and `fit`: no line past 80 columns, every table with every column
    # (its header there), every size with its unit, and rows whose full names differ told apart. fit's figures are
    # the fixture's predicted peaks (its search, a step traced per candidate, is tests/test_fit.py's).
    from litgpt.config import name_to_config

    from thunder_fsdp_mem.predict.largest_step import Largest, StepFit, longest_for
    from thunder_fsdp_mem.report.contents import summary_rows
    from thunder_fsdp_mem.report.fit_table import render_fit
    from thunder_fsdp_mem.report.text import render_text
    from thunder_fsdp_mem.units import format_bytes

    report = request.getfixturevalue(family)
    text = render_text(report, width=80)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80, [line for line in lines if len(line) > 80]
    blocks = _header_blocks(lines)
    labels = [p.label for p in report.plans]
    tables = [("step", *labels), ("at the peak, by category", *labels)]
    if report.rewrites:
        tables.append(("pass", "pair", "outcome", "peak", "saved", "seconds"))
    if any(r.recomputed and r.outcome.value == "applied" for r in report.rewrites):
        tables.append(("symbol", "count", "predicted time", "source"))
    for headers in tables:
        assert any(all(_has_header(block, h) for h in headers) for _, block in blocks), (headers, blocks)
    start = next(i for i, line in enumerate(lines) if line.startswith("Largest allocations"))
    top = [line for rule, block in blocks if rule > start for line in block]  # the one table, or the two stacked
    assert [h for h in TOP_HEADERS if not _has_header(top, h)] == [], top
    figures = {format_bytes(b) for p in report.plans for _, _, b in summary_rows(p.step)}
    figures |= {format_bytes(b) for p in report.plans for _, b in p.by_category}
    figures |= {format_bytes(p.reserved.peak_reserved_bytes) for p in report.plans if p.reserved is not None}
    for r in report.rewrites:
        figures |= {format_bytes(b) for b in (r.peak_before, r.peak_after, r.saved_before, r.saved_after) if b}
    assert [f for f in figures if f not in text] == []
    _check_units(lines)
    _check_names(report.shown.top, _top_rows("\n".join(lines[start:])))

    def fit(peak: int) -> StepFit:
        return StepFit(peak, Largest(tokens, peak, 2 * tokens, 2 * peak), Largest(1, peak, 2, 2 * peak))

    fits = [(p.label, fit(p.step.peak_bytes)) for p in report.plans]
    longest = longest_for(name_to_config[model]["block_size"], tokens)
    text = render_fit(fits, title=report.title, block_size=tokens, micro_batch_size=1, longest=longest, width=80)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80, [line for line in lines if len(line) > 80]
    ((_, block),) = _header_blocks(lines)
    assert [h for h in FIT_HEADERS if not _has_header(block, h)] == [], block
    _check_units(lines)
    rows = _fit_rows(lines)
    searched = ("sequence length at micro-batch 1", f"micro-batch at {tokens} tokens")
    assert [name for name, _ in rows] == [f"{label}: {what}" for label in labels for what in searched]
    cell = rf"\d+ (?:tokens|sequences) \({SIZE}\)"
    assert all(len(cells) == 2 and all(re.fullmatch(cell, c) for c in cells) for _, cells in rows), rows


def _header_blocks(lines: list[str]) -> list[tuple[int, list[str]]]:
    """(the line of its rule, its header's lines) of each table: the lines above a rule of ─ up to a blank line or
    a caption (a line ending in ':')."""
    blocks = []
    for i, line in enumerate(lines):
        if line.startswith("─"):
            j = i
            while j > 0 and lines[j - 1].strip() and not lines[j - 1].endswith(":"):
                j -= 1
            blocks.append((i, lines[j:i]))
    return blocks


def _has_header(lines: list[str], header: str) -> bool:
    return any(re.search(rf"(?<!\S){re.escape(header)}(?!\S)", line) for line in lines)


def _check_units(lines: list[str]) -> None:
    """Every figure in a table's rows keeps its unit: none cut by an ellipsis, every two-decimal figure followed by
    its unit (B to TiB, ms or us, %), but a pass's seconds, the last column of the table of what the transform did."""
    assert not re.search(r"\d(?:\.\d*)?(?: [KMGT]?i?)?…", "\n".join(lines))
    for rule, block in _header_blocks(lines):
        for line in itertools.takewhile(str.strip, lines[rule + 1 :]):
            if _has_header(block, "seconds"):
                line = re.sub(r"\s\d+\.\d\d$", "", line)
            assert not re.search(r"\d+\.\d\d(?! (?:B|KiB|MiB|GiB|TiB|ms|us)\b|%)", line), line


_TOP_ROW = re.compile(rf"^\s*(?:(\d+)\s{{2,}})?(\S.*?)\s{{2,}}x(\d+)\s.*?({SIZE})\s+({SIZE})(?:\s|$)")


def _top_rows(section: str) -> list[list]:
    """[name as shown, count, size each, total] of each row of the table that names the largest allocations (the
    first after the caption), in order; a whole name folded onto more lines joined."""
    lines = section.splitlines()
    rule = next(i for i, line in enumerate(lines) if line.startswith("─"))
    rows = []
    for line in lines[rule + 1 :]:
        if not line.strip():
            break
        match = _TOP_ROW.match(line)
        if match:
            rows.append([match[2], int(match[3]), match[4], match[5]])
        else:
            rows[-1][0] += " " + line.strip()
    return rows


def _check_names(top, rows: list[list]) -> None:
    """Each row its allocation's count and sizes, its name whole or shortened in the middle (its start and end
    kept); two rows whose full names differ never shown alike."""
    from thunder_fsdp_mem.units import format_bytes

    assert len(rows) == len(top), rows
    for t, (shown, count, each, total) in zip(top, rows):
        assert (count, each, total) == (t.count, format_bytes(t.nbytes), format_bytes(t.total_bytes)), shown
        head, cut, tail = shown.partition("…")
        whole = t.name.split() == shown.split() or t.name.replace(" ", "") == shown.replace(" ", "")
        assert whole or (cut and "  " not in shown and t.name.startswith(head) and t.name.endswith(tail)), shown
    for i, j in itertools.combinations(range(len(top)), 2):
        if top[i].name != top[j].name:
            assert rows[i][0] != rows[j][0], (top[i].name, top[j].name, rows[i][0])


def _fit_rows(lines: list[str]) -> list[tuple[str, list[str]]]:
    """(the plan and what was searched, its two cells) of each row of fit's table: a row's first line holds its
    cells, the name folds onto the lines after."""
    rule = next(i for i, line in enumerate(lines) if line.startswith("─"))
    rows = []
    for line in lines[rule + 1 :]:
        if line.startswith("Searched"):
            break
        name, *cells = re.split(r"\s{3,}", line.strip())
        if cells:
            rows.append((name, cells))
        else:
            rows[-1] = (f"{rows[-1][0]} {name}", rows[-1][1])
    return rows
