"""``verify``: recompute the checksum of every shard a tier holds, without loading anything.

Memory: every item of every record in this node's tier root (its own ranks and
the replicas it holds for peers). Persistent: every item of every committed
step in the store. Read-only; one :class:`ItemCheck` per item.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Literal

from ..core.chunk_sink import check_chunk
from ..core.config import resolve_job_id, resolve_root
from ..errors import CheckpointNotFoundError, ChecksumMismatchError, GeminiError, StepNotFoundError, TierRootError
from ..health.count import count_bytes, kind_of_name
from ..local.job_dir import JobLayout
from ..local.job_files import open_job, read_record_or_reason
from ..local.slots import ReadOnlySlot
from .parity_view import parity_checks

Progress = Callable[[int, int], None]


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
    nonfinite: int = 0   # NaN/Inf values of a float item held in memory (gemini_dcp.health)

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

    @property
    def nonfinite(self) -> dict[int, dict[str, int]]:
        """``{step: {fqn: NaN/Inf values}}`` of the items holding any (memory items, summed over chunks)."""
        out: dict[int, dict[str, int]] = {}
        for it in self.items:
            if it.nonfinite:
                per = out.setdefault(it.step, {})
                per[it.fqn] = per.get(it.fqn, 0) + it.nonfinite
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"root": self.root, "job_id": self.job_id, "steps": self.steps, "ok": self.ok,
                "counts": self.counts, "bytes_checked": self.bytes_checked, "seconds": self.seconds,
                "nonfinite": {str(s): v for s, v in self.nonfinite.items()},
                "items": [i.to_dict() for i in self.items]}


def _offset(idx: Any) -> list[int] | None:
    off = getattr(idx, "offset", None)
    return None if off is None else [int(x) for x in off]


def _memory_checks(layout: JobLayout, step: int) -> list[tuple[ItemCheck, Callable[[], tuple[ItemStatus, str]]]]:
    """(check, thunk) per stored item of ``step`` held here; the thunk reads and hashes it."""
    rec, problem = read_record_or_reason(layout, step)
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
        what = f"shard {idx.fqn!r} (offset {tuple(idx.offset or ())}) of step {step}, saved by rank {ref.rank}"

        def run(ref: Any = ref, path: Path = path, what: str = what, check: ItemCheck = check) -> tuple[ItemStatus, str]:
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
            try:
                check_chunk(m.view(ref.offset, ref.length), ref.algo, ref.checksum,
                            what=what, sources=f"slot file {path.parent.name}/{path.name} @ {ref.offset}")
            except ChecksumMismatchError as exc:
                return "bad", str(exc)
            check.nonfinite = count_bytes(m.view(ref.offset, ref.length), kind_of_name(ref.dtype))
            return "ok", ""

        out.append((check, run))
    for what, rank, nbytes, prun in parity_checks(layout, rec):  # XOR parity slots held here (ops/parity_view)
        out.append((ItemCheck(step, "memory", what, None, rank, nbytes, "ok"), prun))  # type: ignore[arg-type]
    return out


def _persistent_checks(url: str, job_id: str, steps: Iterable[int] | None) -> list[tuple[ItemCheck, Callable[[], tuple[ItemStatus, str]]]]:
    from ..persistent.store import PersistentTier  # noqa: PLC0415 - the optional tier (fsspec)

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
            from ..persistent.store import PersistentTier  # noqa: PLC0415

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


