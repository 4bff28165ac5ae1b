"""Options of the local (node memory) tier: where the tier lives, which node this is, what it keeps.

Also the environment variables of the local tier (``GEMINI_DCP_ROOT``, ``GEMINI_DCP_NODE_ID``):
:func:`root_from_env` / :func:`node_id_from_env` are the only readers of them. Torch-free.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from ..errors import ConfigError
from .checks import check_choice, check_int, check_optional_int, check_path
from .env import env_str

__all__ = [
    "ENV_JOB_ID", "job_id_from_env",
    "DEFAULT_KEEP", "DEFAULT_ROOT", "ENV_NODE_ID", "ENV_ROOT", "ChecksumAlgo", "LocalOptions",
    "node_id_from_env", "root_from_env",
]

DEFAULT_ROOT = "/dev/shm/gemini_dcp"
"""The tier root when neither ``root=`` nor ``$GEMINI_DCP_ROOT`` is given."""
DEFAULT_KEEP = 2
"""Committed steps kept in a node's memory (``keep=``)."""
ENV_ROOT = "GEMINI_DCP_ROOT"  # tier root of this node (default DEFAULT_ROOT)
ENV_NODE_ID = "GEMINI_DCP_NODE_ID"  # identity of this node (default <hostname>:<root>)
ENV_JOB_ID = "GEMINI_DCP_JOB_ID"  # the job (default $TORCHELASTIC_RUN_ID, else "default")

ChecksumAlgo = Literal["auto", "xxh3", "crc32c", "xsum64"]
_JOB_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def root_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """``$GEMINI_DCP_ROOT`` (stripped), or None when unset or blank."""
    return env_str(ENV_ROOT, None, environ)


def job_id_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """``$GEMINI_DCP_JOB_ID`` (stripped), or None when unset or blank."""
    return env_str(ENV_JOB_ID, None, environ)


def node_id_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """``$GEMINI_DCP_NODE_ID`` (stripped), or None when unset or blank."""
    return env_str(ENV_NODE_ID, None, environ)


@dataclass(frozen=True, slots=True, kw_only=True)
class LocalOptions:
    """The node's memory tier.

    ``root`` None: ``$GEMINI_DCP_ROOT``, else ``/dev/shm/gemini_dcp`` (resolved when the tier
    is opened). ``job_id`` None: ``$GEMINI_DCP_JOB_ID``, else ``$TORCHELASTIC_RUN_ID``, else ``"default"``. ``node_id``
    None: ``$GEMINI_DCP_NODE_ID``, else ``<hostname>:<root>``.
    """

    root: str | os.PathLike[str] | None = None
    job_id: str | None = None
    node_id: str | None = None
    keep: int = DEFAULT_KEEP
    """Committed steps kept in memory (>= 1); the newest committed step is never evicted before a newer one commits."""
    checksum: ChecksumAlgo = "auto"
    """The shards' checksum: ``"auto"`` (crc32c through the extension, else xxh3), ``"xxh3"``, ``"crc32c"``
    or ``"xsum64"`` (the GPU checksum)."""
    capacity_bytes: int | None = None
    """A cap on this job's bytes in the tier root (None: the root's free space is the limit)."""

    def __post_init__(self) -> None:
        check_path(self.root, "root", "pass the tier root as a str or pathlib.Path (e.g. root='/dev/shm/gemini_dcp'), "
                   f"or leave it unset to use ${ENV_ROOT}.")
        if self.job_id is not None and self.job_id != "" and (
            not isinstance(self.job_id, str) or not _JOB_RE.match(self.job_id)
        ):
            raise ConfigError(
                f"job_id {self.job_id!r} is not usable as a directory name: use 1-128 characters "
                "from letters, digits, '.', '_' and '-', starting with a letter or digit."
            )
        if self.node_id is not None and (not isinstance(self.node_id, str) or not self.node_id.strip()):
            raise ConfigError(f"node_id={self.node_id!r}: give a non-empty string, or None for <hostname>:<root>.")
        check_int(self.keep, "keep", minimum=1, fix=f"keep at least 1 committed step (default {DEFAULT_KEEP}).")
        check_choice(
            self.checksum, "checksum", ("auto", "xxh3", "crc32c", "xsum64"),
            "choose 'auto' (default: crc32c when the C++ extension is built, else xxh3), 'xxh3', 'crc32c' or "
            "'xsum64' (the GPU checksum; CUDA tensors use it by default, see GEMINI_DCP_D2H_CHECKSUM).",
        )
        check_optional_int(self.capacity_bytes, "capacity_bytes", minimum=1, fix="give a positive byte budget or None.")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **kwargs: object) -> "LocalOptions":
        """``kwargs`` with ``root`` / ``node_id`` taken from the environment where not given."""
        kwargs.setdefault("root", root_from_env(environ))
        kwargs.setdefault("node_id", node_id_from_env(environ))
        return cls(**kwargs)  # type: ignore[arg-type]
