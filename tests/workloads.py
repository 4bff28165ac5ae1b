"""Deterministic state dicts and per-rank test bodies used by the multi-process tests.

Every value depends only on (step, rank/global index), so a load can be checked
bit-exact against the state that was saved at that step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from gemini_dcp import GeminiStorageReader, GeminiStorageWriter, find_gemini_error

ROWS, COLS = 64, 33


def full_weight(step: int) -> torch.Tensor:
    """The global (unsharded) weight at ``step``: every element changes every step."""
    base = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)
    return base * 0.5 + step


def plain_state(step: int, rank: int = 0) -> dict[str, Any]:
    """Plain tensors are replicated in DCP's model (saved once, by the lowest rank), so no rank term."""
    return {
        "w": torch.full((128, 7), float(step * 100)),
        "i": torch.arange(10, dtype=torch.int64) + step,
        "step": step,
        "meta": {"lr": 0.1 * step, "name": "run"},
        "rng": torch.manual_seed(step).get_state(),
    }


def dtensor_state(step: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    w = distribute_tensor(full_weight(step), mesh, [Shard(0)])
    b = distribute_tensor(torch.arange(COLS, dtype=torch.float64) + step, mesh, [Shard(0)])
    return {"model": {"w": w, "b": b}, "step": step}


def zero_like(sd: Any) -> Any:
    if isinstance(sd, dict):
        return {k: zero_like(v) for k, v in sd.items()}
    if isinstance(sd, torch.Tensor):
        if hasattr(sd, "to_local"):
            local = sd.to_local()
            local.zero_()
            return sd
        return torch.zeros_like(sd)
    return sd


class MetadataHidingPlanner(dcp.DefaultSavePlanner):
    """A save planner that does not expose its global metadata while the writer writes, as
    custom planners may: DCP hands it to the storage writer only in the coordinator's ``finish``."""

    def create_global_plan(self, all_plans: Any) -> Any:
        plans, metadata = super().create_global_plan(all_plans)
        del self.metadata
        return plans, metadata


def save_steps(
    rank: int, world_size: int, root: str, *, job: str, steps: list[int], kind: str = "dtensor",
    planner: type[dcp.SavePlanner] | None = None, **writer_kw: Any,
) -> list[int]:
    done = []
    for step in steps:
        sd = dtensor_state(step, world_size) if kind == "dtensor" else plain_state(step, rank)
        writer = GeminiStorageWriter(root=root, job_id=job, **writer_kw)
        dcp.save(sd, storage_writer=writer, checkpoint_id=step, planner=planner() if planner else None)
        done.append(step)
    return done


def load_and_check(rank: int, world_size: int, root: str, *, job: str, step: int | None = None, expect: int | None = None, kind: str = "dtensor", **reader_kw: Any) -> dict[str, Any]:
    """Load into zeroed state and compare bit-exact with what was saved at the restored step."""
    target = dtensor_state(0, world_size) if kind == "dtensor" else plain_state(0, rank)
    for v in target["model"].values() if kind == "dtensor" else []:
        v.to_local().zero_()
    reader = GeminiStorageReader(root=root, job_id=job, **reader_kw)
    try:
        dcp.load(target, storage_reader=reader, checkpoint_id=step)
    except BaseException as exc:
        err = find_gemini_error(exc)
        return {"error": type(err).__name__ if err else type(exc).__name__, "message": str(exc)[-600:]}
    got = reader.restored_step
    if kind == "dtensor":
        want = dtensor_state(got, world_size)
        ok = all(torch.equal(target["model"][k].full_tensor(), want["model"][k].full_tensor()) for k in ("w", "b"))
        ok = ok and target["step"] == got
    else:
        want = plain_state(got, rank)
        ok = torch.equal(target["w"], want["w"]) and torch.equal(target["i"], want["i"]) and target["step"] == got
        ok = ok and torch.equal(target["rng"], want["rng"]) and target["meta"] == want["meta"]
    if expect is not None:
        ok = ok and got == expect
    return {"step": got, "ok": ok, "from": dict(reader.restored_from), "rank_from": dict(reader.rank_restored_from)}
