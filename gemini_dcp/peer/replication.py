"""The former ``gemini_dcp.peer.replication`` module: its names, now at their places by concern.

- :mod:`gemini_dcp.peer.routes`: node positions and replication routes (pure);
- :mod:`gemini_dcp.peer.push`: the save side (replicate, verify received replicas);
- :mod:`gemini_dcp.peer.fetch`: the restore side (route, fetch, repair, persistent fallback);
- :mod:`gemini_dcp.peer.arena`: the receive buffers of a restore round;
- :mod:`gemini_dcp.transport.p2p`: every point-to-point transfer.

Import from those modules in new code (patch a name where it is used: in its module).
"""

from ..transport.p2p import messages as _messages  # noqa: F401 - the former private name (tests/test_interleave.py)
from .arena import ReceiveArena
from .fetch import (
    MAX_REPAIR_ROUNDS,
    Inflight,
    Staging,
    Tally,
    assign_sources,
    fetch_remote,
    finish_transfer,
    raise_unservable,
    refs_by_key,
    start_transfer,
)
from .push import Replicated, node_order, replicate
from .routes import ItemKey, SlotReport, choose_order, replication_routes

__all__ = [
    "MAX_REPAIR_ROUNDS",
    "Inflight",
    "ItemKey",
    "ReceiveArena",
    "Replicated",
    "SlotReport",
    "Staging",
    "Tally",
    "assign_sources",
    "choose_order",
    "fetch_remote",
    "finish_transfer",
    "node_order",
    "raise_unservable",
    "refs_by_key",
    "replicate",
    "replication_routes",
    "start_transfer",
]
