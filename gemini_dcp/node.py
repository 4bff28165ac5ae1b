"""The tiers of this node, opened once from a :class:`~gemini_dcp.options.GeminiOptions`.

:func:`open_tiers` is the one place the DCP adapters (writer and reader) turn the options tree
into the node's local tier, its node id and, when a store is configured, its persistent tier:
the writer opens the store writable (the access probe writes), the reader read-only. Nothing
here starts a process or takes a lock; the writer adds what only a save needs (launch lock,
slot pool, commit protocol, drain) on top.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .core.config import resolve_node_id
from .local.tier import LocalTier
from .options.tree import GeminiOptions

if TYPE_CHECKING:
    from .persistent.store import PersistentTier

__all__ = ["NodeTiers", "open_tiers"]


@dataclass(frozen=True, slots=True)
class NodeTiers:
    """This node's tiers for one job: the local tier, the node's id, the persistent tier or None."""

    tier: LocalTier
    node_id: str
    persistent: PersistentTier | None


def open_tiers(options: GeminiOptions, *, writable: bool) -> NodeTiers:
    """Open the local tier (creating the job's directory) and, when ``options.persistent.url`` is
    set, the persistent tier with every store call bounded by ``options.persistent_timeout_s``
    (``writable``: probe write access, for a writer). Raises what the tiers raise on a bad root
    or an unreachable store."""
    root = options.local.root
    tier = LocalTier(None if root is None else Path(root), options.local.job_id)
    node_id = options.local.node_id or resolve_node_id(tier.root)
    persistent = None
    p = options.persistent
    if p.url is not None:
        from .persistent.store import PersistentTier  # noqa: PLC0415 - optional tier (fsspec)

        persistent = PersistentTier(
            str(p.url),
            tier.job_id,
            keep=p.keep,
            keep_every=p.keep_every,
            writable=writable,
            storage_options=dict(p.storage_options) if p.storage_options is not None else None,
            timeout_s=options.persistent_timeout_s,
        )
    return NodeTiers(tier, node_id, persistent)
