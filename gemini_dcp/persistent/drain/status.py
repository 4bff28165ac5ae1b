"""What a node's drain files say, for the trainer, adoption and operators (``gemini-dcp inspect``).

Reads only (torch-free): the drain settings a writer left (:func:`read_config`), the outcome
of each step (:func:`drain_status`: queued, staged, uploading, part-written, committed, done,
failed / abandoned with the reason), the summary shown by ``inspect`` (:func:`drain_summary`),
the server's pid, and :func:`wait_idle`. :class:`StatusBook` is the server's writer of
``status.json``.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any

from ...errors import GeminiError
from .paths import Paths, write_atomic
from .request import DrainConfig

__all__ = ["STATUS_KEEP", "StatusBook", "drain_status", "drain_summary", "read_config", "server_pid", "wait_idle"]

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

    def set(self, step: int, state: str, **info: Any) -> None:
        with self._lock:
            try:
                status = json.loads(self.p.status.read_bytes())
            except (FileNotFoundError, ValueError):
                status = {"steps": {}}
            steps = status.setdefault("steps", {})
            entry = steps.setdefault(str(step), {})
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
