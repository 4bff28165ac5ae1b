"""The identity of one launch of a job: what tells a restart from another job.

A *launch* is one start of the worker processes of a job (one torchrun attempt, one
``mp.spawn``, one ``srun``). Every rank of a launch gets the same identity, and two launches
that run at the same time cannot share it. Records carry the launch that saved them, and the
launch lock (:mod:`gemini_dcp.local.launch_lock`) keeps one live launch per job and root.

**How the ranks agree.** Not from environment variables (a group initialized with
``init_method="tcp://..."``, ``"file://..."`` or a ``Store`` passed in has none, and ranks
started by hand may set them differently): each rank proposes a fresh random token on the
default group's key-value store with one compare-and-set, and every rank takes the first one
posted (:func:`gemini_dcp.transport.comm.agree_on_default_store`). The store is what the ranks
of one process group share and what two concurrent launches never share. Its key names the
torchrun run id and restart count, because torchrun's agent keeps one store across restarts
of the worker group: a restart is a new launch.

Without an initialized process group the identity comes from torchrun's rendezvous variables
when they are set, else from this host, process id and process start time: a launch of one process. It is computed again once a group exists, so a
writer built before ``init_process_group`` moves to the agreed identity at its first save.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)

STORE_KEY = "gemini_dcp/launch"
AGREE_TIMEOUT_S = 60.0  # a store that does not answer a compare-and-set within this is stalled or gone


@dataclass(frozen=True, slots=True)
class LaunchInfo:
    """Who launched: ``launch_id`` is the same on every rank of one launch."""

    launch_id: str
    description: str  # human-readable: run id, rendezvous, restart count (or host/pid)
    host: str
    pid: int
    started_unix: float


_agreed: LaunchInfo | None = None
_alone: LaunchInfo | None = None


def current_launch() -> LaunchInfo:
    """This process's launch: agreed over the default group's store once one is initialized
    (computed once, then kept for the life of the process), else this process alone."""
    global _agreed, _alone
    if _agreed is not None:
        return _agreed
    if _group_initialized():
        _agreed = _agree()
        return _agreed
    if _alone is None:
        _alone = _env_launch() or _process_launch()
    return _alone


def launch_known() -> bool:
    """Whether :func:`current_launch` is the launch of a process group (not a lone process's)."""
    return _agreed is not None or _group_initialized()


def cache_clear() -> None:
    """Forget the computed identity (tests that change the environment or the group)."""
    global _agreed, _alone
    _agreed = _alone = None



def _group_initialized() -> bool:
    try:
        import torch.distributed as dist  # noqa: PLC0415 - the root package stays torch-free
    except ImportError:
        return False
    return bool(dist.is_available() and dist.is_initialized())


def _env_description() -> str:
    env = os.environ
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        return (f"run {env.get('TORCHELASTIC_RUN_ID') or '-'} at {env['MASTER_ADDR']}:{env['MASTER_PORT']}"
                f" (restart {env.get('TORCHELASTIC_RESTART_COUNT') or 0}, world {env.get('WORLD_SIZE') or '?'})")
    return ""


def _agree() -> LaunchInfo:
    import torch.distributed as dist  # noqa: PLC0415

    from .comm import agree_on_default_store  # noqa: PLC0415 - the store lives in the transport

    host, pid = socket.gethostname(), os.getpid()
    world = dist.get_world_size()
    desc = _env_description() or f"group of {world} rank(s) led by process {pid} on {host}"
    token = os.urandom(8).hex()
    key = (f"{STORE_KEY}/{os.environ.get('TORCHELASTIC_RUN_ID', '')}"
           f"/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '')}/{world}")
    proposal = f"{token}|{desc}"
    try:
        agreed = agree_on_default_store(key, proposal, AGREE_TIMEOUT_S)
    except TimeoutError as exc:
        from ..errors import RestartRequiredError  # noqa: PLC0415

        raise RestartRequiredError(
            f"could not agree on this launch's identity: {exc}. The process serving the default group's store "
            "(rank 0, or torchrun's agent) is stalled or gone; restart the job."
        ) from None
    if agreed is None:  # a Store without compare_set: the rendezvous in the environment, else alone
        if not _env_description():
            log.warning("the default group's store cannot compare-and-set and no MASTER_ADDR/MASTER_PORT is set: "
                        "each process is its own launch, so the ranks sharing a tier root refuse each other "
                        "(JobConflictError); initialize the group with a TCPStore, FileStore or HashStore")
        return _env_launch() or _process_launch()
    token, _, desc = agreed.partition("|")
    return LaunchInfo(launch_id=_digest(token), description=desc, host=host, pid=pid, started_unix=time.time())


def _env_launch() -> LaunchInfo | None:
    """From torchrun's rendezvous in the environment: only where no group's store can agree
    (no group yet, or a store without compare-and-set)."""
    desc = _env_description()
    if not desc:
        return None
    keys = ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "WORLD_SIZE")
    return LaunchInfo(launch_id=_digest("|".join(os.environ.get(k, "") for k in keys)), description=desc,
                      host=socket.gethostname(), pid=os.getpid(), started_unix=time.time())


def _process_launch() -> LaunchInfo:
    host, pid = socket.gethostname(), os.getpid()
    return LaunchInfo(launch_id=_digest(f"{host}|{pid}|{_boot_time_of(pid)}"), description=f"process {pid} on {host}",
                      host=host, pid=pid, started_unix=time.time())


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def _boot_time_of(pid: int) -> str:
    """The start time of ``pid`` (field 22 of /proc/<pid>/stat): pids are reused, start times are not."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
        return stat.rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return "0"


__all__ = ["LaunchInfo", "cache_clear", "current_launch", "launch_known"]
