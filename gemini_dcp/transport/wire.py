"""What the control group's object collectives send: pickles decoded without running code.

``torch.distributed.all_gather_object`` and ``broadcast_object_list`` unpickle whatever arrives with
``pickle.Unpickler``: a process that is not one of the job's ranks but reached the group (a stale
worker of an earlier launch on a reused port, a misconfigured job on the same MASTER_ADDR), or a
corrupted frame, would run code in every rank. :class:`~gemini_dcp.transport.comm.Comm`'s object
collectives send the same pickles but decode them with
:func:`gemini_dcp.core.safe_pickle.restricted_loads`, resolving only :data:`CONTROL_GLOBALS` (the
classes gemini_dcp's control messages hold: node views, decisions, tallies, peer slots) beside the
record and DCP metadata classes; an announced length over :data:`MAX_OBJECT_BYTES` is refused
before anything is allocated for it.

Keep :data:`CONTROL_GLOBALS` to plain value classes of gemini_dcp and torch's checkpoint metadata
(see the rules in :mod:`gemini_dcp.core.safe_pickle`).
"""

from __future__ import annotations

import pickle
from collections.abc import Collection
from typing import Any

from ..core.safe_pickle import restricted_loads
from ..errors import UntrustedDataError

#: The globals gemini_dcp's control messages may name, beyond the record and DCP metadata classes
#: of :data:`gemini_dcp.core.safe_pickle.ALLOWED_GLOBALS`. Plain containers, numbers, strings and
#: bytes need no entry.
CONTROL_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        ("gemini_dcp.core.restore_order", "NodeView"),  # the reader's restore decision: each node's view
        ("gemini_dcp.core.restore_order", "StepView"),
        ("gemini_dcp.peer.fetch", "Tally"),  # the restore's agreement rounds
        ("gemini_dcp.restore.fast_plan", "FastEntry"),  # fast_load's routing of chunks another node holds
    }
)

#: The longest pickle a rank may announce in one object collective (a step record of 100,000 items
#: pickles to tens of MiB): a longer announcement is a foreign or corrupt frame.
MAX_OBJECT_BYTES = 1 << 30


def encode(obj: Any) -> bytes:
    """``obj`` as the bytes an object collective sends."""
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes, source: str, allowed: Collection[tuple[str, str]] = CONTROL_GLOBALS) -> Any:
    """The object ``data`` holds, resolving only ``allowed`` beside the record and DCP metadata classes
    (UntrustedDataError otherwise)."""
    return restricted_loads(data, source=source, allowed=allowed)


def checked_length(what: str, lengths: list[int], limit: int) -> int:
    """The longest of the pickle lengths the ranks announced, or UntrustedDataError when one is 0 or over
    ``limit`` (every rank sees the same lengths, so all refuse together, before allocating anything)."""
    longest = max(lengths)
    if longest <= 0 or longest > limit:
        bad = [r for r, n in enumerate(lengths) if n <= 0 or n > limit]
        raise UntrustedDataError(
            f"{what}: group ranks {bad} announced {longest} bytes, not a gemini_dcp control message "
            f"(1 to {limit} bytes); nothing was allocated or decoded. A process that is not this job's (or a "
            "corrupted frame) is on the checkpoint control group: check that every rank runs the same "
            "gemini_dcp and that MASTER_ADDR/MASTER_PORT are this job's own."
        )
    return longest
