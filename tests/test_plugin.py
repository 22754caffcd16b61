"""``FSDPMemoryPlugin``: the transform through Thunder's own way in, ``thunder.compile(model, plugins=[...])``, by
object and by its registered name, under both interpreters: the results are those of Thunder without it, bit for
bit, and the transform comes after every transform of the recipe and of the plugins before it."""

import pytest
import thunder
import torch
from thunder.core.recipe import Plugin, Recipe
from thunder.core.transform_common import Transform

from thunder_fsdp_mem import FSDPMemoryPlugin, FSDPMemoryTransform, MemoryConfig
from thunder_fsdp_mem.plugin import NAME


class _Marker(Transform):
    pass


class _Before(Plugin):  # a plugin of the default policy (PRE), as Thunder's FSDP plugin is
    def setup_transforms(self):
        return [_Marker()]


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))


def _step(compiled):
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    out = compiled(x)
    out.sum().backward()
    return out.detach(), [p.grad for p in compiled.parameters()]


@pytest.mark.parametrize("interpreter", ["thunder.jit", "thunder.fx"])
def test_the_plugin_keeps_thunders_results_and_comes_last(interpreter):
    # Thunder's own recipe with no fusion executor (its BaseRecipe asks for nvFuser or torch.compile): what a
    # recipe holds is the plugins and the interpreter.
    plain_out, plain_grads = _step(thunder.compile(_model(), recipe=Recipe(plugins=None, interpreter=interpreter)))
    plugin = FSDPMemoryPlugin(MemoryConfig(strict=True))
    recipe = Recipe(plugins=None, interpreter=interpreter)
    compiled = thunder.compile(_model(), recipe=recipe, plugins=[plugin, _Before()])
    out, grads = _step(compiled)
    assert torch.equal(out, plain_out) and all(torch.equal(a, b) for a, b in zip(grads, plain_grads))
    (transform,) = plugin.transforms
    assert transform.pairs == 1 and transform.config.strict
    # PRE plugins' transforms first, then ours (ThunderFX appends its prologue transform to the list after them).
    assert [type(t) for t in recipe.transforms][:2] == [_Marker, FSDPMemoryTransform]


def test_the_plugin_by_its_registered_name():
    assert thunder.plugins.get_plugin(NAME) is FSDPMemoryPlugin
    recipe = Recipe(plugins=None)
    out, _ = _step(thunder.compile(_model(), recipe=recipe, plugins=[NAME]))
    assert any(isinstance(t, FSDPMemoryTransform) for t in recipe.transforms)
    assert out.shape == (16, 4)
