"""Command-line pieces the benchmarks share: ``UsageError`` and ``UsageParser`` (a parser that raises it, so that
``main`` prints one line and returns 2 instead of argparse's exit), and ``add_override`` (litgpt fields that shrink a
model).
"""

from __future__ import annotations

import argparse


class UsageError(Exception):
    """Input the user can correct; ``main`` prints it as one line and exits 2."""


class UsageParser(argparse.ArgumentParser):
    def error(self, message: str):
        raise UsageError(message)


def add_override(p: argparse.ArgumentParser) -> None:
    """``--override FIELD=INT``, repeatable: a litgpt ``Config`` field (``litgpt_models.parse_overrides``)."""
    p.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="FIELD=INT",
        help="litgpt Config field to override (repeatable), e.g. n_embd=128, to shrink a model",
    )
