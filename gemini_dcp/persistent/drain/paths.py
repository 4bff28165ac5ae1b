"""Where the drain of one job keeps its state on a node's tmpfs, and the two file helpers it writes with.

``<tier root>/<job_id>/persist/``: ``requests/step-N.json`` (one per step to drain),
``stage/step-N/`` (the staged bytes, the record snapshot, the upload progress),
``daemon.lock`` / ``standby.lock`` / ``warming.lock`` / ``starting.lock`` / ``daemon.pid`` (the server),
``status.json`` (what it did),
``drain.log`` and ``config.json`` (the drain settings a writer left, for adoption). The drain
of adopted parts keeps the same layout under ``persist/adopt/``. Torch-free.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

__all__ = ["Paths", "private_dir", "step_name", "write_atomic"]


def step_name(step: int) -> str:
    return f"step-{step:012d}"


class Paths:
    """Drain state of one job on one node: ``<tier root>/<job_id>/persist/``."""

    def __init__(self, persist_dir: str | os.PathLike[str]) -> None:
        self.dir = Path(persist_dir)
        self.requests = self.dir / "requests"
        self.stage_root = self.dir / "stage"
        self.lock = self.dir / "daemon.lock"
        self.standby_lock = self.dir / "standby.lock"
        self.warming_lock = self.dir / "warming.lock"  # held by a server importing its upload side
        self.starting_lock = self.dir / "starting.lock"  # held by a drain process until it holds daemon.lock
        self.pid = self.dir / "daemon.pid"
        self.status = self.dir / "status.json"
        self.log = self.dir / "drain.log"
        self.config = self.dir / "config.json"

    @property
    def adopt(self) -> "Paths":
        """The drain state of adopted parts (a lost node's ranks, uploaded from the replicas held here).

        Kept apart from the node's own requests (which are keyed by step alone) and served by
        a server of its own, so an adoption never waits behind, or blocks, the node's own drain.
        """
        return Paths(self.dir / "adopt")

    def request(self, step: int) -> Path:
        return self.requests / f"{step_name(step)}.json"

    def stage(self, step: int) -> Path:
        return self.stage_root / step_name(step)

    def pending(self) -> list[int]:
        """The steps with a request waiting (ascending)."""
        try:
            names = os.listdir(self.requests)
        except FileNotFoundError:
            return []
        out = []
        for n in names:
            if n.startswith("step-") and n.endswith(".json"):
                try:
                    out.append(int(n[5:-5]))
                except ValueError:
                    continue
        return sorted(out)


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` beside ``path`` and rename it into place (readers see the old or the new file)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def private_dir(path: Path) -> None:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
