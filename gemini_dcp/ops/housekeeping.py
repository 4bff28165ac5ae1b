"""Freeing a tier's memory by hand: ``gc`` (evict old steps, free unused slot files) and ``remove``.

Both leave a live job alone and ``gc`` never evicts the newest committed step. A job is live
when a launch holds its launch lock (:func:`gemini_dcp.local.launch_lock.live_launches`: the
kernel's lock on the tmpfs inode, seen from any container or PID namespace sharing the memory
volume) or when a process this namespace can see has its files open or mapped (``/proc``).
Touching a live job needs ``force``.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from ..errors import ConfigError, JobConflictError, TierRootError
from ..local.job_dir import remove_quietly
from ..local.job_files import job_usage_bytes, open_job, read_record_or_reason
from ..local.launch_lock import live_launches
from ..local.record_types import StepRecord
from ..options.local import DEFAULT_KEEP


def processes_using(path: Path, *, exclude: Iterable[int] = ()) -> dict[int, str]:
    """pid -> command name of processes with a file under ``path`` open or mapped (Linux /proc).

    Only processes this user may inspect are seen (all of them when run as root,
    as in a training container).
    """
    pids = sorted({pid for users in _users_by_file(path, exclude).values() for pid in users})
    found: dict[int, str] = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/comm", encoding="utf-8") as f:
                found[pid] = f.read().strip()
        except OSError:
            found[pid] = "?"
    return found


# ---- gc / remove ----------------------------------------------------------------------------------
@dataclass
class GcReport:
    root: str
    job_id: str
    keep: int
    dry_run: bool
    kept_steps: list[int]
    evicted_steps: list[int]
    freed_files: list[str]
    freed_bytes: int
    busy_files: dict[str, list[int]]    # slot file -> pids that have it open/mapped (not freed)
    live_launches: list[str] = dataclasses.field(default_factory=list)  # launches holding the job's lock

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def collect_garbage(
    root: str | os.PathLike[str] | None = None,
    job_id: str | None = None,
    keep: int = DEFAULT_KEEP,
    *,
    dry_run: bool = False,
    exclude_pids: Iterable[int] = (),
    force: bool = False,
) -> GcReport:
    """Keep the newest ``keep`` steps of ``job_id`` in this root; evict the older ones.

    Never evicts the newest committed step, nor any step newer than it (a save
    being committed right now). Slot files that no remaining record uses are
    deleted to give the memory back, unless some process (a running trainer)
    has them open or mapped: those are listed in ``busy_files`` and left alone.

    A job a live launch holds (``live_launches`` of the report) is left untouched, whatever
    ``/proc`` shows (its trainer may run in another container): its writer owns its retention
    and its spare slot. ``force`` collects it anyway.
    """
    if not isinstance(keep, int) or keep < 1:
        raise ConfigError(
            f"keep={keep!r}: gc keeps at least 1 step (the newest committed one is never evicted); "
            "to drop a finished job's memory entirely, remove the job (`gemini-dcp gc --remove-job`)."
        )
    layout = open_job(root, job_id)
    live = [] if force else [_launch_text(info) for info in live_launches(layout.job_dir)]
    if live:
        return GcReport(root=str(layout.root), job_id=layout.job_id, keep=keep, dry_run=dry_run,
                        kept_steps=layout.record_steps(), evicted_steps=[], freed_files=[], freed_bytes=0,
                        busy_files={}, live_launches=live)
    steps = layout.record_steps()
    records: dict[int, StepRecord | None] = {s: read_record_or_reason(layout, s)[0] for s in steps}
    committed = [s for s, r in records.items() if r is not None and r.complete]
    newest = max(committed) if committed else (max(steps) if steps else None)
    keep_set = set(steps[-keep:]) if steps else set()
    if newest is not None:
        keep_set |= {s for s in steps if s >= newest}
    evict = [s for s in steps if s not in keep_set]
    # Slots referenced by what stays.
    used: set[tuple[int, int]] = set()
    for s in keep_set:
        rec = records.get(s)
        if rec is not None:
            used |= {(sl.rank, sl.slot) for sl in rec.slots}
    candidates: list[Path] = []
    for rank in _ranks_present(layout):
        for slot, path in sorted(layout.slot_files(rank).items()):
            if (rank, slot) not in used and _is_regular(path):  # an odd entry is left alone
                candidates.append(path)
    busy: dict[str, list[int]] = {}
    if candidates:
        users = _users_by_file(layout.job_dir, exclude_pids)
        for p in candidates:
            pids = users.get(str(p.resolve()), [])
            if pids:
                busy[str(p)] = pids
    freed = [p for p in candidates if str(p) not in busy]
    freed_bytes = 0
    for p in freed:
        try:
            freed_bytes += p.stat().st_blocks * 512
        except FileNotFoundError:
            pass
    if not dry_run:
        for s in evict:
            _remove(layout.record_path(s))
        for p in freed:
            _remove(p)
    return GcReport(root=str(layout.root), job_id=layout.job_id, keep=keep, dry_run=dry_run,
                    kept_steps=sorted(keep_set), evicted_steps=evict, freed_files=[str(p) for p in freed],
                    freed_bytes=freed_bytes, busy_files=busy)


def _ranks_present(layout: Any) -> list[int]:
    """The ranks with a ``rank-<N>`` directory; stray entries (``rank-xyz``, files) are skipped."""
    try:
        names = os.listdir(layout.ranks_dir)
    except FileNotFoundError:
        return []
    out = []
    for n in names:
        if n.startswith("rank-") and n[5:].isascii() and n[5:].isdigit() and (layout.ranks_dir / n).is_dir():
            out.append(int(n[5:]))
    return sorted(out)


def _is_regular(path: Path) -> bool:
    try:
        return os.lstat(path).st_mode & 0o170000 == 0o100000
    except OSError:
        return False


def _remove(path: Path) -> None:
    """Unlink a record or slot file; an odd entry (a directory, no permission) is left with a warning."""
    try:
        remove_quietly(path)
    except OSError as exc:
        import logging  # noqa: PLC0415

        logging.getLogger(__name__).warning("gc: left %s in place: %s", path, exc)


def _users_by_file(job_dir: Path, exclude: Iterable[int]) -> dict[str, list[int]]:
    """resolved file path under ``job_dir`` -> pids with it open or mapped."""
    prefix = str(job_dir.resolve()).rstrip("/") + "/"
    skip = set(exclude)
    out: dict[str, list[int]] = {}
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except FileNotFoundError:
        return out
    for pid in pids:
        if pid in skip:
            continue
        files: set[str] = set()
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if target.startswith(prefix):
                    files.add(target)
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
                for line in f:
                    i = line.find(prefix)
                    if i >= 0:
                        files.add(line[i:].rstrip("\n").removesuffix(" (deleted)"))
        except OSError:
            continue
        for p in files:
            out.setdefault(p, []).append(pid)
    return out


@dataclass
class RemoveReport:
    root: str
    job_id: str
    removed: bool
    freed_bytes: int
    steps: list[int]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def remove_job(
    root: str | os.PathLike[str] | None = None,
    job_id: str | None = None,
    *,
    force: bool = False,
    dry_run: bool = False,
    exclude_pids: Iterable[int] = (),
) -> RemoveReport:
    """Delete every file of a finished job in this root (its memory goes back to the node).

    Refuses while a launch holds the job's launch lock (from any container sharing the
    volume: :class:`~gemini_dcp.errors.JobConflictError` naming it) or a process has the job's
    files open or mapped (a trainer still running), unless ``force``.
    """
    layout = open_job(root, job_id)
    if not force:
        live = [_launch_text(info) for info in live_launches(layout.job_dir)]
        if live:
            raise JobConflictError(
                f"job {layout.job_id!r} in {layout.root} is live: held by {'; '.join(live)}. Its trainer may run in "
                "another container or PID namespace, where this one cannot see its processes. Stop the job first, or "
                "pass --force if that launch is hung."
            )
        users = processes_using(layout.job_dir, exclude=exclude_pids)
        if users:
            who = ", ".join(f"{pid} ({name})" for pid, name in sorted(users.items()))
            raise ConfigError(
                f"job {layout.job_id!r} is still in use in {layout.root}: processes {who} have its checkpoint files "
                "open. Stop the job first, or pass --force if those processes are gone or hung."
            )
    freed = job_usage_bytes(layout)
    steps = layout.record_steps()
    if not dry_run:
        # Records first: a half-removed job must never look restorable.
        for s in steps:
            remove_quietly(layout.record_path(s))
        try:
            shutil.rmtree(layout.job_dir)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise TierRootError(f"cannot remove {layout.job_dir}: {exc.strerror}; check its permissions.") from exc
    return RemoveReport(root=str(layout.root), job_id=layout.job_id, removed=not dry_run, freed_bytes=freed, steps=steps)




def _launch_text(info: dict[str, object]) -> str:
    return f"launch {info.get('description', '?')} (host {info.get('host', '?')}, pid {info.get('pid', '?')})"
