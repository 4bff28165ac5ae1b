"""Defaults, environment resolution and validated option dataclasses."""

from __future__ import annotations

import logging
import math
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ..errors import ConfigError, InvalidStepError

DEFAULT_ROOT = "/dev/shm/gemini_dcp"
ENV_ROOT = "GEMINI_DCP_ROOT"
ENV_NODE_ID = "GEMINI_DCP_NODE_ID"
DEFAULT_KEEP = 2

PlacementStrategy = Literal["mixed", "group", "ring"]
ChecksumAlgo = Literal["auto", "xxh3", "crc32c"]
OnPeerFailure = Literal["raise", "degrade"]

log = logging.getLogger(__name__)

MAX_STEP = 2**63 - 1  # steps are stored as signed 64-bit integers (collectives, record names)
DEFAULT_JOB_IDS = ("default", "none")  # the fallback, and torchrun's run id without --rdzv-id
_warned_default_job = False

_JOB_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def resolve_root(root: str | os.PathLike[str] | None) -> Path:
    """``root`` if given, else ``$GEMINI_DCP_ROOT``, else ``/dev/shm/gemini_dcp``."""
    if root is not None and not isinstance(root, (str, os.PathLike)):
        raise ConfigError(
            f"root={root!r} is a {type(root).__name__}, not a path: pass the tier root as a str or "
            f"pathlib.Path (e.g. root='/dev/shm/gemini_dcp'), or leave it unset to use ${ENV_ROOT}."
        )
    if root is None or str(root) == "":
        root = os.environ.get(ENV_ROOT) or DEFAULT_ROOT
    return Path(root).expanduser().absolute()


def check_timeout(timeout_s: object, name: str = "timeout_s") -> float:
    """``timeout_s`` as a float if it is a positive, finite number of seconds, else ConfigError."""
    if (
        isinstance(timeout_s, bool)
        or not isinstance(timeout_s, (int, float))
        or not math.isfinite(timeout_s)
        or not timeout_s > 0
    ):
        raise ConfigError(
            f"{name}={timeout_s!r}: give a positive, finite number of seconds (default 300); "
            "an infinite wait would hang a save or load forever on a dead peer or store."
        )
    return float(timeout_s)


def resolve_job_id(job_id: str | None) -> str:
    """``job_id`` if given, else ``$TORCHELASTIC_RUN_ID``, else ``"default"``."""
    if job_id is None or job_id == "":
        job_id = os.environ.get("TORCHELASTIC_RUN_ID") or "default"
        if job_id in DEFAULT_JOB_IDS:
            _warn_default_job_id(job_id)
    if not isinstance(job_id, str) or not _JOB_RE.match(job_id):
        raise ConfigError(
            f"job_id {job_id!r} is not usable as a directory name: use 1-128 characters "
            "from letters, digits, '.', '_' and '-', starting with a letter or digit."
        )
    return job_id


def _warn_default_job_id(job_id: str) -> None:
    """Warn once per process that the job id fell back to a shared default."""
    global _warned_default_job
    if _warned_default_job:
        return
    _warned_default_job = True
    source = "TORCHELASTIC_RUN_ID=none (torchrun without --rdzv-id)" if job_id == "none" else "no job_id given"
    log.warning(
        "gemini_dcp: job id %r (%s): every run on this node that does the same shares its checkpoints; a second "
        "live run is refused, a later one sees the earlier one's steps. Pass job_id=... (or torchrun --rdzv-id) "
        "to give each run its own.", job_id, source,
    )


def resolve_node_id(root: Path) -> str:
    """Identity of this node: ``$GEMINI_DCP_NODE_ID``, else ``<hostname>:<root>``.

    Ranks that share a tier root on one host are one node, so simulated nodes on
    one machine (each with its own root) get distinct identities, and a replaced
    machine that reuses the same host name and root takes over the old identity.
    """
    env = os.environ.get(ENV_NODE_ID)
    if env:
        return env
    return f"{socket.gethostname()}:{root}"


def parse_step(checkpoint_id: object) -> int:
    """Turn a DCP ``checkpoint_id`` into a training step, or raise InvalidStepError."""
    if isinstance(checkpoint_id, bool):
        raise InvalidStepError(
            f"checkpoint_id={checkpoint_id!r} is a bool, not a training step: pass the step as an int."
        )
    if isinstance(checkpoint_id, int) or type(checkpoint_id).__name__ in {"int64", "int32"}:
        step = int(checkpoint_id)  # type: ignore[arg-type]
    elif isinstance(checkpoint_id, str) and checkpoint_id.strip().isdigit():
        step = int(checkpoint_id.strip())
    else:
        raise InvalidStepError(
            f"checkpoint_id={checkpoint_id!r} is not a training step: gemini_dcp names checkpoints "
            "by the step number, e.g. dcp.save(sd, storage_writer=w, checkpoint_id=step) with step an int >= 0."
        )
    if step < 0:
        raise InvalidStepError(f"checkpoint_id={step} is negative: steps are ints >= 0.")
    if step > MAX_STEP:
        raise InvalidStepError(
            f"checkpoint_id={step} is too large: steps are stored as signed 64-bit ints (at most {MAX_STEP}); "
            "pass a smaller step number (e.g. the step, a token count or a millisecond time fit)."
        )
    return step


@dataclass(frozen=True, slots=True, kw_only=True)
class TierOptions:
    """Options shared by the writer and the reader, validated on construction."""

    keep: int = DEFAULT_KEEP
    replicas: int = 1
    placement: PlacementStrategy = "mixed"
    checksum: ChecksumAlgo = "auto"
    capacity_bytes: int | None = None
    timeout_s: float = 300.0
    on_peer_failure: OnPeerFailure = "raise"

    def __post_init__(self) -> None:
        if isinstance(self.keep, bool) or not isinstance(self.keep, int) or self.keep < 1:
            raise ConfigError(f"keep={self.keep!r}: keep at least 1 committed step (default {DEFAULT_KEEP}).")
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int) or self.replicas < 1:
            raise ConfigError(
                f"replicas={self.replicas!r}: replicas counts the node's own copy, so it must be an int >= 1 "
                "(2 = one extra copy on a peer node)."
            )
        if self.placement not in ("mixed", "group", "ring"):
            raise ConfigError(f"placement={self.placement!r}: choose 'mixed' (default), 'group' or 'ring'.")
        if self.checksum not in ("auto", "xxh3", "crc32c"):
            raise ConfigError(
                f"checksum={self.checksum!r}: choose 'auto' (default: crc32c when the C++ extension is "
                "built, else xxh3), 'xxh3' or 'crc32c'."
            )
        if self.capacity_bytes is not None and (
            isinstance(self.capacity_bytes, bool) or not isinstance(self.capacity_bytes, int) or self.capacity_bytes <= 0
        ):
            raise ConfigError(f"capacity_bytes={self.capacity_bytes!r}: give a positive byte budget or None.")
        check_timeout(self.timeout_s)
        if self.on_peer_failure not in ("raise", "degrade"):
            raise ConfigError(
                f"on_peer_failure={self.on_peer_failure!r}: choose 'raise' (fail the save) or 'degrade' "
                "(commit with fewer replicas and warn)."
            )
