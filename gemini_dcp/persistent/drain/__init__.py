"""Background drain of committed steps from node memory to the persistent tier.

How a step gets from CPU memory to the store (per node, no funnel through rank 0):

1. **Request** (training path, a file write): once a step is committed in memory, the
   node's leader rank (its lowest rank) *holds* the step's slots of the saving ranks that
   ran on this node (:mod:`gemini_dcp.local.slot_holds`: the writer's slot choice leaves
   them alone), writes ``persist/requests/step-N.json`` (a :class:`~.request.DrainRequest`
   naming those slots and holds), hard-links the step record next to it, and makes sure a
   drain server runs (:mod:`.client`; the writer already started one when it was built).
2. **Stage** (server, at once, no torch): a request the server can upload now is read in
   place from its held slots; one that waits behind another upload is copied into
   ``persist/stage/step-N/`` (:mod:`.stage`, ``copy_file_range``) and its holds dropped.
3. **Upload** (:mod:`.upload`): each item is written as ``torch.save`` bytes into
   ``__<rank>_<k>.distcp`` in the store, its checksum computed in the pass that writes it
   and compared with the saved one (:mod:`.fused`; progress is recorded per file in
   ``progress.json``, so a killed server resumes where it stopped). Then the holds are
   dropped and the node writes its part marker ``.gemini/part-<node>.pkl``.
4. **Commit**: a node that finds every item of the step covered by the markers
   writes ``.metadata`` (last); the node of saving rank 0 also polls for late
   parts. Then retention runs.

The server (:mod:`.server`) is a **detached process** started by module name
(``python -m gemini_dcp.persistent.drain.server``, in its own session: torchrun killing
the worker group does not stop it, and it shares no GIL with training). It holds an
``flock`` on ``persist/daemon.lock`` (:mod:`.lock`; one per node and job), exits after
``DrainOptions.idle_s`` (``$GEMINI_DCP_DRAIN_IDLE_S``, 60 s) with nothing to do, and is
started again by the next request or by a writer constructed (after a restart, it
resumes any request left on tmpfs). A SIGKILLed server holds its lock until the kernel
has closed its files, which can outlast a worker restart: a writer that resumes pending
requests while the lock is held starts a *standby* server (at most one) that waits for
the lock. ``memory://`` stores live inside one process, so for them (or with drain mode
``thread``) the server is a thread of the training process instead. The server a writer starts
when it is built imports torch *before* it takes the lock (holding ``warming.lock``): a step due
meanwhile is served by a *bridge*, a thread of the training process that holds the lock only
until that server is warm (:func:`.server.warm_then_serve`), so the first durable save of a
process does not wait for a fresh interpreter's ``import torch``. If a drain is
slower than the save cadence, a newer request supersedes an older one that has not
started uploading (coalescing). :mod:`.status` reads what the drain did, for ``inspect``;
:func:`.client.wait_durable` (``GeminiStorageWriter.wait_persisted``) waits for a step's commit.

This face imports no torch: the trainer-side and upload names resolve on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from .paths import Paths
from .request import DrainConfig, DrainRequest, Progress, SlotRef, StoreTarget
from .status import drain_status, drain_summary, read_config, server_pid, wait_idle

# Names of the heavier modules (the client and the upload import torch), resolved on first use.
_LAZY: dict[str, tuple[str, str]] = {
    "Drainer": ("client", "Drainer"),
    "ensure_server": ("client", "ensure_server"),
    "write_request": ("client", "write_request"),
    "server_command": ("client", "server_command"),
    "serve": ("server", "serve"),
    "main": ("server", "main"),
    "adoption_marker_id": ("upload", "adoption_marker_id"),
    "load_progress": ("upload", "load_progress"),
    "SPLIT_BYTES": ("upload", "SPLIT_BYTES"),
}


def __getattr__(name: str) -> Any:
    try:
        module, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    return getattr(importlib.import_module(f"{__name__}.{module}"), attr)


__all__ = [
    "DrainConfig", "DrainRequest", "Paths", "Progress", "SlotRef", "StoreTarget", "drain_status", "drain_summary",
    "read_config", "server_pid", "wait_idle", *_LAZY,
]
