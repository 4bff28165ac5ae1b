"""Resolving a writer's or reader's identity (root, job, node) and its step numbers.

The option dataclasses live in :mod:`gemini_dcp.options`; the ``GEMINI_DCP_*`` variables are
read there only.
"""

from __future__ import annotations

import logging
import os
import re
import socket
from pathlib import Path

from ..errors import ConfigError, InvalidStepError
from ..options.local import (
    DEFAULT_ROOT,
    ENV_ROOT,
    job_id_from_env,
    node_id_from_env,
    root_from_env,
)

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
        root = root_from_env() or DEFAULT_ROOT
    return Path(root).expanduser().absolute()


def resolve_job_id(job_id: str | None) -> str:
    """``job_id`` if given, else ``$GEMINI_DCP_JOB_ID``, else ``$TORCHELASTIC_RUN_ID``, else ``"default"``."""
    if job_id is None or job_id == "":
        job_id = job_id_from_env() or os.environ.get("TORCHELASTIC_RUN_ID") or "default"
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
    env = node_id_from_env()
    if env:
        return env
    return f"{socket.gethostname()}:{root}"


_STEP_DIR = re.compile(r"step-([0-9]+)")


def _step_of_path(checkpoint_id: object) -> int | None:
    """N for a path-like id whose last component is ``step-<N>`` (torchtitan's ``<folder>/step-<N>``),
    else None. Only the last component counts; the rest of the path names nothing in the memory tiers."""
    if isinstance(checkpoint_id, os.PathLike):
        checkpoint_id = os.fspath(checkpoint_id)
    if not isinstance(checkpoint_id, str):
        return None
    last = checkpoint_id.strip().rstrip("/").rstrip(os.sep).rpartition("/")[2].rpartition(os.sep)[2]
    m = _STEP_DIR.fullmatch(last)
    return int(m.group(1)) if m else None


def _ascii_digits(text: str) -> bool:
    """``text`` is one or more of ``0``-``9`` (``str.isdigit`` also takes ``'²'`` and ``'٣'``)."""
    return text.isascii() and text.isdigit()


def parse_step(checkpoint_id: object) -> int:
    """Turn a DCP ``checkpoint_id`` into a training step, or raise InvalidStepError.

    Accepted: an int ``>= 0`` (or a numpy integer), a string of ASCII digits, or a path-like id
    (``str`` or ``os.PathLike``) whose last component is ``step-<N>`` — e.g. torchtitan's
    ``outputs/checkpoint/step-1200`` is step 1200; the folder part is ignored (the job is ``job_id``).
    """
    if isinstance(checkpoint_id, bool):
        raise InvalidStepError(
            f"checkpoint_id={checkpoint_id!r} is a bool, not a training step: pass the step as an int."
        )
    if isinstance(checkpoint_id, int) or type(checkpoint_id).__name__ in {"int64", "int32"}:
        step = int(checkpoint_id)  # type: ignore[arg-type]
    elif isinstance(checkpoint_id, str) and _ascii_digits(checkpoint_id.strip()):
        step = int(checkpoint_id.strip())
    elif (from_path := _step_of_path(checkpoint_id)) is not None:
        step = from_path
    else:
        raise InvalidStepError(
            f"checkpoint_id={checkpoint_id!r} is not a training step: gemini_dcp names checkpoints "
            "by the step number, e.g. dcp.save(sd, storage_writer=w, checkpoint_id=step) with step an int >= 0, "
            "or by a path whose last component is step-<N> (e.g. 'outputs/checkpoint/step-1200')."
        )
    if step < 0:
        raise InvalidStepError(f"checkpoint_id={step} is negative: steps are ints >= 0.")
    if step > MAX_STEP:
        raise InvalidStepError(
            f"checkpoint_id={step} is too large: steps are stored as signed 64-bit ints (at most {MAX_STEP}); "
            "pass a smaller step number (e.g. the step, a token count or a millisecond time fit)."
        )
    return step


__all__ = [
    "DEFAULT_JOB_IDS", "MAX_STEP", "parse_step", "resolve_job_id", "resolve_node_id", "resolve_root",
]
