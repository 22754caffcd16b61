"""``FSDPMemoryPlugin``: the transform offered the way Thunder offers its FSDP, DDP and FP8, as a ``thunder.Plugin``
for ``thunder.compile(model, plugins=[...])``, by object or by its registered name (``fsdp-memory``, registered
when this module is imported)::

    import thunder
    from thunder_fsdp_mem import FSDPMemoryPlugin, MemoryConfig

    model = thunder.compile(model, plugins=[FSDPMemoryPlugin()])        # thunder.jit's interpreter
    model = thunder.compile(model, plugins=["fsdp", "fsdp-memory"])     # after Thunder's FSDP plugin
    model = thunder.compile(model, recipe=BaseRecipe(interpreter="thunder.fx", fuser="torch.compile"),
                            plugins=[FSDPMemoryPlugin(MemoryConfig(memory_budget=60 * 2**30))])  # ThunderFX

Its policy is ``POST``: the transform comes after every transform of the recipe and of the ``PRE`` plugins (Thunder's
FSDP among them), as it must (it reads the traces FSDP made). It adds no executor and no lookaside: it keeps the
recipe's executors and, where a fusion executor listed ahead of an attention executor would decompose attention,
keeps attention on that attention executor itself (``MemoryConfig.route_attention``). ``plugin.transforms`` lists
the transforms it made (one per ``thunder.compile``), whose ``summary()`` says what each did.
"""

from __future__ import annotations

import thunder.plugins
from thunder.core.recipe import Plugin, PluginPolicy

from thunder_fsdp_mem.config import MemoryConfig
from thunder_fsdp_mem.transform import FSDPMemoryTransform

NAME = "fsdp-memory"


class FSDPMemoryPlugin(Plugin):
    """``FSDPMemoryTransform(config)`` as a Thunder plugin (see the module's docstring); ``config`` None: the
    defaults."""

    policy = PluginPolicy.POST

    def __init__(self, config: MemoryConfig | None = None):
        self.config = config if config is not None else MemoryConfig()
        self.transforms: list[FSDPMemoryTransform] = []

    def setup_transforms(self) -> list[FSDPMemoryTransform]:
        transform = FSDPMemoryTransform(self.config)
        self.transforms.append(transform)
        return [transform]


thunder.plugins.register_plugin(NAME, FSDPMemoryPlugin)
