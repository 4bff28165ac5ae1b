"""Options of the peer tier: how many copies of each node's shards, placed where, and what a failed copy does.

Torch-free. The wire message size of a paced replication follows the async checkpointer's
pacer (``gemini_dcp.snapshot``), not an option here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from ..errors import ConfigError
from .checks import check_choice, check_int
from .env import env_choice, env_int, env_str, raw

__all__ = [
    "ENV_PARITY_GROUP", "ENV_PEER_TRANSPORT", "PEER_TRANSPORTS", "OnPeerFailure", "PeerOptions", "PeerTransport",
    "PlacementStrategy", "check_peer_transport", "peer_transport_from_env",
]

ENV_PARITY_GROUP = "GEMINI_DCP_PARITY_GROUP"  # XOR parity over groups of this many nodes (docs/parity.md)
ENV_PEER_TRANSPORT = "GEMINI_DCP_PEER_TRANSPORT"  # what moves the peer tier's bytes (gloo | nixl | auto)

PeerTransport = Literal["gloo", "nixl", "auto"]
PEER_TRANSPORTS: tuple[str, ...] = ("gloo", "nixl", "auto")


def check_peer_transport(value: object) -> None:
    """ConfigError unless ``value`` is one of :data:`PEER_TRANSPORTS`."""
    check_choice(value, "peer_transport", PEER_TRANSPORTS,
                 "choose 'gloo' (default: torch.distributed over TCP), 'nixl' (NIXL one-sided transfers over UCX: "
                 "RDMA, shared memory; pip install --no-deps nixl-cu12 numpy) or 'auto' (NIXL where every rank "
                 "starts it, else gloo).")


def peer_transport_from_env(environ: Mapping[str, str] | None = None) -> PeerTransport:
    """``$GEMINI_DCP_PEER_TRANSPORT`` (gloo, nixl or auto; unset: gloo)."""
    return env_choice(ENV_PEER_TRANSPORT, PEER_TRANSPORTS, "gloo", environ)  # type: ignore[return-value]

ENV_FAILURE_DOMAIN = "GEMINI_DCP_FAILURE_DOMAIN"  # this node's failure domain (rack, switch, power feed)
_DOMAIN_MAX = 128


def check_failure_domain(value: object) -> None:
    """ConfigError unless ``value`` is None or a printable name of 1-128 characters."""
    if value is None:
        return
    if not isinstance(value, str) or not value or len(value) > _DOMAIN_MAX or not value.isprintable():
        raise ConfigError(
            f"failure_domain={value!r}: give the name of this node's failure domain (what fails together: a rack, "
            f"a top-of-rack switch, a power feed), a printable string of 1-{_DOMAIN_MAX} characters, the same on "
            "every rank of a node; or None when unknown (copies are then placed by node position only). "
            "docs/placement.md shows how to derive it from SLURM, a hostname or a Kubernetes node label.")


def failure_domain_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """``$GEMINI_DCP_FAILURE_DOMAIN`` (unset or empty: None)."""
    value = env_str(ENV_FAILURE_DOMAIN, None, environ)
    value = value.strip() if value is not None else None
    check_failure_domain(value or None)
    return value or None


PlacementStrategy = Literal["mixed", "group", "ring"]
OnPeerFailure = Literal["raise", "degrade"]


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerOptions:
    """``replicas`` counts the node's own copy (1: local only; 2: one peer copy). ``parity_group``:
    instead of replicas, XOR parity over groups of this many nodes (>= 3; requires ``replicas=1``)."""

    replicas: int = 1
    placement: PlacementStrategy = "mixed"
    """Which nodes hold whose copies: ``"group"``, ``"ring"`` or ``"mixed"`` (GEMINI's placements; default mixed)."""
    on_peer_failure: OnPeerFailure = "raise"
    """A failed or corrupt peer transfer: ``"raise"`` fails the save (``PeerError``); ``"degrade"`` commits with
    fewer replicas and warns."""
    parity_group: int | None = None

    def __post_init__(self) -> None:
        check_int(self.replicas, "replicas", minimum=1, fix=(
            "replicas counts the node's own copy, so it must be an int >= 1 (2 = one extra copy on a peer node)."))
        check_choice(self.placement, "placement", ("mixed", "group", "ring"),
                     "choose 'mixed' (default), 'group' or 'ring'.")
        check_choice(self.on_peer_failure, "on_peer_failure", ("raise", "degrade"),
                     "choose 'raise' (fail the save) or 'degrade' (commit with fewer replicas and warn).")
        g = self.parity_group
        if g is not None:
            check_int(g, "parity_group", minimum=3, fix=(
                "pass an int >= 3 (nodes per XOR parity group; each node then keeps 1/(parity_group-1) of a "
                "checkpoint in parity), or leave it None for no parity."))
            if self.replicas > 1:
                raise ConfigError(
                    f"parity_group={g} and replicas={self.replicas} both protect the peer tier: choose one. Set "
                    "replicas=1 to use XOR parity (one lost node per group, ~1/(g-1) of a checkpoint per node), or "
                    f"drop parity_group to keep {self.replicas - 1} full peer "
                    f"cop{'y' if self.replicas == 2 else 'ies'}."
                )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "PeerOptions":
        """``$GEMINI_DCP_PARITY_GROUP`` (an int >= 3; unset: no parity); the rest at their defaults."""
        group = env_int(ENV_PARITY_GROUP, 0, minimum=3, environ=environ) if raw(ENV_PARITY_GROUP, environ) else None
        return cls(parity_group=group)
