"""The peer tier: replicas of each node's checkpoint in other nodes' CPU memory.

Modules by concern: ``placement`` (which nodes hold which copies: pure), ``routes``
(node positions, replication routes: pure), ``push`` (the save side: replicate and
verify), ``fetch`` (the restore side: route, fetch, repair), ``arena`` (receive
buffers). Bytes move only through :mod:`gemini_dcp.transport.p2p`; nothing here
imports the DCP adapters (:mod:`gemini_dcp.dcp`), which call in with narrow values.

Names of the former flat module ``gemini_dcp.peer`` (``gemini_dcp.peer.replicate`` and the
like) resolve on first use, through :mod:`gemini_dcp.peer.replication`.
"""

import importlib
from typing import Any


def __getattr__(name: str) -> Any:
    """An old name of the flat module (imports torch on first use; the face itself does not)."""
    module = importlib.import_module(f"{__name__}.replication")
    try:
        return getattr(module, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
