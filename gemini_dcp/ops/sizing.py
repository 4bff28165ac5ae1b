"""``plan``: replica placement, the probability of recovering from memory, and GEMINI's wasted-time model.

A view for operators over :mod:`gemini_dcp.peer.placement` and :mod:`gemini_dcp.ops.costmodel`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..errors import ConfigError, GeminiError


def plan(
    nodes: int,
    replicas: int,
    strategy: str = "mixed",
    failures: int | None = None,
    *,
    cost: dict[str, Any] | None = None,
    group: int | None = None,
) -> dict[str, Any]:
    """Placement table, P(recover from memory | k simultaneous node failures) for k = 1..``failures``
    (default ``replicas + 1``), and, given ``cost`` (figures for :class:`costmodel.CostInputs`),
    GEMINI's expected wasted time per failure and per day vs persistent-only checkpointing.

    ``strategy="parity"`` with ``group``: XOR parity groups instead, beside ``replicas`` full copies
    (:func:`gemini_dcp.ops.parity_plan.parity_plan`).

    Raises PlacementError / ConfigError with what to change.
    """
    if strategy == "parity":
        from .parity_plan import parity_plan  # noqa: PLC0415 - as the placement below: loaded for plan only

        if group is None:
            raise ConfigError("strategy 'parity' needs the group size: pass --group g (>= 3 nodes per parity group).")
        out = parity_plan(nodes, group, failures, replicas=replicas,
                          checkpoint_gb=(cost or {}).get("checkpoint_gb"))
        return out
    from ..peer.placement import group_formula, place, recovery_probability  # noqa: PLC0415

    pl = place(nodes, replicas, strategy)  # type: ignore[arg-type] - validates sizes and strategy
    if failures is not None and (not isinstance(failures, int) or isinstance(failures, bool) or failures < 1):
        raise ConfigError(f"failures={failures!r}: give the largest number of simultaneous node failures to show (>= 1).")
    k_max = min(nodes, replicas + 1 if failures is None else failures)
    recovery = []
    for k in range(1, k_max + 1):
        row: dict[str, Any] = {"failures": k, "p_recover": recovery_probability(pl, k)}
        if nodes % replicas == 0:
            # The paper's closed form for group placement: exact for k <= m, a lower bound above.
            row["group_formula"] = group_formula(nodes, replicas, k)
        recovery.append(row)
    out: dict[str, Any] = {
        "nodes": nodes, "replicas": replicas, "strategy": strategy,
        "holders": {i: list(h) for i, h in enumerate(pl.holders)},
        "groups": [list(g) for g in pl.groups],
        "table": pl.table(),
        "recovery": recovery,
    }
    if cost:
        from .costmodel import CostInputs, wasted_time  # noqa: PLC0415

        try:
            inputs = CostInputs(**cost)
        except TypeError as exc:
            raise ConfigError(f"wasted-time model: {exc}") from exc
        except ValueError as exc:
            if isinstance(exc, GeminiError):
                raise
            raise ConfigError(f"wasted-time model: {exc}") from exc
        out["cost_inputs"] = dataclasses.asdict(inputs)
        out["wasted_time"] = wasted_time(inputs)
    return out
