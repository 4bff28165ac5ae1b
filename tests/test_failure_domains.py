"""Issue 54: failure domains — no node's copies all in one rack, and a planner that knows it.

Unit tests of the placement arithmetic (every strategy, many domain shapes, stability, the
planner against an enumeration), then one end-to-end run: 8 simulated nodes (each its own tier
root, one gloo rank each) in 4 domains of 2 and in 3+3+2, every layout saved in one launch, each
domain's nodes wiped, every job restored in fresh processes from what survived.
"""

from __future__ import annotations

import itertools
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from mp_utils import run_ranks

from gemini_dcp import GeminiStorageReader, GeminiStorageWriter, find_gemini_error
from gemini_dcp.errors import ConfigError
from gemini_dcp.ops.sizing import domain_recovery, parse_domains, plan
from gemini_dcp.options import GeminiOptions
from gemini_dcp.peer.parity_groups import parity_groups
from gemini_dcp.peer.placement import (
    assign_positions,
    place,
    place_over_domains,
    recovery_probability,
    shared_domains,
    spread_over_domains,
)

STRATEGIES = ("group", "ring", "mixed")


# ---- placement arithmetic ------------------------------------------------------------------------
def _shapes() -> list[list[str]]:
    shapes = [list("aabbccdd"), list("aaabbbcc"), list("aaaaabbbbbcc"), list("aaaa"), list("abcdabcd"),
              [f"d{i // 4}" for i in range(16)]]
    rng = random.Random(54)
    for _ in range(60):
        n = rng.randint(2, 12)
        shapes.append([rng.choice("abcde"[: rng.randint(1, 5)]) for _ in range(n)])
    return shapes


def test_spread_alternates_domains_and_is_idempotent() -> None:
    for doms in _shapes():
        order = [f"n{i:02d}" for i in range(len(doms))]
        of = dict(zip(order, doms))
        spread = spread_over_domains(order, of)
        assert sorted(spread) == order
        assert spread_over_domains(spread, of) == spread  # a restart keeps the positions
        counts = sorted(((doms.count(d), d) for d in set(doms)), reverse=True)
        rest = len(doms) - counts[0][0]
        # neighbours differ in domain as long as the largest domain has a partner left for each node
        same = sum(of[a] == of[b] for a, b in zip(spread, spread[1:]))
        assert same == max(0, counts[0][0] - rest - 1), (doms, spread)


def test_with_the_layout_the_order_spends_small_domains_slowly_and_stays_idempotent() -> None:
    # racks of 6, 3 and 3 with 3 copies in groups: plain window-3 spreading uses racks b and c up first and
    # leaves a group of three rack-a nodes; the alternating order keeps every group in two racks or more
    doms = list("aaaaaabbbccc")
    assert recovery_probability(place_over_domains(doms, 3, "group"), 1, domains=doms) == 1.0
    for doms in _shapes():
        n = len(doms)
        order = [f"n{i:02d}" for i in range(n)]
        of = dict(zip(order, doms))
        for m in (2, 3):
            if m > n:
                continue
            for strategy in STRATEGIES:
                if strategy == "group" and n % m:
                    continue
                sets = place(n, m, strategy).holders  # type: ignore[arg-type]
                once = spread_over_domains(order, of, m, sets)
                assert spread_over_domains(once, of, m, sets) == once, (doms, m, strategy)
        for g in (3, 4):
            groups = parity_groups(list(range(n)), g)  # type: ignore[arg-type]
            once = spread_over_domains(order, of, g, groups, 2)
            assert spread_over_domains(once, of, g, groups, 2) == once, (doms, g)


def test_one_domain_or_none_keeps_gemini_order() -> None:
    order = ["n3", "n1", "n2", "n0"]
    assert spread_over_domains(order, {}) == order
    assert spread_over_domains(order, dict.fromkeys(order, "rack1")) == order


def test_a_replaced_node_in_the_same_domain_keeps_every_position() -> None:
    nodes = [f"n{i}" for i in range(8)]
    doms = dict(zip(nodes, "aabbccdd"))
    first = spread_over_domains(assign_positions(None, nodes), doms)
    replaced = [x if x != "n5" else "m5" for x in nodes]
    doms2 = {**{k: v for k, v in doms.items() if k != "n5"}, "m5": doms["n5"]}
    again = spread_over_domains(assign_positions(first, replaced), doms2)
    assert again == [x if x != "n5" else "m5" for x in first]


@pytest.mark.parametrize("doms", [list("aabbccdd"), list("aaabbbcc"), [f"d{i // 4}" for i in range(16)], list("aaaaabbbbbcc")])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_copy_in_distinct_domains_where_possible(doms: list[str], strategy: str) -> None:
    n, m = len(doms), 2
    if strategy == "group" and n % m:
        pytest.skip("group needs m | N")
    spread = place_over_domains(doms, m, strategy)  # type: ignore[arg-type]
    assert shared_domains(spread, doms) == {}
    assert recovery_probability(spread, 1, domains=doms) == 1.0
    # the random-node figure is the placement's own (a relabelling of GEMINI's placement)
    base = place(n, m, strategy)  # type: ignore[arg-type]
    for k in range(1, 4):
        assert recovery_probability(spread, k) == pytest.approx(recovery_probability(base, k))


def _enumerate_domain_loss(holders: Any, doms: list[str]) -> float:
    names = sorted(set(doms))
    ok = 0
    for d in names:
        dead = {i for i, x in enumerate(doms) if x == d}
        ok += all(set(hs) - dead for hs in holders)
    return ok / len(names)


def test_planner_16_nodes_4x4_matches_an_enumeration() -> None:
    res = plan(16, 2, "mixed", domains="4x4")
    doms = res["domains"]
    assert doms == [f"d{i // 4}" for i in range(16)]
    for row in res["domain_recovery"]:
        assert row["p_domain_spread"] == 1.0
        blind = place_over_domains(doms, 2, row["strategy"], spread=False)
        spread = place_over_domains(doms, 2, row["strategy"])
        assert row["p_domain_blind"] == _enumerate_domain_loss(blind.holders, doms) == 0.0
        assert row["p_domain_spread"] == _enumerate_domain_loss(spread.holders, doms)
        # k whole domains at once, against brute force
        for k in (1, 2):
            brute = 0
            combos = list(itertools.combinations(sorted(set(doms)), k))
            for failed in combos:
                dead = {i for i, x in enumerate(doms) if x in failed}
                brute += all(set(hs) - dead for hs in spread.holders)
            assert recovery_probability(spread, k, domains=doms) == pytest.approx(brute / len(combos))


def test_planner_parity_rows() -> None:
    rows = {r["strategy"]: r for r in domain_recovery(list("aabbccdd"), 2, group=4)}
    assert rows["parity"]["p_domain_spread"] == 1.0 and rows["parity"]["p_domain_blind"] == 0.0
    # 3 domains cannot give a group of 4 four domains: the best is one domain of three surviving
    rows = {r["strategy"]: r for r in domain_recovery(list("aaabbbcc"), 2, group=4)}
    assert rows["parity"]["p_domain_spread"] == pytest.approx(1 / 3)
    order = [str(i) for i in range(8)]
    groups = parity_groups(spread_over_domains(order, dict(zip(order, "aabbccdd"))), 4)
    assert all(len({"aabbccdd"[int(x)] for x in g}) == 4 for g in groups)


def test_plan_cli_prints_domain_recovery_per_strategy() -> None:
    from typer.testing import CliRunner

    from gemini_dcp_cli.main import app

    res = CliRunner().invoke(app, ["plan", "--nodes", "16", "--replicas", "2", "--domains", "4x4"])
    assert res.exit_code == 0, res.output
    assert "1 domain" in res.output and "spread over domains" in res.output
    for strategy in STRATEGIES:
        assert any(line.startswith(strategy) and "1.0000" in line for line in res.output.splitlines())
    bad = CliRunner().invoke(app, ["plan", "--nodes", "10", "--replicas", "2", "--domains", "4x4"])
    assert bad.exit_code != 0


def test_parse_domains_forms(tmp_path: Path) -> None:
    assert parse_domains("2x3", 6) == ["d0"] * 3 + ["d1"] * 3
    assert parse_domains("3,3,2", 8) == ["d0"] * 3 + ["d1"] * 3 + ["d2"] * 2
    f = tmp_path / "racks.txt"
    f.write_text("# node -> rack\nr1\nr1\n\nr2\nr2\n")
    assert parse_domains(str(f), 4) == ["r1", "r1", "r2", "r2"]
    with pytest.raises(ConfigError, match="names 4 node"):
        parse_domains(str(f), 5)
    with pytest.raises(ConfigError):
        parse_domains("racks!", 4)


def test_the_option_its_environment_variable_and_keywords(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert GeminiOptions().failure_domain is None
    assert GeminiOptions(failure_domain="rack7").failure_domain == "rack7"
    assert GeminiOptions.from_env({"GEMINI_DCP_FAILURE_DOMAIN": "rack2"}).failure_domain == "rack2"
    assert GeminiOptions.from_env({"GEMINI_DCP_FAILURE_DOMAIN": ""}).failure_domain is None
    for bad in ("", "x" * 200, "a\nb", 3):
        with pytest.raises(ConfigError, match="failure_domain"):
            GeminiOptions(failure_domain=bad)  # type: ignore[arg-type]
    root = tmp_path / "tier"
    root.mkdir(mode=0o700)
    w = GeminiStorageWriter(root=str(root), job_id="fd", failure_domain="rackA")
    assert w.options.failure_domain == "rackA"
    monkeypatch.setenv("GEMINI_DCP_FAILURE_DOMAIN", "rackB")
    r = GeminiStorageReader(root=str(root), job_id="fd")
    assert r.options.failure_domain == "rackB"
    assert GeminiStorageReader(root=str(root), job_id="fd", failure_domain="rackC").options.failure_domain == "rackC"


def test_a_saved_step_records_the_domains_and_inspect_shows_them(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from gemini_dcp.local.tier import LocalTier
    from gemini_dcp.ops.inspection import inspect_job

    root = tmp_path / "tier"
    root.mkdir(mode=0o700)
    w = GeminiStorageWriter(root=str(root), job_id="fd2", failure_domain="rack9")
    dcp.save({"w": torch.ones(8)}, storage_writer=w, checkpoint_id=1)
    tier = LocalTier(str(root), "fd2")
    rec = tier.record(1)
    assert rec is not None and rec.domain_of(rec.node_id) == "rack9"
    info = inspect_job(tier.layout)
    assert info.steps[-1].domains == {rec.node_id: "rack9"}


# ---- end to end: 8 simulated nodes, a whole domain wiped ---------------------------------------
D4 = ["r0", "r0", "r1", "r1", "r2", "r2", "r3", "r3"]
D332 = ["a", "a", "a", "b", "b", "b", "c", "c"]
LAYOUTS: dict[str, dict[str, Any]] = {
    "group": {"replicas": 2, "placement": "group"},
    "ring": {"replicas": 2, "placement": "ring"},
    "mixed": {"replicas": 2, "placement": "mixed"},
    "parity": {"parity_group": 4},
}


def _jobs() -> list[tuple[str, str, str, str]]:
    """(job id, layout, shape, domain wiped): every layout x every domain of 4x2; replicas over 3+3+2;
    the parity layout over 3+3+2 (cannot spread: logged); one domain-blind job with a store."""
    jobs = [(f"{lay}-d4-{d}", lay, "d4", d) for lay in LAYOUTS for d in sorted(set(D4))]
    jobs += [(f"{lay}-d332-{d}", lay, "d332", d) for lay in LAYOUTS for d in sorted(set(D332))]
    jobs.append(("blind-group-r0", "group", "blind", "r0"))
    return jobs


def _state(rank: int, job: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(hash((rank, job)) % (2**31))
    return {f"w{rank}": torch.randn(256, generator=g)}


def _save_all(rank: int, world: int, root: str, *, store: str) -> int:
    import torch.distributed.checkpoint as dcp

    for job, lay, shape, _ in _jobs():
        domain = None if shape == "blind" else (D4 if shape == "d4" else D332)[rank]
        extra = {"persistent": f"file://{store}", "persist_every": 1} if shape == "blind" else {}
        w = GeminiStorageWriter(root=root, job_id=job, failure_domain=domain, **LAYOUTS[lay], **extra)
        for step in (1, 2):
            dcp.save(_state(rank, f"{job}/{step}"), storage_writer=w, checkpoint_id=step)
        if extra:
            w.wait_persisted(2, timeout_s=120)
    return 0


def _restore_all(rank: int, world: int, root: str, *, store: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    out: dict[str, Any] = {}
    for job, _lay, shape, _ in _jobs():
        like = {k: torch.zeros_like(v) for k, v in _state(rank, job).items()}
        reader = GeminiStorageReader(root=root, job_id=job, persistent=f"file://{store}" if shape == "blind" else None)
        try:
            dcp.load(like, storage_reader=reader)
        except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException; compared below
            err = find_gemini_error(exc) or exc
            out[job] = {"error": type(err).__name__, "message": str(err)[:600]}
            continue
        want = _state(rank, f"{job}/2")
        out[job] = {"step": reader.restored_step, "exact": all(torch.equal(like[k], want[k]) for k in want),
                    "from": {k: v for k, v in reader.restored_from.items() if v}}
    return out


@pytest.fixture(scope="module")
def wiped_domains() -> dict[str, Any]:
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    top = Path(tempfile.mkdtemp(prefix="gemini-fd-", dir=base))
    store = Path(tempfile.mkdtemp(prefix="gemini-fd-store-"))
    roots = []
    for i in range(8):
        r = top / f"node{i}"
        r.mkdir(mode=0o700)
        roots.append(str(r))
    try:
        os.environ["GEMINI_DCP_DRAIN_MODE"] = "thread"
        run_ranks(_save_all, 8, roots, timeout=600, store=str(store))
        for job, _lay, shape, d in _jobs():  # a whole domain's nodes lose their memory
            doms = D332 if shape == "d332" else D4
            for i, x in enumerate(doms):
                if x == d:
                    shutil.rmtree(Path(roots[i]) / job, ignore_errors=True)
        res = run_ranks(_restore_all, 8, roots, timeout=600, store=str(store))
        return {"ranks": res}
    finally:
        os.environ.pop("GEMINI_DCP_DRAIN_MODE", None)
        shutil.rmtree(top, ignore_errors=True)
        shutil.rmtree(store, ignore_errors=True)


@pytest.mark.timeout(900)
def test_a_lost_domain_restores_from_memory_in_4_domains_of_2(wiped_domains: dict[str, Any]) -> None:
    for job, _lay, shape, _d in _jobs():
        if shape != "d4":
            continue
        for rank, res in enumerate(wiped_domains["ranks"]):
            got = res[job]
            assert "error" not in got, (job, rank, got)
            assert got["step"] == 2 and got["exact"], (job, rank, got)
            assert "persistent" not in got["from"], (job, rank, got)


@pytest.mark.timeout(900)
def test_a_lost_domain_of_uneven_domains_restores_replicas_and_names_parity_s_limit(wiped_domains: dict[str, Any]) -> None:
    for job, lay, shape, _d in _jobs():
        if shape != "d332" or lay == "parity":
            continue
        for rank, res in enumerate(wiped_domains["ranks"]):
            got = res[job]
            assert "error" not in got and got["step"] == 2 and got["exact"], (job, rank, got)
    # parity groups of 4 over 3 domains: some group holds two nodes of one domain, so some domain's loss
    # leaves a group short of two members: no memory restore, and the error names that domain
    errors = [res[f"parity-d332-{d}"] for d in sorted(set(D332)) for res in wiped_domains["ranks"]]
    failed = [e for e in errors if "error" in e]
    assert failed and all(e["error"] == "ShardUnavailableError" for e in failed)
    assert any("failure domain" in e["message"] for e in failed)


@pytest.mark.timeout(900)
def test_without_domains_the_same_wipe_falls_back_to_the_store(wiped_domains: dict[str, Any]) -> None:
    for rank, res in enumerate(wiped_domains["ranks"]):
        got = res["blind-group-r0"]
        assert "error" not in got and got["step"] == 2 and got["exact"], (rank, got)
        assert got["from"].get("persistent", 0) > 0, (rank, got)  # the group's both copies were in r0


def test_every_python_block_of_docs_placement_runs() -> None:
    import re

    text = (Path(__file__).resolve().parents[1] / "docs" / "placement.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) >= 2
    for block in blocks:
        exec(compile(block, "docs/placement.md", "exec"), {})  # noqa: S102 - the docs' own snippets
