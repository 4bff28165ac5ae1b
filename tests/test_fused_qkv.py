"""torchtitan's fused-qkv save split from local rows (gemini_dcp.integrations.fused_qkv), 2 real gloo ranks.

A stand-in for torchtitan's ``FusedQKVLinear`` (the same hook name and row layout: ``n_kv`` groups of
``heads_per_kv`` query heads, a key head and a value head) with an FSDP-like ``Shard(0)`` ``wqkv``:
``ModelStatesCache`` gives ``wq``/``wk``/``wv`` as ``Shard(0)`` DTensors whose global values equal the
hook's, tracks in-place updates without calling the hook, keeps the hook where the groups do not divide
evenly, and keeps both ranks on the same path when only one of them sees a change.
"""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
import torch
from mp_utils import run_ranks
from titan_stub import ModelWrapperStub as _Wrapper


class FusedQKVLinear(torch.nn.Module):
    """The layout torchtitan's fused projection saves through its state-dict post hook."""

    def __init__(self, mesh: Any, n_heads: int, n_kv: int, head_dim: int, dim: int) -> None:
        from torch.distributed.tensor import Shard, distribute_tensor

        super().__init__()
        self.head_dim, self.heads_per_kv = head_dim, n_heads // n_kv
        self.r_dim = self.heads_per_kv + 2
        self.wqkv = torch.nn.Linear(dim, n_kv * self.r_dim * head_dim, bias=False)
        g = torch.Generator().manual_seed(7)
        full = torch.randn(n_kv * self.r_dim * head_dim, dim, generator=g)
        self.wqkv.weight = torch.nn.Parameter(distribute_tensor(full, mesh, [Shard(0)]))
        self.register_state_dict_post_hook(self._split_qkv_on_save)

    @staticmethod
    def _split_qkv_on_save(module: Any, sd: dict[str, Any], prefix: str, _meta: Any) -> None:
        from torch.distributed.tensor import Replicate

        t = sd.pop(f"{prefix}wqkv.weight")
        t = t.redistribute(t.device_mesh, [Replicate()])
        hd, hpk, r = module.head_dim, module.heads_per_kv, module.r_dim
        cols = t.shape[1]
        heads = t.reshape(-1, r, hd, cols)
        sd[f"{prefix}wq.weight"] = heads[:, :hpk].reshape(-1, cols).contiguous()
        sd[f"{prefix}wk.weight"] = heads[:, hpk].reshape(-1, cols).contiguous()
        sd[f"{prefix}wv.weight"] = heads[:, hpk + 1].reshape(-1, cols).contiguous()


def _model(mesh: Any, n_kv: int) -> Any:
    net = torch.nn.Module()
    net.attn = FusedQKVLinear(mesh, n_heads=2 * n_kv, n_kv=n_kv, head_dim=2, dim=3)
    net.out = torch.nn.Linear(3, 2)
    return net


def _full(sd: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for k, v in sd.items()}


def _ranks(rank: int, world: int, root: str, n_kv: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from gemini_dcp.integrations.torchtitan import ModelStatesCache

    mesh = init_device_mesh("cpu", (world,))
    model = _model(mesh, n_kv)
    wrapper = _Wrapper(model)
    cache = ModelStatesCache(_Wrapper, timeout_s=60.0)
    first = cache.get(wrapper)
    placements = {k: str(getattr(v, "placements", None)) for k, v in first.items()}
    exact = [list(first) == list(wrapper._get_state_dict())]
    with torch.no_grad():
        for _ in range(2):
            for p in model.parameters():
                p.add_(0.25)
            got = _full(cache.get(wrapper))  # every rank runs the same collectives: no short-circuit before them
            ref = _full(_Wrapper(model)._get_state_dict())
            exact.append(list(got) == list(ref) and all([torch.equal(got[k], ref[k]) for k in ref]))
        same_objects = all(cache.get(wrapper)[k] is first[k] for k in first)
        # Only rank 1 sees a change (a re-pointed parameter, which it then holds as a copy and cannot
        # remember): both ranks rebuild, and neither splits (rank 1's hook all-gathers), neither hangs.
        before = cache.rebuilds
        if rank == 1:
            model.out.bias.data = model.out.bias.data.clone()
        got = _full(cache.get(wrapper))
        ref = _full(_Wrapper(model)._get_state_dict())
        exact.append(all([torch.equal(got[k], v) for k, v in ref.items()]))
        after = {k: str(getattr(v, "placements", None)) for k, v in cache.get(wrapper).items()}
    return {"after": after, "placements": placements, "exact": exact, "same": same_objects, "rebuilt": cache.rebuilds - before,
            "hits": cache.hits}


@pytest.mark.timeout(180)
def test_fused_split_is_sharded_exact_and_tracks_updates() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = run_ranks(_ranks, 2, tmp, timeout=150, n_kv=2)  # one kv group per rank
    for res in out:
        assert res["placements"]["attn.wq.weight"] == "(Shard(dim=0),)", res
        assert res["placements"]["attn.wk.weight"] == "(Shard(dim=0),)", res
        assert all(res["exact"]) and res["same"], res
        assert res["rebuilt"] == 2 and res["hits"] == 7, res  # 2 in-place steps, 5 gets of same_objects
        assert res["after"]["attn.wq.weight"] == "(Replicate(),)", res


@pytest.mark.timeout(180)
def test_uneven_groups_keep_torchtitans_hook() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = run_ranks(_ranks, 2, tmp, timeout=150, n_kv=3)  # 3 kv groups on 2 ranks: no local split
    for res in out:
        assert res["placements"]["attn.wq.weight"] == "(Replicate(),)", res
        assert all(res["exact"]) and res["rebuilt"] == 2, res
