"""The node-local CPU-memory tier: records and slots of one job in one tier root.

All files live on the node's tmpfs, outside every worker process, so they
survive a SIGKILL of a worker and torchrun's restart of the worker group.
This module does no communication; the writer and reader call it from every
rank, and only a node's *leader* rank (its lowest rank) writes or evicts
records.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from .config import resolve_job_id, resolve_root
from .errors import ChecksumMismatchError, TierRootError
from .layout import JobLayout, check_root, list_jobs, remove_quietly
from .records import StepRecord, read_record, write_record

log = logging.getLogger(__name__)

_MAX_DECODED = 16  # decoded records kept per LocalTier (newest steps)


class LocalTier:
    """One job's files in one node's tier root."""

    def __init__(self, root: str | Path | None = None, job_id: str | None = None, *, create: bool = True) -> None:
        explicit = root is not None and str(root) != "" or _env_root_set()
        self.root = check_root(resolve_root(root), explicit=explicit)
        self.job_id = resolve_job_id(job_id)
        self.layout = JobLayout(self.root, self.job_id)
        self._decoded: dict[int, tuple[tuple[int, int, int, int], StepRecord]] = {}
        if create:
            self.layout.create()

    # ---- records -------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Steps that have a record on this node, ascending (records are only written once committed)."""
        return self.layout.record_steps()

    def record(self, step: int) -> StepRecord | None:
        """The record of ``step`` on this node; None if absent or corrupt (logged)."""
        path = self.layout.record_path(step)
        try:
            ident = _identity(path)
            hit = self._decoded.get(step)
            if hit is not None and hit[0] == ident:
                return hit[1]
            rec = read_record(path)
        except FileNotFoundError:
            self._decoded.pop(step, None)
            return None
        except (ChecksumMismatchError, EOFError, ValueError, TypeError, AttributeError) as exc:
            log.warning("ignoring unreadable step record %s: %s", path, exc)
            return None
        # Records are only ever replaced by rename (a new inode), so the file's identity
        # says whether the decoded copy is current; a save reads 4+ records, and decoding
        # one (unpickling the DCP metadata) costs milliseconds.
        self._decoded[step] = (ident, rec)
        if len(self._decoded) > _MAX_DECODED:
            for old in sorted(self._decoded)[: len(self._decoded) - _MAX_DECODED]:
                del self._decoded[old]
        return rec

    def records(self) -> dict[int, StepRecord]:
        out: dict[int, StepRecord] = {}
        for step in self.steps():
            rec = self.record(step)
            if rec is not None:
                out[step] = rec
        return out

    def write_record(self, record: StepRecord) -> None:
        self.layout.create()
        path = self.layout.record_path(record.step)
        write_record(path, record)
        self._decoded[record.step] = (_identity(path), record)

    def delete_record(self, step: int) -> bool:
        return remove_quietly(self.layout.record_path(step))

    # ---- slots ---------------------------------------------------------------------------
    def slots_in_use(self, rank: int, keep: int) -> dict[int, int]:
        """slot -> step for ``rank``'s slots referenced by the newest ``keep`` records."""
        used: dict[int, int] = {}
        for step in self.steps()[-keep:]:
            rec = self.record(step)
            if rec is None:
                continue
            s = rec.slot_of(rank)
            if s is not None:
                used[s.slot] = step
        return used

    def choose_slot(self, rank: int, keep: int) -> int:
        """A slot of ``rank`` not holding any of the newest ``keep`` steps.

        Older records that still point at the chosen slot are deleted first, so
        no record can ever describe bytes that are being overwritten.
        """
        used = self.slots_in_use(rank, keep)
        slot = min(i for i in range(keep + 1) if i not in used)
        for step in self.steps():
            rec = self.record(step)
            s = rec.slot_of(rank) if rec is not None else None
            if s is not None and s.slot == slot:
                self.delete_record(step)
        return slot

    def slot_path(self, rank: int, slot: int) -> Path:
        return self.layout.slot_path(rank, slot)

    # ---- retention -----------------------------------------------------------------------
    def retain(self, keep: int, newest: int) -> list[int]:
        """Evict records beyond the newest ``keep``, after ``newest`` was committed.

        Records of steps *after* ``newest`` belong to an abandoned timeline (the
        job restored an older step and saved again) and are dropped as well.
        ``newest`` itself is never evicted.
        """
        evicted: list[int] = []
        steps = self.steps()
        for step in steps:
            if step > newest and self.delete_record(step):
                evicted.append(step)
        remaining = [s for s in steps if s <= newest]
        for step in remaining[:-keep] if keep < len(remaining) else []:
            if step != newest and self.delete_record(step):
                evicted.append(step)
        return evicted

    def usage_bytes(self) -> int:
        total = 0
        for rank in self.layout.ranks_present():
            for path in self.layout.slot_files(rank).values():
                try:
                    total += path.stat().st_blocks * 512
                except FileNotFoundError:
                    continue
        return total

    def remove_job(self) -> None:
        """Delete every file of this job on this node (a finished job)."""
        shutil.rmtree(self.layout.job_dir, ignore_errors=False)

    def other_jobs(self) -> list[str]:
        return [j for j in list_jobs(self.root) if j != self.job_id]


def _identity(path: Path) -> tuple[int, int, int, int]:
    """What changes when a record file is replaced (by rename: a new inode) or rewritten."""
    st = os.stat(path)
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)


def _env_root_set() -> bool:
    from .config import ENV_ROOT

    return bool(os.environ.get(ENV_ROOT))


__all__ = ["LocalTier", "TierRootError"]
