"""The feature soak's trial generator and oracle (tests/soak_trials.py), without starting a process.

The soak itself runs outside the suite (scripts/soak.sh); here: every feature value and every fault
is drawn, draws respect the features' constraints, the oracle tells each wrong restore by its name,
and the results file accumulates.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import soak_trials as st

from gemini_dcp.core.faults import CONDITIONAL_PHASES, PHASES


def test_every_feature_and_fault_is_drawn_and_draws_are_valid() -> None:
    trials = [st.draw(seed) for seed in range(3000)]
    assert st.draw(7) == st.draw(7)  # a seed reproduces its trial
    seen = Counter(f"{k}={v}" for t in trials for k, v in t.features.items())
    for k, values in st.FEATURES.items():
        for v in values:
            assert seen[f"{k}={v}"] > 100, (k, v, seen[f"{k}={v}"])
    kinds = Counter(t.fault["kind"] for t in trials)
    assert set(kinds) == set(st.FAULTS), kinds
    phases = Counter(t.fault["phase"] for t in trials if t.fault["kind"] == "signal")
    want = set(PHASES) | {p for p in CONDITIONAL_PHASES if not p.startswith("nixl.") or st.nixl_available()}
    assert want <= set(phases), sorted(want - set(phases))
    assert {t.fault["sig"] for t in trials if t.fault["kind"] == "signal"} == set(st.SIGNALS)
    for t in trials:
        if t.parity is not None or t.replicas == 3:
            assert t.nodes >= 3, t
        if t.parity == 4:
            assert t.nodes == 4, t
        if t.features["placement"] == "group":
            assert t.nodes % t.replicas == 0, t
        if t.fault["kind"] in ("enospc_store",) or t.fault.get("lock") == "drain":
            assert t.features["persistent"] != "off", t
        if t.fault.get("phase", "").startswith("commit."):
            assert t.fault["rank"] == t.layout.index(t.layout[t.fault["rank"]]), t  # a node leader


def _trial(**features: str) -> st.Trial:
    f = {k: v[0] for k, v in st.FEATURES.items()} | {"redundancy": "replicas2"} | features
    return st.Trial(seed=1, layout=(0, 1), features=f, fault={"kind": "none"}, steps=3)


def _obs(t: st.Trial, restored: tuple[int, int, int] | None, *, saved: int = 3, bad: list[str] | None = None,
         error: dict[str, Any] | None = None, journal: list[list[dict[str, Any]]] | None = None) -> dict[str, Any]:
    if journal is None:
        journal = [[{"e": "begin", "job": 0, "step": s, "tl": 0} for s in range(1, saved + 1)]
                   + [{"e": "saved", "job": 0, "step": s, "tl": 0} for s in range(1, saved + 1)]] * t.world
    if error is not None:
        res: dict[str, Any] = {"restores": [error]}
    else:
        assert restored is not None
        job, tl, step = restored
        res = {"restores": [{"job": "soak", "step": step, "meta": {"job": job, "tl": tl, "step": step},
                             "bad": bad or []}]}
    return {"hangs": [], "journal": journal, "train": {"codes": [0] * t.world, "killed": []},
            "train_results": [{"rank": r} for r in range(t.world)], "restore_results": [res] * t.world, "gc": []}


def test_the_oracle_names_each_wrong_restore() -> None:
    t = _trial()
    assert st.judge(t, _obs(t, (0, 0, 3)))["outcome"] == "pass"
    for restored, kw, word in [
        ((0, 0, 2), {}, "lost"),
        ((0, 0, 3), {"bad": ["w"]}, "torn"),
        ((1, 0, 3), {}, "foreign"),
        ((0, 0, 9), {}, "never saved"),
    ]:
        v = st.judge(t, _obs(t, restored, **kw))
        assert v["outcome"] == "fail" and word in v["detail"], (restored, v)
    # a clean error is fine only when nothing was committed; never a foreign exception
    err = {"error": "CheckpointNotFoundError", "gemini": True, "message": "none", "touched": []}
    assert st.judge(t, _obs(t, None, error=err, saved=0, journal=[[], []]))["outcome"] == "pass"
    assert "raised" in st.judge(t, _obs(t, None, error=err))["detail"]
    raw = {"error": "KeyError", "gemini": False, "message": "x", "touched": []}
    assert "not the package" in st.judge(t, _obs(t, None, error=raw, saved=0, journal=[[], []]))["detail"]
    # a wait past its bound, leftovers after gc
    assert st.judge(t, {**_obs(t, (0, 0, 3)), "hangs": ["x"]})["outcome"] == "hang"
    assert "gc" in st.judge(t, {**_obs(t, (0, 0, 3)), "gc": ["node0: left ['soak']"]})["detail"]


def test_the_oracle_knows_timelines_and_health() -> None:
    # NaN at step 3 marked unhealthy: step 2 is the answer, step 3 is poisoned
    t = _trial(nonfinite="mark", nan="yes")
    t.nan_at = (1, 3)
    assert st.judge(t, _obs(t, (0, 0, 2)))["outcome"] == "pass"
    v = st.judge(t, _obs(t, (0, 0, 3)))
    assert "poisoned" in v["detail"] and v["known"] == st.KNOWN_50
    # rolled back to 2 after step 3, then saved 3 and 4 on timeline 1: step 3 of timeline 0 is abandoned
    t = _trial(rollback="yes")
    t.rollback_after = 3
    rank = ([{"e": "begin", "job": 0, "step": s, "tl": 0} for s in (1, 2, 3)]
            + [{"e": "saved", "job": 0, "step": s, "tl": 0} for s in (1, 2, 3)]
            + [{"e": "rolled", "to": 2, "tl": 1, "ok": True}]
            + [{"e": "begin", "job": 0, "step": s, "tl": 1} for s in (3, 4)]
            + [{"e": "saved", "job": 0, "step": s, "tl": 1} for s in (3, 4)])
    assert st.judge(t, _obs(t, (0, 1, 4), journal=[rank, rank]))["outcome"] == "pass"
    assert "lost" in st.judge(t, _obs(t, (0, 1, 3), journal=[rank, rank]))["detail"]
    v = st.judge(t, _obs(t, (0, 0, 3), journal=[rank, rank]))
    assert "abandoned" in v["detail"] and v["known"] == st.KNOWN_50


def test_results_accumulate_in_one_file(tmp_path: Path) -> None:
    path = tmp_path / "soak.json"
    rec = {"seed": 5, "fault": "signal save.mid_copy@1:SIGKILL/0", "fault_kind": "signal", "fired": True,
           "features": {"saver": "dcp.save"}, "outcome": "pass", "seconds": 1.5}
    bad = {**rec, "seed": 6, "outcome": "fail", "detail": "lost", "fault": "wipe node=1", "fault_kind": "wipe"}
    st.accumulate([rec, bad], path, {"id": "a", "trials": 2})
    doc = st.accumulate([rec], path, {"id": "a", "trials": 3})
    assert doc == json.loads(path.read_text())
    assert doc["trials"] == 3 and doc["outcomes"] == {"pass": 2, "fail": 1}
    assert doc["features"] == {"saver=dcp.save": 3}
    assert doc["faults"]["signal:SIGKILL"] == 2 and doc["faults"]["fired:save.mid_copy:SIGKILL"] == 2
    assert doc["faults"]["wipe"] == 1 and [f["seed"] for f in doc["failures"]] == [6]
    assert [r["trials"] for r in doc["runs"]] == [3]
    # a failure explained later moves to "known"
    assert st.reclassify(6, "harness fix abc123", path) and not st.reclassify(6, "again", path)
    doc = json.loads(path.read_text())
    assert doc["outcomes"] == {"pass": 2, "fail": 0, "known": 1} and doc["known"] == {"harness fix abc123": 1}
    assert doc["by_fault"]["wipe"] == {"fail": 0, "known": 1} and doc["failures"][0]["known"] == "harness fix abc123"


def test_a_focused_draw_reaches_the_pairs_short_of_fired_signals() -> None:
    doc = {"faults": {f"fired:{k}": st.FOCUS_TARGET for k in st.signal_pairs()}}
    assert st.focus_of(doc) == {}
    doc["faults"]["fired:replicate.after:SIGTERM"] = 5
    doc["faults"]["fired:drain.before_metadata:SIGSTOP"] = 90
    doc["faults"]["fired:rollback.marker:SIGKILL"] = 0
    focus = st.focus_of(doc)
    assert focus == {"replicate.after:SIGTERM": 95, "drain.before_metadata:SIGSTOP": 10,
                     "rollback.marker:SIGKILL": 100}
    doc["faults"]["phase:replicate.after:SIGTERM"] = 20  # a quarter of its draws fired: it needs 4x its lack
    assert st.focus_of(doc)["replicate.after:SIGTERM"] == 380
    trials = [st.draw(seed, focus) for seed in range(600)]
    assert st.draw(11, focus) == st.draw(11, focus) and st.draw(11) != st.draw(11, focus)
    signals = [t for t in trials if t.fault["kind"] == "signal"]
    assert len(signals) > 0.8 * len(trials)
    assert {f"{t.fault['phase']}:{t.fault['sig']}" for t in signals} == set(focus)
    for t in signals:  # each with what its phase needs to be reached
        phase = t.fault["phase"]
        if phase.startswith("replicate."):
            assert t.replicas >= 2 and t.parity is None, t
        if phase.startswith("drain."):
            assert t.features["persistent"] != "off", t
        if phase == "rollback.marker":
            assert t.rollback_after is not None, t
        if t.features["placement"] == "group":
            assert t.nodes % t.replicas == 0, t
    assert all(t.focus == focus for t in trials)
