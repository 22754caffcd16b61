"""edit: how every pass builds its result. Its ``del``s are Thunder's own (``del_last_used``), a program given back
as it was is the trace itself, and the transform's notes add up on the provenance line."""

import dataclasses

import pytest
import thunder
import torch
from thunder.core.prims import PrimIDs
from thunder.executors.passes import del_last_used

from configs import BY_NAME
from thunder_fsdp_mem.analysis.symbols import without_dels
from thunder_fsdp_mem.passes.edit import dels_at_last_use, rebuilt
from thunder_fsdp_mem.training import litgpt_models


@pytest.fixture(scope="module")
def plain_traces():
    spec = dataclasses.replace(BY_NAME["neox"], n_layers=1)
    jitted = thunder.jit(litgpt_models.build(spec, dtype=torch.float32))
    jitted(*litgpt_models.batch(spec)).backward()
    return thunder.last_traces(jitted)[-1], thunder.last_backward_traces(jitted)[-1]


def _listing(trace):
    return [(b.sym.id, tuple(p.name for p in b.flat_proxy_args)) for b in trace.bound_symbols]


def test_dels_are_placed_as_thunders_del_last_used_places_them(plain_traces):
    # The same symbols, the same dels with the same names in the same places, forward and backward (with its
    # collection clears), as Thunder's own pass.
    for trace, clear in zip(plain_traces, (False, True)):
        assert any(b.sym.id == PrimIDs.DEL for b in trace.bound_symbols)
        ours = dels_at_last_use(trace, clear_mutable_collections=clear)
        assert _listing(ours) == _listing(del_last_used(trace, clear_mutable_collections=clear))


def test_a_program_given_back_unchanged_is_the_trace_itself(plain_traces):
    forward, backward = plain_traces
    assert rebuilt(forward, without_dels(forward.bound_symbols), "nothing") is forward
    assert (
        rebuilt(backward, without_dels(backward.bound_symbols), "nothing", clear_mutable_collections=True) is backward
    )


def test_an_edited_program_gets_its_dels_again_and_the_notes_add_up(plain_traces):
    forward = plain_traces[0]
    body = without_dels(forward.bound_symbols)
    # Swap two neighbours that do not depend on each other: the unpacking of two inputs.
    unpacks = [i for i, b in enumerate(body) if b.sym.id == PrimIDs.UNPACK_TRIVIAL]
    i, j = unpacks[0], unpacks[1]
    body[i], body[j] = body[j], body[i]
    first = rebuilt(forward, body, "first")
    assert first is not forward
    assert _listing(first) == _listing(del_last_used(first))
    body[i], body[j] = body[j], body[i]
    second = rebuilt(first, body, "second")
    assert second.get_provenance().pss == "FSDPMemoryTransform: first; second"
