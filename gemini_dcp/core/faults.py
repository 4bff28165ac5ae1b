"""Named fault points for the fault-injection suite (tests/test_fault_injection.py).

Production code marks each phase boundary of save, replicate, commit, drain and load
with ``fault_point("<phase>")``. Unless ``$GEMINI_DCP_FAULT`` or ``$GEMINI_DCP_FAULT_LOG``
is set this is two membership tests on ``os.environ`` (about a microsecond). With ``GEMINI_DCP_FAULT="<phase>[@<nth>][:<signal>][/<rank>]"`` the process
kills itself with the signal (default SIGKILL) at the ``nth`` (default 1st) time it
reaches that phase, optionally only on one global rank. ``GEMINI_DCP_FAULT_LOG=<dir>``
makes every process append the phases it reached to ``<dir>/<pid>.phases`` as
``<rank> <phase>`` lines, and ``<rank> <phase> fire`` just before it kills itself (the
harness uses them to prove every boundary is reached and that a fault fired). The drain
process inherits both variables from the rank that started it.

The phase names are part of the test contract; see :data:`PHASES` and :data:`CONDITIONAL_PHASES`.
"""

from __future__ import annotations

import os
from collections import Counter

from ..options.faults import ENV_FAULT, ENV_FAULT_LOG, fault_settings

PHASES: tuple[str, ...] = (
    # save (GeminiStorageWriter.write_data)
    "save.before_copy",          # plan known, nothing written into the slot yet
    "save.mid_copy",             # half of this rank's items copied into the slot
    "save.after_copy",           # every item copied and checksummed, before the report gather
    "save.after_gather",         # every rank's report gathered, before replication
    "replicate.mid_send",        # peer replication under way
    "replicate.after",           # replicas written and verified, before the commit
    "commit.before_record",      # about to write this node's step record
    "commit.after_record",       # record renamed into place, before eviction of old steps
    "commit.after_evict",        # old steps evicted, before write_data returns
    # drain (persistent tier, in the drain process)
    "drain.before_upload",
    "drain.mid_upload",
    "drain.before_metadata",     # data files uploaded, before .metadata is committed
    # load (GeminiStorageReader)
    "load.after_decide",         # the step to restore is agreed
    "load.mid_copy",             # some chunks copied into the live tensors
    # health (every save with nonfinite="mark" or "refuse")
    "health.judge",              # the step's verdict decided, before a refusal or the replication
    # rollback (every restore notes the step it restored in the job dir)
    "rollback.marker",           # before the restore marker (abandoned steps, new timeline) is written
)

#: Fault points reached only with a feature on (so not by the clean job of the phase test):
#: phase -> what reaches it.
CONDITIONAL_PHASES: dict[str, str] = {
    "drain.bridge_upload": "a step due while the node's drain process still imports torch (bridge=True): "
                           "the training process uploads it",
    "nixl.exchange": "peer_transport='nixl': a receive's descriptor is posted to the sender",
    "nixl.transfer": "peer_transport='nixl': a WRITE of a send is posted",
}

_counts: Counter[str] = Counter()


def _log(log_dir: str | None, phase: str, what: str = "") -> None:
    """Append ``<rank> <phase>[ <what>]`` to this process's phase log, if one is configured."""
    if not log_dir:
        return
    try:
        with open(os.path.join(log_dir, f"{os.getpid()}.phases"), "a") as f:
            f.write(f"{os.environ.get('RANK', '0')} {phase}{' ' + what if what else ''}\n")
    except OSError:
        pass


def fault_point(phase: str) -> None:
    """Die here if the fault-injection environment says so (a no-op in production).

    Production cost: two membership tests on ``os.environ`` per call (in
    :func:`gemini_dcp.options.faults.fault_settings`). The kill is logged as
    ``<rank> <phase> fire`` before the signal is sent, so the harness knows it fired.
    """
    settings = fault_settings()
    if settings is None:
        return
    _log(settings.log_dir, phase)
    spec = settings.spec
    if spec is None or spec.phase != phase:
        return
    if spec.rank is not None and int(os.environ.get("RANK", "0")) != spec.rank:
        return
    _counts[phase] += 1
    if _counts[phase] == spec.nth:
        _log(settings.log_dir, phase, "fire")
        os.kill(os.getpid(), spec.sig)


def reached(log_dir: str | os.PathLike[str]) -> dict[str, set[int]]:
    """Phase -> the ranks that reached it, from every ``*.phases`` file in ``log_dir``."""
    out: dict[str, set[int]] = {}
    for name in os.listdir(log_dir):
        if not name.endswith(".phases"):
            continue
        with open(os.path.join(log_dir, name)) as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 2:
                    out.setdefault(parts[1], set()).add(int(parts[0]))
    return out


__all__ = ["CONDITIONAL_PHASES", "ENV_FAULT", "ENV_FAULT_LOG", "PHASES", "fault_point", "reached"]
