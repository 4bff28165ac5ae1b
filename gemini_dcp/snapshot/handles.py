"""One asynchronous save's handle, the async path's error, and the checkpoint control group.

:class:`SnapshotHandle` is what ``AsyncCheckpointer.save()`` returns (and what the
``dcp.async_save`` stager keeps for its guard): ``copied`` is set once this rank's bytes
are in the tier (the guard), ``finished`` once the step is committed on every node.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from ..errors import GeminiError
from .pacer import Pacer

__all__ = ["AsyncCheckpointError", "SnapshotHandle", "checkpoint_group"]


class AsyncCheckpointError(GeminiError):
    """A background checkpoint failed; ``__cause__`` is the original error."""


def checkpoint_group(process_group: Any = None, timeout_s: float = 300.0, scope: str = "") -> Any:
    """The dedicated gloo control group for the ranks of ``process_group`` (default WORLD) in ``scope``.

    Collective on first use (``new_group``): call it on every rank, from the
    training thread, before the first async save. Returns None without an
    initialized process group or with a single rank.
    """
    from ..transport.comm import get_comm  # noqa: PLC0415

    return get_comm(timeout_s, process_group, scope=scope).group


class SnapshotHandle:
    """One asynchronous save. ``wait_copied()``: this rank's bytes are in the tier;
    ``wait()``: the step is committed on every node (returns DCP's Metadata)."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.copied = threading.Event()
        self.finished = threading.Event()
        self.error: BaseException | None = None
        self.metadata: Any = None
        self.skipped = False
        self.t_submit = time.perf_counter()
        self.blocked_s: float = 0.0  # time save() held the caller
        self.started_s: float | None = None  # submit -> background save started
        self.copy_s: float | None = None  # background start -> local copy done
        self.total_s: float | None = None  # submit -> committed
        self.guard_wait_s: float = 0.0  # time the training thread waited for this copy
        self.cpu_s: float | None = None  # CPU time of the background save thread
        self.pacer_stats: dict[str, Any] | None = None
        self.replication_pacer_stats: dict[str, Any] | None = None
        self._surfaced = False  # its error was raised to the caller (once)
        # Its error was handled where every rank handles it alike: save(), wait() or close() (they know the save
        # finished on every rank), not only by a wait_copied() that happened to find it finished on this rank.
        self._settled = False
        self._pacer: Pacer | None = None
        self._replication_pacer: Pacer | None = None
        self._hurry = False  # someone is blocked on this save's copy: do not pace it
        self._hurry_replication = False  # someone is blocked on its commit: do not pace anything

    def hurry(self, *, replication: bool = True) -> None:
        """Copy (and, with ``replication``, send to peers) the rest at full speed.

        Flags are set before the pacers are read; the worker checks them after setting a pacer.
        """
        self._hurry = True
        if replication:
            self._hurry_replication = True
        for p in (self._pacer, self._replication_pacer if replication else None):
            if p is not None:
                p.hurry()

    def done(self) -> bool:
        return self.finished.is_set()

    def _raise(self, *, settle: bool = True) -> None:
        if self.error is not None and settle:
            self._settled = True
        if self.error is not None and not self._surfaced:
            self._surfaced = True
            raise AsyncCheckpointError(
                f"asynchronous checkpoint of step {self.step} failed: {type(self.error).__name__}: {self.error}"
            ) from self.error

    def wait_copied(self, timeout: float | None = None, *, surface: bool = True) -> None:
        if not self.copied.is_set():
            self.hurry(replication=False)
            t = time.perf_counter()
            ok = self.copied.wait(timeout)
            self.guard_wait_s += time.perf_counter() - t
            if not ok:
                raise AsyncCheckpointError(
                    f"step {self.step}: the local copy did not finish within {timeout} s "
                    "(a rank stopped checkpointing, or the save failed before its copy started)"
                )
        if surface and self.finished.is_set():
            self._raise(settle=False)  # finished here by chance: the next save() still settles it (see there)

    def wait(self, timeout: float | None = None) -> Any:
        if not self.finished.wait(timeout):
            raise AsyncCheckpointError(f"step {self.step}: the checkpoint did not commit within {timeout} s")
        self._raise()
        return self.metadata

    def as_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "skipped": self.skipped,
            "blocked_s": self.blocked_s,
            "started_s": self.started_s,
            "copy_s": self.copy_s,
            "total_s": self.total_s,
            "guard_wait_s": self.guard_wait_s,
            "cpu_s": self.cpu_s,
            "pacer": self.pacer_stats,
            "replication_pacer": self.replication_pacer_stats,
            "error": None if self.error is None else repr(self.error),
        }
