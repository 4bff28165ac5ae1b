"""benchmarks/gate.py's comparison: a ratio worse than the previous run by more than its band fails,
within it passes, a figure new or dropped is reported and never fails; the median of the history's last
full entries is the reference. No benchmark runs here."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

GATE = Path(__file__).resolve().parents[1] / "benchmarks" / "gate.py"


def _gate() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gate_under_test", GATE)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_ratio_worse_than_its_band_fails_and_one_within_passes() -> None:
    gate = _gate()
    bands = {"durable_vs_stock": 0.2, "local_save_vs_stock": 0.2}
    _, failures = gate.compare({"durable_vs_stock": 1.1, "local_save_vs_stock": 0.3},
                               {"durable_vs_stock": 1.0, "local_save_vs_stock": 0.3}, bands)
    assert failures == []
    lines, failures = gate.compare({"durable_vs_stock": 1.5, "local_save_vs_stock": 0.2},
                                   {"durable_vs_stock": 1.0, "local_save_vs_stock": 0.3}, bands)
    assert len(failures) == 1 and failures[0].startswith("durable_vs_stock")
    assert any("WORSE" in line for line in lines)


def test_new_and_dropped_figures_never_fail_and_the_first_run_passes() -> None:
    gate = _gate()
    _, failures = gate.compare({"a": 9.0}, {"b": 1.0}, {"a": 0.1, "b": 0.1})
    assert failures == []
    _, failures = gate.compare({"a": 9.0}, None)
    assert failures == []


def test_the_reference_is_the_median_of_the_last_full_entries(tmp_path: Path) -> None:
    gate = _gate()
    history = tmp_path / "h.jsonl"
    assert gate.last_entries(history) == [] and gate.reference([]) is None
    rows = [{"commit": "a", "ratios": {"x": 1.0}}, {"commit": "b", "ratios": {"x": 2.0}},
            {"commit": "c", "ratios": {"x": 9.0}}, {"commit": "d", "ratios": {"x": 2.5}},
            {"commit": "e", "quick": True, "ratios": {"x": 99.0}}]
    history.write_text("\n".join(json.dumps(r) for r in rows) + "\nnot json\n")
    last = gate.last_entries(history)
    assert [e["commit"] for e in last] == ["b", "c", "d"]
    assert gate.reference(last) == {"x": 2.5}  # the outlier 9.0 does not set the bar


def test_every_measured_ratio_has_a_band() -> None:
    gate = _gate()
    src = GATE.read_text()
    for name in gate.BANDS:
        assert f'ratios["{name}"]' in src
    assert src.count('ratios["') == len(gate.BANDS)
