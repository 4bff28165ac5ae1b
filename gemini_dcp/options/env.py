"""Typed reads of the ``GEMINI_DCP_*`` environment variables: the only place that parses them.

Each getter returns the default when the variable is unset or blank, and raises
:class:`~gemini_dcp.errors.ConfigError` naming the variable, the value and what it accepts
otherwise, so a bad value fails where the option is built (before any side effect), never
later inside a detached process. Torch-free.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TypeVar

from ..errors import ConfigError

__all__ = ["PREFIX", "env_bool", "env_choice", "env_float", "env_int", "env_str", "raw"]

PREFIX = "GEMINI_DCP_"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
T = TypeVar("T", int, float)


def raw(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The stripped value of ``name``, or None when unset or blank."""
    value = (os.environ if environ is None else environ).get(name)
    if value is None or not value.strip():
        return None
    return value.strip()


def env_str(name: str, default: str | None = None, environ: Mapping[str, str] | None = None) -> str | None:
    """``name`` as a string (stripped), or ``default``."""
    value = raw(name, environ)
    return default if value is None else value


def _number(name: str, kind: type[T], default: T, minimum: T | None, environ: Mapping[str, str] | None) -> T:
    value = raw(name, environ)
    if value is None:
        return default
    try:
        out = kind(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not a{'n integer' if kind is int else ' number'}; "
                          f"set it to one (default {default}) or unset it.") from None
    if minimum is not None and out < minimum:
        raise ConfigError(f"{name}={value!r} is below {minimum}; set it to at least {minimum} "
                          f"(default {default}) or unset it.")
    return out


def env_int(name: str, default: int, *, minimum: int | None = None, environ: Mapping[str, str] | None = None) -> int:
    """``name`` as an int ≥ ``minimum``, or ``default``."""
    return _number(name, int, default, minimum, environ)


def env_float(name: str, default: float, *, minimum: float | None = None,
              environ: Mapping[str, str] | None = None) -> float:
    """``name`` as a float ≥ ``minimum``, or ``default``."""
    return _number(name, float, default, minimum, environ)


def env_bool(name: str, default: bool = False, environ: Mapping[str, str] | None = None) -> bool:
    """``name`` as a flag: 1/true/yes/on or 0/false/no/off (any case), or ``default``."""
    value = raw(name, environ)
    if value is None:
        return default
    low = value.lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ConfigError(f"{name}={value!r} is not a flag; set it to 1 or 0 (or unset it).")


def env_choice(name: str, choices: Sequence[str], default: str, environ: Mapping[str, str] | None = None,
               *, aliases: Mapping[str, str] | None = None) -> str:
    """``name`` as one of ``choices`` (case-insensitive; ``aliases`` map other spellings), or ``default``."""
    value = raw(name, environ)
    if value is None:
        return default
    low = value.lower()
    low = (aliases or {}).get(low, low)
    if low not in choices:
        raise ConfigError(f"{name}={value!r} is not one of {', '.join(choices)}; set one of them or unset it.")
    return low
