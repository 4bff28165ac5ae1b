"""The newest step gemini_dcp can restore, asked before loading (collective): **the** way to resume.

Every rank calls it on a launch; ``None`` means there is nothing to resume (a fresh start, not an
error), otherwise it is the step to pass to ``dcp.load`` (or ``gemini_dcp.fast_load``)::

    reader = GeminiStorageReader(job_id="run1")
    step = newest_restorable_step(reader)            # all ranks; None: nothing to resume
    if step is not None:
        dcp.load(state_dict, storage_reader=reader, checkpoint_id=step)

No caller catches ``dcp.load``'s ``CheckpointException`` (a ``BaseException`` that wraps the backend's
error) to find out that a job has no checkpoint yet. A trainer that also keeps checkpoints elsewhere
(torchtitan's ``<folder>/step-<N>``) passes ``has_fallback=True`` and picks the newer source
(:func:`gemini_dcp.integrations.resume.choose_resume`). This runs the reader's restore decision — the
same one ``dcp.load`` runs: local and peer memory, and the persistent tier when the reader has one —
and reports its step without reading a byte of state.
"""

from __future__ import annotations

import logging

from ..errors import CheckpointNotFoundError, GeminiError
from .reader import GeminiStorageReader

log = logging.getLogger(__name__)


def newest_restorable_step(
    reader: GeminiStorageReader, step: int | None = None, *, has_fallback: bool = False
) -> int | None:
    """The newest step ``reader`` can restore (or ``step``, if given and restorable), else None.

    Collective: every rank of the job must call this, with the same ``step`` and ``has_fallback``.
    None when gemini_dcp holds no committed step of the job (or not ``step``). When steps exist but none
    can be restored (every copy of some shard lost): with ``has_fallback`` (the caller has another source,
    e.g. a checkpoint folder) a warning is logged and None returned, else the reader's error is raised.
    The decision is the same on every rank, so every rank returns (or raises) alike.
    """
    try:
        reader.reset(step)  # with a step, the decision runs here
        if step is None:
            reader.read_metadata()
    except CheckpointNotFoundError:  # StepNotFoundError included
        return None
    except GeminiError as exc:
        if not has_fallback:
            raise
        log.warning("gemini_dcp cannot restore job %r (%s); resuming from the other source.", reader.job_id, exc)
        return None
    return reader.decided_step


__all__ = ["newest_restorable_step"]
