"""Options of the persistent tier (an fsspec store) and of the drain that fills it.

:class:`DrainOptions` is built once, in the training process (``DrainOptions.from_env()`` is the
only reader of the ``GEMINI_DCP_DRAIN_*`` variables), and handed to the drain server as a
JSON record (``to_json`` / ``from_json``): a bad value fails where the writer is built, never
inside the detached drain process. Torch-free.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from ..errors import ConfigError
from .checks import check_choice, check_int, check_number, check_optional_int, check_timeout
from .env import env_bool, env_choice, env_float, env_int, env_str

__all__ = [
    "DRAIN_ENV", "DrainMode", "DrainOptions", "PersistentOptions",
    "ENV_ATTEMPTS", "ENV_BRIDGE", "ENV_IDLE", "ENV_MODE", "ENV_NICE", "ENV_PEER_TIMEOUT", "ENV_THREADS", "ENV_THROTTLE",
]

ENV_MODE = "GEMINI_DCP_DRAIN_MODE"  # "process" (default) or "thread"
ENV_IDLE = "GEMINI_DCP_DRAIN_IDLE_S"  # a drain server exits after this many idle seconds (default 60)
ENV_THROTTLE = "GEMINI_DCP_DRAIN_THROTTLE_BPS"  # cap on upload bytes/s (tests; shared links)
ENV_PEER_TIMEOUT = "GEMINI_DCP_DRAIN_PEER_TIMEOUT_S"  # rank 0's node waits this long for other parts (3600)
ENV_NICE = "GEMINI_DCP_DRAIN_NICE"  # niceness of the drain process (default 10: training first), or "idle"
ENV_THREADS = "GEMINI_DCP_DRAIN_THREADS"  # files written in parallel per node (default 2)
ENV_ATTEMPTS = "GEMINI_DCP_DRAIN_ATTEMPTS"  # upload attempts of a step before it is abandoned (default 5)
ENV_BRIDGE = "GEMINI_DCP_DRAIN_BRIDGE"  # 0: a step due while the drain process starts waits for it (default 1)
DRAIN_ENV = (ENV_MODE, ENV_IDLE, ENV_THROTTLE, ENV_PEER_TIMEOUT, ENV_NICE, ENV_THREADS, ENV_ATTEMPTS, ENV_BRIDGE)

DrainMode = Literal["auto", "process", "thread"]
DRAIN_OPTIONS_VERSION = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class DrainOptions:
    """How the background drain runs.

    mode: ``"process"`` (a detached server), ``"thread"`` (a thread of the training process),
    or ``"auto"`` (default: thread for ``memory://`` stores, which live in one process, else process).
    idle_s: a drain server exits after this many seconds with nothing to do.
    throttle_bps: cap on upload bytes per second (None: no cap).
    peer_timeout_s: how long the node of rank 0 waits for the other nodes' parts of a step.
    nice: niceness added to the drain process (training first), or ``"idle"`` (SCHED_IDLE).
    threads: data files written in parallel per node.
    attempts: upload attempts of a step before its drain is abandoned.
    bridge: a step due while the node's drain process still imports torch is uploaded by a thread
        of the training process until that process is warm (default True: the first durable save
        of a process is as fast as later ones); False: it waits for the drain process, and no
        upload ever runs in the training process (process mode).
    """

    mode: DrainMode = "auto"
    idle_s: float = 60.0
    throttle_bps: float | None = None
    peer_timeout_s: float = 3600.0
    nice: int | Literal["idle"] = 10
    threads: int = 2
    attempts: int = 5
    bridge: bool = True

    def __post_init__(self) -> None:
        check_choice(self.mode, "drain mode", ("auto", "process", "thread"),
                     f"choose 'process' (default) or 'thread' (${ENV_MODE}), or 'auto'.")
        check_number(self.idle_s, "drain idle_s", minimum=0.0,
                     fix=f"give the seconds a drain server idles before it exits, >= 0 (${ENV_IDLE}, default 60).")
        if self.throttle_bps is not None:
            check_number(self.throttle_bps, "drain throttle_bps", minimum=0.0,
                         fix=f"give a cap in bytes per second > 0, or None for none (${ENV_THROTTLE}).")
            if self.throttle_bps == 0:
                object.__setattr__(self, "throttle_bps", None)  # 0 means no cap, as the variable says
        check_timeout(self.peer_timeout_s, "drain peer_timeout_s")
        if self.nice != "idle":
            check_int(self.nice, "drain nice", minimum=-20,
                      fix=f"give a niceness -20..19 (default 10) or 'idle' (${ENV_NICE}).")
            if self.nice > 19:
                raise ConfigError(f"drain nice={self.nice!r}: give a niceness -20..19 (default 10) or 'idle' (${ENV_NICE}).")
        check_int(self.threads, "drain threads", minimum=1,
                  fix=f"give the data files written in parallel per node, an int >= 1 (${ENV_THREADS}, default 2).")
        check_int(self.attempts, "drain attempts", minimum=1,
                  fix=f"give the upload attempts of a step, an int >= 1 (${ENV_ATTEMPTS}, default 5).")
        if not isinstance(self.bridge, bool):
            raise ConfigError(f"drain bridge={self.bridge!r}: give True (default) or False (${ENV_BRIDGE}=1 or 0).")

    def resolved_mode(self, protocol: str) -> Literal["process", "thread"]:
        """The mode for a store of ``protocol``: ``auto`` is a thread for ``memory://``, else a process."""
        if self.mode == "auto":
            return "thread" if protocol == "memory" else "process"
        return self.mode

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "DrainOptions":
        """The ``GEMINI_DCP_DRAIN_*`` variables (unset: the defaults); ConfigError names a bad one."""
        nice_raw = env_str(ENV_NICE, None, environ)
        nice: int | Literal["idle"] = 10
        if nice_raw is not None:
            nice = "idle" if nice_raw.lower() == "idle" else env_int(ENV_NICE, 10, minimum=-20, environ=environ)
            if nice != "idle" and nice > 19:
                raise ConfigError(f"{ENV_NICE}={nice_raw!r} is above 19; set a niceness -20..19 (default 10), "
                                  "or 'idle', or unset it.")
        throttle = env_float(ENV_THROTTLE, 0.0, minimum=0.0, environ=environ)
        return cls(
            mode=env_choice(ENV_MODE, ("process", "thread"), "auto", environ),  # type: ignore[arg-type]
            idle_s=env_float(ENV_IDLE, 60.0, minimum=0.0, environ=environ),
            throttle_bps=throttle or None,
            peer_timeout_s=env_float(ENV_PEER_TIMEOUT, 3600.0, environ=environ),
            nice=nice,
            threads=env_int(ENV_THREADS, 2, minimum=1, environ=environ),
            attempts=env_int(ENV_ATTEMPTS, 5, minimum=1, environ=environ),
            bridge=env_bool(ENV_BRIDGE, True, environ),
        )

    def to_dict(self) -> dict[str, Any]:
        return {"version": DRAIN_OPTIONS_VERSION, **asdict(self)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "DrainOptions":
        """Decode :meth:`to_dict`; a newer or unknown version, or an unknown field, is a ConfigError."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"drain options {data!r} are not a JSON object: they were not written by gemini_dcp.")
        version = data.get("version")
        if version != DRAIN_OPTIONS_VERSION:
            raise ConfigError(
                f"drain options of version {version!r}: this gemini_dcp reads version {DRAIN_OPTIONS_VERSION}. "
                "Run the drain with the gemini_dcp of the trainer that started it (upgrade it on every node)."
            )
        fields = {k: v for k, v in data.items() if k != "version"}
        unknown = set(fields) - set(cls.__dataclass_fields__)
        if unknown:
            raise ConfigError(f"drain options name unknown fields {sorted(unknown)}: written by another gemini_dcp version.")
        return cls(**fields)

    @classmethod
    def from_json(cls, text: str | bytes) -> "DrainOptions":
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"drain options are not valid JSON ({exc}).") from None
        return cls.from_dict(data)


@dataclass(frozen=True, slots=True, kw_only=True)
class PersistentOptions:
    """The persistent tier: ``url`` None means none (the other fields are still validated).

    every: drain every K-th committed step. keep / keep_every: retention in the store
    (None: keep all). storage_options: passed to fsspec. timeout_s: None takes the
    writer's / reader's ``timeout_s`` (every store call is bounded by it).
    """

    url: str | None = None
    every: int = 10
    keep: int | None = 2
    keep_every: int | None = None
    storage_options: Mapping[str, Any] | None = None
    timeout_s: float | None = None
    drain: DrainOptions = field(default_factory=DrainOptions)

    def __post_init__(self) -> None:
        if self.url is not None and (not isinstance(self.url, (str, os.PathLike)) or not str(self.url).strip()):
            raise ConfigError(f"persistent={self.url!r}: give the fsspec URL of the persistent tier, or None.")
        check_int(self.every, "persist_every", minimum=1, fix="drain every K-th step with K an int >= 1.")
        check_optional_int(self.keep, "persist_keep", minimum=1, fix="give an int >= 1, or None.")
        check_optional_int(self.keep_every, "persist_keep_every", minimum=1, fix="give an int >= 1, or None.")
        if self.storage_options is not None and not isinstance(self.storage_options, Mapping):
            raise ConfigError(f"storage_options={self.storage_options!r}: give a dict of fsspec options, or None.")
        if self.timeout_s is not None:
            check_timeout(self.timeout_s, "persistent timeout_s")
        if not isinstance(self.drain, DrainOptions):
            raise ConfigError(f"drain={self.drain!r}: give a DrainOptions (e.g. DrainOptions.from_env()).")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **kwargs: Any) -> "PersistentOptions":
        """``kwargs`` with the drain options taken from the ``GEMINI_DCP_DRAIN_*`` variables unless given."""
        kwargs.setdefault("drain", DrainOptions.from_env(environ))
        return cls(**kwargs)

