"""Paths inside a node-local tier root, permission handling and atomic file writes.

Layout of one job in a tier root (``<root>/<job_id>/``, mode 0700)::

    ranks/rank-00003/slot-1.bin     # preallocated, reused slot files: rank 3's shard bytes
    steps/step-000000000042.rec     # committed step records (metadata + checksums + slots)
    persist/                        # persistent-tier drain state

A node holds shard bytes of a rank either because the rank ran there (local
copy) or because it keeps a peer replica of another node; both use the same
slot files, the step record says which slot holds which rank's bytes.
"""

from __future__ import annotations

import errno
import os
import re
from dataclasses import dataclass
from pathlib import Path

from .config import DEFAULT_ROOT, ENV_ROOT
from .errors import TierRootError

_STEP_RE = re.compile(r"^step-(\d{12})\.rec$")
_SLOT_RE = re.compile(r"^slot-(\d+)\.bin$")


def check_root(root: Path, *, explicit: bool) -> Path:
    """Make sure ``root`` is a writable directory, creating only the default root.

    An explicitly configured root (argument or ``$GEMINI_DCP_ROOT``) must exist:
    a typo must not silently put checkpoints on the wrong filesystem.
    """
    if not root.exists():
        if not explicit and root.parent.is_dir():
            try:
                root.mkdir(mode=0o700, exist_ok=True)
            except OSError as exc:
                raise TierRootError(
                    f"cannot create the default tier root {root}: {exc.strerror}. "
                    f"Create it yourself or set {ENV_ROOT} to a writable tmpfs directory."
                ) from exc
        else:
            raise TierRootError(
                f"tier root {root} does not exist. Create it (mkdir -p {root}) on a memory-backed "
                f"filesystem such as /dev/shm, or pass root=/{ENV_ROOT}= pointing at an existing "
                f"directory (default {DEFAULT_ROOT})."
            )
    if not root.is_dir():
        raise TierRootError(f"tier root {root} exists but is not a directory: point root at a directory.")
    if not os.access(root, os.W_OK | os.X_OK):
        raise TierRootError(
            f"tier root {root} is not writable by this user (uid {os.getuid()}): fix its permissions "
            "or choose another root."
        )
    return root


def ensure_private_dir(path: Path) -> Path:
    """Create ``path`` (and parents below it) with mode 0700; tighten it if it exists."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        if path.stat().st_mode & 0o077:
            path.chmod(0o700)
    except PermissionError as exc:
        raise TierRootError(f"{path} belongs to another user; choose another root or job_id.") from exc
    return path


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via tmp file + fsync + rename + dir fsync."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def remove_quietly(path: Path) -> bool:
    """Unlink ``path``; a file already gone (another rank won the race) is fine."""
    try:
        path.unlink()
        return True
    except FileNotFoundError:
        return False


@dataclass(frozen=True, slots=True)
class JobLayout:
    """Where one job's files live inside one node's tier root."""

    root: Path
    job_id: str

    @property
    def job_dir(self) -> Path:
        return self.root / self.job_id

    @property
    def steps_dir(self) -> Path:
        return self.job_dir / "steps"

    @property
    def ranks_dir(self) -> Path:
        return self.job_dir / "ranks"

    @property
    def persist_dir(self) -> Path:
        return self.job_dir / "persist"

    def rank_dir(self, rank: int) -> Path:
        return self.ranks_dir / f"rank-{rank:05d}"

    def slot_path(self, rank: int, slot: int) -> Path:
        return self.rank_dir(rank) / f"slot-{slot}.bin"

    def record_path(self, step: int) -> Path:
        return self.steps_dir / f"step-{step:012d}.rec"

    def create(self) -> "JobLayout":
        ensure_private_dir(self.job_dir)
        ensure_private_dir(self.steps_dir)
        ensure_private_dir(self.ranks_dir)
        return self

    def exists(self) -> bool:
        return self.job_dir.is_dir()

    def record_steps(self) -> list[int]:
        """Steps with a record file in this root, ascending."""
        try:
            names = os.listdir(self.steps_dir)
        except FileNotFoundError:
            return []
        steps = [int(m.group(1)) for n in names if (m := _STEP_RE.match(n))]
        return sorted(steps)

    def slot_files(self, rank: int) -> dict[int, Path]:
        try:
            names = os.listdir(self.rank_dir(rank))
        except FileNotFoundError:
            return {}
        return {int(m.group(1)): self.rank_dir(rank) / n for n in names if (m := _SLOT_RE.match(n))}

    def ranks_present(self) -> list[int]:
        try:
            names = os.listdir(self.ranks_dir)
        except FileNotFoundError:
            return []
        return sorted(int(n.split("-", 1)[1]) for n in names if n.startswith("rank-"))


def list_jobs(root: Path) -> list[str]:
    """Job ids that have a directory in ``root``."""
    try:
        return sorted(n for n in os.listdir(root) if (root / n / "steps").is_dir())
    except FileNotFoundError:
        return []
    except OSError as exc:
        if exc.errno == errno.EACCES:
            return []
        raise
