"""Issue 27: the collectives a plain ``dcp.save`` with ``GeminiStorageWriter`` runs of its own.

- The pre-write agreement (:mod:`gemini_dcp.commit.agreement`) rides DCP's planning: each rank's
  values go to the coordinator in its local plan, the combined ones come back in its final plan,
  and ``write_data`` runs no all-reduce; with DCP's plan cache (whose cached plans carry values
  already used) every rank runs the all-reduce instead, all alike.
- The commit gather is one fixed-size all-gather (:mod:`gemini_dcp.commit.exchange`), two only
  when a report does not fit its frame.

2 real gloo ranks, each its own node (tier root); every step restores bit-exact.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from mp_utils import run_ranks

from gemini_dcp.commit.agreement import AgreedValues, PlannedValues, combine_planned, take_agreed
from gemini_dcp.commit.exchange import MAX_FRAME, MIN_FRAME, frame_bytes

HAS_PLAN_CACHE = "enable_plan_caching" in __import__("inspect").signature(
    __import__("torch.distributed.checkpoint.default_planner", fromlist=["x"]).DefaultSavePlanner.__init__
).parameters


@pytest.fixture
def roots() -> Any:
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    d = tempfile.mkdtemp(prefix="gemini-savecoll-", dir=base)
    paths = [os.path.join(d, f"node{i}") for i in range(2)]
    for p in paths:
        os.makedirs(p)
    yield paths
    shutil.rmtree(d, ignore_errors=True)


# ---- the agreement's payloads, one process ---------------------------------------------------------
def test_combined_values_are_the_minimum_and_used_values_are_never_taken_again() -> None:
    a, b = PlannedValues(7, [5, 0, 0]), PlannedValues(7, [3, -1, 0])
    assert combine_planned(7, [a, b], delivered=True) == [3, -1, 0]
    assert a.used and b.used
    # DCP's plan cache hands back a plan of an earlier save: its values were used, so no agreement.
    assert combine_planned(7, [a, PlannedValues(7, [9, 0, 0])], delivered=True) is None
    # Another step's values, a plan without values, or a rank that will use a cached plan: none.
    assert combine_planned(8, [PlannedValues(7, [1, 0, 0])], delivered=True) is None
    assert combine_planned(7, [PlannedValues(7, [1, 0, 0]), None], delivered=True) is None
    assert combine_planned(7, [PlannedValues(7, [1, 0, 0])], delivered=False) is None
    agreed = AgreedValues(7, [3, -1, 0])
    assert take_agreed(agreed, 8) is None and not agreed.used  # another step: not taken
    assert take_agreed(agreed, 7) == [3, -1, 0] and agreed.used
    assert take_agreed(agreed, 7) is None  # a cached final plan handing the same values back
    assert take_agreed(AgreedValues(7, None), 7) is None
    assert take_agreed(None, 7) is None


def test_frame_size_is_bounded_and_the_same_for_a_world_size() -> None:
    assert frame_bytes(2) == MAX_FRAME
    assert frame_bytes(1 << 20) == MIN_FRAME
    assert MIN_FRAME <= frame_bytes(256) <= MAX_FRAME


# ---- 2 real ranks ----------------------------------------------------------------------------------
def _state(rank: int, step: int, changed: bool) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (2,))
    g = torch.Generator().manual_seed(100 * step + rank)
    sd: dict[str, Any] = {
        f"w{i}": DTensor.from_local(torch.randn(6 if (changed and i == 0) else 4, 8, generator=g), mesh, [Shard(0)],
                                    run_check=False)
        for i in range(10)
    }
    sd["step"] = step
    return sd


def _saves(rank: int, world: int, root: str, cached: bool) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.tensor import DTensor

    import gemini_dcp.commit.protocol as protocol
    from gemini_dcp import GeminiStorageReader, GeminiStorageWriter

    counts = {"all_reduce": 0, "all_gather": 0}
    real_reduce, real_gather = protocol.min_all_reduce, dist.all_gather

    def reduce(*a: Any, **k: Any) -> Any:
        counts["all_reduce"] += 1
        return real_reduce(*a, **k)

    def gather(*a: Any, **k: Any) -> Any:
        counts["all_gather"] += 1
        return real_gather(*a, **k)

    protocol.min_all_reduce = reduce  # type: ignore[assignment]
    dist.all_gather = gather  # type: ignore[assignment]
    job = "cached" if cached else "plain"
    writer = GeminiStorageWriter(root=root, job_id=job, keep=8)
    per_save: list[dict[str, int]] = []
    global_steps: list[int | None] = []
    states: dict[int, dict[str, Any]] = {}
    for step in range(1, 7):
        sd = _state(rank, step, changed=step >= 4)
        states[step] = sd
        planner = DefaultSavePlanner(enable_plan_caching=True) if cached else None
        if planner is not None:
            planner._cached_plans_key = f"test_save_collectives-{job}"
        before = dict(counts)
        dcp.save(sd, storage_writer=writer, checkpoint_id=step, planner=planner)
        per_save.append({k: counts[k] - before[k] for k in counts})
        global_steps.append(writer.commit.global_step)
    protocol.min_all_reduce = real_reduce  # type: ignore[assignment]
    dist.all_gather = real_gather  # type: ignore[assignment]
    # A report too large for the first round's frame takes a second one, with the same values on every rank.
    from gemini_dcp.commit.exchange import gather_objects
    from gemini_dcp.transport.comm import get_comm

    big = {"rank": rank, "pad": os.urandom(MAX_FRAME + 1000 * (rank + 1))}
    got = gather_objects(get_comm(60.0), big)
    big_ok = [g["rank"] for g in got] == [0, 1] and all(len(g["pad"]) == MAX_FRAME + 1000 * (r + 1) for r, g in enumerate(got))
    exact = {}
    for step, sd in states.items():
        out = {k: DTensor.from_local(torch.zeros_like(v.to_local()), v.device_mesh, v.placements, run_check=False)
               if isinstance(v, DTensor) else -1 for k, v in sd.items()}
        dcp.load(out, storage_reader=GeminiStorageReader(root=root, job_id=job), checkpoint_id=step)
        exact[step] = all(torch.equal(out[k].to_local(), v.to_local()) if isinstance(v, DTensor) else out[k] == v
                          for k, v in sd.items())
    return {"per_save": per_save, "global_steps": global_steps, "exact": exact, "big_ok": big_ok}


@pytest.mark.timeout(300)
def test_plain_save_runs_one_gather_and_no_agreement_collective(roots: list[str]) -> None:
    res = run_ranks(_saves, 2, roots, timeout=280, cached=False)
    for r in res:
        assert all(r["exact"].values()), r["exact"]
        assert r["per_save"] == [{"all_reduce": 0, "all_gather": 1}] * 6, r["per_save"]
        # G, agreed through the plans: the newest step committed on both nodes before each save.
        assert r["global_steps"] == [None, 1, 2, 3, 4, 5], r["global_steps"]
        assert r["big_ok"]


@pytest.mark.timeout(300)
@pytest.mark.skipif(not HAS_PLAN_CACHE, reason="DCP's plan cache needs torch >= 2.7")
def test_plan_cache_falls_back_to_the_all_reduce_on_every_rank_alike(roots: list[str]) -> None:
    res = run_ranks(_saves, 2, roots, timeout=280, cached=True)
    for r in res:
        assert all(r["exact"].values()), r["exact"]
        # The first save plans afresh (values in the plans); a cached plan (steps 2-3, 5-6) carries
        # used values: the all-reduce runs. Step 4 changed structure: DCP plans rank 0's... both anew.
        reduces = [s["all_reduce"] for s in r["per_save"]]
        assert reduces[0] == 0 and reduces[1] == 1 and reduces[2] == 1 and reduces[4] == 1 and reduces[5] == 1, reduces
        assert all(s["all_gather"] == 1 for s in r["per_save"]), r["per_save"]
        assert r["global_steps"] == [None, 1, 2, 3, 4, 5], r["global_steps"]
    assert res[0]["per_save"] == res[1]["per_save"]
