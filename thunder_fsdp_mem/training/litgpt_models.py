"""litgpt models for the report, the benchmarks and the tests: a configuration by name with overrides, and the
model with its loss so that one jitted program holds the whole step.

Configurations come from ``litgpt.Config.from_name``; no weights are downloaded (models start from random
initialisation, which does not change memory).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from litgpt import GPT, Config

from thunder_fsdp_mem.loss.modules import LossModel
from thunder_fsdp_mem.window_mask import vectorize_window_masks

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """A litgpt configuration by name and the overrides we apply to it.

    name: a litgpt configuration name (``litgpt.Config.from_name``).
    n_layers: number of transformer blocks (None keeps the configuration's).
    block_size: sequence length of the step (also the model's block size).
    overrides: further ``Config`` fields as (name, value) pairs, to shrink a model for tests.
    vectorized_window_masks: sliding-window attention with its mask built by one comparison
        (``window_mask.vectorize_window_masks``), bit for bit litgpt's mask without its Python loop.
    """

    name: str
    n_layers: int | None = None
    block_size: int = 2048
    overrides: tuple[tuple[str, object], ...] = ()
    vectorized_window_masks: bool = False

    def __post_init__(self) -> None:
        if self.n_layers is not None and (not isinstance(self.n_layers, int) or self.n_layers < 1):
            raise ValueError(f"ModelSpec.n_layers must be a positive int, got {self.n_layers!r}")
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"ModelSpec.block_size must be a positive int, got {self.block_size!r}")

    @classmethod
    def from_config(cls, config: Config, *, block_size: int) -> ModelSpec:
        """The spec of a litgpt ``config`` known by name, with every field it changes from the named one as an
        override, at ``block_size`` tokens."""
        from litgpt.config import name_to_config

        if config.name not in name_to_config:
            raise ValueError(
                f"litgpt configuration {config.name!r} is not known by name (Config.from_name): "
                "start from a named one and change its fields"
            )
        named = Config.from_name(config.name, block_size=block_size)
        changed = tuple(
            (f.name, getattr(config, f.name))
            for f in dataclasses.fields(Config)
            if f.init
            and f.name not in ("name", "block_size", "n_layer")
            and getattr(config, f.name) != getattr(named, f.name)
        )
        n_layers = config.n_layer if config.n_layer != named.n_layer else None
        return cls(name=config.name, n_layers=n_layers, block_size=block_size, overrides=changed)

    def gpt(self) -> GPT:
        """The litgpt model of this spec on the current default device, in float32 (the mask fix applied where
        asked)."""
        gpt = GPT(self.config())
        if self.vectorized_window_masks:
            vectorize_window_masks(gpt)
        return gpt

    def config(self) -> Config:
        kwargs = dict(self.overrides)
        if self.n_layers is not None:
            kwargs["n_layer"] = self.n_layers
        try:
            return Config.from_name(self.name, block_size=self.block_size, **kwargs)
        except ValueError as e:
            raise ValueError(f"unknown litgpt model {self.name!r}: {e}") from None


def parse_overrides(pairs: list[str]) -> tuple[tuple[str, int], ...]:
    """``FIELD=INT`` strings (a benchmark's repeated ``--override``) as ``ModelSpec.overrides``; ValueError names
    the one that is not of that form."""
    out = []
    for pair in pairs:
        key, _, value = pair.partition("=")
        if not key or not value.removeprefix("-").isdigit():
            raise ValueError(f"--override takes FIELD=INT, got {pair!r}")
        out.append((key, int(value)))
    return tuple(out)


def build(
    spec: ModelSpec, *, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu", seed: int = 0
) -> LossModel:
    """The model of ``spec`` with its loss, on ``device`` in ``dtype``, deterministically initialised."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = LossModel(spec.gpt())
    return model.to(dtype)


def batch(
    spec: ModelSpec, *, micro_batch_size: int = 1, device: str | torch.device = "cpu", seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids and targets of shape (micro_batch_size, block_size); on the meta device, their shapes alone
    (no host memory for a long sequence)."""
    cfg = spec.config()
    shape = (micro_batch_size, spec.block_size)
    if torch.device(device).type == "meta":
        return torch.empty(shape, dtype=torch.int64, device="meta"), torch.empty(
            shape, dtype=torch.int64, device="meta"
        )
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, cfg.padded_vocab_size, shape, generator=g).to(device)
    targets = torch.randint(0, cfg.padded_vocab_size, shape, generator=g).to(device)
    return idx, targets
