"""gemini_dcp.ops.costmodel: GEMINI's wasted-time model (pure, fast)."""

from __future__ import annotations

import dataclasses

import pytest

from gemini_dcp.ops.costmodel import CostInputs, wasted_time


def test_defaults_and_keys() -> None:
    inputs = CostInputs(checkpoint_gb=10.0, iteration_s=5.0)
    assert (inputs.memory_bw_gbps, inputs.persistent_bw_gbps, inputs.failures_per_day) == (10.0, 2.5, 1.0)
    assert inputs.persistent_interval_s is None
    out = wasted_time(inputs)
    prefixes = ("gemini_", "persistent_")
    rows = ("checkpoint_s", "interval_s", "retrieval_s", "wasted_per_failure_s", "wasted_per_day_s")
    assert set(out) == {p + r for p in prefixes for r in rows} | {"persistent_over_gemini"}
    assert all(isinstance(v, float) for v in out.values())


def test_numbers() -> None:
    out = wasted_time(CostInputs(checkpoint_gb=10.0, iteration_s=5.0, failures_per_day=3.0))
    # gemini: 10 GB at 10 GB/s = 1 s < iteration, so checkpoint every iteration (5 s).
    assert out["gemini_checkpoint_s"] == 1.0
    assert out["gemini_interval_s"] == 5.0
    assert out["gemini_retrieval_s"] == 1.0
    assert out["gemini_wasted_per_failure_s"] == 1.0 + 2.5 + 1.0
    assert out["gemini_wasted_per_day_s"] == pytest.approx(3 * 4.5)
    # persistent: 10 GB at 2.5 GB/s = 4 s < iteration, so every iteration too.
    assert out["persistent_checkpoint_s"] == 4.0
    assert out["persistent_interval_s"] == 5.0
    assert out["persistent_wasted_per_failure_s"] == 4.0 + 2.5 + 4.0
    assert out["persistent_over_gemini"] == pytest.approx(10.5 / 4.5)


def test_checkpoint_slower_than_iteration_sets_interval() -> None:
    out = wasted_time(CostInputs(checkpoint_gb=100.0, iteration_s=1.0, memory_bw_gbps=50.0))
    assert out["gemini_interval_s"] == 2.0  # 100 GB / 50 GB/s
    assert out["persistent_interval_s"] == 40.0  # 100 GB / 2.5 GB/s


def test_paper_mt_nlg_example() -> None:
    # MT-NLG: a 42-minute checkpoint to storage costs 42 + 21 + 42 minutes per failure.
    t = 42 * 60
    out = wasted_time(CostInputs(checkpoint_gb=2.5 * t, iteration_s=60.0))
    assert out["persistent_wasted_per_failure_s"] == pytest.approx((42 + 21 + 42) * 60)
    assert out["persistent_over_gemini"] > 1


def test_explicit_persistent_interval() -> None:
    out = wasted_time(CostInputs(checkpoint_gb=25.0, iteration_s=30.0, persistent_interval_s=3 * 3600))
    assert out["persistent_interval_s"] == 10800.0
    assert out["persistent_wasted_per_failure_s"] == 10.0 + 5400.0 + 10.0
    # gemini is unaffected by the persistent cadence.
    assert out["gemini_interval_s"] == 30.0


def test_zero_failures_per_day() -> None:
    out = wasted_time(CostInputs(checkpoint_gb=1.0, iteration_s=1.0, failures_per_day=0))
    assert out["gemini_wasted_per_day_s"] == out["persistent_wasted_per_day_s"] == 0.0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"checkpoint_gb": 0.0}, "checkpoint_gb=0.0: give a finite number > 0"),
        ({"iteration_s": -1.0}, "iteration_s"),
        ({"memory_bw_gbps": float("nan")}, "memory_bw_gbps"),
        ({"persistent_bw_gbps": float("inf")}, "persistent_bw_gbps"),
        ({"failures_per_day": -0.5}, "failures_per_day=-0.5: give a finite number >= 0"),
        ({"checkpoint_gb": "10"}, "checkpoint_gb"),
        ({"iteration_s": True}, "iteration_s"),
        ({"persistent_interval_s": 0.0}, "persistent_interval_s"),
        ({"persistent_interval_s": 3.0}, r"shorter than one checkpoint .*\(4 s\)"),
    ],
)
def test_validation(kwargs: dict[str, object], match: str) -> None:
    base: dict[str, object] = {"checkpoint_gb": 10.0, "iteration_s": 2.0}
    with pytest.raises(ValueError, match=match):
        CostInputs(**{**base, **kwargs})  # type: ignore[arg-type]


def test_frozen_keyword_only() -> None:
    inputs = CostInputs(checkpoint_gb=1.0, iteration_s=1.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        inputs.checkpoint_gb = 2.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        CostInputs(1.0, 1.0)  # type: ignore[call-arg]
