"""Shared validators of option values: each raises ConfigError saying what to give instead. Torch-free."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

from ..errors import ConfigError

__all__ = [
    "DEFAULT_TIMEOUT_S", "check_choice", "check_int", "check_number", "check_optional_int", "check_path", "check_timeout",
]

DEFAULT_TIMEOUT_S = 300.0
"""Seconds every checkpoint collective, peer transfer and store call may take before it fails (``timeout_s``)."""


def check_timeout(timeout_s: object, name: str = "timeout_s") -> float:
    """``timeout_s`` as a float if it is a positive, finite number of seconds, else ConfigError."""
    if (
        isinstance(timeout_s, bool)
        or not isinstance(timeout_s, (int, float))
        or not math.isfinite(timeout_s)
        or not timeout_s > 0
    ):
        raise ConfigError(
            f"{name}={timeout_s!r}: give a positive, finite number of seconds (default 300); "
            "an infinite wait would hang a save or load forever on a dead peer or store."
        )
    return float(timeout_s)


def check_int(value: object, name: str, *, minimum: int, fix: str) -> int:
    """``value`` if it is an int (not a bool) ``>= minimum``, else ConfigError ``"<name>=<value>: <fix>"``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name}={value!r}: {fix}")
    return value


def check_optional_int(value: object, name: str, *, minimum: int, fix: str) -> int | None:
    """None, or ``value`` checked as :func:`check_int`."""
    return None if value is None else check_int(value, name, minimum=minimum, fix=fix)


def check_number(value: object, name: str, *, minimum: float, fix: str) -> float:
    """``value`` as a float if it is a finite real number (not a bool) ``>= minimum``, else ConfigError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < minimum:
        raise ConfigError(f"{name}={value!r}: {fix}")
    return float(value)


def check_choice(value: object, name: str, choices: Sequence[str], fix: str) -> str:
    """``value`` if it is one of ``choices``, else ConfigError ``"<name>=<value>: <fix>"``."""
    if not isinstance(value, str) or value not in choices:
        raise ConfigError(f"{name}={value!r}: {fix}")
    return value


def check_path(value: object, name: str, fix: str) -> None:
    """Refuse anything but None, a str or an os.PathLike."""
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise ConfigError(f"{name}={value!r} is a {type(value).__name__}, not a path: {fix}")
