"""Read-only access to one tier root and a job's files in it, for the operator tools.

Nothing here creates or changes a file: looking at a root must not change it.
Shared by :mod:`gemini_dcp.inspect`, :mod:`gemini_dcp.verify` and
:mod:`gemini_dcp.housekeeping`.
"""

from __future__ import annotations

import os
from pathlib import Path

from .config import DEFAULT_ROOT, ENV_ROOT, resolve_job_id, resolve_root
from .errors import CheckpointNotFoundError, TierRootError
from .layout import JobLayout, list_jobs
from .records import StepRecord, read_record


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
        return layout.slot_path(rank, slot).stat().st_size
    except FileNotFoundError:
        return None


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
