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

import collections
import threading

# The newest GeminiErrors created in this process. torch >= 2.13's dcp.load turns a
# failure of ``StorageReader.read_metadata`` into ``AssertionError(f"...: {exc}")``,
# keeping only the message (no __cause__/__context__), so find_gemini_error has to
# recognize our error by its message there.
_RECENT: "collections.deque[GeminiError]" = collections.deque(maxlen=16)
_RECENT_LOCK = threading.Lock()


class GeminiError(Exception):
    """Root of every error raised by gemini_dcp."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        with _RECENT_LOCK:
            _RECENT.append(self)


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


def find_gemini_error(exc: BaseException) -> GeminiError | None:
    """Return the first :class:`GeminiError` inside ``exc``.

    Looks at ``exc`` itself, its ``__cause__``/``__context__`` chain, and, for a
    DCP ``CheckpointException``, at every rank's wrapped failure. Where DCP kept
    only the message of our error (``read_metadata`` failures in torch >= 2.13),
    the error this process raised with that message is returned.
    """
    seen: set[int] = set()
    stack: list[BaseException] = [exc]
    messages: list[str] = []
    while stack:
        cur = stack.pop()
        if id(cur) in seen:
            continue
        seen.add(id(cur))
        if isinstance(cur, GeminiError):
            return cur
        messages.append(str(cur))
        failures = getattr(cur, "failures", None)
        if isinstance(failures, dict):
            for wrapped in failures.values():
                inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
                if isinstance(inner, BaseException):
                    stack.append(inner)
        for nxt in (cur.__cause__, cur.__context__):
            if nxt is not None:
                stack.append(nxt)
    with _RECENT_LOCK:
        recent = list(_RECENT)
    for err in reversed(recent):
        text = str(err)
        if text and any(text in m for m in messages):
            return err
    return None
