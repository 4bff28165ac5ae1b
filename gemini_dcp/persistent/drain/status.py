"""What a node's drain files say, for the trainer, adoption and operators (``gemini-dcp inspect``).

Reads only (torch-free): the drain settings a writer left (:func:`read_config`), the outcome
of each step (:func:`drain_status`: queued, staged, uploading, part-written, committed, done,
failed / abandoned with the reason), the same folded into the four states an operator sees
(:func:`step_states`: queued, writing, durable, failed + why), the summary shown by
``inspect`` (:func:`drain_summary`),
the server's pid, and :func:`wait_idle`. :class:`StatusBook` is the server's writer of
``status.json``.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from ...errors import GeminiError
from .paths import Paths, write_atomic
from .request import DrainConfig

__all__ = [
    "DRAIN_STATES", "STATUS_KEEP", "StatusBook", "StepDrain", "drain_status", "drain_summary", "read_config", "server_pid",
    "step_states", "wait_idle",
]

log = logging.getLogger("gemini_dcp.persistent.drain")

STATUS_KEEP = 64  # steps whose outcome status.json keeps


def read_config(persist_dir: str | os.PathLike[str]) -> DrainConfig | None:
    """The drain settings a writer with a persistent tier left on this node (None if none did, or unreadable)."""
    path = Paths(persist_dir).config
    try:
        return DrainConfig.from_json(path.read_bytes(), str(path))
    except FileNotFoundError:
        return None
    except GeminiError as exc:
        log.warning("drain: ignoring %s: %s", path, exc)
        return None


def wait_idle(persist_dir: str | os.PathLike[str], timeout_s: float = 300.0, poll_s: float = 0.05) -> bool:
    """Wait until this node has no pending drain request (done or abandoned); False on timeout."""
    p = Paths(persist_dir)
    deadline = time.monotonic() + timeout_s
    while p.pending():
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
    return True


def drain_status(persist_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """What the drain server of this node reported: ``{"steps": {step: {...}}, "pending": [...]}``."""
    p = Paths(persist_dir)
    try:
        status = json.loads(p.status.read_bytes())
    except (FileNotFoundError, ValueError):
        status = {"steps": {}}
    if not isinstance(status, dict) or not isinstance(status.get("steps"), dict):
        status = {"steps": {}}
    status["pending"] = p.pending()
    return status


def drain_summary(persist_dir: str | os.PathLike[str], recent: int = 3) -> dict[str, Any] | None:
    """This node's drain of one job, for operators (``gemini-dcp inspect``); reads files only.

    ``{"url", "every", "pending", "recent", "adopt_pending", "adopt_recent"}``: the store and
    cadence a writer configured, the steps waiting, and the last ``recent`` outcomes (``step``,
    ``state``, ``unix``, and ``reason`` / ``detail`` when there is one) of the node's own drain
    and of adopted parts (``gemini_dcp.persistent.adopt``). None when no drain ever ran for the job here.
    """
    p = Paths(persist_dir)
    cfg = read_config(p.dir)
    own, adopt = drain_status(p.dir), drain_status(p.adopt.dir)
    if cfg is None and not any(st["steps"] or st["pending"] for st in (own, adopt)):
        return None

    def latest(status: dict[str, Any]) -> list[dict[str, Any]]:
        steps = status.get("steps", {})
        out = []
        for k in sorted(steps, key=int)[-recent:]:
            entry = steps[k]
            out.append({"step": int(k), **{f: entry[f] for f in ("state", "unix", "reason", "detail") if entry.get(f)}})
        return out

    return {
        "url": cfg.store.url if cfg else None, "every": cfg.every if cfg else None,
        "pending": own["pending"], "recent": latest(own),
        "adopt_pending": adopt["pending"], "adopt_recent": latest(adopt),
    }


DRAIN_STATES = ("queued", "writing", "durable", "failed")


@dataclass(frozen=True, slots=True, kw_only=True)
class StepDrain:
    """One step's drain as an operator or a waiting trainer sees it.

    ``state``: ``queued`` (requested, not uploading yet), ``writing`` (uploading, or its part is
    written and another node commits), ``durable`` (this node committed its ``.metadata``), or
    ``failed`` (``reason`` says why; ``retrying`` when another attempt follows).
    ``superseded_by``: a newer step that replaced this one in the drain queue. ``fingerprint``: of the
    save this drain is of (None: not known), telling it from another save of the same step number.
    """

    step: int
    state: str
    reason: str | None = None
    retrying: bool = False
    superseded_by: int | None = None
    unix: float | None = None
    fingerprint: str | None = None


def step_states(persist_dir: str | os.PathLike[str]) -> dict[int, StepDrain]:
    """Each step's drain state on this node (from ``status.json`` and the pending requests)."""
    status = drain_status(persist_dir)
    pending = set(status["pending"])
    out: dict[int, StepDrain] = {}
    for key, entry in status["steps"].items():
        try:
            step = int(key)
        except ValueError:
            continue
        if not isinstance(entry, dict):
            continue
        raw = entry.get("state")
        fp = entry.get("fingerprint") if isinstance(entry.get("fingerprint"), str) else None
        why = entry.get("reason") or entry.get("detail") or None
        sup = entry.get("superseded_by")
        sup = sup if isinstance(sup, int) and not isinstance(sup, bool) else None
        if raw == "committed" or raw == "done" and (entry.get("committed_unix") or "already holds" in str(why)):
            state, why = "durable", None
        elif raw == "abandoned" or (raw == "failed" and step not in pending):
            state = "failed"
        elif raw == "failed":
            out[step] = StepDrain(step=step, state="failed", reason=why, retrying=True, unix=entry.get("unix"),
                                  fingerprint=fp)
            continue
        elif raw in ("uploading", "part-written", "done"):
            state = "writing"
        else:
            state = "queued"
        out[step] = StepDrain(step=step, state=state, reason=why if state != "writing" or raw == "done" else None,
                              superseded_by=sup, unix=entry.get("unix"), fingerprint=fp)
    for step in pending - set(out):
        out[step] = StepDrain(step=step, state="queued")
    return out


def server_pid(persist_dir: str | os.PathLike[str]) -> int | None:
    """The pid the last drain server of ``persist_dir`` recorded, or None."""
    try:
        return int(Paths(persist_dir).pid.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


class StatusBook:
    """The server's record of each step's outcome in ``status.json`` (the newest :data:`STATUS_KEEP` steps)."""

    def __init__(self, p: Paths) -> None:
        self.p = p
        self._lock = threading.Lock()

    def set(self, step: int, state: str, *, fresh: bool = False, **info: Any) -> None:
        """Record ``state`` (and ``info``) of ``step``; ``fresh``: a new save of the step number starts
        its entry anew (nothing of an earlier drain of the same number stays in it)."""
        with self._lock:
            try:
                status = json.loads(self.p.status.read_bytes())
            except (FileNotFoundError, ValueError):
                status = {"steps": {}}
            steps = status.setdefault("steps", {})
            entry = steps.setdefault(str(step), {})
            if fresh:
                entry.clear()
            entry.update(info)
            entry["state"] = state
            entry["unix"] = time.time()
            if len(steps) > STATUS_KEEP:
                for k in sorted(steps, key=int)[: len(steps) - STATUS_KEEP]:
                    steps.pop(k)
            status["pid"] = os.getpid()
            try:
                write_atomic(self.p.status, json.dumps(status).encode())
            except OSError as exc:  # status is informational (CLI); the drain goes on
                log.debug("drain: could not write %s: %s", self.p.status, exc)
