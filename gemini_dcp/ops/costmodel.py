"""GEMINI's wasted-time model, for the CLI's ``plan`` command.

A failure wastes, on average (GEMINI, SOSP'23, section 3)::

    t_ckpt + interval / 2 + t_rtvl

the checkpoint time (a failure during a checkpoint rolls back to the previous one), half
the checkpoint interval (progress lost since the last complete checkpoint), and the time to
retrieve the checkpoint. The interval can be no shorter than one checkpoint or one iteration.

:func:`wasted_time` compares gemini_dcp (checkpoint into CPU memory as often as possible,
retrieve from a peer's memory) with persistent-only checkpointing (to remote storage, every
``persistent_interval_s`` or as often as possible). Pure Python; no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["CostInputs", "wasted_time"]


@dataclass(frozen=True, slots=True, kw_only=True)
class CostInputs:
    """Figures for the wasted-time model; sizes in GB (1e9 bytes), bandwidths in GB/s, times in s.

    Attributes:
        checkpoint_gb: checkpoint size per node.
        iteration_s: time of one training iteration.
        memory_bw_gbps: GB/s at which a node's checkpoint reaches CPU memory, the peers'
            over the network included (the slower of the two). Default 10.0 (80 Gbit/s).
        persistent_bw_gbps: GB/s each node gets to remote persistent storage (if the storage's
            bandwidth is shared, its aggregate divided by the number of nodes). Default 2.5
            (20 Gbit/s, the paper's FSx).
        failures_per_day: expected failures per day, for the per-day figures (0 allowed).
        persistent_interval_s: seconds between persistent-only checkpoints; None (default)
            means as often as possible, ``max(checkpoint_gb / persistent_bw_gbps, iteration_s)``.
    """

    checkpoint_gb: float
    iteration_s: float
    memory_bw_gbps: float = 10.0
    persistent_bw_gbps: float = 2.5
    failures_per_day: float = 1.0
    persistent_interval_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("checkpoint_gb", "iteration_s", "memory_bw_gbps", "persistent_bw_gbps"):
            _require_number(name, getattr(self, name), positive=True)
        _require_number("failures_per_day", self.failures_per_day, positive=False)
        if self.persistent_interval_s is not None:
            _require_number("persistent_interval_s", self.persistent_interval_s, positive=True)
            floor = max(self.checkpoint_gb / self.persistent_bw_gbps, self.iteration_s)
            if self.persistent_interval_s < floor:
                raise ValueError(
                    f"persistent_interval_s={self.persistent_interval_s!r} is shorter than one checkpoint to "
                    f"storage or one iteration ({floor:.6g} s): give at least that, or None for as often as possible."
                )


def _require_number(name: str, value: object, *, positive: bool) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or (value <= 0 if positive else value < 0):  # type: ignore[operator]
        want = "a finite number > 0" if positive else "a finite number >= 0"
        raise ValueError(f"{name}={value!r}: give {want}.")


def wasted_time(inputs: CostInputs) -> dict[str, float]:
    """Expected wasted time per failure and per day, gemini_dcp vs persistent-only checkpointing.

    gemini_dcp checkpoints into CPU memory every ``max(iteration_s, t_ckpt)`` with
    ``t_ckpt = checkpoint_gb / memory_bw_gbps``, and after a machine replacement retrieves
    the checkpoint from a peer's memory at the same bandwidth (a software failure retrieves
    locally and wastes less). Persistent-only checkpointing writes to and reads from remote
    storage at ``persistent_bw_gbps``.

    Returns:
        A flat dict of floats, times in seconds: for each prefix ``gemini_`` and
        ``persistent_``, ``checkpoint_s``, ``interval_s``, ``retrieval_s``,
        ``wasted_per_failure_s`` and ``wasted_per_day_s``; and ``persistent_over_gemini``,
        the ratio of the two wasted times.
    """
    size = inputs.checkpoint_gb
    gemini_ckpt = size / inputs.memory_bw_gbps
    persistent_ckpt = size / inputs.persistent_bw_gbps
    out: dict[str, float] = {}
    out.update(_system("gemini", gemini_ckpt, max(inputs.iteration_s, gemini_ckpt), gemini_ckpt, inputs))
    persistent_interval = inputs.persistent_interval_s
    if persistent_interval is None:
        persistent_interval = max(inputs.iteration_s, persistent_ckpt)
    out.update(_system("persistent", persistent_ckpt, persistent_interval, persistent_ckpt, inputs))
    out["persistent_over_gemini"] = out["persistent_wasted_per_failure_s"] / out["gemini_wasted_per_failure_s"]
    return out


def _system(prefix: str, ckpt: float, interval: float, retrieval: float, inputs: CostInputs) -> dict[str, float]:
    per_failure = ckpt + interval / 2 + retrieval
    return {
        f"{prefix}_checkpoint_s": ckpt,
        f"{prefix}_interval_s": interval,
        f"{prefix}_retrieval_s": retrieval,
        f"{prefix}_wasted_per_failure_s": per_failure,
        f"{prefix}_wasted_per_day_s": per_failure * inputs.failures_per_day,
    }
