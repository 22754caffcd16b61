"""The door to Thunder's internals: every private name of lightning-thunder the package uses goes through here, so
that a Thunder release that renames or changes one breaks in this module (and in ``tests/test_thunder_internals.py``,
which lists what passes through), not silently in a pass. Checked against lightning-thunder 0.2.7.dev20260201
(``versions`` says at import when another is installed).

Private names, each behind one function:

- ``update_fusion(bsym)``: ``thunder.executors.passes._update_fusion_call_ctx``. A fusion's bound symbol carries
  the compiled callable of its subsymbols in its call context; after a pass changes the subsymbols (prunes them,
  adds outputs, splits a region), the executor must compile the region again. Thunder's own passes call it so.
- ``implementations(executor)``, ``set_implementations(executor, implmap)``: ``Executor._implmap``, the ops an
  executor claims and how (``ImplInfo``). The package copies a fusion executor less Thunder's distributed prims,
  and the meta-device prediction makes the CUDA checkers accept the meta device.
- ``call_context(bsym)``, ``renamed_fusion(bsym, sym)``: ``BoundSymbol._call_ctx``, the names a bound symbol's
  generated code calls; a renamed fusion needs its callable under the new name.
- ``view_symbol_names()``: ``thunder.torch._syms_returning_views``, the torch symbols whose outputs alias their
  first input.
- ``softmax_symbol()``: ``thunder.torch._softmax``, the symbol ``torch.softmax`` and ``Tensor.softmax`` trace to
  (``thunder.torch.softmax`` is a function that calls it).
- ``original_module(fn)``: ``ThunderModule._model``, the module ``thunder.jit`` was given (its submodules name
  the allocations of the traces).
- ``sdpa_choice(choice)``: ``thunder.executors.sdpaex._fused_sdp_choice``, which kernel Thunder's sdpa executor
  picks for given inputs, replaced within the context (the prediction on the meta device chooses as CUDA would).

Contracts Thunder keeps but does not document, which the passes rely on (each checked by the tests on the
installed Thunder):

- a forward trace returns ``(output, (saved_for_backward, other))``, and the backward's first argument is that
  ``saved_for_backward`` collection (``C0``), unpacked by ``unpack_sequence``;
- ``thunder.jit`` names a module's parameters ``t_`` followed by their qualified name with dots as underscores;
  ThunderFX names them ``l_self_modules_..._parameters_<name>_``;
- a fusion symbol's ``subsymbols`` are the ops it runs, in order, and its ``is_fusion`` flag is set.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import thunder.torch as ltorch
from thunder.core.module import ThunderModule
from thunder.executors.passes import _update_fusion_call_ctx

# What passes through the door: tests/test_thunder_internals.py checks this list against the module's functions
# and that no other module of the package reaches these names.
PRIVATE_NAMES = (
    "_update_fusion_call_ctx",
    "_implmap",
    "_call_ctx",
    "_syms_returning_views",
    "_softmax",
    "_fused_sdp_choice",
    "_model",
)


def update_fusion(bsym):
    """``bsym``, a fusion whose subsymbols or outputs a pass changed, with its callable compiled again."""
    return _update_fusion_call_ctx(bsym)


def implementations(executor) -> dict:
    """The ops ``executor`` claims: op (a symbol id) -> its ``ImplInfo``."""
    return executor._implmap


def set_implementations(executor, implmap: dict) -> None:
    executor._implmap = implmap


def call_context(bsym) -> dict:
    """The names ``bsym``'s generated code calls -> what they are."""
    return bsym._call_ctx


def renamed_fusion(bsym, sym):
    """The fusion ``bsym`` as the symbol ``sym`` (another name), its callable under the new name."""
    return bsym.from_bsym(sym=sym, _call_ctx={sym.name: bsym._call_ctx[bsym.sym.name]})


def original_module(fn):
    """The module a ``ThunderModule`` compiles (``fn`` itself where it is not one)."""
    return fn._model if isinstance(fn, ThunderModule) else fn


def view_symbol_names() -> frozenset[str]:
    """The names of the torch symbols Thunder knows to return a view of their first input."""
    return frozenset(s.name for s in ltorch._syms_returning_views)


def softmax_symbol():
    """The symbol ``torch.softmax`` traces to."""
    return ltorch._softmax


@contextmanager
def sdpa_choice(choice) -> Iterator[object]:
    """Within the context, Thunder's sdpa executor picks its kernel with ``choice(query, ...)`` (returning an
    ``SpdaBackend``); yields Thunder's ``SpdaBackend`` enum."""
    import thunder.executors.sdpaex as sdpaex

    original = sdpaex._fused_sdp_choice
    sdpaex._fused_sdp_choice = choice
    try:
        yield sdpaex.SpdaBackend
    finally:
        sdpaex._fused_sdp_choice = original
