"""benchmarks/gate.py's comparison: a ratio worse than the previous run by more than its band fails,
within it passes, a figure new or dropped is reported and never fails; the median of the history's last
full entries is the reference; the multi-rank benchmarks' JSON becomes ratios, and one that hangs is
stopped with its children. No benchmark runs here (the hang is a sleeping script)."""

from __future__ import annotations

import importlib.util
import json
import re
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

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


def test_a_count_over_its_limit_fails_whatever_the_history(tmp_path: Path) -> None:
    """Mechanism counts have fixed limits, no band: the drain copying a step it could read in place
    (issue 52's regression) fails the first run that does it."""
    gate = _gate()
    assert gate.LIMITS["durable_staged_copies"] == 0
    _, failures = gate.check_limits({"durable_staged_copies": 0})
    assert failures == []
    lines, failures = gate.check_limits({"durable_staged_copies": 3})
    assert failures == ["durable_staged_copies: 3 > 0"] and any("WORSE" in line for line in lines)
    lines, failures = gate.check_limits({})  # an older run without the count: reported, never failed
    assert failures == [] and "not measured" in lines[0]


def test_staged_copies_are_read_from_the_drain_status(tmp_path: Path) -> None:
    """A step the status shows read in place counts 0; copied, or missing from the status, counts 1."""
    gate = _gate()
    d = tmp_path / "persist"
    d.mkdir()
    (d / "status.json").write_text(json.dumps({"steps": {"2": {"in_place": True}, "3": {"in_place": False},
                                                         "4": {"in_place": True}}}))
    from gemini_dcp.persistent.drain.status import Paths

    assert Paths(d).status == d / "status.json"
    assert gate._staged_copies(d, range(2, 6)) == 2  # step 3 copied, step 5 never staged


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


def _measured_names(gate: ModuleType) -> set[str]:
    """Every ratio name gate.py assigns: ``ratios["x"]`` and, per item count, ``ratios[f"x_{n}"]``."""
    src = GATE.read_text()
    names = set(re.findall(r'ratios\["(\w+)"\]', src))
    for template in re.findall(r'ratios\[f"(\w+)_\{n\}"\]', src):
        names |= {f"{template}_{n}" for n in gate.ITEM_COUNTS}
    return names


def test_every_measured_ratio_has_a_band_and_a_line_in_the_docstring() -> None:
    gate = _gate()
    names = _measured_names(gate)
    assert names == set(gate.BANDS)
    doc = gate.__doc__
    for name in names:
        template = re.sub(r"_(\d+)$", "_N", name) if name.startswith("async_") and name[-1].isdigit() else name
        assert f"``{template}``" in doc, name


def test_an_old_history_line_without_the_new_figures_passes_and_stays_the_reference_for_the_old(tmp_path: Path) -> None:
    gate = _gate()
    history = tmp_path / "h.jsonl"
    old = {"local_save_vs_stock": 0.15, "durable_vs_stock": 0.7}
    new = dict(old, local_save_vs_memcpy=1.0, restore_spread=1.2, async_blocked_vs_stock_738=0.001)
    rows = [{"commit": "a", "ratios": old}, {"commit": "b", "ratios": old}, {"commit": "c", "ratios": old},
            {"commit": "d", "ratios": new}, {"commit": "e", "quick": True, "ratios": {"restore_spread": 50.0}}]
    history.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    ref = gate.reference(gate.last_entries(history, None))
    assert ref is not None and ref["restore_spread"] == 1.2 and ref["local_save_vs_stock"] == 0.15
    lines, failures = gate.compare(dict(new, restore_spread=1.25), ref)
    assert failures == []
    # Against the old lines alone, the new figures are reported, never failed.
    lines, failures = gate.compare(new, gate.reference(gate.last_entries(history, None)[:3]))
    assert failures == [] and sum("no previous figure" in line for line in lines) == 3
    # A run without the multi-rank figures (--no-benches) does not push them out of the reference.
    rows.insert(4, {"commit": "f", "benches": False, "ratios": old})
    history.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    ref = gate.reference(gate.last_entries(history, None))
    assert ref is not None and ref["restore_spread"] == 1.2
    _, failures = gate.compare(dict(new, restore_spread=9.0), ref, {"restore_spread": 0.5})
    assert failures and failures[0].startswith("restore_spread")


def _many_items_doc(exact: bool = True) -> dict[str, Any]:
    row = {"stock": {"median_ms": 200.0, "saves_ms": [190.0, 200.0, 210.0], "exact": True},
           "async": {"median_ms": 20.0, "saves_ms": [19.0, 20.0, 21.0], "blocked_median_ms": 0.5, "exact": exact}}
    return {"results": {"16": row, "738": row}}


def test_the_multi_rank_benches_json_becomes_ratios_where_lower_is_better() -> None:
    gate = _gate()
    ratios, sec = gate.many_items_ratios(_many_items_doc())
    assert ratios == {"async_blocked_vs_stock_16": 0.0025, "async_committed_vs_stock_16": 0.1,
                      "async_blocked_vs_stock_738": 0.0025, "async_committed_vs_stock_738": 0.1}
    assert sec["items738_committed"]["baseline"] == [0.19, 0.2, 0.21]
    peer = {"bit_exact": True, "restored_peer": True, "figures": {
        "replication": {"gbps": 2.0, "seconds": [0.1]}, "raw_swap": {"gbps": 4.0, "seconds": [0.05]},
        "restore": {"gbps": 1.0, "spread": {"max_over_median": 1.3, "load_s_sorted": [0.2, 0.2, 0.26]}},
        "restore_raw_oneway": {"gbps": 3.0}}}
    ratios, _ = gate.peer_ratios(peer)
    assert ratios == {"replication_vs_raw_gloo": 2.0, "restore_vs_raw_gloo": 3.0, "restore_spread": 1.3}
    asyn = {"modes": {"none": {"step_median_s": 0.1}, "gemini": {"step_median_s": 0.11, "paired_ratio_median": 1.05,
                                                               "round_ratios": [1.0, 1.05, 1.1]}}}
    assert gate.async_ratios(asyn)[0] == {"async_step_ratio": 1.05}


def test_a_bench_that_measured_nothing_or_lost_bytes_is_an_error_not_a_figure() -> None:
    gate = _gate()
    with pytest.raises(gate.GateError, match="not bit-exact"):
        gate.many_items_ratios(_many_items_doc(exact=False))
    doc = _many_items_doc()
    doc["results"]["16"]["stock"] = dict(doc["results"]["16"]["stock"], median_ms=None)
    with pytest.raises(gate.GateError, match="not a positive number"):
        gate.many_items_ratios(doc)
    with pytest.raises(gate.GateError, match="not bit-exact or did not come from the peer"):
        gate.peer_ratios({"bit_exact": True, "restored_peer": False, "figures": {}})


def test_the_benches_write_only_into_the_gates_scratch_and_quick_shrinks_them() -> None:
    gate = _gate()
    full, quick = gate.bench_args(False), gate.bench_args(True)
    assert set(full) == set(quick) == set(gate.BENCHES)
    assert "--json" not in " ".join(a for args in full.values() for a in args)  # run_bench adds its own
    assert full["bench_async.py"][full["bench_async.py"].index("--png") + 1] == ""  # no plot into docs/img/
    assert "--quick" in quick["bench_peer.py"]


def test_a_hung_bench_is_stopped_with_its_children_and_ends_the_gate_with_an_error(tmp_path: Path) -> None:
    gate = _gate()
    pidfile = tmp_path / "child.pid"
    hang = tmp_path / "hang.py"
    hang.write_text(
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        f"open({str(pidfile)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(600)\n")
    with pytest.raises(gate.GateError, match="did not finish within"):
        gate.run_bench(str(hang), [], tmp_path, timeout_s=5.0)
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 30.0
    while time.monotonic() < deadline and _alive(child):
        time.sleep(0.1)
    assert not _alive(child), "the bench's own child outlived the gate's stop"
    quiet = tmp_path / "quiet.py"
    quiet.write_text("print('measured nothing')\n")
    with pytest.raises(gate.GateError, match="no readable JSON"):
        gate.run_bench(str(quiet), [], tmp_path, timeout_s=60.0)


def _alive(pid: int) -> bool:
    """``pid`` runs (a zombie waiting for its reaper counts as ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"
