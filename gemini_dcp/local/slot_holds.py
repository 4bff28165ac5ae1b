"""Holds on memory slots: a drain reading a committed slot in place asks the slot choice to leave it alone.

The persistent drain uploads a step straight from the slots the save committed into (no
staging copy). While it does, the node leader's request keeps a *hold* per slot:
``<job>/persist/holds/rank-<R>-slot-<K>`` (the step in it, for operators). The writer's
slot choice (:meth:`gemini_dcp.local.tier.LocalTier.choose_slot`) skips a held slot whenever
another slot may be overwritten, and takes it only when every other slot is protected (a
step known everywhere lagging behind a slow drain). Whenever it takes a slot it drops the
slot's hold first (:func:`drop_hold`), and the drain checks its holds after each item it
wrote (:func:`holds_intact`): an item read while its hold was intact was read before any
overwrite began, and a step whose hold is gone is abandoned (nothing torn reaches the store).

A hold is bounded: it counts only while its file was refreshed within :data:`HOLD_S`
(the drain server touches the holds of the steps it still has to read), so a drain that
died cannot pin a slot for longer than that. Torch-free; the drain package and the tier
both use it.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterable
from pathlib import Path

__all__ = [
    "HOLD_S", "drop_hold", "hold_path", "holds_dir", "held_slots", "holds_intact", "refresh_holds", "release_holds",
    "take_holds",
]

HOLD_S = 120.0  # a hold not refreshed for this long is stale (its drain died or hangs)
_HOLD_RE = re.compile(r"^rank-([0-9]+)-slot-([0-9]+)$")


def holds_dir(persist_dir: str | os.PathLike[str]) -> Path:
    return Path(persist_dir) / "holds"


def hold_path(persist_dir: str | os.PathLike[str], rank: int, slot: int) -> Path:
    return holds_dir(persist_dir) / f"rank-{rank}-slot-{slot}"


def take_holds(persist_dir: str | os.PathLike[str], step: int, slots: Iterable[tuple[int, int]]) -> list[Path]:
    """Hold ``(rank, slot)`` pairs for the drain of ``step``; the hold files written."""
    d = holds_dir(persist_dir)
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    out = []
    for rank, slot in slots:
        path = hold_path(persist_dir, rank, slot)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text(f"{step}\n")
        os.replace(tmp, path)
        out.append(path)
    return out


def refresh_holds(paths: Iterable[str | os.PathLike[str]]) -> None:
    """Renew holds (their drain is alive and still has to read the slots)."""
    for p in paths:
        try:
            os.utime(p)
        except FileNotFoundError:
            pass


def release_holds(paths: Iterable[str | os.PathLike[str]], step: int | None = None) -> None:
    """Drop holds; with ``step``, only those still taken for that step (a forced reuse may have re-taken one)."""
    for p in paths:
        try:
            if step is not None and Path(p).read_text().strip() != str(step):
                continue
            os.unlink(p)
        except (FileNotFoundError, ValueError):
            pass


def holds_intact(paths: Iterable[str | os.PathLike[str]], step: int) -> bool:
    """Whether every hold in ``paths`` is still there for ``step``: no writer has taken its slot.

    A writer drops a slot's hold (:func:`drop_hold`) *before* it writes into the slot, so bytes
    read from a held slot and found intact afterwards were read before any overwrite began.
    """
    for p in paths:
        try:
            if Path(p).read_text().strip() != str(step):
                return False
        except (FileNotFoundError, ValueError):
            return False
    return True


def drop_hold(persist_dir: str | os.PathLike[str], rank: int, slot: int) -> None:
    """Remove the hold of ``rank``'s ``slot`` (live or stale): the slot is about to be overwritten."""
    try:
        os.unlink(hold_path(persist_dir, rank, slot))
    except FileNotFoundError:
        pass


def held_slots(persist_dir: str | os.PathLike[str], rank: int, *, now: float | None = None) -> set[int]:
    """The slots of ``rank`` under a live hold (refreshed within :data:`HOLD_S`)."""
    now = time.time() if now is None else now
    try:
        names = os.listdir(holds_dir(persist_dir))
    except (FileNotFoundError, NotADirectoryError):
        return set()
    out: set[int] = set()
    for n in names:
        m = _HOLD_RE.match(n)
        if m is None or int(m.group(1)) != rank:
            continue
        try:
            if now - os.stat(holds_dir(persist_dir) / n).st_mtime < HOLD_S:
                out.add(int(m.group(2)))
        except FileNotFoundError:
            continue
    return out
