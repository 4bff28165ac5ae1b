"""``GeminiOptions``: the whole options tree, and how it merges with the writer's and reader's keywords.

``GeminiOptions.from_env()`` reads every ``GEMINI_DCP_*`` variable of the tiers (root, node id,
drain, peer transport); ``resolve_options(options, **keywords)`` is what ``GeminiStorageWriter`` /
``GeminiStorageReader`` call first, before any side effect. The async checkpointer's
interleaving knobs stay :class:`gemini_dcp.snapshot.InterleaveOptions` (given to
``AsyncCheckpointer``, not to a storage writer). Torch-free.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from .checks import DEFAULT_TIMEOUT_S, check_timeout
from .health import NonfiniteMode, check_nonfinite, nonfinite_from_env
from .incremental import IncrementalOptions
from .local import LocalOptions
from .peer import (
    PeerOptions,
    PeerTransport,
    check_failure_domain,
    check_peer_transport,
    failure_domain_from_env,
    peer_transport_from_env,
)
from .persistent import DrainOptions, PersistentOptions

__all__ = ["KEYWORDS", "GeminiOptions", "resolve_options"]

# A writer / reader keyword -> (section of the tree or None for the top, field).
KEYWORDS: dict[str, tuple[str | None, str]] = {
    "root": ("local", "root"),
    "job_id": ("local", "job_id"),
    "keep": ("local", "keep"),
    "checksum": ("local", "checksum"),
    "capacity_bytes": ("local", "capacity_bytes"),
    "replicas": ("peer", "replicas"),
    "placement": ("peer", "placement"),
    "on_peer_failure": ("peer", "on_peer_failure"),
    "parity_group": ("peer", "parity_group"),
    "incremental": ("incremental", "enabled"),
    "full_every": ("incremental", "full_every"),
    "timeout_s": (None, "timeout_s"),
    "nonfinite": (None, "nonfinite"),
    "peer_transport": (None, "peer_transport"),
    "failure_domain": (None, "failure_domain"),
    "persistent": ("persistent", "url"),
    "persist_every": ("persistent", "every"),
    "persist_keep": ("persistent", "keep"),
    "persist_keep_every": ("persistent", "keep_every"),
}


@dataclass(frozen=True, slots=True, kw_only=True)
class GeminiOptions:
    """Every option of the tiers: ``local``, ``peer``, ``persistent`` (with its ``drain``), what a
    save copies (``incremental``), the ``timeout_s`` of checkpoint collectives, peer transfers and
    store calls, and what moves the peer tier's bytes (``peer_transport``)."""

    local: LocalOptions = field(default_factory=LocalOptions)
    peer: PeerOptions = field(default_factory=PeerOptions)
    persistent: PersistentOptions = field(default_factory=PersistentOptions)
    incremental: IncrementalOptions = field(default_factory=IncrementalOptions)
    timeout_s: float = DEFAULT_TIMEOUT_S
    nonfinite: NonfiniteMode = "mark"
    """What a save does with NaN/Inf values: ``"mark"`` (default), ``"refuse"`` or ``"ignore"``
    (:mod:`gemini_dcp.options.health`; ``$GEMINI_DCP_NONFINITE``)."""
    peer_transport: PeerTransport = "gloo"
    """What moves the peer tier's bytes (replicas, parity stripes, lost-node restores): ``"gloo"``
    (torch.distributed over TCP), ``"nixl"`` (NIXL one-sided WRITEs over UCX: RDMA, shared memory;
    ConfigError at the first transfer when a rank cannot start it) or ``"auto"`` (NIXL where every
    rank starts it, else gloo). The same on every rank. ``$GEMINI_DCP_PEER_TRANSPORT``."""
    failure_domain: str | None = None
    """This node's failure domain: what fails together with it (a rack, a top-of-rack switch, a power
    feed, an NVLink domain), as a name; the same on every rank of a node. Peer placement (replicas and
    parity groups) puts each node's copies in as many distinct domains as exist. None (default): not
    known, copies are placed by node position only. ``$GEMINI_DCP_FAILURE_DOMAIN``; docs/placement.md."""

    def __post_init__(self) -> None:
        for name, kind in (("local", LocalOptions), ("peer", PeerOptions), ("persistent", PersistentOptions),
                           ("incremental", IncrementalOptions)):
            if not isinstance(getattr(self, name), kind):
                raise ConfigError(f"{name}={getattr(self, name)!r}: give a {kind.__name__}.")
        check_timeout(self.timeout_s)
        check_nonfinite(self.nonfinite)
        check_peer_transport(self.peer_transport)
        check_failure_domain(self.failure_domain)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **keywords: Any) -> "GeminiOptions":
        """The environment (root, node id, parity group, incremental saves, drain settings) under the
        writer-style ``keywords`` (``root=...``, ``replicas=...``, ``persistent=...``: see
        :data:`KEYWORDS`), which win."""
        base = cls(
            local=LocalOptions.from_env(environ),
            peer=PeerOptions.from_env(environ),
            persistent=PersistentOptions.from_env(environ),
            incremental=IncrementalOptions.from_env(environ),
            nonfinite=nonfinite_from_env(environ),
            peer_transport=peer_transport_from_env(environ),
            failure_domain=failure_domain_from_env(environ),
        )
        return base.with_keywords(**keywords)

    def with_keywords(self, **keywords: Any) -> "GeminiOptions":
        """This tree with writer-style ``keywords`` replacing its fields (validated)."""
        sections: dict[str, dict[str, Any]] = {}
        top: dict[str, Any] = {}
        for kw, value in keywords.items():
            where = KEYWORDS.get(kw)
            if where is None:
                raise ConfigError(f"{kw}= is not an option of gemini_dcp; the keywords are {', '.join(KEYWORDS)}.")
            section, name = where
            (top if section is None else sections.setdefault(section, {}))[name] = value
        new = {s: dataclasses.replace(getattr(self, s), **vals) for s, vals in sections.items()}
        return dataclasses.replace(self, **new, **top)

    @property
    def persistent_timeout_s(self) -> float:
        """The deadline of every store call: the persistent tier's own, else the tree's."""
        return self.persistent.timeout_s if self.persistent.timeout_s is not None else self.timeout_s


def _default_of(keyword: str) -> Any:
    section, name = KEYWORDS[keyword]
    owner: Any = GeminiOptions if section is None else {
        "local": LocalOptions, "peer": PeerOptions, "persistent": PersistentOptions,
        "incremental": IncrementalOptions}[section]
    return owner.__dataclass_fields__[name].default


def _is_default(value: Any, default: Any) -> bool:
    if value is None or default is None:
        return value is default
    if isinstance(value, bool) or isinstance(default, bool):
        return type(value) is type(default) and value == default
    if isinstance(value, (int, float)) and isinstance(default, (int, float)):
        return value == default
    return type(value) is type(default) and value == default


def _value_at(options: GeminiOptions, keyword: str) -> Any:
    section, name = KEYWORDS[keyword]
    return getattr(options if section is None else getattr(options, section), name)


def resolve_options(options: GeminiOptions | None, /, **keywords: Any) -> GeminiOptions:
    """The validated tree of a writer or reader: ``options`` merged with its keyword arguments.

    Without ``options``: the keywords, with the drain settings from the environment when a
    persistent tier is given (root and node id, when not given, are resolved from the
    environment when the tier is opened).
    With ``options``: a keyword left at its default takes the options' value; a keyword given
    takes the place of an options field left at its default; a keyword and an options field
    both set, to different values, is a ConfigError naming both; the options' drain settings
    are used as given (``GeminiOptions.from_env()`` takes the environment's). No side effect:
    nothing is created or started here.
    """
    if options is None:
        # The drain settings matter (and a bad one fails) only where there is a store to drain to.
        drain = DrainOptions.from_env() if keywords.get("persistent") is not None else DrainOptions()
        if keywords.get("nonfinite", "mark") == "mark":  # left at its default: the environment's
            keywords = {**keywords, "nonfinite": nonfinite_from_env()}
        if keywords.get("peer_transport") is None:  # not given: $GEMINI_DCP_PEER_TRANSPORT, else gloo
            keywords = {**keywords, "peer_transport": peer_transport_from_env()}
        if keywords.get("failure_domain") is None:  # not given: $GEMINI_DCP_FAILURE_DOMAIN, else unknown
            keywords = {**keywords, "failure_domain": failure_domain_from_env()}
        return GeminiOptions(persistent=PersistentOptions(drain=drain)).with_keywords(**keywords)
    if not isinstance(options, GeminiOptions):
        raise ConfigError(
            f"options={options!r}: give a gemini_dcp.options.GeminiOptions (e.g. GeminiOptions.from_env()), or None."
        )
    given: dict[str, Any] = {}
    for kw, value in keywords.items():
        if kw in ("peer_transport", "failure_domain") and value is None:  # not given: the options' value
            continue
        default = _default_of(kw)
        if _is_default(value, default):
            continue
        current = _value_at(options, kw)
        if not _is_default(current, default) and current != value:
            section, name = KEYWORDS[kw]
            where = f"options.{section}.{name}" if section else f"options.{name}"
            raise ConfigError(
                f"{kw}={value!r} conflicts with {where}={current!r}: give it in one place (drop the keyword, "
                f"or build the options with {name}={value!r})."
            )
        given[kw] = value
    return options.with_keywords(**given)
