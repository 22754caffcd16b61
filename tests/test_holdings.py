"""holdings.Holdings: the ledger of what is alive outside the traces, by hand: an allocation lives while anyone
holds it, and a phase counts each allocation once, inside its timeline or outside it."""

from enum import Enum

from thunder_fsdp_mem.analysis.categories import Category
from thunder_fsdp_mem.analysis.holdings import Holder, Holdings, Key, Role, held_allocation
from thunder_fsdp_mem.analysis.phases import Stage


class _Kind(Enum):
    SHARD = "shard"
    STATE = "state"


MODEL, CALLER = Holder(Role.MODEL), Holder(Role.CALLER)


def test_an_allocation_lives_while_anyone_holds_it():
    holdings = Holdings()
    key = Key(_Kind.SHARD, "block", "weight")
    holdings.hold(key, held_allocation("weight", 100, Category.PARAMETER), MODEL)
    holdings.hold(key, held_allocation("weight again", 100, Category.PARAMETER), CALLER)
    assert holdings[key].name == "weight"  # the first record held stays
    assert holdings.held_by(Role.CALLER) == [key] and holdings.bytes(_Kind.SHARD) == 100
    holdings.release(key, MODEL)
    assert holdings.keys(_Kind.SHARD, "block") == [key]
    holdings.release(key, CALLER)
    assert holdings.keys(_Kind.SHARD) == [] and holdings.bytes(_Kind.SHARD) == 0
    holdings.release(key, CALLER)  # what is gone stays gone


def test_a_phase_splits_what_is_held_into_inside_and_outside():
    holdings = Holdings()
    weight, state = Key(_Kind.SHARD, item="weight"), Key(_Kind.STATE, item="weight")
    holdings.hold(weight, held_allocation("weight", 100, Category.PARAMETER), MODEL)
    holdings.hold(state, held_allocation("exp_avg", 50, Category.OPTIMIZER_STATE), Holder(Role.OPTIMIZER))
    extra = (held_allocation("logits' gradient", 30, Category.TEMPORARY),)
    phase = holdings.phase(Stage.LOSS, "loss", inside=[weight], extra=extra, symbol="loss")
    assert [a.name for a in phase.outside] == ["exp_avg"] and [a.name for a in phase.inside] == ["weight"]
    assert phase.peak_bytes == 50 + 30 and phase.peak_symbol == "loss" and phase.peak_index == -1
    assert holdings.phases == [phase]
