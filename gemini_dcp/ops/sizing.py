"""``plan``: replica placement, the probability of recovering from memory, and GEMINI's wasted-time model.

A view for operators over :mod:`gemini_dcp.peer.placement` and :mod:`gemini_dcp.ops.costmodel`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import ConfigError, GeminiError


def parse_domains(spec: str | Sequence[str], nodes: int) -> list[str]:
    """Each node's failure domain (node ``i``: entry ``i``) from ``spec``: ``"DxN"`` (``D`` domains of ``N``
    consecutive nodes: ``4x4``), sizes ``"3,3,2"`` (consecutive nodes per domain), a file with one domain
    name per line (node order; blank lines and ``#`` comments skipped), or a list of names.
    Raises ConfigError unless it names exactly ``nodes`` nodes."""
    if not isinstance(spec, str):
        names = [str(x) for x in spec]
    else:
        text = spec.strip()
        path = Path(text).expanduser()
        if re.fullmatch(r"\d+x\d+", text):
            d, n = (int(x) for x in text.split("x"))
            names = [f"d{i // n}" for i in range(d * n)] if n else []
        elif re.fullmatch(r"\d+(,\d+)+|\d+", text) and not path.is_file():
            names = [f"d{i}" for i, size in enumerate(int(x) for x in text.split(",")) for _ in range(size)]
        elif path.is_file():
            lines = [ln.split("#", 1)[0].strip() for ln in path.read_text().splitlines()]
            names = [ln for ln in lines if ln]
        else:
            raise ConfigError(f"domains {spec!r}: give DxN (D domains of N consecutive nodes, e.g. 4x4), sizes "
                              "such as 3,3,2, or a file with one domain name per node, one per line.")
    if len(names) != nodes:
        raise ConfigError(f"domains {spec!r} names {len(names)} node(s) but --nodes is {nodes}: make them agree.")
    return names


def plan(
    nodes: int,
    replicas: int,
    strategy: str = "mixed",
    failures: int | None = None,
    *,
    cost: dict[str, Any] | None = None,
    group: int | None = None,
    domains: str | Sequence[str] | None = None,
) -> dict[str, Any]:
    """Placement table, P(recover from memory | k simultaneous node failures) for k = 1..``failures``
    (default ``replicas + 1``), and, given ``cost`` (figures for :class:`costmodel.CostInputs`),
    GEMINI's expected wasted time per failure and per day vs persistent-only checkpointing.

    ``strategy="parity"`` with ``group``: XOR parity groups instead, beside ``replicas`` full copies
    (:func:`gemini_dcp.ops.parity_plan.parity_plan`).

    ``domains`` (see :func:`parse_domains`): adds ``domain_recovery``, per strategy (group, ring, mixed,
    and parity with ``group``), P(recover from memory) when one whole failure domain fails, with the
    positions domain-blind (node order: a job without ``failure_domain``) and spread over the domains
    (:func:`gemini_dcp.peer.placement.spread_over_domains`: a job that names its domains), beside
    P(recover) for ``replicas`` random node failures.

    Raises PlacementError / ConfigError with what to change.
    """
    if strategy == "parity":
        from .parity_plan import parity_plan  # noqa: PLC0415 - as the placement below: loaded for plan only

        if group is None:
            raise ConfigError("strategy 'parity' needs the group size: pass --group g (>= 3 nodes per parity group).")
        out = parity_plan(nodes, group, failures, replicas=replicas,
                          checkpoint_gb=(cost or {}).get("checkpoint_gb"))
        if domains is not None:
            out["domains"] = parse_domains(domains, nodes)
            out["domain_recovery"] = domain_recovery(out["domains"], replicas, group)
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
    if domains is not None:
        out["domains"] = parse_domains(domains, nodes)
        out["domain_recovery"] = domain_recovery(out["domains"], replicas, group)
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


def domain_recovery(domains: Sequence[str], replicas: int, group: int | None = None) -> list[dict[str, Any]]:
    """Per strategy: P(recover from memory) when one whole failure domain fails (uniformly one of the
    distinct domains), domain-blind and spread, and P(recover) for ``random_failures`` random node failures
    (``replicas``; 2 for parity, the first count a parity group cannot always survive)."""
    from ..peer.parity_groups import parity_groups  # noqa: PLC0415
    from ..peer.placement import STRATEGIES, place_over_domains, recovery_probability, spread_over_domains  # noqa: PLC0415
    from .parity_plan import parity_recovery_probability  # noqa: PLC0415

    n = len(domains)
    m = min(replicas, n)
    rows: list[dict[str, Any]] = []
    for strategy in STRATEGIES:
        if strategy == "group" and n % m:
            continue
        blind = place_over_domains(domains, m, strategy, spread=False)  # type: ignore[arg-type]
        spread = place_over_domains(domains, m, strategy)  # type: ignore[arg-type]
        rows.append({"strategy": strategy, "replicas": m, "random_failures": m,
                     "p_random_failures": recovery_probability(spread, m),
                     "p_domain_blind": recovery_probability(blind, 1, domains=domains),
                     "p_domain_spread": recovery_probability(spread, 1, domains=domains)})
    if group is not None and n >= 2:
        ids = [str(i) for i in range(n)]
        names = sorted(set(domains))

        def survives(order: list[str]) -> float:
            groups = parity_groups(order, group)
            ok = sum(all(sum(domains[int(x)] == d for x in g) <= 1 for g in groups) for d in names)
            return ok / len(names) if len(names) > 1 else 0.0

        rows.append({"strategy": "parity", "group": group, "random_failures": 2,
                     "p_random_failures": parity_recovery_probability(n, group, 2),
                     "p_domain_blind": survives(ids),
                     "p_domain_spread": survives(spread_over_domains(ids, dict(zip(ids, domains)), group,
                                                                     parity_groups(list(range(n)), group), 2))})  # type: ignore[arg-type]
    return rows
