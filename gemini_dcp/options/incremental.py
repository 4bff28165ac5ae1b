"""Options of incremental saves: copy (and send) only what changed since a slot was last written.

``GEMINI_DCP_INCREMENTAL`` (a flag) and ``GEMINI_DCP_FULL_EVERY`` (an int >= 1) are read by
:meth:`IncrementalOptions.from_env` only (``GeminiOptions.from_env()``); docs/incremental.md has
the design and why the default stays off. Torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import ConfigError
from .env import env_bool, env_int, raw

__all__ = ["ENV_FULL_EVERY", "ENV_INCREMENTAL", "IncrementalOptions"]

ENV_INCREMENTAL = "GEMINI_DCP_INCREMENTAL"
ENV_FULL_EVERY = "GEMINI_DCP_FULL_EVERY"


@dataclass(frozen=True, kw_only=True, slots=True)
class IncrementalOptions:
    """Whether saves carry unchanged items forward, and how often a full save is forced.

    ``enabled`` (writer keyword ``incremental``): copy only the items whose tensor changed since
    the slot was last written, and of sharded embedding tables only the changed rows.
    ``full_every``: with ``enabled``, every K-th save of a writer copies every item (K >= 1;
    None: only when the change rule requires it). It bounds how long a change the rule cannot
    see (a write through ``.data``, a fused optimizer: docs/incremental.md) stays unsaved, and
    refreshes the whole base every K saves.
    """

    enabled: bool = False
    full_every: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ConfigError(f"incremental={self.enabled!r}: pass True or False (default False).")
        k = self.full_every
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ConfigError(
                f"full_every={k!r}: pass a positive int (a full save every K saves, e.g. full_every=10) or None."
            )
        if k is not None and not self.enabled:
            raise ConfigError(
                f"full_every={k} only applies to incremental saves: pass incremental=True with it, or drop it."
            )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "IncrementalOptions":
        """``$GEMINI_DCP_INCREMENTAL`` (1/0) and ``$GEMINI_DCP_FULL_EVERY`` (K >= 1); unset: off, None."""
        enabled = env_bool(ENV_INCREMENTAL, False, environ)
        full_every = env_int(ENV_FULL_EVERY, 0, minimum=1, environ=environ) if raw(ENV_FULL_EVERY, environ) else None
        if full_every is not None and not enabled:
            raise ConfigError(
                f"{ENV_FULL_EVERY}={full_every} only applies to incremental saves: set {ENV_INCREMENTAL}=1 too, "
                f"or unset {ENV_FULL_EVERY}."
            )
        return cls(enabled=enabled, full_every=full_every)
