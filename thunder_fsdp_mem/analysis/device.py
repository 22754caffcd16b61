"""The device a trace runs on: its tensors' own, or, for a trace made on the meta device (the predictions of
``predict/``), the device ``as_on`` names. What depends on it: which casts fold (``passes/casts.py``) and how AdamW
steps (``optimizer.anticipated_adamw_step``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

_target: ContextVar[str | None] = ContextVar("thunder_fsdp_mem.device.as_on", default=None)


@contextmanager
def as_on(device_type: str) -> Iterator[None]:
    """Within it, a trace made on the meta device is taken for one that runs on ``device_type``."""
    token = _target.set(device_type)
    try:
        yield
    finally:
        _target.reset(token)


def device_type(tensor) -> str | None:
    """The type of the device ``tensor`` (a ``TensorProxy``) runs on: its own, or for a meta tensor the one
    ``as_on`` names (None outside it)."""
    on = tensor.device.type
    return _target.get() if on == "meta" else on
