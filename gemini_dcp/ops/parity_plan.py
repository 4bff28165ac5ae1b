"""``plan --strategy parity``: XOR parity groups beside ``replicas=m`` for the same nodes.

Pure arithmetic for operators (no torch): the groups :mod:`gemini_dcp.peer.parity_groups`
forms, the exact probability that ``k`` simultaneous node failures leave every group with at
most one lost node (then everything is rebuilt from memory), the memory each node spends
and the bytes each node sends per save, next to the same figures for full replicas.

P(recover | k failures), exact, for groups of sizes ``s_1..s_G`` over ``N`` nodes, failures
uniform over the ``C(N, k)`` sets of ``k`` nodes: the sets that take at most one node of
each group number ``e_k(s_1, .., s_G)`` (the elementary symmetric polynomial: pick ``k``
groups, one node in each), so ``P = e_k(s) / C(N, k)``.
"""

from __future__ import annotations

from fractions import Fraction
from math import comb
from typing import Any

from ..errors import ConfigError
from ..peer.parity_groups import parity_groups
from ..peer.placement import place, recovery_probability

__all__ = ["parity_plan", "parity_recovery_probability"]


def _elementary_symmetric(sizes: list[int], k: int) -> int:
    coeffs = [1] + [0] * k  # coefficients of prod(1 + s x), truncated at x^k
    for s in sizes:
        for j in range(k, 0, -1):
            coeffs[j] += coeffs[j - 1] * s
    return coeffs[k]


def parity_recovery_probability(nodes: int, group: int, failures: int) -> float:
    """Exact P(no parity group loses two nodes) when ``failures`` of ``nodes`` fail at once."""
    return float(_recovery_fraction(nodes, group, failures))


def _recovery_fraction(nodes: int, group: int, failures: int) -> Fraction:
    if failures <= 0:
        return Fraction(1)
    if failures > nodes:
        return Fraction(0)
    sizes = [len(g) for g in parity_groups([str(i) for i in range(nodes)], group)]
    return Fraction(_elementary_symmetric(sizes, failures), comb(nodes, failures))


def parity_plan(
    nodes: int, group: int, failures: int | None = None, *, replicas: int = 2, keep: int = 2,
    checkpoint_gb: float | None = None,
) -> dict[str, Any]:
    """Parity groups, P(recover from memory) for k = 1..``failures`` (default: number of groups + 1),
    memory per node and bytes sent per node per save, each beside ``replicas`` full copies.

    Memory counts the ring: ``keep + 1`` slots of data plus, with parity, ``keep + 1`` parity
    slots of ``1/(s-1)`` of a checkpoint (``s``: the node's group size; the last group may be
    larger, see :func:`gemini_dcp.peer.parity_groups.parity_groups`). Raises ConfigError with
    what to change.
    """
    if not isinstance(nodes, int) or nodes < 2:
        raise ConfigError(f"nodes={nodes!r}: parity needs at least 2 nodes (give --nodes >= 2).")
    if not isinstance(group, int) or isinstance(group, bool) or group < 3:
        raise ConfigError(f"group={group!r}: give --group >= 3 (nodes per parity group).")
    if failures is not None and (not isinstance(failures, int) or failures < 1):
        raise ConfigError(f"failures={failures!r}: give the largest number of simultaneous node failures to show (>= 1).")
    groups = parity_groups(list(range(nodes)), group)  # type: ignore[arg-type]
    k_max = min(nodes, len(groups) + 1 if failures is None else failures)
    m = min(replicas, nodes)
    rep = place(nodes, m, "mixed") if m > 1 else None
    recovery = [
        {"failures": k, "p_recover": parity_recovery_probability(nodes, group, k),
         "p_recover_replicas": recovery_probability(rep, k) if rep is not None else (1.0 if k == 0 else 0.0)}
        for k in range(1, k_max + 1)
    ]
    worst = max(1 / (len(g) - 1) for g in groups)  # parity of a node, in checkpoints
    slots = keep + 1
    out: dict[str, Any] = {
        "nodes": nodes, "group": group, "strategy": "parity", "replicas_compared": m, "keep": keep,
        "groups": [list(g) for g in groups],
        "recovery": recovery,
        # in checkpoints (one node's checkpoint = 1)
        "parity_per_checkpoint": worst,
        "memory_per_node": slots * (1 + worst),
        "memory_per_node_replicas": slots * m,
        "sent_per_node_per_save": 1.0,  # n-1 stripes of 1/(n-1): S
        "sent_per_node_per_save_replicas": float(m - 1),
    }
    if checkpoint_gb is not None:
        out["checkpoint_gb"] = checkpoint_gb
        for key in ("memory_per_node", "memory_per_node_replicas", "sent_per_node_per_save", "sent_per_node_per_save_replicas"):
            out[key + "_gb"] = out[key] * checkpoint_gb
    return out
