"""``thunder_internals``, the one door to Thunder's private names: what passes through it is listed
(``PRIVATE_NAMES``, so that a new use is a visible change), no other module of the package or its benchmarks reaches
those names, each works on the installed Thunder, and the undocumented contracts the passes rely on hold."""

import ast
from pathlib import Path

import thunder
import thunder.torch as ltorch
import torch
from thunder.executors.torch_compile import torch_compile_ex

from thunder_fsdp_mem import thunder_internals as door

ROOT = Path(__file__).resolve().parent.parent
DOOR = ROOT / "thunder_fsdp_mem" / "thunder_internals.py"


def _private_names(tree: ast.AST) -> set[str]:
    """Names starting with one underscore that ``tree`` imports from Thunder or reads as attributes."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("thunder"):
            found |= {a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")}
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            found.add(node.attr)
    return found


def test_what_passes_through_the_door_is_listed():
    assert _private_names(ast.parse(DOOR.read_text())) == set(door.PRIVATE_NAMES)


def test_no_other_module_reaches_thunders_private_names():
    for path in [*(ROOT / "thunder_fsdp_mem").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]:
        if path == DOOR:
            continue
        reached = _private_names(ast.parse(path.read_text())) & set(door.PRIVATE_NAMES)
        assert not reached, (str(path.relative_to(ROOT)), reached)


def test_each_works_on_the_installed_thunder():
    claimed = door.implementations(torch_compile_ex)
    assert claimed and all(hasattr(info, "symbol") for info in claimed.values())
    assert {"view", "transpose", "permute"} <= door.view_symbol_names()
    softmax = thunder.trace()(lambda x: ltorch.softmax(x, -1), torch.randn(2, 3))
    assert door.softmax_symbol() in [b.sym for b in softmax.bound_symbols]
    import thunder.executors.sdpaex as sdpaex

    before = sdpaex._fused_sdp_choice
    with door.sdpa_choice(lambda *a, **k: "chosen") as backends:
        assert sdpaex._fused_sdp_choice() == "chosen" and hasattr(backends, "MATH")
    assert sdpaex._fused_sdp_choice is before


def test_the_contracts_the_passes_rely_on_hold():
    # The forward returns (output, (saved_for_backward, other)); the backward's first argument is that saved
    # collection; thunder.jit names a module's parameters t_ + their qualified name with dots as underscores.
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
    jitted = thunder.jit(model)
    jitted(torch.randn(2, 4, requires_grad=True)).sum().backward()
    forward, backward = thunder.last_traces(jitted)[-1], thunder.last_backward_traces(jitted)[-1]
    output, (saved, _) = forward.bound_symbols[-1].args
    assert isinstance(output, dict) and "output" in output and len(saved) > 0
    first = backward.bound_symbols[0]  # saved_for_backward, cotangents: C0, C1 = saved_for_backward
    assert first.sym.name == "unpack_trivial" and first.output.name == "saved_for_backward"
    assert [p.name for p in backward.args[0][0]] == [p.name for p in saved]
    assert {"t_0_weight", "t_0_bias"} <= {a.name for a in forward.args if hasattr(a, "name")}
