"""The exception hierarchy of gemini_dcp.

Every error the package raises on purpose derives from :class:`GeminiError`, and
its message says what happened *and* what to do about it.

Note on ``dcp.save`` / ``dcp.load``: DCP runs the storage layer's planning and
I/O steps inside its own collective wrappers and re-raises any failure as a
``torch.distributed.checkpoint.api.CheckpointException`` that carries each
rank's original exception. Errors detected before DCP's wrappers run (in the
writer/reader constructors and in ``reset(checkpoint_id)``) reach the caller
unwrapped; use :func:`find_gemini_error` to get ours out of a
``CheckpointException``.
"""

from __future__ import annotations


class GeminiError(Exception):
    """Root of every error raised by gemini_dcp.

    ``from_another_rank``: True on the error a rank raises only because another rank failed (so that
    every rank leaves a collective step together); that rank's own error says what happened, and
    :func:`find_gemini_error` prefers it.
    """

    from_another_rank: bool = False


def mark_from_another_rank(err: GeminiError) -> GeminiError:
    """Mark ``err`` as raised only because another rank failed (see :class:`GeminiError`); returns it."""
    err.from_another_rank = True
    return err


class ConfigError(GeminiError, ValueError):
    """An argument or environment setting is invalid."""


class InvalidStepError(ConfigError):
    """A ``checkpoint_id`` that is not a training step (a non-negative int)."""


class TierRootError(GeminiError):
    """A tier root is missing, not a directory, or not writable."""


class TierFullError(GeminiError):
    """The tier has not enough free space (or budget) for the checkpoint."""


class CheckpointNotFoundError(GeminiError):
    """No committed checkpoint (for this job, or for this step) can be found."""


class StepNotFoundError(CheckpointNotFoundError):
    """The requested step is not committed in any reachable tier."""


class ChecksumMismatchError(GeminiError):
    """Stored bytes do not match the checksum recorded at save time."""


class ShardUnavailableError(GeminiError):
    """Some shards of a step are held by no reachable copy."""


class WorldSizeError(GeminiError):
    """The process layout does not match what an operation needs."""


class PeerError(GeminiError):
    """Peer replication or a peer transfer failed or timed out."""


class PersistentTierError(GeminiError):
    """The persistent (fsspec) tier is unreachable, misconfigured or failed."""


class UntrustedDataError(GeminiError):
    """Bytes read back from a tier root, a peer or a store are not ours to trust.

    Raised for a file owned by another user, a planted symbolic link, a group- or
    world-writable directory, or a record/side file whose content names anything
    but the classes a gemini_dcp record may hold (it is never unpickled).
    """


class JobConflictError(ConfigError):
    """Another live job (another launch) uses the same tier root and job id."""


class CheckpointMismatchError(GeminiError):
    """The state dict being loaded does not match the checkpoint (keys, shapes, dtypes)."""


class IncompatibleCheckpointError(GeminiError):
    """The checkpoint was written in a format (or by a torch) the running code cannot read."""


class RestartRequiredError(PeerError):
    """The checkpoint control group is broken (a peer timed out or died): the job must restart."""


class UnhealthyStateError(GeminiError):
    """A save with ``nonfinite="refuse"`` found more NaN/Inf values than the newest healthy step held: nothing was committed."""


def find_gemini_error(exc: BaseException) -> GeminiError | None:
    """Return the first :class:`GeminiError` inside ``exc``, preferring a rank's own error to one
    raised only because another rank failed (``from_another_rank``).

    Looks at ``exc`` itself, its ``__cause__``/``__context__`` chain, and, for a
    DCP ``CheckpointException``, at every rank's wrapped failure. (A ``read_metadata``
    failure reaches DCP's wrapper as the object itself on every supported torch: the
    reader re-raises it from ``set_up_storage_reader``, see ``compat.failed_metadata``.)
    """
    seen: set[int] = set()
    stack: list[BaseException] = [exc]
    echo: GeminiError | None = None
    while stack:
        cur = stack.pop()
        if id(cur) in seen:
            continue
        seen.add(id(cur))
        if isinstance(cur, GeminiError) and cur.from_another_rank:
            echo = echo or cur  # the rank that failed first may be further in: keep looking
        elif isinstance(cur, GeminiError):
            return cur
        failures = getattr(cur, "failures", None)
        if isinstance(failures, dict):
            for wrapped in failures.values():
                inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
                if isinstance(inner, BaseException):
                    stack.append(inner)
        for nxt in (cur.__cause__, cur.__context__):
            if nxt is not None:
                stack.append(nxt)
    return echo
