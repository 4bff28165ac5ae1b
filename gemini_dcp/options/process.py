"""Options of the process's own exit: the only reader of ``GEMINI_DCP_EXIT_WAIT_S``.

``GEMINI_DCP_EXIT_WAIT_S``
    how long, at most, an exiting process waits for gloo's worker threads to go idle before the
    interpreter finalizes (:mod:`gemini_dcp.transport.exit_guard`); default 2 s, ``0`` turns the
    wait off. A value that is not a number >= 0 falls back to the default: an exit hook must never
    turn a clean exit into an error.

Torch-free: reading the options never imports torch.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..errors import ConfigError
from .env import env_float

__all__ = ["EXIT_WAIT_S", "exit_wait_s"]

EXIT_WAIT_S = 2.0


def exit_wait_s(environ: Mapping[str, str] | None = None) -> float:
    """The exit guard's limit in seconds (``environ`` defaults to ``os.environ``)."""
    try:
        return env_float("GEMINI_DCP_EXIT_WAIT_S", EXIT_WAIT_S, minimum=0.0, environ=environ)
    except ConfigError:
        return EXIT_WAIT_S
