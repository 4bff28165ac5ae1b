"""Options of the peer tier: how many copies of each node's shards, placed where, and what a failed copy does.

Torch-free. The wire message size of a paced replication follows the async checkpointer's
pacer (``gemini_dcp.snapshot``), not an option here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .checks import check_choice, check_int

__all__ = ["OnPeerFailure", "PeerOptions", "PlacementStrategy"]

PlacementStrategy = Literal["mixed", "group", "ring"]
OnPeerFailure = Literal["raise", "degrade"]


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerOptions:
    """``replicas`` counts the node's own copy (1: local only; 2: one peer copy)."""

    replicas: int = 1
    placement: PlacementStrategy = "mixed"
    on_peer_failure: OnPeerFailure = "raise"

    def __post_init__(self) -> None:
        check_int(self.replicas, "replicas", minimum=1, fix=(
            "replicas counts the node's own copy, so it must be an int >= 1 (2 = one extra copy on a peer node)."))
        check_choice(self.placement, "placement", ("mixed", "group", "ring"),
                     "choose 'mixed' (default), 'group' or 'ring'.")
        check_choice(self.on_peer_failure, "on_peer_failure", ("raise", "degrade"),
                     "choose 'raise' (fail the save) or 'degrade' (commit with fewer replicas and warn).")
