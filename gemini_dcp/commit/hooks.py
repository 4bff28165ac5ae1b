"""The async path's hooks into one save, as one typed value.

:class:`~gemini_dcp.snapshot.checkpointer.AsyncCheckpointer` (and
``AsyncGeminiStorageWriter``) pace a save's local copy and peer replication into the idle
spans of training, and learn when this rank's bytes are in the tier (to release the
optimizer). They install all of it at once, for one save, and clear it at once::

    writer.hooks = SaveHooks(pace=pacer, replication_pace=rpacer, on_local_copy_done=copied)
    try:
        dcp.save(...)
    finally:
        writer.hooks = NO_HOOKS
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ..core.checksum import BLOCK_BYTES

#: A pacer: called with each block's (message's) size before it is copied (sent); an optional
#: ``block_bytes`` attribute sets that size (see :mod:`gemini_dcp.snapshot.interleave`).
Pacer = Callable[[int], None]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SaveHooks:
    """What the async path adds to a save; every field None is a plain, unpaced save.

    ``pace``: paces the local copy (called before each block is copied).
    ``replication_pace``: paces the peer replication (called before each message is sent);
    when set (and replicas > 1), the slot travels in ``block_bytes``-sized messages.
    ``on_local_copy_done``: called with the step once this rank's bytes are in the tier,
    before the commit collectives (the async snapshot guard releases the optimizer there);
    called even when the local write failed, so a waiter never hangs.
    """

    pace: Pacer | None = None
    replication_pace: Pacer | None = None
    on_local_copy_done: Callable[[int], None] | None = None


#: No hooks: a plain save (what a writer starts with, and what the async path restores).
NO_HOOKS = SaveHooks()


def block_bytes(pace: Pacer | None) -> int:
    """The block (message) size ``pace`` asks for; the unpaced default when it names none."""
    return int(getattr(pace, "block_bytes", 0) or BLOCK_BYTES)
