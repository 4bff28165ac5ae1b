"""The identity of one launch of a job: what tells a torchrun restart from another job.

A *launch* is one start of the worker processes of a job (one torchrun attempt, one
``mp.spawn``). Every rank of a launch computes the same identity from its environment,
and two launches that run at the same time on the same hosts cannot share it, because
their rendezvous addresses differ (``MASTER_ADDR:MASTER_PORT``; one port serves one job).
A torchrun restart of the worker group is a new launch of the same job; records carry the
launch that saved them, so a restore across launches is logged with what it is.

Without a rendezvous in the environment (one process, or a process group initialized by
URL) the identity falls back to this host and process id: a launch of one process.
"""

from __future__ import annotations

import hashlib
import os
import socket
import time
from dataclasses import dataclass
from functools import lru_cache

_ENV_KEYS = ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "WORLD_SIZE")


@dataclass(frozen=True, slots=True)
class LaunchInfo:
    """Who launched: ``launch_id`` is the same on every rank of one launch."""

    launch_id: str
    description: str  # human-readable: run id, rendezvous, restart count (or host/pid)
    host: str
    pid: int
    started_unix: float


@lru_cache(maxsize=1)
def current_launch() -> LaunchInfo:
    """This process's launch, computed once (the environment of a worker does not change)."""
    env = {k: os.environ.get(k, "") for k in _ENV_KEYS}
    host = socket.gethostname()
    pid = os.getpid()
    if env["MASTER_ADDR"] and env["MASTER_PORT"]:
        desc = (
            f"run {env['TORCHELASTIC_RUN_ID'] or '-'} at {env['MASTER_ADDR']}:{env['MASTER_PORT']}"
            f" (restart {env['TORCHELASTIC_RESTART_COUNT'] or 0}, world {env['WORLD_SIZE'] or '?'})"
        )
        key = "|".join(env[k] for k in _ENV_KEYS)
    else:
        desc = f"process {pid} on {host}"
        key = f"{host}|{pid}|{_boot_time_of(pid)}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return LaunchInfo(launch_id=digest, description=desc, host=host, pid=pid, started_unix=time.time())


def _boot_time_of(pid: int) -> str:
    """The start time of ``pid`` (field 22 of /proc/<pid>/stat): pids are reused, start times are not."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
        return stat.rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return "0"


__all__ = ["LaunchInfo", "current_launch"]
