"""Issue 27: the structural snapshot's cache (gemini_dcp.snapshot.structure) and the replayed
plan's fast check (gemini_dcp.snapshot.replay_check). Fast unit tests, no processes.

The cache must give exactly what a full walk gives (containers copied, tensors by reference,
buffers cloned, Stateful values turned into state dicts), reuse the walk while the structure
holds, and walk again (a new generation) on any change: a key, a container, another tensor
object, a scalar that became a tensor, a buffer whose storage moved.
"""

from __future__ import annotations

import collections
import time
from typing import Any

import pytest
import torch

from gemini_dcp.snapshot.replay_check import FastCheck
from gemini_dcp.snapshot.structure import StructureCache, buffer_storages, snapshot_structure, storage_key


def _sd(n: int = 4) -> dict[str, Any]:
    return {
        "model": {f"w{i}": torch.randn(3, 2) for i in range(n)},
        "optim": {"state": {0: {"exp_avg": torch.zeros(3), "step": torch.tensor(1.0)}}, "param_groups": [{"lr": 0.1, "params": [0]}]},
        "pair": (torch.ones(1), 5),
        "step": 7,
    }


def _same_structure(a: Any, b: Any) -> None:
    """``a`` and ``b`` are equal snapshots: same containers and types, the same tensor objects."""
    assert type(a) is type(b)
    if isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _same_structure(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same_structure(x, y)
    elif isinstance(a, torch.Tensor):
        assert a is b
    else:
        assert a == b


def test_unchanged_state_reuses_the_walk_and_equals_a_full_walk() -> None:
    sd = _sd()
    cache = StructureCache()
    first = cache.snapshot(sd)
    second = cache.snapshot(sd)
    assert not first.reused and second.reused and first.generation == second.generation
    assert (cache.walks, cache.reuses) == (1, 1)
    _same_structure(second.state_dict, snapshot_structure(sd))
    # Containers are copies: mutating the snapshot's containers leaves the state dict alone.
    assert second.state_dict["model"] is not sd["model"] and second.state_dict["optim"]["state"][0] is not sd["optim"]["state"][0]
    second.state_dict["model"]["new"] = 1
    assert "new" not in sd["model"]
    assert second.devices == {torch.device("cpu")}


def test_new_containers_around_the_same_tensors_reuse() -> None:
    """get_state_dict() builds fresh dicts each step around the same parameter objects."""
    sd = _sd()
    cache = StructureCache()
    g = cache.snapshot(sd).generation
    rebuilt = {"model": dict(sd["model"]), "optim": {"state": {0: dict(sd["optim"]["state"][0])},
               "param_groups": [dict(sd["optim"]["param_groups"][0])]}, "pair": tuple(sd["pair"]), "step": 8}
    snap = cache.snapshot(rebuilt)
    assert snap.reused and snap.generation == g and snap.state_dict["step"] == 8
    _same_structure(snap.state_dict, snapshot_structure(rebuilt))


@pytest.mark.parametrize(
    "change",
    [
        "new_key", "removed_key", "key_order", "other_tensor", "container_type", "scalar_to_tensor",
        "scalar_to_dict", "tensor_to_scalar", "nested_tensor", "list_length", "tuple_member",
    ],
)
def test_any_structure_change_walks_again(change: str) -> None:
    sd = _sd()
    cache = StructureCache()
    g = cache.snapshot(sd).generation
    if change == "new_key":
        sd["model"]["w9"] = torch.zeros(1)
    elif change == "removed_key":
        del sd["model"]["w0"]
    elif change == "key_order":
        w0 = sd["model"].pop("w0")
        sd["model"]["w0"] = w0
    elif change == "other_tensor":
        sd["model"]["w1"] = sd["model"]["w1"].clone()
    elif change == "container_type":
        sd["model"] = collections.OrderedDict(sd["model"])
    elif change == "scalar_to_tensor":
        sd["step"] = torch.tensor(7)
    elif change == "scalar_to_dict":
        sd["step"] = {"value": 7}
    elif change == "tensor_to_scalar":
        sd["model"]["w2"] = 3
    elif change == "nested_tensor":
        sd["optim"]["state"][0]["exp_avg"] = torch.zeros(3)
    elif change == "list_length":
        sd["optim"]["param_groups"].append({"lr": 1.0})
    elif change == "tuple_member":
        sd["pair"] = (torch.ones(1), 5)
    snap = cache.snapshot(sd)
    assert not snap.reused and snap.generation != g
    _same_structure(snap.state_dict, snapshot_structure(sd))
    again = cache.snapshot(sd)
    assert again.reused and again.generation == snap.generation


def test_scalar_values_change_without_a_new_walk() -> None:
    sd = _sd()
    cache = StructureCache()
    g = cache.snapshot(sd).generation
    sd["step"] = 8
    sd["optim"]["param_groups"][0]["lr"] = 0.5
    snap = cache.snapshot(sd)
    assert snap.reused and snap.generation == g
    assert snap.state_dict["step"] == 8 and snap.state_dict["optim"]["param_groups"][0]["lr"] == 0.5


def test_buffers_are_cloned_at_every_snapshot_and_a_moved_buffer_walks_again() -> None:
    bn = torch.nn.BatchNorm1d(3)
    sd = {"model": dict(bn.state_dict(keep_vars=True)), "w": torch.ones(2)}
    cache = StructureCache(buffer_storages(bn))
    first = cache.snapshot(sd)
    second = cache.snapshot(sd)
    assert second.reused
    for snap in (first, second):
        rm = snap.state_dict["model"]["running_mean"]
        assert rm is not bn.running_mean and torch.equal(rm, bn.running_mean)
        assert snap.state_dict["model"]["weight"] is bn.weight and snap.state_dict["w"] is sd["w"]
    assert first.state_dict["model"]["running_mean"] is not second.state_dict["model"]["running_mean"]
    bn.running_mean.data = torch.zeros(3)  # the same object, its storage moved: no longer a known buffer
    assert storage_key(bn.running_mean) not in cache.clone_storages
    third = cache.snapshot(sd)
    assert not third.reused and third.state_dict["model"]["running_mean"] is bn.running_mean


class _Stateful:
    def __init__(self) -> None:
        self.t = torch.ones(2)
        self.calls = 0

    def state_dict(self) -> dict[str, Any]:
        self.calls += 1
        return {"t": self.t, "calls": self.calls}

    def load_state_dict(self, sd: dict[str, Any]) -> None:  # pragma: no cover - the protocol's other half
        self.t = sd["t"]


def test_top_level_stateful_is_asked_for_its_state_dict_every_time() -> None:
    obj = _Stateful()
    sd = {"app": obj, "w": torch.ones(1)}
    cache = StructureCache()
    a = cache.snapshot(sd)
    b = cache.snapshot(sd)
    assert b.reused and obj.calls == 2
    assert a.state_dict["app"]["calls"] == 1 and b.state_dict["app"]["calls"] == 2 and b.state_dict["app"]["t"] is obj.t
    obj.t = torch.zeros(2)  # its state dict now holds another tensor: walk again
    c = cache.snapshot(sd)
    assert not c.reused and c.state_dict["app"]["t"] is obj.t


def test_a_failed_walk_caches_nothing() -> None:
    class Broken:
        def state_dict(self) -> dict[str, Any]:
            raise RuntimeError("boom")

        def load_state_dict(self, sd: dict[str, Any]) -> None:  # pragma: no cover
            pass

    cache = StructureCache()
    cache.snapshot({"w": torch.ones(1)})
    with pytest.raises(RuntimeError, match="boom"):
        cache.snapshot({"w": torch.ones(1), "b": Broken()})
    assert not cache.snapshot({"w": torch.ones(1)}).reused
    with pytest.raises(TypeError, match="must be a dict"):
        cache.snapshot([1])  # type: ignore[arg-type]


def test_reuse_is_flat_in_the_number_of_items() -> None:
    """3,000 tensors: a reused snapshot costs well under a millisecond (a full walk: tens of ms)."""
    sd = {f"layers.{i}.weight": torch.zeros(2) for i in range(3000)}
    sd["step"] = 0
    cache = StructureCache()
    cache.snapshot(sd)
    times = []
    for s in range(20):
        sd["step"] = s
        t0 = time.perf_counter()
        snap = cache.snapshot(sd)
        times.append(time.perf_counter() - t0)
        assert snap.reused
    assert sorted(times)[len(times) // 2] < 2e-3  # generous for a loaded host; measured ~0.2 ms


# ---- the replayed plan's fast check -------------------------------------------------------------
def _flat(sd: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    return flatten_state_dict(sd)


def test_fast_check_accepts_the_same_tensors_and_refuses_in_place_changes() -> None:
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    sd = {"model": {"w": torch.randn(4, 2), "p": torch.nn.Parameter(torch.randn(3))}, "step": 1}
    flat, mappings = _flat(sd)
    fast = FastCheck.of(5, flat, mappings)
    assert fast is not None and fast.generation == 5
    planner = DefaultSavePlanner()
    sd["step"] = 2
    assert fast.set_up(planner, sd, True)
    assert planner.state_dict["step"] == 2 and planner.state_dict["model.w"] is sd["model"]["w"] and planner.is_coordinator
    sd["model"]["w"].data = torch.randn(5, 2)  # same object, another shape
    assert not fast.set_up(DefaultSavePlanner(), sd, True)
    sd["model"]["w"].data = torch.randn(4, 2).double()  # another dtype
    assert not fast.set_up(DefaultSavePlanner(), sd, True)
    sd["model"]["w"].data = torch.randn(4, 2)
    assert fast.set_up(DefaultSavePlanner(), sd, True)
    sd["model"]["p"].requires_grad_(False)
    assert not fast.set_up(DefaultSavePlanner(), sd, True)
    sd["model"]["p"].requires_grad_(True)
    with torch.no_grad():
        assert not fast.set_up(DefaultSavePlanner(), sd, True)  # the grad mode is part of DCP's plan
    del sd["model"]["w"]
    assert not fast.set_up(DefaultSavePlanner(), sd, True)  # a path that no longer resolves


def test_fast_check_needs_a_generation() -> None:
    flat, mappings = _flat({"w": torch.ones(1)})
    assert FastCheck.of(None, flat, mappings) is None
