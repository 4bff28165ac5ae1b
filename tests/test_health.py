"""Issue 38: health-checked steps (NaN/Inf counted in the save's pass) and rollback inside a running job."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from mp_utils import node_root_factory, run_ranks, wipe

from gemini_dcp import GeminiStorageReader, GeminiStorageWriter, InvalidStepError, UnhealthyStateError
from gemini_dcp.core.checksum import checksum
from gemini_dcp.errors import ConfigError
from gemini_dcp.ext import loader as ext_loader
from gemini_dcp.health.count import copy_checksum_count, count_bytes, count_nonfinite, kind_of
from gemini_dcp.health.rule import judge
from gemini_dcp.local.tier import LocalTier
from gemini_dcp.options import GeminiOptions


def _root(tmp_path: Path) -> Path:
    root = tmp_path / "tier"
    root.mkdir(mode=0o700, exist_ok=True)
    return root


def test_counts_every_float_dtype_with_and_without_the_extension(monkeypatch: pytest.MonkeyPatch) -> None:
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        t = torch.randn(3000).to(dtype)
        t[[5, 700, 2999]] = float("nan")
        t[11] = float("inf")
        t[12] = float("-inf")
        src = t.view(torch.uint8)
        assert count_nonfinite(t) == 5
        dst = torch.empty_like(src)
        for algo in ("crc32c", "xxh3"):
            value, n = copy_checksum_count(dst, src, algo, {torch.float32: 1, torch.float64: 2, torch.float16: 3,
                                                             torch.bfloat16: 4}[dtype], 1 << 12, None)
            assert n == 5 and torch.equal(dst, src) and value == checksum(src, algo)
    assert count_nonfinite(torch.full((4,), complex(float("nan"), float("inf")), dtype=torch.complex64)) == 8
    if ext_loader.load():  # large pieces (streaming stores, several threads), values at the edges and in the tail
        for dtype, kind in ((torch.float32, 1), (torch.float64, 2), (torch.float16, 3), (torch.bfloat16, 4)):
            t = torch.zeros((3 << 20) // dtype.itemsize + 5, dtype=dtype)
            for i in (0, 1, 4097, t.numel() // 2, t.numel() - 1):
                t[i] = float("nan") if i % 2 else float("-inf")
            src = t.view(torch.uint8)
            dst = torch.empty_like(src)
            for threads in (1, 3):
                crc, n = torch.ops.gemini_dcp.copy_crc32c_count(dst, src, kind, threads, 0)
                assert n == 5 and torch.equal(dst, src) and crc == checksum(src, "crc32c"), (dtype, threads)
            assert torch.ops.gemini_dcp.copy_crc32c_count(dst, torch.zeros_like(src), kind, 2, 0)[1] == 0
    assert count_nonfinite(torch.arange(10)) == 0
    monkeypatch.setattr(ext_loader, "load", lambda *a, **k: False)  # the GEMINI_DCP_EXT=0 path
    t = torch.zeros(100)
    t[3] = float("nan")
    assert count_bytes(t.view(torch.uint8), 1) == 1


def test_the_restore_decision_passes_over_unhealthy_and_superseded_steps() -> None:
    from gemini_dcp.core.restore_order import NodeView, StepView, decide

    def view(rank: int, steps: dict[int, tuple[bool, bool]]) -> NodeView:
        return NodeView(rank, f"n{rank}", tuple(StepView(s, f"fp{s}", 2, (rank,), float(s), True, unhealthy=u, superseded=x)
                                                for s, (u, x) in steps.items()))

    views = [view(r, {2: (False, False), 3: (True, False), 4: (True, False), 5: (False, True)}) for r in (0, 1)]
    got = decide(views, None, "j")
    assert got.step == 2 and got.skipped_unhealthy == (4, 3)
    assert decide(views, 4, "j").step == 4  # asked for: loaded, healthy or not
    assert decide(views, None, "j", [2, 6], persistent_unhealthy=[6]).step == 2
    only_bad = [view(r, {3: (True, False)}) for r in (0, 1)]
    assert decide(only_bad, None, "j").step == 3  # nothing healthy is restorable: the newest restorable one


def test_the_rule_and_the_options(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert judge([(0, [("mask", 8)])], None).healthy  # the first step sets the baseline
    assert judge([(0, [("mask", 8)]), (1, [("mask", 8)])], {"mask": 16}).healthy
    bad = judge([(0, [("mask", 8)]), (1, [("w", 1)])], {"mask": 8})
    assert not bad.healthy and bad.worse == (("w", 1, 0),) and "ranks [1]" in bad.describe()
    assert GeminiOptions(nonfinite="refuse").nonfinite == "refuse"
    with pytest.raises(ConfigError, match="nonfinite"):
        GeminiOptions(nonfinite="drop")  # type: ignore[arg-type]
    monkeypatch.setenv("GEMINI_DCP_NONFINITE", "ignore")
    assert GeminiOptions.from_env().nonfinite == "ignore"
    monkeypatch.setenv("GEMINI_DCP_NONFINITE", "refuse")  # the writer's keyword left at its default: the environment's
    w = GeminiStorageWriter(root=_root(tmp_path), job_id="env")
    assert w.options.nonfinite == "refuse" and w.commit.nonfinite == "refuse"
    del w
    w = GeminiStorageWriter(root=_root(tmp_path), job_id="kw", nonfinite="ignore")
    assert w.options.nonfinite == "ignore" and not w.local_writer.count_nonfinite
    del w
    monkeypatch.setenv("GEMINI_DCP_NONFINITE", "sometimes")
    with pytest.raises(ConfigError, match="GEMINI_DCP_NONFINITE"):
        GeminiOptions.from_env()


def _state(step: int, poison: bool = False) -> dict[str, torch.Tensor]:
    w = torch.arange(64, dtype=torch.float32).reshape(8, 8) + step
    if poison:
        w[2, 3] = float("nan")
    mask = torch.zeros(4, 4)
    mask[0, 1:] = float("-inf")  # a constant attention mask: never unhealthy
    return {"w": w, "b": torch.full((8,), float(step), dtype=torch.bfloat16), "mask": mask,
            "big": torch.full((300_000,), float(step))}


def test_poisoned_steps_are_marked_skipped_and_kept_out_of_eviction(tmp_path: Path, caplog) -> None:
    root = _root(tmp_path)
    w = GeminiStorageWriter(root=root, job_id="h", keep=2)
    for step in range(1, 7):  # NaN enters at step 3 and stays: steps 3..6 unhealthy
        sd = _state(step, poison=step >= 3)
        if step >= 3:
            sd["big"][7] = float("inf")
        dcp.save(sd, storage_writer=w, checkpoint_id=step)
        assert w.last_save is not None
        assert w.last_save.nonfinite == ({"mask": 3, "w": 1, "big": 1} if step >= 3 else {"mask": 3})
    tier = LocalTier(root, "h")
    assert tier.record(2).healthy and not tier.record(6).healthy
    assert tier.record(6).nonfinite == ((0, "w", 1), (0, "mask", 3), (0, "big", 1)) or \
        set(tier.record(6).nonfinite) == {(0, "w", 1), (0, "mask", 3), (0, "big", 1)}
    assert 2 in tier.steps()  # the newest healthy step outlives keep=2
    out = _state(0)
    reader = GeminiStorageReader(root=root, job_id="h")
    with caplog.at_level(logging.WARNING, logger="gemini_dcp"):
        dcp.load(out, storage_reader=reader)
    assert reader.restored_step == 2 and reader.skipped_unhealthy == [6, 5]
    assert "passed over unhealthy steps" in caplog.text
    for k, v in _state(2).items():
        assert torch.equal(out[k], v), k
    caplog.clear()
    asked = _state(0)
    with caplog.at_level(logging.WARNING, logger="gemini_dcp"):
        dcp.load(asked, storage_reader=GeminiStorageReader(root=root, job_id="h"), checkpoint_id=6)
    assert torch.isnan(asked["w"][2, 3]) and "as asked" in caplog.text
    del w
    # The CLI: inspect shows each step's health and the items behind an unhealthy one; verify counts NaN/Inf.
    import json

    from typer.testing import CliRunner

    from gemini_dcp_cli.main import app

    runner = CliRunner()
    res = runner.invoke(app, ["inspect", "--root", str(root), "--job", "h", "--json"])
    assert res.exit_code == 0, res.output
    job = json.loads(res.output)["jobs"][0]
    health = {s["step"]: s["health"] for s in job["steps"]}
    assert health[2] == "healthy" and health[6] == "unhealthy" and job["newest_healthy"] == 2
    assert [0, "w", 1] in next(s for s in job["steps"] if s["step"] == 6)["nonfinite"]
    res = runner.invoke(app, ["inspect", "--root", str(root), "--job", "h"], terminal_width=200)
    assert "unhealthy" in res.output and "NaN/Inf in" in res.output, res.output
    res = runner.invoke(app, ["verify", "--root", str(root), "--job", "h", "--json"])
    assert res.exit_code == 0, res.output
    counts = json.loads(res.output)["nonfinite"]
    assert counts["6"] == {"w": 1, "mask": 3, "big": 1} and counts["2"] == {"mask": 3}
    res = runner.invoke(app, ["verify", "6", "--root", str(root), "--job", "h"], terminal_width=200)
    assert "non-finite values" in res.output, res.output


def test_refuse_commits_nothing_and_ignore_counts_nothing(tmp_path: Path) -> None:
    root = _root(tmp_path)
    w = GeminiStorageWriter(root=root, job_id="r", nonfinite="refuse")
    dcp.save(_state(1), storage_writer=w, checkpoint_id=1)
    with pytest.raises(BaseException) as info:
        dcp.save(_state(2, poison=True), storage_writer=w, checkpoint_id=2)
    from gemini_dcp.errors import find_gemini_error

    err = find_gemini_error(info.value)
    assert isinstance(err, UnhealthyStateError) and "'w'" in str(err)
    assert LocalTier(root, "r").steps() == [1]
    del w
    w2 = GeminiStorageWriter(root=root, job_id="i", nonfinite="ignore")
    dcp.save(_state(1, poison=True), storage_writer=w2, checkpoint_id=1)
    assert w2.last_save is not None and w2.last_save.nonfinite == {}
    assert LocalTier(root, "i").record(1).healthy is None


def test_rollback_inside_the_running_job(tmp_path: Path) -> None:
    root = _root(tmp_path)
    w = GeminiStorageWriter(root=root, job_id="rb", keep=3)
    for step in range(1, 6):
        dcp.save(_state(step), storage_writer=w, checkpoint_id=step)
    sd = _state(0)
    dcp.load(sd, storage_reader=GeminiStorageReader(root=root, job_id="rb"), checkpoint_id=3)
    assert torch.equal(sd["w"], _state(3)["w"])
    for step in (4, 5):  # the new timeline: other values than the abandoned steps
        dcp.save(_state(step * 100), storage_writer=w, checkpoint_id=step)
    with pytest.raises(BaseException) as info:  # two saves of one step within one timeline: still refused
        dcp.save(_state(5), storage_writer=w, checkpoint_id=5)
    assert "already saved" in str(info.value) or isinstance(info.value, InvalidStepError)
    out = _state(0)
    reader = GeminiStorageReader(root=root, job_id="rb")
    dcp.load(out, storage_reader=reader)
    assert reader.restored_step == 5
    for k, v in _state(500).items():
        assert torch.equal(out[k], v), k
    # A second rollback to the same step in the same process starts yet another timeline.
    dcp.load(_state(0), storage_reader=GeminiStorageReader(root=root, job_id="rb"), checkpoint_id=3)
    dcp.save(_state(4000), storage_writer=w, checkpoint_id=4)
    assert 5 not in LocalTier(root, "rb").steps()
    del w


# ---- three nodes, one rank each (one spawn to save, one to restore): peer replicas and XOR parity ----
JOBS = {"hp": {"replicas": 2}, "hq": {"parity_group": 3}}


def _shard(rank: int, step: int, poison: bool = False) -> dict[str, torch.Tensor]:
    w = torch.arange(256, dtype=torch.float32) + step * 10 + rank
    if poison and rank == 1:
        w[5] = float("nan")
    return {f"w{rank}": w, "mask": torch.tensor([0.0, float("-inf")])}  # one shard per rank (DCP dedups equal keys)


def _poison_then_roll_back(rank: int, world_size: int, root: str) -> dict[str, object]:
    from gemini_dcp import fast_load

    out: dict[str, object] = {}
    for job, kw in JOBS.items():
        w = GeminiStorageWriter(root=root, job_id=job, keep=2, **kw)
        for step in range(1, 7):  # K = 3: steps 3..6 poisoned on rank 1
            dcp.save(_shard(rank, step, poison=step >= 3), storage_writer=w, checkpoint_id=step)
        got = _shard(rank, 0)
        reader = GeminiStorageReader(root=root, job_id=job)
        dcp.load(got, storage_reader=reader)
        fresh = (reader.restored_step, tuple(reader.skipped_unhealthy), torch.equal(got[f"w{rank}"], _shard(rank, 2)[f"w{rank}"]))
        got = _shard(rank, 0)
        fl = fast_load(got, storage_reader=GeminiStorageReader(root=root, job_id=job), step=2)  # in-process rollback
        fast = (fl.step, torch.equal(got[f"w{rank}"], _shard(rank, 2)[f"w{rank}"]))
        for step in (3, 4):  # the new timeline
            dcp.save(_shard(rank, step + 1000), storage_writer=w, checkpoint_id=step)
        out[job] = {"fresh": fresh, "fast": fast, "steps": LocalTier(root, job).steps()}
    return out


def _restore_after_wipe(rank: int, world_size: int, root: str) -> dict[str, object]:
    out: dict[str, object] = {}
    for job in JOBS:
        sd = _shard(rank, 0)
        reader = GeminiStorageReader(root=root, job_id=job)
        dcp.load(sd, storage_reader=reader)
        out[job] = (reader.restored_step, torch.equal(sd[f"w{rank}"], _shard(rank, 1004)[f"w{rank}"]),
                    {t: n for t, n in reader.restored_from.items() if n})
    return out


def test_three_nodes_poisoned_shard_rollback_and_a_wiped_node_from_peer_and_parity() -> None:
    make, cleanup = node_root_factory("gemini-health")
    try:
        roots = make(3)
        for r in run_ranks(_poison_then_roll_back, 3, roots):
            for job in JOBS:
                assert r[job]["fresh"] == (2, (6, 5), True), (job, r)
                assert r[job]["fast"] == (2, True), (job, r)
                assert max(r[job]["steps"]) == 4, (job, r)
        wipe(roots[1])  # node 1 replaced: its shards come from a peer's replica, or are rebuilt from parity
        got = run_ranks(_restore_after_wipe, 3, roots)
        for r in got:
            assert r["hp"][:2] == (4, True) and "peer" in r["hp"][2], got
            assert r["hq"][:2] == (4, True) and "parity" in r["hq"][2], got
    finally:
        cleanup()


def test_the_newest_healthy_step_is_never_evicted_for_unhealthy_ones(tmp_path: Path) -> None:
    root = _root(tmp_path)
    w = GeminiStorageWriter(root=root, job_id="k1", keep=1)  # a ring of 2 slots
    dcp.save(_state(1), storage_writer=w, checkpoint_id=1)
    dcp.save(_state(2, poison=True), storage_writer=w, checkpoint_id=2)
    with pytest.raises(BaseException) as info:
        dcp.save(_state(3, poison=True), storage_writer=w, checkpoint_id=3)
    from gemini_dcp.errors import TierFullError, find_gemini_error

    assert isinstance(find_gemini_error(info.value), TierFullError)
    assert LocalTier(root, "k1").steps() == [1, 2]
    del w


def test_the_persistent_tier_keeps_the_health_and_restores_the_newest_healthy_step(tmp_path: Path) -> None:
    root = _root(tmp_path)
    store = tmp_path / "store"
    w = GeminiStorageWriter(root=root, job_id="p", persistent=str(store), persist_every=1, persist_keep=2)
    for step in range(1, 5):  # NaN from step 3 on
        dcp.save(_state(step, poison=step >= 3), storage_writer=w, checkpoint_id=step)
        w.wait_persisted(step, timeout_s=60)
    assert (store / "p" / "step-4").exists() or any(store.rglob("health.json"))
    del w
    fresh = tmp_path / "replacement"  # the node is gone: a new one, with only the store left
    fresh.mkdir(mode=0o700)
    out = _state(0)
    reader = GeminiStorageReader(root=fresh, job_id="p", persistent=str(store))
    dcp.load(out, storage_reader=reader)
    assert reader.restored_step == 2 and reader.skipped_unhealthy == [4, 3]
    for k, v in _state(2).items():
        assert torch.equal(out[k], v), k


# ---- issue 50: one verdict on every rank across node replacements, restores and the store ----
# Three nodes, one rank each (XOR parity needs three): one spawn per phase, every variant in it.
VARIANTS = {"n1": {}, "n2": {"replicas": 2}, "np": {"parity_group": 3}}
REFUSING = "nr"


def _step_state(rank: int, step: int, poison: bool = False) -> dict[str, torch.Tensor]:
    w = torch.arange(256, dtype=torch.float32) + step * 10 + rank
    if poison and rank == 1:
        w[5] = float("nan")
    mask = torch.zeros(16)
    mask[:10] = float("-inf")  # a constant 10-value mask: the restored step's counts must hold it
    return {f"w{rank}": w, "mask": mask}


def _refused(w: GeminiStorageWriter, rank: int, step: int) -> tuple[str, bool]:
    """Save a step poisoned on rank 1: (the gemini error this rank got, whether it names the item)."""
    from gemini_dcp.errors import find_gemini_error

    try:
        dcp.save(_step_state(rank, step, poison=True), storage_writer=w, checkpoint_id=step)
    except BaseException as exc:  # noqa: BLE001 - the error is the result
        err = find_gemini_error(exc)
        return type(err).__name__, "'w1'" in str(err)
    return "none", False


def _refusing_writer(root: str) -> GeminiStorageWriter:
    # A short timeout: a save that stalled instead of refusing fails the test in seconds, not minutes.
    return GeminiStorageWriter(root=root, job_id=REFUSING, replicas=2, nonfinite="refuse", timeout_s=30)


def _phase_healthy(rank: int, world_size: int, root: str, *, store: str) -> dict[str, object]:
    for job, kw in VARIANTS.items():
        w = GeminiStorageWriter(root=root, job_id=job, persistent=store, persist_every=1, **kw)
        for step in (1, 2, 3):
            dcp.save(_step_state(rank, step), storage_writer=w, checkpoint_id=step)
        w.wait_persisted(3, timeout_s=120)
    w = _refusing_writer(root)
    dcp.save(_step_state(rank, 1), storage_writer=w, checkpoint_id=1)
    refused = _refused(w, rank, 2)
    dcp.save(_step_state(rank, 2), storage_writer=w, checkpoint_id=2)  # the control group is still usable
    return {"refused": refused, "steps": LocalTier(root, REFUSING).steps()}


def _phase_node1_replaced(rank: int, world_size: int, root: str, *, store: str) -> dict[str, object]:
    out: dict[str, object] = {}
    for job, kw in VARIANTS.items():
        w = GeminiStorageWriter(root=root, job_id=job, persistent=store, persist_every=1, **kw)
        restored: object = None
        if job != "n1":  # n1 saves without restoring: only the agreed baseline knows step 3
            reader = GeminiStorageReader(root=root, job_id=job, persistent=store)
            dcp.load(_step_state(rank, 0), storage_reader=reader)
            restored = (reader.restored_step, sorted(t for t, n in reader.restored_from.items() if n))
        for step in (4, 5):
            dcp.save(_step_state(rank, step, poison=True), storage_writer=w, checkpoint_id=step)
        w.wait_persisted(5, timeout_s=120)
        tier = LocalTier(root, job)
        out[job] = {"verdicts": [tier.record(s).healthy for s in (4, 5)], "restored": restored}
    w = _refusing_writer(root)  # node 1 holds no record: the others' baseline is agreed
    out["refused"] = _refused(w, rank, 3)
    dcp.save(_step_state(rank, 3), storage_writer=w, checkpoint_id=3)
    out["refusing_steps"] = LocalTier(root, REFUSING).steps()
    return out


def _phase_nodes_0_and_2_replaced(rank: int, world_size: int, root: str, *, store: str) -> dict[str, object]:
    out: dict[str, object] = {}
    for job, kw in VARIANTS.items():
        sd = _step_state(rank, 0)
        reader = GeminiStorageReader(root=root, job_id=job, persistent=store)
        dcp.load(sd, storage_reader=reader)
        want = _step_state(rank, 3)
        same = all(torch.equal(sd[k], want[k]) for k in want)
        # Node 1 holds only the unhealthy steps: the restored step's counts (store's health.json) judge the next saves.
        w = GeminiStorageWriter(root=root, job_id=job, **kw)
        dcp.save(_step_state(rank, 4, poison=True), storage_writer=w, checkpoint_id=4)
        dcp.save(_step_state(rank, 5), storage_writer=w, checkpoint_id=5)
        tier = LocalTier(root, job)
        out[job] = {"restore": (reader.restored_step, tuple(reader.skipped_unhealthy), same),
                    "verdicts": [tier.record(s).healthy for s in (4, 5)]}
    return out


def _drains_gone(root: str) -> None:
    """Wait until the drain servers of ``root``'s jobs exited (idle): a wiped node's server must not outlive it."""
    import os
    import time

    from gemini_dcp.persistent.drain import server_pid

    deadline = time.monotonic() + 120
    for job in VARIANTS:
        pid = server_pid(LocalTier(root, job).layout.persist_dir)
        while pid is not None and time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)


def test_one_verdict_across_node_replacements_restores_and_the_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GEMINI_DCP_DRAIN_IDLE_S", "2")
    store = f"file://{tmp_path / 'store'}"
    make, cleanup = node_root_factory("gemini-health50")
    try:
        roots = make(3)
        first = run_ranks(_phase_healthy, 3, roots, store=store)
        assert all(r["refused"] == ("UnhealthyStateError", True) for r in first), first  # in the save, every rank
        assert all(r["steps"] == [1, 2] for r in first), first
        _drains_gone(roots[1])
        wipe(roots[1])  # node 1 replaced: no records, its first saves hold a NaN
        second = run_ranks(_phase_node1_replaced, 3, roots, store=store)
        for rank, r in enumerate(second):
            for job in VARIANTS:
                assert r[job]["verdicts"] == [False, False], (rank, job, second)  # every node's records agree
            assert r["n2"]["restored"][0] == 3 and r["np"]["restored"][0] == 3, second
            assert r["refused"] == ("UnhealthyStateError", True), (rank, second)
            assert r["refusing_steps"][-1] == 3, second
        assert "peer" in second[1]["n2"]["restored"][1] and "parity" in second[1]["np"]["restored"][1], second
        for i in (0, 2):
            _drains_gone(roots[i])
            wipe(roots[i])  # nodes 0 and 2 replaced too: only node 1's unhealthy steps and the store are left
        third = run_ranks(_phase_nodes_0_and_2_replaced, 3, roots, store=store)
        for rank, r in enumerate(third):
            for job in VARIANTS:
                assert r[job]["restore"] == (3, (5, 4), True), (rank, job, third)
                assert r[job]["verdicts"] == [False, True], (rank, job, third)
    finally:
        cleanup()


def test_float8_nan_is_counted() -> None:
    kinds = [n for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
             if hasattr(torch, n)]
    assert {"float8_e4m3fn", "float8_e5m2"} <= set(kinds)
    for name in kinds:
        dtype = getattr(torch, name)
        t = torch.ones(5000).to(dtype)
        nan = torch.tensor([float("nan")]).to(dtype).view(torch.uint8)
        b = t.view(torch.uint8)
        b[[0, 777, 4999]] = nan
        want = 3
        if name == "float8_e5m2":
            t[10] = float("inf")
            t[11] = float("-inf")
            want = 5
        assert count_nonfinite(t) == want, name
        assert count_nonfinite(t[::2]) == (2 if want == 5 else 1), name  # not contiguous: indices 0 and 10 only
        dst = torch.empty_like(b)
        value, n = copy_checksum_count(dst, b, "crc32c", kind_of(dtype), 1 << 12, None)
        assert n == want and torch.equal(dst, b) and value == checksum(b, "crc32c"), name
    assert count_nonfinite(torch.zeros(8).to(torch.float8_e4m3fn)) == 0


def test_float8_nan_marks_a_save_unhealthy(tmp_path: Path) -> None:
    root = _root(tmp_path)
    w = GeminiStorageWriter(root=root, job_id="f8")
    good = {"w8": torch.ones(64).to(torch.float8_e4m3fn), "g8": torch.ones(64).to(torch.float8_e5m2), "x": torch.ones(4)}
    dcp.save(good, storage_writer=w, checkpoint_id=1)
    bad = {k: v.clone() for k, v in good.items()}
    bad["w8"].view(torch.uint8)[3] = 0x7F  # NaN
    bad["g8"][5] = float("inf")
    dcp.save(bad, storage_writer=w, checkpoint_id=2)
    assert w.last_save is not None and w.last_save.nonfinite == {"w8": 1, "g8": 1}
    tier = LocalTier(root, "f8")
    assert tier.record(1).healthy and tier.record(2).healthy is False
    del w
    import json

    from typer.testing import CliRunner

    from gemini_dcp_cli.main import app

    res = CliRunner().invoke(app, ["verify", "--root", str(root), "--job", "f8", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["nonfinite"]["2"] == {"w8": 1, "g8": 1}


def test_a_restore_from_the_store_hands_its_counts_to_the_next_save(tmp_path: Path) -> None:
    root, store = _root(tmp_path), tmp_path / "store"
    w = GeminiStorageWriter(root=root, job_id="hs", persistent=str(store), persist_every=1)
    for step in (1, 2):
        dcp.save(_state(step), storage_writer=w, checkpoint_id=step)
    w.wait_persisted(2, timeout_s=60)
    del w
    fresh = tmp_path / "wiped"  # the node's memory is gone; the store's health.json is all that is left
    fresh.mkdir(mode=0o700)
    reader = GeminiStorageReader(root=fresh, job_id="hs", persistent=str(store))
    dcp.load(_state(0), storage_reader=reader)
    assert reader.restored_step == 2 and reader.restored_from["persistent"] > 0
    w = GeminiStorageWriter(root=fresh, job_id="hs")
    dcp.save(_state(3, poison=True), storage_writer=w, checkpoint_id=3)  # NaN beside the constant mask
    dcp.save(_state(4), storage_writer=w, checkpoint_id=4)  # the mask alone
    tier = LocalTier(fresh, "hs")
    assert tier.record(3).healthy is False and tier.record(4).healthy is True
    del w


def test_the_agreed_baseline_is_the_newest_proposal() -> None:
    from gemini_dcp.health.baseline import agree, baseline_of, valid_counts

    assert agree([None, None]) is None
    assert agree([None, baseline_of(3, {"mask": 10}), baseline_of(2, {})]) == (3, (("mask", 10),))
    assert valid_counts([[0, "w", 1], [1, "mask", 10]]) == ((0, "w", 1), (1, "mask", 10))
    for bad in ("x", [[0, "w"]], [[0, "w", -1]], [["0", "w", 1]], [[0, 3, 1]], [[True, "w", 1]]):
        assert valid_counts(bad) is None, bad
