"""pipeline.py and declaration.py: the passes the declarations give, in the order pipeline.py's docstring documents,
each ``MemoryConfig`` switch turned off removing exactly its passes, under every combination of switches (checked
against the lists below, written by hand), and what a declaration's scope and the resolved ``regather`` mean."""

import itertools

import pytest

from thunder_fsdp_mem import MemoryConfig
from thunder_fsdp_mem.passes import pipeline
from thunder_fsdp_mem.passes.declaration import Declaration, Scope
from thunder_fsdp_mem.passes.driver import Context, Pair, PassError, Proposal

# (name, after): every pass, in the documented order.
ORDER = [
    ("folded casts", None),
    ("fusion rematerialization", None),
    ("rematerialization", None),
    ("folded casts after rematerialization", "rematerialization"),
    ("recomputed regions", "rematerialization"),
    ("order", None),
    ("all-gathers", None),
    ("reduce-scatters", None),
    ("loss chunks", None),
]
# switch -> the passes it removes when False
REMOVES = {
    "fold_casts": {"folded casts", "folded casts after rematerialization"},
    "fusion_rematerialize": {"fusion rematerialization"},
    "rematerialize": {"rematerialization", "folded casts after rematerialization", "recomputed regions"},
    "reorder": {"order"},
    "gathers": {"all-gathers"},
    "scatters": {"reduce-scatters"},
    "chunk_loss": {"loss chunks"},
}
SCOPES = {
    "folded casts": Scope.EACH_TRACE,
    "fusion rematerialization": Scope.PAIR,
    "rematerialization": Scope.PAIR,
    "folded casts after rematerialization": Scope.EACH_TRACE,
    "recomputed regions": Scope.BACKWARD,
    "order": Scope.PAIR,
    "all-gathers": Scope.PAIR,
    "reduce-scatters": Scope.BACKWARD,
    "loss chunks": Scope.EACH_TRACE,
}


def _listed(config: MemoryConfig, *, regather: bool = False) -> list[tuple[str, str | None]]:
    return [(p.name, p.after) for p in pipeline.pipeline(config, regather=regather)]


def test_every_pass_runs_by_default_in_the_documented_order():
    assert _listed(MemoryConfig()) == ORDER
    assert _listed(MemoryConfig(), regather=True) == ORDER
    names = (pipeline.FOLD, pipeline.FUSIONS, pipeline.REMATERIALIZE, pipeline.ORDER)
    assert names == ("folded casts", "fusion rematerialization", "rematerialization", "order")
    assert (pipeline.ALL_GATHERS, pipeline.REDUCE_SCATTERS) == ("all-gathers", "reduce-scatters")


@pytest.mark.parametrize("switch", sorted(REMOVES))
def test_a_switch_turned_off_removes_exactly_its_passes(switch):
    assert _listed(MemoryConfig(**{switch: False})) == [p for p in ORDER if p[0] not in REMOVES[switch]]


def test_every_combination_of_switches_keeps_the_passes_left_in_order():
    for off in itertools.chain.from_iterable(itertools.combinations(REMOVES, k) for k in range(len(REMOVES) + 1)):
        removed = set().union(*(REMOVES[s] for s in off))
        config = MemoryConfig(**dict.fromkeys(off, False))
        assert _listed(config) == [p for p in ORDER if p[0] not in removed], off


def test_each_pass_declares_what_it_rewrites():
    assert {d.name: d.scope for d in pipeline.DECLARED} == SCOPES


def test_a_pass_on_the_backward_alone_that_proposes_a_new_forward_is_refused():
    pair = Pair("forward", "backward")  # the scope check reads identities alone
    keeps = Declaration("keeps", (), Scope.BACKWARD, lambda p, c, config: Proposal(p.forward, "new backward"))
    assert keeps.bound(MemoryConfig()).run(pair, Context(pair)).backward == "new backward"
    strays = Declaration("strays", (), Scope.BACKWARD, lambda p, c, config: Proposal("new forward", p.backward))
    with pytest.raises(PassError, match="'strays' rewrites the backward alone"):
        strays.bound(MemoryConfig()).run(pair, Context(pair))
    assert Declaration("pair", (), Scope.PAIR, strays.propose).bound(MemoryConfig()).run(pair, Context(pair))


def test_the_passes_read_regather_as_the_transform_resolved_it(monkeypatch):
    seen = []

    def probe(pair, context, config):
        seen.append(config.regather)
        return Proposal(pair.forward, pair.backward)

    monkeypatch.setattr(pipeline, "DECLARED", (Declaration("probe", ("gathers",), Scope.PAIR, probe),))
    pair = Pair("forward", "backward")
    for regather in (True, False):
        (probe_pass,) = pipeline.pipeline(MemoryConfig(), regather=regather)
        probe_pass.run(pair, Context(pair))
    assert seen == [True, False]
    assert pipeline.pipeline(MemoryConfig(gathers=False), regather=True) == []
