"""The versions of torch, lightning-thunder and litgpt the package supports (the ranges of its installed metadata,
which ``pyproject.toml`` states) against those installed. ``outside()`` lists each one outside its range; importing
the package says so in one line (``check``), naming the versions, since the package reads Thunder's traces and
internals that change between releases."""

from __future__ import annotations

import importlib.metadata
import warnings

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

DISTRIBUTION = "thunder-fsdp-mem"
CHECKED = ("torch", "lightning-thunder", "litgpt")


def outside() -> list[str]:
    """``name version (supported: range)`` for each of ``CHECKED`` installed outside the range the package states;
    [] when the package runs from a checkout that was never installed (no metadata to read)."""
    try:
        requirements = importlib.metadata.requires(DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        return []
    found = []
    for text in requirements:
        requirement = Requirement(text)
        if requirement.marker is not None or canonicalize_name(requirement.name) not in CHECKED:
            continue
        try:
            version = importlib.metadata.version(requirement.name)
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{requirement.name} not installed (supported: {requirement.specifier})")
            continue
        if not requirement.specifier.contains(version, prereleases=True):
            found.append(f"{requirement.name} {version} (supported: {requirement.specifier})")
    return found


def check() -> None:
    """One warning line when ``outside()`` finds anything."""
    found = outside()
    if found:
        warnings.warn(
            f"thunder_fsdp_mem {importlib.metadata.version(DISTRIBUTION)} is not made for this environment: "
            + "; ".join(found),
            stacklevel=3,
        )
