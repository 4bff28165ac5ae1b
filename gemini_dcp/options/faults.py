"""The fault-injection settings (``GEMINI_DCP_FAULT``, ``GEMINI_DCP_FAULT_LOG``): test hooks, read here only.

:func:`gemini_dcp.core.faults.fault_point` asks :func:`fault_settings` at every phase boundary;
with neither variable set that is two membership tests on ``os.environ``. Torch-free.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import ConfigError
from .env import env_str

__all__ = ["ENV_FAULT", "ENV_FAULT_LOG", "FaultSettings", "FaultSpec", "fault_settings", "parse_fault"]

ENV_FAULT = "GEMINI_DCP_FAULT"  # "<phase>[@<nth>][:<signal>][/<rank>]": kill this process there
ENV_FAULT_LOG = "GEMINI_DCP_FAULT_LOG"  # a directory: every process logs the phases it reached there


@dataclass(frozen=True, slots=True, kw_only=True)
class FaultSpec:
    """Kill with signal ``sig`` the ``nth`` time ``phase`` is reached (only on global ``rank`` if given)."""

    phase: str
    nth: int = 1
    sig: int = int(signal.SIGKILL)
    rank: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class FaultSettings:
    spec: FaultSpec | None
    log_dir: str | None


def parse_fault(text: str) -> FaultSpec:
    """Parse ``<phase>[@<nth>][:<signal>][/<rank>]`` (signal by name, e.g. SIGTERM, or number)."""
    raw = text
    try:
        rank: int | None = None
        if "/" in raw:
            raw, _, r = raw.rpartition("/")
            rank = int(r)
        sig = int(signal.SIGKILL)
        if ":" in raw:
            raw, _, s = raw.partition(":")
            sig = int(signal.Signals(int(s))) if s.isascii() and s.isdigit() else int(getattr(signal, s))
        nth = 1
        if "@" in raw:
            raw, _, n = raw.partition("@")
            nth = int(n)
    except (ValueError, AttributeError):
        raise ConfigError(
            f"{ENV_FAULT}={text!r}: write <phase>[@<nth>][:<signal>][/<rank>], e.g. save.mid_copy@2:SIGTERM/1."
        ) from None
    return FaultSpec(phase=raw, nth=nth, sig=sig, rank=rank)


def fault_settings(environ: Mapping[str, str] | None = None) -> FaultSettings | None:
    """The fault-injection settings, or None when neither variable is set (the production case, ~1 µs)."""
    env = os.environ if environ is None else environ
    if ENV_FAULT not in env and ENV_FAULT_LOG not in env:
        return None
    spec = env_str(ENV_FAULT, None, env)
    return FaultSettings(spec=parse_fault(spec) if spec else None, log_dir=env_str(ENV_FAULT_LOG, None, env))
