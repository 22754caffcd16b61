"""The litgpt functions whose behaviour the package reproduces, each with the digest of the source it was checked
against (litgpt 0.5.13), so that a litgpt whose code differs is noticed instead of silently diverged from:

- ``GPT.forward``: ``LossModel`` runs its layers itself, the way ``GPT.forward`` does in training;
- ``CausalSelfAttention.forward``: ``vectorize_window_masks`` hands it the sliding-window mask its loop builds.

A function whose source differs, or that cannot be read, is not relied on: the caller falls back to litgpt's own
code and warns once. ``tests/test_litgpt_source.py`` checks each reproduction against litgpt bit for bit.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import inspect
import warnings

CHECKED = {
    "GPT.forward": "d872e5128a9b2b9a",
    "CausalSelfAttention.forward": "71b001eb30a4b820",
}


def digest(fn) -> str | None:
    """The first 16 hex digits of the SHA-256 of ``fn``'s source, None when its source cannot be read."""
    try:
        return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()[:16]
    except (OSError, TypeError):
        return None


@functools.cache
def is_checked(fn) -> bool:
    """Whether ``fn`` is the litgpt function of ``CHECKED`` it names, with the source checked; warns once if not."""
    name = fn.__qualname__
    if digest(fn) == CHECKED.get(name):
        return True
    try:
        version = importlib.metadata.version("litgpt")
    except importlib.metadata.PackageNotFoundError:
        version = "(version unknown)"
    warnings.warn(
        f"thunder_fsdp_mem: litgpt {version}'s {name} is not the one checked (litgpt 0.5.13); using litgpt's own code "
        "for it (docs/design.md, 'What the package takes from litgpt')",
        stacklevel=3,
    )
    return False
