"""The health check of saved steps: what a save does with NaN/Inf values (``nonfinite``).

``"mark"`` (default): every save counts the non-finite values of its floating-point items and
commits; a step holding more of them than the newest healthy step is marked unhealthy, and a
restore passes over it. ``"refuse"``: such a save fails with
:class:`~gemini_dcp.errors.UnhealthyStateError` on every rank and commits nothing. ``"ignore"``:
nothing is counted, and every step counts as healthy. ``GEMINI_DCP_NONFINITE`` sets it when the
writer's keyword is left at its default (docs/health.md). Torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal, cast

from .checks import check_choice
from .env import raw

__all__ = ["ENV_NONFINITE", "NONFINITE_MODES", "NonfiniteMode", "check_nonfinite", "nonfinite_from_env"]

ENV_NONFINITE = "GEMINI_DCP_NONFINITE"
NonfiniteMode = Literal["mark", "refuse", "ignore"]
NONFINITE_MODES: tuple[str, ...] = ("mark", "refuse", "ignore")


def check_nonfinite(value: object, name: str = "nonfinite") -> NonfiniteMode:
    """``value`` if it is a mode, else ConfigError saying what to give."""
    return cast(NonfiniteMode, check_choice(
        value, name, NONFINITE_MODES,
        "choose 'mark' (default: commit, mark the step unhealthy, restores skip it), 'refuse' (fail the save with "
        "UnhealthyStateError, commit nothing) or 'ignore' (no check).",
    ))


def nonfinite_from_env(environ: Mapping[str, str] | None = None) -> NonfiniteMode:
    """``$GEMINI_DCP_NONFINITE`` (mark/refuse/ignore); unset: ``"mark"``."""
    value = raw(ENV_NONFINITE, environ)
    return "mark" if value is None else check_nonfinite(value.lower(), ENV_NONFINITE)
