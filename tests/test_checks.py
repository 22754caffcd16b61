"""checks: every rewrite is a valid program that returns the same values and issues the same collectives; each
broken rewrite below is made by hand from a trace that passes, and must fail with the check that names it."""

import pytest
import thunder
import thunder.torch as ltorch
import torch
from thunder.core.trace import from_trace
from thunder.executors.passes import del_last_used

from fake_collectives import all_gather, wait
from thunder_fsdp_mem.passes import checks


def two_gathers(a, b):
    ga, gb = wait(all_gather(a)), wait(all_gather(b))
    return ltorch.add(ltorch.exp(ga), ltorch.sin(gb))


@pytest.fixture(scope="module")
def trace():
    return del_last_used(thunder.trace()(two_gathers, torch.randn(2, 4), torch.randn(2, 4)))


def _with(trace, bsyms):
    new = from_trace(trace)
    new.bound_symbols = bsyms
    return new


def _index(trace, name):
    return next(i for i, b in enumerate(trace.bound_symbols) if b.sym.name == name)


def test_the_trace_itself_passes(trace):
    checks.check_rewrite(trace, trace)


def test_a_name_read_before_it_is_defined(trace):
    bsyms = list(trace.bound_symbols)
    del bsyms[_index(trace, "exp")]
    with pytest.raises(checks.CheckError, match=r"reads \w+ before anything defines it"):
        checks.check_program(_with(trace, bsyms))


def test_a_name_read_after_its_del(trace):
    bsyms = list(trace.bound_symbols)
    add = bsyms.pop(_index(trace, "add"))
    bsyms.insert(len(bsyms) - 1, add)  # after the dels of its arguments
    with pytest.raises(checks.CheckError, match=r"reads \w+ after its del at symbol \d+"):
        checks.check_program(_with(trace, bsyms))


def test_another_return(trace):
    bsyms = list(trace.bound_symbols)
    exp = bsyms[_index(trace, "exp")]
    bsyms[-1] = bsyms[-1].from_bsym(args=(exp.output,))
    with pytest.raises(checks.CheckError, match="returns different values"):
        checks.check_same_result(trace, _with(trace, bsyms))


def test_collectives_in_another_order_or_others(trace):
    bsyms = list(trace.bound_symbols)
    first, second = [i for i, b in enumerate(bsyms) if b.sym.name == "torch_all_gather_prim_impl"]
    bsyms[first], bsyms[second] = bsyms[second], bsyms[first]
    swapped = _with(trace, bsyms)
    assert [c[0] for c in checks.collectives(trace)] == ["torch_all_gather_prim_impl"] * 2
    with pytest.raises(checks.CheckError, match="in another order"):
        checks.check_same_collectives(trace, swapped)
    checks.check_same_collectives(trace, swapped, ordered=False)  # a pass that orders them itself may
    one = _with(trace, [b for i, b in enumerate(trace.bound_symbols) if i != first])
    with pytest.raises(checks.CheckError, match="different collectives"):
        checks.check_same_collectives(trace, one)
    checks.check_same_collectives(one, trace, added=[checks.collectives(trace)[0]])  # unless the pass adds it
