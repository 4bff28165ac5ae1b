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
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from ..errors import ConfigError, GeminiError, JobConflictError, TierRootError
from ..local.job_dir import remove_quietly
from ..local.job_files import job_usage_bytes, open_job, read_record_or_reason
from ..local.launch_lock import live_launches
from ..local.record_types import StepRecord
from ..options.local import DEFAULT_KEEP
from ..options.persistent import DrainOptions
from ..persistent.drain.client import SERVER_MODULE
from ..persistent.drain.paths import Paths
from ..persistent.drain.status import drain_status

STOP_DRAIN_WAIT_S = 600.0  # remove_job(stop_drain=True): how long the drain's pending uploads may take


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
    stop_drain: bool = False,
    drain_wait_s: float = STOP_DRAIN_WAIT_S,
) -> RemoveReport:
    """Delete every file of a finished job in this root (its memory goes back to the node).

    Refuses while a launch holds the job's launch lock (from any container sharing the
    volume: :class:`~gemini_dcp.errors.JobConflictError` naming it) or a process has the job's
    files open or mapped (a trainer still running), unless ``force``. The job's own drain server
    (it uploads the job's steps to the persistent tier, and exits by itself after its idle
    timeout) is named as such; ``stop_drain`` waits (up to ``drain_wait_s``) until it has no
    upload left, stops it, and goes on.
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
        drains = drain_servers(layout.persist_dir, users)
        if stop_drain and drains and set(users) <= set(drains):
            stop_drain_servers(layout.persist_dir, drains, drain_wait_s)
            users = processes_using(layout.job_dir, exclude=exclude_pids)
            drains = drain_servers(layout.persist_dir, users)
        if users:
            raise ConfigError(_busy_message(layout.job_id, layout.root, layout.persist_dir, users, drains))
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




def drain_servers(persist_dir: Path, users: dict[int, str]) -> dict[int, float]:
    """Those of ``users`` (pid -> name) that are the job's drain servers: pid -> their idle timeout (s)."""
    out: dict[int, float] = {}
    for pid in users:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = [a.decode(errors="replace") for a in f.read().split(b"\0")]
        except OSError:
            continue
        if SERVER_MODULE not in argv or not any(a.startswith(str(persist_dir)) for a in argv):
            continue
        idle = DrainOptions().idle_s
        if "--options" in argv and argv.index("--options") + 1 < len(argv):
            try:
                idle = DrainOptions.from_json(argv[argv.index("--options") + 1]).idle_s
            except GeminiError:
                pass
        out[pid] = idle
    return out


def _pending_uploads(persist_dir: Path) -> list[int]:
    p = Paths(persist_dir)
    return sorted(set(p.pending()) | set(p.adopt.pending()))


def _busy_message(job_id: str, root: Path, persist_dir: Path, users: dict[int, str], drains: dict[int, float]) -> str:
    others = {pid: name for pid, name in users.items() if pid not in drains}
    parts = [f"job {job_id!r} is still in use in {root}:"]
    if drains:
        pending = _pending_uploads(persist_dir)
        idle = max(drains.values())
        last = _last_drain_activity(persist_dir)
        left = max(0.0, idle - (time.time() - last)) if last is not None and not pending else None
        when = (f"about {left:.0f} s from now" if left is not None else "once its uploads are done")
        pids = ", ".join(f"{pid} ({users[pid]})" for pid in sorted(drains))
        parts.append(
            f"process {pids} is the job's drain server, which uploads its steps to the persistent tier "
            f"({'uploads of steps ' + str(pending) + ' still pending' if pending else 'no upload pending'}); it exits by "
            f"itself after {idle:g} s idle, {when}. Wait for it and run this again, or pass --stop-drain to stop it "
            "once its uploads are done and then remove the job."
        )
    if others:
        who = ", ".join(f"{pid} ({name})" for pid, name in sorted(others.items()))
        parts.append(f"processes {who} have its checkpoint files open. Stop the job first, or pass --force if those "
                     "processes are gone or hung.")
    elif drains:
        parts.append("(--force removes the files at once, cutting off an upload in flight: only for a hung server.)")
    return " ".join(parts)


def _last_drain_activity(persist_dir: Path) -> float | None:
    """When the drain last did something (its newest status entry), as a UNIX time; None if unknown."""
    times = [float(t) for st in (drain_status(persist_dir), drain_status(Paths(persist_dir).adopt.dir))
             for e in st.get("steps", {}).values() if isinstance(e, dict)
             if isinstance(t := e.get("unix"), (int, float))]
    return max(times) if times else None


def stop_drain_servers(persist_dir: Path, drains: dict[int, float], wait_s: float) -> None:
    """Wait until the job's drain has no upload pending (up to ``wait_s``), then stop its servers
    (``drains``: pid -> idle timeout) and wait for them to exit. ConfigError if an upload is still
    pending at the deadline, or a server does not exit."""
    deadline = time.monotonic() + wait_s
    while _pending_uploads(persist_dir):
        if time.monotonic() >= deadline:
            raise ConfigError(
                f"the drain server of {persist_dir} still has uploads of steps {_pending_uploads(persist_dir)} pending "
                f"after {wait_s:g} s: the job was not removed. Wait for them (`gemini-dcp inspect` shows the drain), "
                "or pass --force to cut them off."
            )
        time.sleep(0.2)
    for pid in drains:
        if drain_servers(persist_dir, {pid: "?"}):  # still that server (not a reused pid)
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    while any(_alive(pid) for pid in drains):  # an exiting server shows no command line while it still holds files
        if time.monotonic() >= deadline + 10.0:
            raise ConfigError(f"the drain server(s) {sorted(drains)} of {persist_dir} did not exit when stopped.")
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _launch_text(info: dict[str, object]) -> str:
    return f"launch {info.get('description', '?')} (host {info.get('host', '?')}, pid {info.get('pid', '?')})"
