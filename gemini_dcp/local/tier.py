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
from typing import Any

from ..core.config import resolve_job_id, resolve_root
from ..core.faults import fault_point
from ..core.timelines import ROOT, Lineage
from ..errors import ChecksumMismatchError, GeminiError, TierFullError, TierRootError
from ..options.local import root_from_env
from ..transport.launch import LaunchInfo
from .job_dir import (
    JobLayout,
    atomic_write_bytes,
    check_root,
    ensure_private_dir,
    list_jobs,
    read_private_bytes,
    remove_quietly,
)
from .record_codec import read_record, write_record
from .record_types import StepRecord
from .slot_holds import drop_hold, held_slots

log = logging.getLogger(__name__)

_MAX_DECODED = 16  # decoded records kept per LocalTier (newest steps)
TIMELINES = "timelines.json"  # in the job dir: the job's lineage as this node knows it (core.timelines)
RESTORES_DIR = "restores"  # in the job dir: one marker per launch that restored (see note_restore)
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
        it may be the only step restorable everywhere). ``newest`` was saved by launch
        ``launch_id``: a rollback of that launch (:meth:`note_restore`) takes effect now (the
        job's lineage, :mod:`gemini_dcp.core.timelines`, becomes the launch's), and every step of
        an abandoned timeline is dropped wherever it sits (a restart must never fall back into
        it). Steps *after* ``newest`` of the live history are kept (another launch's steps are
        never deleted just because this one saves older steps). ``healthy_step``, the newest
        healthy step (:mod:`gemini_dcp.health`), is kept however many unhealthy steps follow it.
        """
        evicted: list[int] = []
        lineage = self.launch_lineage(launch_id) if launch_id is not None else self.lineage()
        self._commit_lineage(lineage, launch_id)
        steps = self.steps()
        for step in steps:
            rec = self.record(step)
            if rec is not None and not lineage.live(step, rec.timeline) and step != newest and step != global_step:
                if self.delete_record(step):
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

    # ---- timelines: restores that abandon newer steps ------------------------------------
    def lineage(self) -> Lineage:
        """The job's live history as this node knows it (:mod:`gemini_dcp.core.timelines`): the
        rollbacks a step of their new timeline committed here (or that this node learnt from a
        restore); the root lineage when there were none."""
        return read_lineage(self.layout.job_dir)

    def _commit_lineage(self, lineage: Lineage, launch_id: str | None) -> None:
        """Make ``lineage`` this node's (only ever a newer one); prune other launches' restore markers
        that can no longer apply (a reader's, a dead launch's: one per restart otherwise)."""
        current = self.lineage()
        if lineage.gen > current.gen:
            atomic_write_bytes(self.layout.job_dir / TIMELINES, json.dumps(lineage.to_json(), sort_keys=True).encode())
            current = lineage
        lineage = current
        mine = self._marker_path(launch_id)
        for path in self._marker_files():
            if path == mine:
                continue
            data = _read_json(path)
            lin = Lineage.from_json(data.get("lineage")) if data is not None else None
            if lin is None or lin.gen <= lineage.gen:
                remove_quietly(path)

    def note_restore(self, step: int, launch: LaunchInfo, lineage: Lineage) -> None:
        """Record that launch ``launch`` restored ``step``, after which the job's history is
        ``lineage`` (a marker of that launch in ``restores/``; idempotent, called on every rank).

        The marker changes nothing by itself: a restore by a process that never saves (an eval
        sidecar, a notebook) leaves the live job's history and saves alone. A lineage newer
        than the node's takes effect when the launch commits its next save (:meth:`retain`):
        from then on the steps it abandoned are never restored and are evicted first.
        """
        data = {"step": int(step), "launch_id": launch.launch_id, "launch": launch.description,
                "lineage": lineage.to_json()}
        blob = json.dumps(data, sort_keys=True).encode()
        fault_point("rollback.marker")
        path = self._marker_path(launch.launch_id)
        try:
            if read_private_bytes(path) == blob:
                return
        except (OSError, GeminiError):  # absent, or not ours / a link: replaced by our own below
            pass
        ensure_private_dir(path.parent)
        atomic_write_bytes(path, blob)

    def record_restore(self, step: int, lineage: Lineage) -> None:
        """:meth:`note_restore` for this process's launch; a failure is logged, never raised
        (the restore goes on; the job's history then stays as it was)."""
        from ..transport.launch import current_launch  # noqa: PLC0415

        try:
            self.note_restore(step, current_launch(), lineage)
        except Exception as exc:  # noqa: BLE001 - a marker must not fail a load
            log.warning("could not note the restore of step %s in %s: %s", step, self.layout.job_dir, exc)

    def last_restore(self, launch_id: str) -> int | None:
        """The step launch ``launch_id`` last restored from this job (None: it restored none)."""
        data = _read_json(self._marker_path(launch_id))
        step = None if data is None else data.get("step")
        return step if isinstance(step, int) and not isinstance(step, bool) else None

    def launch_lineage(self, launch_id: str | None) -> Lineage:
        """The history launch ``launch_id`` saves on: its last restore's lineage when that is newer
        than the node's (a rollback not yet committed), else the node's."""
        mine = self.lineage()
        data = _read_json(self._marker_path(launch_id)) if launch_id is not None else None
        lin = Lineage.from_json(data.get("lineage")) if data is not None else None
        return lin if lin is not None and lin.gen > mine.gen else mine

    def timeline(self, launch_id: str | None) -> str:
        """The timeline launch ``launch_id`` saves on (recorded in each step record it commits)."""
        return self.launch_lineage(launch_id).tip

    def superseded_steps(self) -> set[int]:
        """Steps held here whose timeline this node's lineage abandoned: never restored by default."""
        lineage = self.lineage()
        return {s for s, rec in self.records().items() if not lineage.live(s, rec.timeline)}

    def newest_healthy(self, upto: int | None = None) -> int | None:
        """The newest step (at most ``upto``) whose record is healthy and checked (None: none)."""
        records = {s: r for s in self.steps() if (upto is None or s <= upto) and (r := self.record(s)) is not None}
        return newest_healthy(records, None if upto is None else upto + 1)

    def _marker_path(self, launch_id: str | None) -> Path:
        tag = hashlib.sha256(str(launch_id).encode()).hexdigest()[:16]
        return self.layout.job_dir / RESTORES_DIR / f"{tag}.json"

    def _marker_files(self) -> list[Path]:
        try:
            return sorted((self.layout.job_dir / RESTORES_DIR).glob("*.json"))
        except OSError:
            return []

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
    """Those of ``steps`` that the history this launch saves on keeps (no rollback abandoned them)."""
    if not steps:
        return []
    from ..transport.launch import current_launch  # noqa: PLC0415

    lineage = tier.launch_lineage(current_launch().launch_id)
    return [s for s in steps if (rec := tier.record(s)) is None or lineage.live(s, rec.timeline)]


def read_lineage(job_dir: Path) -> Lineage:
    """The lineage in ``job_dir``'s timeline file (:meth:`LocalTier.lineage`; the root one when absent or
    unreadable, reported once). Also read by the drain, which stores it beside each step it commits."""
    path = job_dir / TIMELINES
    try:
        raw = read_private_bytes(path)
    except FileNotFoundError:
        return ROOT
    except (OSError, GeminiError) as exc:
        _warn_once(str(path), "ignoring unreadable timeline file %s: %s", path, exc)
        return ROOT
    lin = Lineage.from_json(raw)
    if lin is None:
        _warn_once(f"bad:{path}", "ignoring timeline file %s: not a lineage written by gemini_dcp", path)
        return ROOT
    return lin


def _read_json(path: Path) -> dict[str, Any] | None:
    """A small JSON object of ours in the job dir (None: absent or unreadable, reported once)."""
    try:
        data = json.loads(read_private_bytes(path))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, GeminiError) as exc:
        _warn_once(str(path), "ignoring unreadable restore marker %s: %s", path, exc)
        return None
    return data if isinstance(data, dict) else None


# ---- one live launch per job and root ---------------------------------------------------------


def _identity(path: Path) -> tuple[int, int, int, int]:
    """What changes when a record file is replaced (by rename: a new inode) or rewritten."""
    st = os.lstat(path)
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)


def _env_root_set() -> bool:
    return root_from_env() is not None


__all__ = ["LocalTier", "TierRootError"]
