"""This node's parts, built once from a :class:`~gemini_dcp.options.GeminiOptions`: the composition root.

:func:`open_tiers` is the one place the DCP adapters (writer and reader) turn the options tree
into the node's local tier, its node id and, when a store is configured, its persistent tier:
the writer opens the store writable (the access probe writes), the reader read-only; it starts
no process and takes no lock. :func:`open_save_node` builds on it what a save needs — the launch
lock, the commit protocol, the slot pool, the copy engine (with the carry tracker of incremental
saves), the parity slots, the replica memory of delta replication and the drain to the persistent
tier — so the writer (and everything built on it: ``AsyncCheckpointer``, the integrations) holds
parts it did not assemble. The parts talk to each other through the objects handed in here, never
back to the writer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .core.config import resolve_node_id
from .local.tier import LocalTier
from .options.tree import GeminiOptions

if TYPE_CHECKING:
    from .commit.protocol import CommitProtocol
    from .commit.slot_pool import SlotPool
    from .peer.delta import ReplicaMemory
    from .peer.parity import ParitySlots
    from .persistent.drain.client import Drainer
    from .persistent.store import PersistentTier
    from .save.local_write import LocalWriter
    from .transport.launch import LaunchInfo

__all__ = ["NodeTiers", "SaveNode", "open_save_node", "open_tiers"]


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


@dataclass(slots=True)
class SaveNode:
    """What a save needs on this node (:func:`open_save_node`), one per writer."""

    tiers: NodeTiers
    launch: LaunchInfo
    """This process's launch (agreed by the ranks, or this process alone before a group exists)."""
    launch_release: Callable[[], Any]
    """Drops this writer's hold on the launch lock (called when the writer goes, or to move it)."""
    launch_bound: bool
    """Whether ``launch`` is the ranks' agreed launch (False: re-bound at the first save)."""
    commit: CommitProtocol
    slot_pool: SlotPool
    local_writer: LocalWriter
    """The copy engine (step 2 of a save), with the carry tracker of incremental saves."""
    parity_slots: ParitySlots
    replica_memory: ReplicaMemory | None
    """What this node's replica slots hold (delta replication of incremental saves), or None."""
    drainer: Drainer | None
    """The drain of committed steps to the persistent tier, or None without one."""


def open_save_node(options: GeminiOptions, owner: object, launch: LaunchInfo) -> SaveNode:
    """Build a writer's parts from its validated ``options`` for ``launch`` (this process's:
    :func:`gemini_dcp.transport.launch.current_launch`); ``owner`` is the writer, whose life bounds
    its hold on the launch lock.

    Opens the tiers writable, holds the launch lock (:class:`~gemini_dcp.errors.JobConflictError`
    if another live launch uses the job), and, with a persistent tier, resumes the drains a
    previous worker generation left pending and starts the node's drain server, so the first due
    step finds it running.
    """
    import os  # noqa: PLC0415 - the save side's parts import torch: only when a writer is built

    from .commit.protocol import CommitProtocol, NodeIdentity  # noqa: PLC0415
    from .commit.slot_pool import SlotPool  # noqa: PLC0415
    from .local.launch_lock import hold_launch_lock  # noqa: PLC0415
    from .peer.delta import ReplicaMemory  # noqa: PLC0415
    from .peer.parity import ParitySlots  # noqa: PLC0415
    from .save.carry import CarryTracker  # noqa: PLC0415
    from .save.local_write import LocalWriter  # noqa: PLC0415
    from .transport.launch import launch_known  # noqa: PLC0415

    tiers = open_tiers(options, writable=True)
    tier = tiers.tier
    # The ranks agree on the launch's identity over the default group's store; a writer built before
    # the group exists holds the lock of its process (or torchrun's environment) and moves to the
    # agreed one at its first save.
    release = hold_launch_lock(tier, launch, owner)
    st = os.stat(tier.root)
    identity = NodeIdentity(node_id=tiers.node_id, host=launch.host, root_id=(st.st_dev, st.st_ino),
                            launch_id=launch.launch_id, launch_description=launch.description,
                            failure_domain=options.failure_domain or "")
    commit = CommitProtocol(tier, identity, options)
    commit.parity = options.peer.parity_group is not None
    commit.nonfinite = options.nonfinite  # the health check of each step (gemini_dcp.health)
    slot_pool = SlotPool(tier, keep=options.local.keep, capacity_bytes=options.local.capacity_bytes)
    incremental = options.incremental.enabled
    carry = CarryTracker(options.incremental, history=options.local.keep + 2) if incremental else None
    local_writer = LocalWriter(slot_pool, carry)
    local_writer.count_nonfinite = options.nonfinite != "ignore"
    drainer = None
    if tiers.persistent is not None:
        from .persistent.drain.client import Drainer  # noqa: PLC0415 - optional tier

        p = options.persistent
        drainer = Drainer(tier, tiers.persistent, p.every, options=p.drain, keep=options.local.keep)
        drainer.resume()  # drains left pending by a previous worker generation
        drainer.start_early()  # the first due step finds its drain running (torch imported)
    return SaveNode(
        tiers=tiers, launch=launch, launch_release=release, launch_bound=launch_known(), commit=commit,
        slot_pool=slot_pool, local_writer=local_writer, parity_slots=ParitySlots(tier.layout.rank_dir),
        replica_memory=ReplicaMemory() if incremental and options.peer.replicas > 1 else None, drainer=drainer,
    )
