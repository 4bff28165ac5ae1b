"""Operator views of the tiers: what is held here, is it intact, what can be evicted, is the host ready.

The ``gemini-dcp`` command line tool is a thin layer over these functions; they
return plain dataclasses (``.to_dict()`` gives JSON-ready dicts) and raise
:class:`~gemini_dcp.errors.GeminiError` subclasses with messages that say what
to do. Everything here reads one tier root, the one of *this* node: to see a
whole job, run them on every node (or point ``root`` at each simulated node's
root).

- :func:`inspect_root` — jobs, steps, sizes, ranks and nodes, replica placement,
  age, and whether each step is restorable from what is visible here.
- :func:`verify` — recompute the checksum of every shard held here (and, given a
  persistent URL, of every item stored there).
- :func:`collect_garbage` — evict old steps (never the newest committed one) and
  free slot files no record uses and no process has open.
- :func:`remove_job` — delete a finished job's memory.
- :func:`doctor` — environment checks with a pass / warn / fail per line.
- :func:`plan` — placement table, recovery probabilities and GEMINI's
  wasted-time model (through :mod:`gemini_dcp.placement` and :mod:`gemini_dcp.costmodel`).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Literal

from .config import DEFAULT_KEEP, DEFAULT_ROOT, ENV_ROOT, resolve_job_id, resolve_node_id, resolve_root
from .errors import (
    CheckpointNotFoundError,
    ConfigError,
    GeminiError,
    StepNotFoundError,
    TierRootError,
)
from .layout import JobLayout, list_jobs, remove_quietly
from .records import StepRecord, read_record

GIB = float(1 << 30)
MEMORY_FSTYPES = ("tmpfs", "ramfs", "hugetlbfs")

Progress = Callable[[int, int], None]


# ---- opening a root / job --------------------------------------------------------------------------
def open_root(root: str | os.PathLike[str] | None) -> Path:
    """Resolve ``root`` (argument, ``$GEMINI_DCP_ROOT``, default) and require it to be an existing directory.

    Unlike the writer, never creates it: looking must not change anything.
    """
    path = resolve_root(root)
    if not path.exists():
        raise TierRootError(
            f"tier root {path} does not exist, so this node holds no checkpoint there. Pass the root the job "
            f"used (--root, or ${ENV_ROOT}; default {DEFAULT_ROOT}), or run `gemini-dcp doctor` to check the setup."
        )
    if not path.is_dir():
        raise TierRootError(f"tier root {path} exists but is not a directory: pass the directory the job used.")
    if not os.access(path, os.R_OK | os.X_OK):
        raise TierRootError(f"tier root {path} is not readable by this user (uid {os.getuid()}): run as the job's user.")
    return path


def open_job(root: str | os.PathLike[str] | None, job_id: str | None) -> JobLayout:
    """The layout of an existing job in an existing root (CheckpointNotFoundError naming the jobs present)."""
    path = open_root(root)
    job = resolve_job_id(job_id)
    layout = JobLayout(path, job)
    if not layout.steps_dir.is_dir():
        jobs = list_jobs(path)
        hint = f"jobs present: {', '.join(jobs)}" if jobs else "no job has files there"
        raise CheckpointNotFoundError(
            f"job {job!r} has no checkpoint in tier root {path} ({hint}). Pass --job (default $TORCHELASTIC_RUN_ID "
            "or 'default') or --root for the job you mean."
        )
    return layout


def _read(layout: JobLayout, step: int) -> tuple[StepRecord | None, str | None]:
    """The record of ``step`` and, if it cannot be read, why."""
    path = layout.record_path(step)
    try:
        return read_record(path), None
    except FileNotFoundError:
        return None, "record vanished (evicted meanwhile)"
    except Exception as exc:  # noqa: BLE001 - a corrupt record is reported, not fatal
        return None, f"record unreadable: {type(exc).__name__}: {exc}"


def _slot_size(layout: JobLayout, rank: int, slot: int) -> int | None:
    try:
        return layout.slot_path(rank, slot).stat().st_size
    except FileNotFoundError:
        return None


def _rank_extent(record: StepRecord) -> dict[int, int]:
    """Bytes of each saving rank's slot the record's items reach (offset + length)."""
    ext: dict[int, int] = {}
    for ref in record.metadata.storage_data.values():
        end = getattr(ref, "offset", 0) + getattr(ref, "length", 0)
        r = getattr(ref, "rank", None)
        if r is not None:
            ext[r] = max(ext.get(r, 0), end)
    return ext


# ---- inspect --------------------------------------------------------------------------------------
@dataclass
class StepInfo:
    step: int
    committed: bool                      # a complete record (metadata of the whole save) is here
    in_memory: bool                      # a record of this step is in this root
    in_persistent: bool | None           # None: no persistent tier given
    world_size: int | None = None
    total_bytes: int | None = None       # bytes of the whole save (all ranks)
    bytes_here: int = 0                  # bytes of it held in this root
    local_ranks: list[int] = field(default_factory=list)   # saved by this node, held here
    peer_ranks: list[int] = field(default_factory=list)    # replicas of other nodes' ranks held here
    nodes: list[str] = field(default_factory=list)         # saving nodes, in rank order of first rank
    rank_nodes: list[str] = field(default_factory=list)
    holders: dict[str, list[str]] = field(default_factory=dict)  # origin node -> nodes with a copy
    replicas: int | None = None
    placement: str | None = None
    node_id: str | None = None            # the node that wrote this record
    created_unix: float | None = None
    age_s: float | None = None
    restorable: str = "no"                # "memory" | "memory+persistent" | "persistent" | "no"
    missing_ranks: list[int] = field(default_factory=list)
    problem: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class JobInfo:
    job_id: str
    path: str
    usage_bytes: int
    steps: list[StepInfo]
    persistent_error: str | None = None
    drain: dict[str, Any] | None = None  # this node's drain to the persistent tier (drain.drain_summary)

    @property
    def newest_restorable(self) -> int | None:
        ok = [s.step for s in self.steps if s.restorable != "no"]
        return max(ok) if ok else None

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in dataclasses.asdict(self).items() if k != "steps"}
        d["newest_restorable"] = self.newest_restorable
        d["steps"] = [s.to_dict() for s in self.steps]
        return d


@dataclass
class RootInfo:
    root: str
    node_id: str
    persistent: str | None
    jobs: list[JobInfo]

    def to_dict(self) -> dict[str, Any]:
        return {"root": self.root, "node_id": self.node_id, "persistent": self.persistent,
                "jobs": [j.to_dict() for j in self.jobs]}


def _step_info(layout: JobLayout, step: int, persisted: set[int] | None, now: float) -> StepInfo:
    rec, problem = _read(layout, step)
    info = StepInfo(step=step, committed=False, in_memory=True,
                    in_persistent=None if persisted is None else step in persisted)
    if rec is None:
        info.problem = problem
        info.restorable = "persistent" if info.in_persistent else "no"
        return info
    info.committed = rec.complete
    info.world_size = rec.world_size
    info.total_bytes = rec.total_bytes
    info.nodes = list(rec.nodes)
    info.rank_nodes = list(rec.rank_nodes)
    info.holders = {k: list(v) for k, v in rec.holders.items()}
    info.replicas = rec.replicas
    info.placement = rec.placement
    info.node_id = rec.node_id
    info.created_unix = rec.created_unix
    info.age_s = max(0.0, now - rec.created_unix)
    extent = _rank_extent(rec)
    present: set[int] = set()
    short: list[str] = []
    for s in rec.slots:
        size = _slot_size(layout, s.rank, s.slot)
        if size is None:
            short.append(f"slot file of rank {s.rank} (slot {s.slot}) is missing")
            continue
        if size < extent.get(s.rank, 0):
            short.append(f"slot file of rank {s.rank} (slot {s.slot}) is shorter than its items")
            continue
        present.add(s.rank)
        info.bytes_here += s.nbytes
        if 0 <= s.rank < len(rec.rank_nodes) and rec.rank_nodes[s.rank] == rec.node_id:
            info.local_ranks.append(s.rank)
        else:
            info.peer_ranks.append(s.rank)
    info.local_ranks.sort()
    info.peer_ranks.sort()
    info.missing_ranks = [r for r in range(rec.world_size) if r not in present]
    if not rec.complete:
        info.problem = (
            "record without the DCP metadata: the commit did not finish, or the save planner does not expose "
            "planner.metadata and only the coordinator's node holds it (restorable together with that node)"
        )
        info.restorable = "persistent" if info.in_persistent else "no"
        return info
    if not info.missing_ranks:
        info.restorable = "memory"
    elif info.in_persistent:
        info.restorable = "memory+persistent"
    else:
        info.restorable = "no"
        lost = sorted({rec.rank_nodes[r] for r in info.missing_ranks if r < len(rec.rank_nodes)})
        info.problem = (
            f"ranks {info.missing_ranks} are not held here (saved on {lost}); restorable only together "
            "with the nodes holding them"
        )
    if short:
        info.problem = "; ".join(short) + (f"; {info.problem}" if info.problem else "")
    return info


def _persistent_steps(url: str | None, job_id: str) -> tuple[set[int] | None, str | None]:
    if url is None:
        return None, None
    from .persistent import PersistentTier  # noqa: PLC0415 - optional tier

    try:
        return set(PersistentTier(url, job_id).committed_steps()), None
    except GeminiError as exc:
        return set(), str(exc)


def inspect_job(layout: JobLayout, persistent: str | None = None, *, now: float | None = None) -> JobInfo:
    now = time.time() if now is None else now
    persisted, perr = _persistent_steps(persistent, layout.job_id)
    steps = layout.record_steps()
    infos = [_step_info(layout, s, persisted, now) for s in steps]
    for s in sorted((persisted or set()) - set(steps)):
        infos.append(StepInfo(step=s, committed=True, in_memory=False, in_persistent=True, restorable="persistent"))
    infos.sort(key=lambda i: i.step)
    from .drain import drain_summary  # noqa: PLC0415

    return JobInfo(job_id=layout.job_id, path=str(layout.job_dir), usage_bytes=job_usage_bytes(layout),
                   steps=infos, persistent_error=perr, drain=drain_summary(layout.persist_dir))


def inspect_root(
    root: str | os.PathLike[str] | None = None,
    job_id: str | None = None,
    persistent: str | None = None,
) -> RootInfo:
    """Every job in ``root`` (or only ``job_id``), with what is held here and what is restorable.

    ``persistent``: fsspec URL of the persistent tier, to count its committed steps too.
    Raises TierRootError (no root) or CheckpointNotFoundError (``job_id`` has nothing here).
    """
    path = open_root(root)
    if job_id is not None:
        layouts = [open_job(path, job_id)]
    else:
        layouts = [JobLayout(path, j) for j in list_jobs(path)]
    now = time.time()
    jobs = [inspect_job(lay, persistent, now=now) for lay in layouts]
    return RootInfo(root=str(path), node_id=resolve_node_id(path), persistent=persistent, jobs=jobs)


def job_usage_bytes(layout: JobLayout) -> int:
    """Memory the job's files take in the root (allocated blocks of slot and record files)."""
    total = 0
    for dirpath, _, files in os.walk(layout.job_dir):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except FileNotFoundError:
                continue
    return total


# ---- verify ---------------------------------------------------------------------------------------
ItemStatus = Literal["ok", "bad", "missing", "unverified"]


@dataclass
class ItemCheck:
    step: int
    tier: str            # "memory" | "persistent"
    fqn: str
    offset: list[int] | None
    rank: int | None
    nbytes: int
    status: ItemStatus
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class VerifyReport:
    root: str
    job_id: str
    steps: list[int]
    items: list[ItemCheck]
    seconds: float

    @property
    def counts(self) -> dict[str, int]:
        out = {"ok": 0, "bad": 0, "missing": 0, "unverified": 0}
        for it in self.items:
            out[it.status] += 1
        return out

    @property
    def bytes_checked(self) -> int:
        return sum(it.nbytes for it in self.items if it.status in ("ok", "bad"))

    @property
    def ok(self) -> bool:
        c = self.counts
        return c["bad"] == 0 and c["missing"] == 0

    def to_dict(self) -> dict[str, Any]:
        return {"root": self.root, "job_id": self.job_id, "steps": self.steps, "ok": self.ok,
                "counts": self.counts, "bytes_checked": self.bytes_checked, "seconds": self.seconds,
                "items": [i.to_dict() for i in self.items]}


def _offset(idx: Any) -> list[int] | None:
    off = getattr(idx, "offset", None)
    return None if off is None else [int(x) for x in off]


def _memory_checks(layout: JobLayout, step: int) -> list[tuple[ItemCheck, Callable[[], tuple[ItemStatus, str]]]]:
    """(check, thunk) per stored item of ``step`` held here; the thunk reads and hashes it."""
    from .checksum import checksum  # noqa: PLC0415
    from .slots import ReadOnlySlot  # noqa: PLC0415

    rec, problem = _read(layout, step)
    if rec is None:
        check = ItemCheck(step, "memory", "<record>", None, None, 0, "bad", problem or "record unreadable")
        return [(check, lambda: ("bad", check.detail))]
    held = {s.rank: s for s in rec.slots}
    maps: dict[Path, ReadOnlySlot | None] = {}
    out = []
    seen: set[tuple[int, int]] = set()
    for idx, ref in sorted(rec.metadata.storage_data.items(), key=lambda kv: (kv[1].rank, kv[1].offset)):
        if ref.rank not in held or (ref.rank, ref.offset) in seen:
            continue
        seen.add((ref.rank, ref.offset))
        path = layout.slot_path(ref.rank, held[ref.rank].slot)
        check = ItemCheck(step, "memory", idx.fqn, _offset(idx), ref.rank, ref.length, "ok")

        def run(ref: Any = ref, path: Path = path) -> tuple[ItemStatus, str]:
            if path not in maps:
                try:
                    maps[path] = ReadOnlySlot(path)
                except FileNotFoundError:
                    maps[path] = None
            m = maps[path]
            if m is None:
                return "missing", f"slot file {path} is missing"
            if ref.offset + ref.length > m.size:
                return "missing", f"slot file {path} ends at {m.size}, item needs bytes {ref.offset}+{ref.length}"
            got = checksum(m.view(ref.offset, ref.length), ref.algo)
            if got != ref.checksum:
                return "bad", (f"{ref.algo} {got:#018x} != recorded {ref.checksum:#018x} "
                               f"({path.parent.name}/{path.name} @ {ref.offset})")
            return "ok", ""

        out.append((check, run))
    return out


def _persistent_checks(url: str, job_id: str, steps: Iterable[int] | None) -> list[tuple[ItemCheck, Callable[[], tuple[ItemStatus, str]]]]:
    from .errors import ChecksumMismatchError  # noqa: PLC0415
    from .persistent import PersistentTier  # noqa: PLC0415

    tier = PersistentTier(url, job_id)
    committed = tier.committed_steps()
    wanted = committed if steps is None else [s for s in steps if s in committed]
    out = []
    for step in wanted:
        md = tier.read_metadata(step)
        index = tier.read_index(step)
        for idx, info in md.storage_data.items():
            check = ItemCheck(step, "persistent", idx.fqn, _offset(idx), None, int(getattr(info, "length", 0)), "ok")

            def run(step: int = step, idx: Any = idx) -> tuple[ItemStatus, str]:
                try:
                    tier.load_item(step, idx)
                except ChecksumMismatchError as exc:
                    return "bad", str(exc)
                except FileNotFoundError as exc:
                    return "missing", str(exc)
                except GeminiError as exc:
                    return "bad", str(exc)
                if index is None or idx not in index.checksums:
                    return "unverified", "no checksum recorded for this item (written outside gemini_dcp)"
                return "ok", ""

            out.append((check, run))
    return out


def verify(
    root: str | os.PathLike[str] | None = None,
    job_id: str | None = None,
    step: int | None = None,
    *,
    persistent: str | None = None,
    progress: Progress | None = None,
) -> VerifyReport:
    """Recompute the checksum of every stored item of ``job_id`` visible here (all steps, or ``step``).

    Memory: every item of every rank whose bytes this root holds (local or peer
    replica), read from the slot file at the offset its ShardRef records.
    Persistent (``persistent`` URL given): every item of the committed steps there.
    ``progress(done_bytes, total_bytes)`` is called as items are checked.
    Raises StepNotFoundError if ``step`` is in no tier visible here.
    """
    t0 = time.perf_counter()
    layout = open_job(root, job_id) if persistent is None else _job_or_none(root, job_id)
    job = layout.job_id if layout is not None else resolve_job_id(job_id)
    mem_steps = layout.record_steps() if layout is not None else []
    checks: list[tuple[ItemCheck, Callable[[], tuple[ItemStatus, str]]]] = []
    if step is not None:
        known = set(mem_steps)
        pers: list[int] = []
        if persistent is not None:
            from .persistent import PersistentTier  # noqa: PLC0415

            pers = PersistentTier(persistent, job).committed_steps()
            known |= set(pers)
        if step not in known:
            raise StepNotFoundError(
                f"step {step} of job {job!r} is in no tier visible here; steps here: {sorted(known) or 'none'}. "
                "Run `gemini-dcp inspect` to list them."
            )
    steps = mem_steps if step is None else [s for s in mem_steps if s == step]
    if layout is not None:
        for s in steps:
            checks.extend(_memory_checks(layout, s))
    if persistent is not None:
        checks.extend(_persistent_checks(persistent, job, None if step is None else [step]))
    if not checks and not steps:
        where = f"tier root {resolve_root(root)}" + (f" or {persistent}" if persistent else "")
        raise CheckpointNotFoundError(
            f"nothing of job {job!r} to verify: no step in {where}. Check --job and --root (`gemini-dcp inspect`)."
        )
    total = sum(c.nbytes for c, _ in checks)
    done = 0
    if progress is not None:
        progress(0, total)
    for check, run in checks:
        check.status, check.detail = run()
        done += check.nbytes
        if progress is not None:
            progress(done, total)
    all_steps = sorted({c.step for c, _ in checks} | set(steps))
    return VerifyReport(root=str(resolve_root(root)), job_id=job, steps=all_steps, items=[c for c, _ in checks],
                        seconds=time.perf_counter() - t0)


def _job_or_none(root: str | os.PathLike[str] | None, job_id: str | None) -> JobLayout | None:
    """With a persistent tier to look at too, a missing root or job in memory is not an error."""
    try:
        return open_job(root, job_id)
    except (TierRootError, CheckpointNotFoundError):
        return None


# ---- processes using a job's files ------------------------------------------------------------------
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

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def collect_garbage(
    root: str | os.PathLike[str] | None = None,
    job_id: str | None = None,
    keep: int = DEFAULT_KEEP,
    *,
    dry_run: bool = False,
    exclude_pids: Iterable[int] = (),
) -> GcReport:
    """Keep the newest ``keep`` steps of ``job_id`` in this root; evict the older ones.

    Never evicts the newest committed step, nor any step newer than it (a save
    being committed right now). Slot files that no remaining record uses are
    deleted to give the memory back, unless some process (a running trainer)
    has them open or mapped: those are listed in ``busy_files`` and left alone.
    """
    if not isinstance(keep, int) or keep < 1:
        raise ConfigError(
            f"keep={keep!r}: gc keeps at least 1 step (the newest committed one is never evicted); "
            "to drop a finished job's memory entirely, remove the job (`gemini-dcp gc --remove-job`)."
        )
    layout = open_job(root, job_id)
    steps = layout.record_steps()
    records: dict[int, StepRecord | None] = {s: _read(layout, s)[0] for s in steps}
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
    for rank in layout.ranks_present():
        for slot, path in sorted(layout.slot_files(rank).items()):
            if (rank, slot) not in used:
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
            remove_quietly(layout.record_path(s))
        for p in freed:
            remove_quietly(p)
    return GcReport(root=str(layout.root), job_id=layout.job_id, keep=keep, dry_run=dry_run,
                    kept_steps=sorted(keep_set), evicted_steps=evict, freed_files=[str(p) for p in freed],
                    freed_bytes=freed_bytes, busy_files=busy)


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

    Refuses while a process has the job's files open or mapped (a trainer still
    running), naming the processes, unless ``force``.
    """
    layout = open_job(root, job_id)
    if not force:
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


# ---- doctor ---------------------------------------------------------------------------------------
CheckStatus = Literal["pass", "warn", "fail", "info"]


@dataclass
class Check:
    name: str
    status: CheckStatus
    detail: str
    fix: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class DoctorReport:
    root: str
    checks: list[Check]

    @property
    def ok(self) -> bool:
        return all(c.status != "fail" for c in self.checks)

    def to_dict(self) -> dict[str, Any]:
        return {"root": self.root, "ok": self.ok, "checks": [c.to_dict() for c in self.checks]}


def mount_entry(path: Path, mounts_file: str = "/proc/mounts") -> tuple[str, str, str] | None:
    """(mount point, fstype, options) of the filesystem holding ``path`` (longest
    mount-point prefix in ``mounts_file``); None if that file cannot be read."""
    target = str(path.resolve())
    best: tuple[str, str, str] | None = None
    try:
        with open(mounts_file, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        mnt = parts[1].replace("\\040", " ")
        if target == mnt or target.startswith(mnt.rstrip("/") + "/") or mnt == "/":
            if best is None or len(mnt) >= len(best[0]):
                best = (mnt, parts[2], parts[3] if len(parts) > 3 else "")
    return best


def mount_of(path: Path, mounts_file: str = "/proc/mounts") -> tuple[str, str] | None:
    """(mount point, fstype) of the filesystem holding ``path`` (longest mount-point prefix)."""
    entry = mount_entry(path, mounts_file)
    if entry is None:
        return _mount_via_psutil(str(path.resolve()))
    return entry[0], entry[1]


def mount_options(path: Path, mounts_file: str = "/proc/mounts") -> dict[str, str]:
    """Mount options of the filesystem holding ``path`` (``{"size": "8g", "huge": "within_size", "rw": ""}``)."""
    entry = mount_entry(path, mounts_file)
    opts = entry[2] if entry is not None else ""
    return {k: v for k, _, v in (o.partition("=") for o in opts.split(",") if o)}


SHMEM_ENABLED = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"
HUGE_PAGE_MODES = ("always", "within_size", "force")


def tmpfs_huge_pages(path: Path, mounts_file: str = "/proc/mounts", shmem_enabled_file: str = SHMEM_ENABLED) -> str:
    """How the tmpfs holding ``path`` allocates the pages of a slot file.

    The slot files are sized with ``posix_fallocate`` before they are mapped, so
    only a mount option (``huge=always`` or ``huge=within_size``) or the
    system-wide ``force`` gives them 2 MiB pages; ``huge=advise`` (and
    ``shmem_enabled=advise``) applies to pages first touched through an
    ``madvise``d mapping, which fallocated pages never are. ``deny`` in sysfs
    overrides every mount. Returns the mode in effect: ``"force"``,
    ``"always"``, ``"within_size"``, or the mode that leaves 4 KiB pages
    (``"never"``, ``"advise"``, ``"deny"``).
    """
    system = ""
    try:
        with open(shmem_enabled_file, encoding="utf-8") as f:
            text = f.read()
        system = next((w.strip("[]") for w in text.split() if w.startswith("[")), "")
    except OSError:
        pass
    if system in ("force", "deny"):
        return system
    return mount_options(path, mounts_file).get("huge", "never")


def _mount_via_psutil(target: str) -> tuple[str, str] | None:
    try:
        import psutil  # noqa: PLC0415
    except ImportError:
        return None
    best = None
    for p in psutil.disk_partitions(all=True):
        mnt = p.mountpoint
        if target == mnt or target.startswith(mnt.rstrip("/") + "/") or mnt == "/":
            if best is None or len(mnt) >= len(best[0]):
                best = (mnt, p.fstype)
    return best


def in_container() -> str | None:
    """'kubernetes' / 'docker' / 'podman' / 'container' when this looks like a container, else None."""
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        return "kubernetes"
    if os.path.exists("/.dockerenv"):
        return "docker"
    if os.path.exists("/run/.containerenv"):
        return "podman"
    try:
        with open("/proc/1/cgroup", encoding="utf-8") as f:
            text = f.read()
        for key, name in (("kubepods", "kubernetes"), ("docker", "docker"), ("containerd", "container"), ("libpod", "podman")):
            if key in text:
                return name
    except OSError:
        pass
    if os.environ.get("container"):
        return "container"
    return None


def _gb(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def shm_fix(need_bytes: float) -> str:
    gib = max(1, int(-(-need_bytes // GIB)))
    return (f"docker run --shm-size={gib}g ...; Kubernetes: mount an emptyDir with medium: Memory and "
            f"sizeLimit: {gib}Gi at /dev/shm; or set {ENV_ROOT} to a larger tmpfs")


def doctor(
    root: str | os.PathLike[str] | None = None,
    *,
    expected_gb: float | None = None,
    keep: int = DEFAULT_KEEP,
    replicas: int = 1,
    mounts_file: str = "/proc/mounts",
    shm_path: str = "/dev/shm",
    build_ext: bool = False,
) -> DoctorReport:
    """Check the environment a job will run in; one :class:`Check` per line, never raising for what it finds.

    ``expected_gb``: checkpoint bytes per node (GiB) the job will save; the
    memory it needs here is ``expected_gb × (keep + 1) slots × replicas``.
    ``build_ext``: build the C++ extension if this machine has no cached build
    (otherwise it is only loaded from the cache, which is fast).
    """
    if not isinstance(keep, int) or keep < 1:
        raise ConfigError(f"keep={keep!r}: give an int >= 1 (the job's keep, default {DEFAULT_KEEP}).")
    if not isinstance(replicas, int) or replicas < 1:
        raise ConfigError(f"replicas={replicas!r}: give an int >= 1 (copies of each node's checkpoint, its own included).")
    if expected_gb is not None and not expected_gb > 0:
        raise ConfigError(f"expected_gb={expected_gb!r}: give the checkpoint size per node in GiB (> 0).")
    path = resolve_root(root)
    explicit = (root is not None and str(root) != "") or bool(os.environ.get(ENV_ROOT))
    need = None if expected_gb is None else expected_gb * GIB * (keep + 1) * replicas
    checks: list[Check] = []

    # 1. the root
    probe = path
    if path.is_dir():
        if os.access(path, os.W_OK | os.X_OK):
            checks.append(Check("tier root", "pass", f"{path} exists and is writable"))
        else:
            checks.append(Check("tier root", "fail", f"{path} is not writable by uid {os.getuid()}",
                                f"chown/chmod it, or set {ENV_ROOT} to a writable tmpfs directory"))
    elif path.exists():
        checks.append(Check("tier root", "fail", f"{path} exists but is not a directory", f"point {ENV_ROOT} at a directory"))
        probe = path.parent
    elif not explicit and path.parent.is_dir() and os.access(path.parent, os.W_OK):
        checks.append(Check("tier root", "pass", f"{path} does not exist yet; the first save creates it (default root)"))
        probe = path.parent
    else:
        checks.append(Check("tier root", "fail", f"{path} does not exist",
                            f"mkdir -p {path} on a tmpfs (e.g. under /dev/shm), or set {ENV_ROOT} to an existing one"))
        probe = path.parent if path.parent.is_dir() else Path("/")

    # 2. memory-backed filesystem
    mnt = mount_of(probe, mounts_file)
    if mnt is None:
        checks.append(Check("tmpfs", "warn", f"cannot tell which filesystem holds {probe}"))
    elif mnt[1] in MEMORY_FSTYPES:
        checks.append(Check("tmpfs", "pass", f"{probe} is on {mnt[1]} mounted at {mnt[0]}"))
    else:
        checks.append(Check("tmpfs", "fail", f"{probe} is on {mnt[1]} (mount {mnt[0]}), not memory-backed: every save "
                            "would go through the page cache to disk at disk speed instead of staying in CPU memory",
                            f"set {ENV_ROOT} to a directory under /dev/shm or another tmpfs"))

    # 2b. page size of the tier's tmpfs
    if mnt is not None and mnt[1] == "tmpfs":
        huge = tmpfs_huge_pages(probe, mounts_file)
        if huge in HUGE_PAGE_MODES:
            checks.append(Check("huge pages", "pass", f"{mnt[0]} gives slot files 2 MiB pages (huge={huge})"))
        else:
            checks.append(Check(
                "huge pages", "info",
                f"{mnt[0]} gives slot files 4 KiB pages (huge={huge}): every restore maps ~0.1 s of page "
                "tables per GiB; 2 MiB pages restored a lost node ~1.5x faster (docs/architecture.md)",
                f"mount -t tmpfs -o size=<N>g,huge=within_size tmpfs /mnt/gemini_dcp and set {ENV_ROOT}=/mnt/gemini_dcp "
                "(Docker: --tmpfs /mnt/gemini_dcp:size=<N>g,huge=within_size)"))

    # 3. free space vs expected checkpoint
    try:
        st = os.statvfs(probe)
        free, size = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    except OSError:
        free = size = None
    if free is None:
        checks.append(Check("free space", "warn", f"cannot statvfs {probe}"))
    elif need is None:
        checks.append(Check("free space", "info", f"{_gb(free)} free of {_gb(size)}; pass --expected-gb to check it "
                            "against the checkpoint size"))
    elif free >= need:
        checks.append(Check("free space", "pass", f"{_gb(free)} free >= {_gb(need)} needed "
                            f"({expected_gb:g} GiB x {keep + 1} slots x {replicas} replicas)"))
    else:
        on_shm = str(probe.resolve()).startswith(str(Path(shm_path).resolve()))
        fix = shm_fix(need) if on_shm else (
            f"free space on {mnt[0] if mnt else probe}, or set {ENV_ROOT} to a tmpfs with {_gb(need)} free")
        checks.append(Check("free space", "fail", f"{_gb(free)} free < {_gb(need)} needed "
                            f"({expected_gb:g} GiB x {keep + 1} slots x {replicas} replicas)", fix))

    # 4. /dev/shm in a container
    where = in_container()
    try:
        st = os.statvfs(shm_path)
        shm_size = st.f_blocks * st.f_frsize
    except OSError:
        shm_size = None
    if shm_size is None:
        checks.append(Check("/dev/shm", "warn", f"{shm_path} is absent", shm_fix(need or GIB)))
    else:
        ctx = f"in a {where} container" if where else "not in a container"
        small = shm_size <= 64 << 20  # Docker's default of 64 MiB
        uses_shm = str(path).startswith(shm_path.rstrip("/") + "/") or str(path) == shm_path
        if need is not None and uses_shm and shm_size < need:
            checks.append(Check("/dev/shm", "fail", f"{shm_path} is {_gb(shm_size)} ({ctx}), < {_gb(need)} needed",
                                shm_fix(need)))
        elif small and uses_shm:
            checks.append(Check("/dev/shm", "fail", f"{shm_path} is only {shm_size >> 20} MiB ({ctx}; Docker's default)",
                                shm_fix(need or 8 * GIB)))
        else:
            checks.append(Check("/dev/shm", "pass", f"{shm_path} is {_gb(shm_size)} ({ctx})"))

    # 5. memory budget
    try:
        import psutil  # noqa: PLC0415

        vm = psutil.virtual_memory()
        detail = f"{_gb(vm.available)} available of {_gb(vm.total)}"
        if need is None:
            checks.append(Check("memory", "info", detail + "; pass --expected-gb to check the budget"))
        elif need > vm.available:
            checks.append(Check("memory", "fail", f"{detail} < {_gb(need)} the tier needs",
                                "lower keep or replicas, shard the checkpoint over more nodes, or use larger machines"))
        elif need > 0.5 * vm.total:
            checks.append(Check("memory", "warn", f"{detail}; the tier needs {_gb(need)}, over half of it, which "
                                "leaves little for the trainer and the dataloader", "lower keep (keep=1 needs 2 slots)"))
        else:
            checks.append(Check("memory", "pass", f"{detail}; the tier needs {_gb(need)}"))
    except ImportError:
        checks.append(Check("memory", "warn", "psutil is not installed", "pip install psutil"))

    # 6. GPUs
    checks.append(_gpu_check())

    # 7. versions
    checks.append(_torch_check())
    checks.append(_ext_check(build_ext))
    return DoctorReport(root=str(path), checks=checks)


def _optional(module: str) -> Any | None:
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


def _field(obj: Any, *names: str) -> Any:
    for n in names:
        if isinstance(obj, dict) and n in obj:
            return obj[n]
        if hasattr(obj, n):
            return getattr(obj, n)
    return None


def _gpu_check() -> Check:
    mod = _optional("gemini_dcp.gpuinfo")
    if mod is None or not hasattr(mod, "gpu_info"):
        return Check("GPUs", "warn", "gemini_dcp.gpuinfo is not available in this build; GPU details skipped")
    try:
        gpus = list(mod.gpu_info())
    except Exception as exc:  # noqa: BLE001 - a driver problem is reported, not raised
        return Check("GPUs", "warn", f"GPU query failed: {type(exc).__name__}: {exc}")
    if not gpus:
        return Check("GPUs", "info", "no GPU visible through NVML (CPU-only host, no driver, or no nvidia-ml-py): "
                     "checkpoints travel over gloo from CPU memory")
    parts = []
    for g in gpus:
        name = _field(g, "name") or "GPU"
        mem = _field(g, "memory_total_bytes")
        mem_s = f", {_gb(mem)}" if isinstance(mem, (int, float)) else ""
        gen = _field(g, "pcie_gen_max", "pcie_gen")
        width = _field(g, "pcie_width_max", "pcie_width")
        gbps = _field(g, "pcie_link_gbps")
        pcie = f", PCIe gen{gen} x{width}" if gen and width else ""
        pcie += f" (~{gbps:g} GB/s per direction)" if isinstance(gbps, (int, float)) else ""
        parts.append(f"[{_field(g, 'index')}] {name}{mem_s}{pcie}")
    driver = _field(gpus[0], "driver_version")
    return Check("GPUs", "pass", f"{len(gpus)} GPU(s): " + "; ".join(parts) + (f"; driver {driver}" if driver else ""))


def _torch_check() -> Check:
    try:
        import torch  # noqa: PLC0415
    except ImportError:
        return Check("torch", "fail", "torch is not installed", "pip install 'torch>=2.7,<2.15'")
    v = torch.__version__
    try:
        major, minor = (int(x) for x in v.split("+")[0].split(".")[:2])
    except ValueError:
        return Check("torch", "warn", f"torch {v}: cannot parse the version")
    cuda = getattr(torch.version, "cuda", None)
    extra = f" (CUDA {cuda})" if cuda else " (CPU build)"
    if (2, 7) <= (major, minor) < (2, 15):
        return Check("torch", "pass", f"torch {v}{extra}, Python {sys.version.split()[0]}")
    return Check("torch", "fail", f"torch {v}{extra} is outside the supported range >=2.7,<2.15",
                 "pip install 'torch>=2.7,<2.15'")


def _ext_cached(mod: Any) -> bool | None:
    """Whether a build of the extension for this machine is already in its cache (None: cannot tell)."""
    loader = getattr(mod, "_LOADER", None)
    if loader is None or not hasattr(loader, "build_dir"):
        return None
    try:
        import torch  # noqa: PLC0415

        variants = [True, False] if torch.cuda.is_available() else [False]
        return any((loader.build_dir(cuda) / "BUILD_OK.json").is_file() for cuda in variants)
    except Exception:  # noqa: BLE001 - sources missing, unreadable cache: cannot tell
        return None


def _ext_check(build: bool = False) -> Check:
    """The C++/CUDA extension: loaded / loadable from the cache; built only when ``build`` (it takes a while)."""
    mod = _optional("gemini_dcp.ext")
    if mod is None:
        return Check("extension", "warn", "gemini_dcp.ext is not in this build; pure-Python fallbacks are used "
                     "(crc32c via the crc32c package)")
    loader = getattr(mod, "_LOADER", None)
    already = bool(getattr(loader, "done", False))
    disabled = os.environ.get("GEMINI_DCP_EXT", "").strip().lower() in ("0", "off", "false", "no", "never")
    if not (already or build or disabled) and _ext_cached(mod) is False:
        cache = getattr(mod, "cache_root", lambda: "its cache")()
        return Check("extension", "warn", f"gemini_dcp.ext is not built on this machine yet (cache {cache}); the first "
                     "save that needs it builds it once (about 15 s on 2 cores)",
                     "gemini-dcp doctor --build-ext builds and checks it now")
    try:
        loaded = bool(mod.load())
    except Exception as exc:  # noqa: BLE001 - GEMINI_DCP_EXT=1 and the build failed, or similar
        return Check("extension", "fail" if build else "warn", f"gemini_dcp.ext failed to load: {type(exc).__name__}: {exc}",
                     "install a C++ compiler (g++), or set GEMINI_DCP_EXT=0 to use the fallbacks")
    status = mod.status() if callable(getattr(mod, "status", None)) else ""
    if loaded:
        return Check("extension", "pass", f"gemini_dcp.ext: {status}")
    return Check("extension", "warn", f"gemini_dcp.ext not loaded ({status}); pure-Python fallbacks are used")


# ---- plan -----------------------------------------------------------------------------------------
def plan(
    nodes: int,
    replicas: int,
    strategy: str = "mixed",
    failures: int | None = None,
    *,
    cost: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Placement table, P(recover from memory | k simultaneous node failures) for k = 1..``failures``
    (default ``replicas + 1``), and, given ``cost`` (figures for :class:`costmodel.CostInputs`),
    GEMINI's expected wasted time per failure and per day vs persistent-only checkpointing.

    Raises PlacementError / ConfigError with what to change.
    """
    from .placement import group_formula, place, recovery_probability  # noqa: PLC0415

    pl = place(nodes, replicas, strategy)  # type: ignore[arg-type] - validates sizes and strategy
    if failures is not None and (not isinstance(failures, int) or isinstance(failures, bool) or failures < 1):
        raise ConfigError(f"failures={failures!r}: give the largest number of simultaneous node failures to show (>= 1).")
    k_max = min(nodes, replicas + 1 if failures is None else failures)
    recovery = []
    for k in range(1, k_max + 1):
        row: dict[str, Any] = {"failures": k, "p_recover": recovery_probability(pl, k)}
        if nodes % replicas == 0:
            # The paper's closed form for group placement: exact for k <= m, a lower bound above.
            row["group_formula"] = group_formula(nodes, replicas, k)
        recovery.append(row)
    out: dict[str, Any] = {
        "nodes": nodes, "replicas": replicas, "strategy": strategy,
        "holders": {i: list(h) for i, h in enumerate(pl.holders)},
        "groups": [list(g) for g in pl.groups],
        "table": pl.table(),
        "recovery": recovery,
    }
    if cost:
        from .costmodel import CostInputs, wasted_time  # noqa: PLC0415

        try:
            inputs = CostInputs(**cost)
        except TypeError as exc:
            raise ConfigError(f"wasted-time model: {exc}") from exc
        except ValueError as exc:
            if isinstance(exc, GeminiError):
                raise
            raise ConfigError(f"wasted-time model: {exc}") from exc
        out["cost_inputs"] = dataclasses.asdict(inputs)
        out["wasted_time"] = wasted_time(inputs)
    return out
