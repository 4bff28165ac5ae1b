"""The node-local CPU-memory tier: records and slots of one job in one tier root.

All files live on the node's tmpfs, outside every worker process, so they
survive a SIGKILL of a worker and torchrun's restart of the worker group.
This module does no communication; the writer and reader call it from every
rank, and only a node's *leader* rank (its lowest rank) writes or evicts
records.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

from ..core.config import resolve_job_id, resolve_root
from ..core.faults import fault_point
from ..errors import ChecksumMismatchError, GeminiError, TierFullError, TierRootError
from ..options.local import root_from_env
from ..transport.launch import LaunchInfo
from .job_dir import (
    JobLayout,
    atomic_write_bytes,
    check_root,
    list_jobs,
    read_private_bytes,
    remove_quietly,
)
from .record_codec import read_record, write_record
from .record_types import StepRecord
from .slot_holds import drop_hold, held_slots

log = logging.getLogger(__name__)

_MAX_DECODED = 16  # decoded records kept per LocalTier (newest steps)
RESTORE_MARKER = "restored.json"  # in the job dir: the last restore from this tier (see note_restore)
_warned: set[str] = set()  # odd entries already reported by this process (one warning each)


def _warn_once(key: str, msg: str, *args: object) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(msg, *args)


class LocalTier:
    """One job's files in one node's tier root."""

    def __init__(self, root: str | Path | None = None, job_id: str | None = None, *, create: bool = True) -> None:
        explicit = root is not None and str(root) != "" or _env_root_set()
        self.root = check_root(resolve_root(root), explicit=explicit)
        self.job_id = resolve_job_id(job_id)
        self.layout = JobLayout(self.root, self.job_id)
        self._decoded: dict[int, tuple[tuple[int, int, int, int], StepRecord]] = {}
        self._saving: tuple[int, int | None] | None = None  # (step being saved, G): see begin_save
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
        except (ChecksumMismatchError, EOFError, ValueError, TypeError, AttributeError, OSError, GeminiError) as exc:
            # One odd entry (a directory named like a record, an unreadable or foreign file)
            # must not block every load and save of the job: skipped, reported once.
            _warn_once(
                str(path), "ignoring unreadable step record %s: %s: %s (remove it, or run `gemini-dcp verify`)",
                path, type(exc).__name__, exc,
            )
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
        path = self.layout.record_path(step)
        try:
            return remove_quietly(path)
        except OSError as exc:  # a directory named like a record, a read-only steps dir: reported once
            _warn_once(f"rm:{path}", "cannot remove step record %s: %s", path, exc)
            return False

    def newest_committed_before(self, step: int) -> int | None:
        """The newest step below ``step`` with a readable record on this node (None if none)."""
        for s in reversed(self.steps()):
            if s < step and self.record(s) is not None:
                return s
        return None

    # ---- the save in progress: what no slot choice may overwrite ---------------------------
    def begin_save(self, step: int, global_step: int | None) -> None:
        """Set the step being saved and the newest step known committed on every node.

        ``global_step`` (G) is never overwritten or evicted by this save: until every node
        has committed a newer step, it may be the only step restorable everywhere.
        :meth:`choose_slot` (also called for peer replicas) honours both.
        """
        self._saving = (step, global_step)

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

    def choose_slot(self, rank: int, keep: int, step: int | None = None, global_step: int | None = None) -> int:
        """A slot of ``rank`` (of the ring of ``keep + 1``) to write the step being saved into.

        Never the slot of ``global_step`` (G, the newest step known committed on every node),
        nor of the newest ``keep - 1`` steps after G and below ``step``: those are what stays
        after this save commits, nor (unless nothing else is left) a slot a persistent drain
        still reads in place (:mod:`gemini_dcp.local.slot_holds`). Among the other slots it
        prefers a free one, then one of a step older than G, then one of a step between G and ``step`` (committed here but not
        known everywhere), then one of a step at or after ``step`` (another timeline, or a
        save of this step that this save replaces). ``step``/``global_step`` default to what
        :meth:`begin_save` set. Older records that still point at the chosen slot are deleted
        first, so no record can ever describe bytes that are being overwritten.
        """
        if step is None and self._saving is not None:
            step, global_step = self._saving
        records = {s: r for s in self.steps() if (r := self.record(s)) is not None}
        below = [s for s in records if step is None or s < step]
        protected: set[int] = set()
        if global_step is not None and global_step in records:
            protected.add(global_step)
        after_g = [s for s in below if global_step is None or s > global_step]
        protected.update(sorted(after_g)[-(keep - 1):] if keep > 1 else [])
        if step is None:  # no save context: the newest ``keep`` steps, as before
            protected = set(sorted(records)[-keep:])
        healthy = newest_healthy(records, step)
        if healthy is not None and any(s > healthy and records[s].healthy is False for s in below):
            protected.add(healthy)  # never overwritten for the unhealthy steps after it (gemini_dcp.health)
        holding: dict[int, list[int]] = {}
        for s, rec in records.items():
            slot = rec.slot_of(rank)
            if slot is not None:
                holding.setdefault(slot.slot, []).append(s)

        held = held_slots(self.layout.persist_dir, rank)  # a drain reads them in place (local.slot_holds)

        def cost(idx: int) -> tuple[int, int]:
            steps = holding.get(idx, [])
            if any(s in protected for s in steps):
                return (9, 0)
            if idx in held:
                return (8, 0)
            if not steps:
                return (0, 0)
            newest = max(steps)
            if global_step is not None and newest < global_step:
                return (1, newest)
            if step is None or newest < step:
                return (2, newest)
            return (3, newest)

        slot = min(range(keep + 1), key=lambda i: (cost(i), i))
        if cost(slot)[0] == 9:  # only with the newest healthy step protected besides the ``keep`` others
            raise TierFullError(
                f"rank {rank}: every one of the {keep + 1} slots holds a step that must stay ({sorted(protected)}: "
                f"the newest step committed everywhere, the newest {keep} and the newest healthy step {healthy}); "
                "this save would evict the only healthy step after unhealthy ones. Roll back to it (dcp.load with "
                "checkpoint_id) or raise keep."
            )
        if cost(slot)[0] == 8:
            log.warning(
                "rank %s: every free slot is held by a persistent drain still reading it; reusing slot %s "
                "(that drain finds its bytes changed and abandons its step). Raise keep, or persist less often.",
                rank, slot,
            )
        lost = sorted(s for s in holding.get(slot, []))
        if cost(slot)[0] == 3 and step is not None and _not_abandoned(self, [s for s in lost if s > step]):
            log.warning(
                "rank %s: reusing the slot of steps %s (newer than step %s, never restored in this launch) "
                "for lack of a free slot: those steps are gone from this node.", rank, lost, step,
            )
        for s in lost:
            self.delete_record(s)
        drop_hold(self.layout.persist_dir, rank, slot)  # a drain still reading it (stale or forced) sees it gone
        return slot

    def slot_path(self, rank: int, slot: int) -> Path:
        return self.layout.slot_path(rank, slot)

    # ---- retention -----------------------------------------------------------------------
    def retain(self, keep: int, newest: int, global_step: int | None = None, launch_id: str | None = None,
               healthy_step: int | None = None) -> list[int]:
        """Evict records after ``newest`` was committed on this node; returns the evicted steps.

        Kept: ``newest``, the newest ``keep`` steps up to it, and ``global_step`` (G, the
        newest step known committed on every node: until every node committed a newer one,
        it may be the only step restorable everywhere). Steps *after* ``newest`` are deleted
        only when a restore in launch ``launch_id`` abandoned them (:meth:`note_restore`):
        the job went back to an older step and saves a new timeline. Otherwise they are kept
        (another launch's steps are never deleted just because this one saves older steps).
        ``healthy_step``, the newest healthy step (:mod:`gemini_dcp.health`), is kept however many
        unhealthy steps follow it.
        """
        evicted: list[int] = []
        steps = self.steps()
        abandoned = self.abandoned_steps(launch_id) if launch_id is not None else set()
        timeline = self.timeline(launch_id) if abandoned and launch_id is not None else ""
        for step in steps:
            # An abandoned step is dropped wherever it sits (even below ``newest``: a restart must
            # never fall back into the abandoned timeline), unless this launch saved it anew on its timeline.
            if step in abandoned and step != newest and step != global_step:
                rec = self.record(step)
                anew = rec is not None and rec.launch_id == launch_id and rec.timeline == timeline
                if not anew and self.delete_record(step):
                    evicted.append(step)
        steps = [s for s in steps if s not in evicted]
        newer = [s for s in steps if s > newest]
        if newer:
            _warn_once(
                f"newer:{self.layout.job_dir}:{newer}",
                "job %r in %s holds steps %s, newer than step %s just saved, which no restore in this launch "
                "abandoned: they are kept, and a restart restores the newest restorable step. If they belong to "
                "another run, give each run its own job_id (or remove them: gemini-dcp gc --remove-job).",
                self.job_id, self.root, newer, newest,
            )
        remaining = [s for s in steps if s <= newest]
        for step in remaining[:-keep] if keep < len(remaining) else []:
            if step != newest and step != global_step and step != healthy_step and self.delete_record(step):
                evicted.append(step)
        return evicted

    # ---- restores that abandon newer steps -----------------------------------------------
    def note_restore(self, step: int, launch: LaunchInfo) -> None:
        """Record that launch ``launch`` restored ``step`` from this job (a marker in the job dir).

        The steps newer than ``step`` held on this node at that moment are *abandoned*: the
        job continues from ``step`` on a new timeline, and this launch's first save deletes
        them (:meth:`retain`). Without such a marker newer steps are never deleted.
        Called by the reader on every rank; idempotent.
        """
        newer = [s for s in self.steps() if s > step]
        # The new timeline's id: the same for every rank of this node (the same records), another for
        # each rollback (the abandoned records differ: their creation times and timelines).
        seen = [(s, r.created_unix, r.timeline) for s in newer if (r := self.record(s)) is not None]
        timeline = hashlib.sha256(repr((launch.launch_id, int(step), seen)).encode()).hexdigest()[:16] if newer else ""
        if not newer:  # nothing abandoned: this launch stays on the timeline it saves on
            timeline = self.timeline(launch.launch_id)
        data = {"step": int(step), "launch_id": launch.launch_id, "launch": launch.description, "abandoned": newer,
                "timeline": timeline}
        blob = json.dumps(data, sort_keys=True).encode()
        fault_point("rollback.marker")
        path = self.layout.job_dir / RESTORE_MARKER
        try:
            if read_private_bytes(path) == blob:
                return
        except (OSError, GeminiError):  # absent, or not ours / a link: replaced by our own below
            pass
        atomic_write_bytes(path, blob)

    def record_restore(self, step: int) -> None:
        """:meth:`note_restore` for this process's launch; a failure is logged, never raised
        (the restore goes on; newer steps are then simply kept)."""
        from ..transport.launch import current_launch  # noqa: PLC0415

        try:
            self.note_restore(step, current_launch())
        except Exception as exc:  # noqa: BLE001 - a marker must not fail a load
            log.warning("could not note the restore of step %s in %s: %s", step, self.layout.job_dir, exc)

    def abandoned_steps(self, launch_id: str) -> set[int]:
        """Steps a restore in ``launch_id`` abandoned (empty without such a restore)."""
        data = self._restore_marker()
        if data is None or data.get("launch_id") != launch_id:
            return set()
        return {int(s) for s in data.get("abandoned", []) if isinstance(s, int)}

    def timeline(self, launch_id: str | None) -> str:
        """The timeline launch ``launch_id`` saves on: the id of its last restore that abandoned newer
        steps (:meth:`note_restore`), else "" (recorded in each step record it commits)."""
        data = self._restore_marker()
        if data is None or launch_id is None or data.get("launch_id") != launch_id:
            return ""
        return str(data.get("timeline", ""))

    def superseded_steps(self) -> set[int]:
        """Steps of an abandoned timeline, once a step of the new timeline committed on this node:
        never restored by default (eviction removes them first)."""
        data = self._restore_marker()
        if data is None or not data.get("abandoned"):
            return set()
        launch, timeline = data.get("launch_id"), str(data.get("timeline", ""))
        records = self.records()

        def anew(rec: StepRecord) -> bool:
            return rec.launch_id == launch and rec.timeline == timeline

        if not any(anew(rec) and s > int(data.get("step", -1)) for s, rec in records.items()):
            return set()
        return {int(s) for s in data["abandoned"] if isinstance(s, int) and s in records and not anew(records[s])}

    def newest_healthy(self, upto: int | None = None) -> int | None:
        """The newest step (at most ``upto``) whose record is healthy and checked (None: none)."""
        records = {s: r for s in self.steps() if (upto is None or s <= upto) and (r := self.record(s)) is not None}
        return newest_healthy(records, None if upto is None else upto + 1)

    def _restore_marker(self) -> dict[str, object] | None:
        path = self.layout.job_dir / RESTORE_MARKER
        try:
            data = json.loads(read_private_bytes(path))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, GeminiError) as exc:
            _warn_once(str(path), "ignoring unreadable restore marker %s: %s", path, exc)
            return None
        return data if isinstance(data, dict) else None

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


def newest_healthy(records: dict[int, StepRecord], below: int | None) -> int | None:
    """The newest step below ``below`` among ``records`` that a health check passed (None: none)."""
    good = [s for s, r in records.items() if (below is None or s < below) and r.healthy]
    return max(good) if good else None


def _not_abandoned(tier: LocalTier, steps: list[int]) -> list[int]:
    """Those of ``steps`` that no restore in this launch abandoned."""
    if not steps:
        return []
    from ..transport.launch import current_launch  # noqa: PLC0415

    gone = tier.abandoned_steps(current_launch().launch_id)
    return [s for s in steps if s not in gone]


# ---- one live launch per job and root ---------------------------------------------------------


def _identity(path: Path) -> tuple[int, int, int, int]:
    """What changes when a record file is replaced (by rename: a new inode) or rewritten."""
    st = os.lstat(path)
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)


def _env_root_set() -> bool:
    return root_from_env() is not None


__all__ = ["LocalTier", "TierRootError"]
