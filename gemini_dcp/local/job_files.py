"""Read-only access to one tier root and a job's files in it, for the operator tools.

Nothing here creates or changes a file: looking at a root must not change it.
The same checks as the save/load path apply: the root and the job's directories
must be ours and not links (:func:`check_job_dirs`), records are read through
``O_NOFOLLOW`` and the restricted unpickler, so a planted record is reported,
never run.
Shared by :mod:`gemini_dcp.ops.inspection`, :mod:`gemini_dcp.ops.verify` and
:mod:`gemini_dcp.ops.housekeeping`.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ..core.config import resolve_job_id, resolve_root
from ..errors import CheckpointNotFoundError, TierRootError
from ..options.local import DEFAULT_ROOT, ENV_ROOT
from .job_dir import JobLayout, check_private_dir_stat, list_jobs
from .record_codec import read_record
from .record_types import StepRecord


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
    check_private_dir_stat(path, os.lstat(path), sticky_ok=True)
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
    check_job_dirs(layout)
    return layout


def check_job_dirs(layout: JobLayout) -> None:
    """Raise TierRootError unless the job, steps and ranks directories (those present) are ours,
    not links and not writable by others."""
    layout.check()


def read_record_or_reason(layout: JobLayout, step: int) -> tuple[StepRecord | None, str | None]:
    """The record of ``step`` and, if it cannot be read, why."""
    path = layout.record_path(step)
    try:
        return read_record(path), None
    except FileNotFoundError:
        return None, "record vanished (evicted meanwhile)"
    except Exception as exc:  # noqa: BLE001 - a corrupt record is reported, not fatal
        return None, f"record unreadable: {type(exc).__name__}: {exc}"


def slot_size(layout: JobLayout, rank: int, slot: int) -> int | None:
    try:
        st = os.lstat(layout.slot_path(rank, slot))  # a link or anything but a file is no slot
    except FileNotFoundError:
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None


def rank_extent(record: StepRecord) -> dict[int, int]:
    """Bytes of each saving rank's slot the record's items reach (offset + length)."""
    ext: dict[int, int] = {}
    for ref in record.metadata.storage_data.values():
        end = getattr(ref, "offset", 0) + getattr(ref, "length", 0)
        r = getattr(ref, "rank", None)
        if r is not None:
            ext[r] = max(ext.get(r, 0), end)
    return ext


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
