"""A small DLRM-style recommendation model with torchrec, checkpointed every step with gemini_dcp.

torchrec ``EmbeddingBagCollection`` tables sharded TABLE_WISE by ``DistributedModelParallel``
(runs on CPU with gloo; each table lives on one rank, as a ``ShardedTensor``), a dense MLP
replicated with DDP, the embedding optimizer fused into fbgemm's TBE kernels
(row-wise Adagrad) and Adagrad for the dense part. Same checkpoint/resume loop and flags
as ``train_fsdp2.py`` (see ``examples/common.py``)::

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 examples/train_torchrec.py \\
        --steps 10 --fail-at-step 5

The state saved is ``model.state_dict()`` (ShardedTensor shards + dense weights) and the
CombinedOptimizer's ``state_dict()`` (fused TBE optimizer state as ShardedTensors + dense
Adagrad state), plus step, RNG and data position.
"""

from __future__ import annotations

import time

_T0 = time.time()
import os  # noqa: E402

os.environ.setdefault("_EXAMPLE_PROCESS_START", repr(_T0))

import argparse  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

SPARSE = ["user", "item", "category", "context"]


class SyntheticClicks:
    """Deterministic click batches indexed by position: batch ``pos`` of rank ``r`` comes
    from a generator seeded with (seed, pos, r). The label depends on the ids and the dense
    features, so the model has something to learn."""

    def __init__(self, seed: int, rank: int, batch: int, rows: int, dense: int) -> None:
        self.seed, self.rank, self.batch, self.rows, self.dense = seed, rank, batch, rows, dense
        self.pos = 0

    def batch_at(self, pos: int) -> tuple[torch.Tensor, Any, torch.Tensor]:
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        g = torch.Generator().manual_seed((self.seed * 1_000_003 + pos) * 4099 + self.rank)
        dense = torch.randn(self.batch, self.dense, generator=g)
        lengths = torch.randint(1, 4, (len(SPARSE), self.batch), generator=g)
        values = torch.randint(self.rows, (int(lengths.sum()),), generator=g)
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=SPARSE, values=values, lengths=lengths.reshape(-1))
        first = values[torch.cumsum(lengths.reshape(-1), 0) - lengths.reshape(-1)].reshape(len(SPARSE), self.batch)
        score = dense[:, 0] + 0.5 * dense[:, 1] + ((first[0] + first[1]) % 7 < 3).float() - 0.5
        labels = (score + 0.3 * torch.randn(self.batch, generator=g) > 0).float()
        return dense, kjt, labels

    def next(self) -> tuple[torch.Tensor, Any, torch.Tensor]:
        out = self.batch_at(self.pos)
        self.pos += 1
        return out

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.pos = int(sd["pos"])


class RecState(common.TrainState):
    """torchrec state: ``model.state_dict()`` / the CombinedOptimizer's ``state_dict()``
    (torch's get_state_dict does not know DistributedModelParallel)."""

    def model_optim_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        return self.model.state_dict(), self.optim.state_dict()

    def load_model_optim(self, model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> None:
        # DCP already loaded in place into the tensors/ShardedTensors of these dicts.
        self.model.load_state_dict(model_sd)
        self.optim.load_state_dict(optim_sd)

    def forget_optimizer_init(self) -> None:
        pass  # Adagrad and the fused TBE optimizer allocate their state up front: nothing lazy to undo


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    m = p.add_argument_group("model")
    m.add_argument("--rows", type=int, default=5000, help="rows per embedding table")
    m.add_argument("--dim", type=int, default=16, help="embedding dimension")
    m.add_argument("--dense", type=int, default=13, help="dense features")
    m.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    common.add_common_args(p)
    p.set_defaults(lr=0.05)
    return p.parse_args(argv)


def build(args: argparse.Namespace, ctx: common.Ctx) -> tuple[torch.nn.Module, Any]:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.types import ShardingEnv, ShardingType
    from torchrec.models.dlrm import DLRM
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    for name in ("torchrec.distributed.planner.types", "torchrec.distributed.planner.storage_reservations"):
        logging.getLogger(name).setLevel(logging.ERROR)  # topology/dry-run advice irrelevant on CPU
    torch.manual_seed(args.seed)
    tables = [
        EmbeddingBagConfig(name=f"t_{f}", embedding_dim=args.dim, num_embeddings=args.rows, feature_names=[f])
        for f in SPARSE
    ]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
    model = DLRM(embedding_bag_collection=ebc, dense_in_features=args.dense,
                 dense_arch_layer_sizes=[32, args.dim], over_arch_layer_sizes=[32, 1])
    sharders = [EmbeddingBagCollectionSharder(fused_params={
        "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": args.lr, "eps": 1e-8})]
    constraints = {t.name: ParameterConstraints(sharding_types=[ShardingType.TABLE_WISE.value]) for t in tables}
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=ctx.world_size, compute_device=ctx.device.type,
                          local_world_size=ctx.local_world_size),
        constraints=constraints, debug=False)
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(module=model, device=ctx.device, env=ShardingEnv.from_process_group(dist.GroupMember.WORLD),
                                   plan=plan, sharders=sharders)
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                  lambda ps: torch.optim.Adagrad(ps, lr=args.lr))
    optim = CombinedOptimizer([dmp.fused_optimizer, dense])
    torch.manual_seed(args.seed + 1 + ctx.rank)
    return dmp, optim


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ctx = common.setup(args)
    model, optim = build(args, ctx)
    data = SyntheticClicks(args.seed, ctx.rank, args.batch, args.rows, args.dense)
    app = RecState(model, optim, data, ctx)
    ckpt = common.make_checkpointer(args)
    placement = {t: f"{ps.sharding_type} on rank {','.join(map(str, ps.ranks or []))}"
                 for mod in model.plan.plan.values() for t, ps in mod.items()}
    ctx.log(f"DLRM: {len(SPARSE)} tables x {args.rows} x {args.dim} under DistributedModelParallel over {ctx.world_size} ranks "
            f"({ctx.backend}); {placement}; attempt {ctx.restart_count}")
    loss_fn = torch.nn.BCEWithLogitsLoss()

    def train_step(step: int) -> torch.Tensor:
        model.train()
        dense, kjt, labels = data.next()
        logits = model(dense.to(ctx.device), kjt.to(ctx.device)).squeeze(-1)
        loss = loss_fn(logits, labels.to(ctx.device))
        loss.backward()  # the fused TBE optimizer updates the embedding rows here
        common.maybe_fail(step, args, ctx)
        optim.step()
        optim.zero_grad()
        avg = loss.detach().clone()
        dist.all_reduce(avg)
        return (avg / ctx.world_size).cpu()

    common.run_loop(args, ctx, app, ckpt, train_step)
    finish(args, ctx, model)
    ckpt.close(ctx)
    return 0


def finish(args: argparse.Namespace, ctx: common.Ctx, model: torch.nn.Module) -> None:
    """Fingerprint: every rank hashes the local shards it holds; rank 0 combines them."""
    if not (args.print_params_hash or args.dump_final):
        return
    local: dict[str, torch.Tensor] = {}
    for k, v in model.state_dict().items():
        if hasattr(v, "local_shards"):
            for sh in v.local_shards():
                local[f"{k}@{tuple(sh.metadata.shard_offsets)}"] = sh.tensor.detach().clone()
        elif ctx.rank == 0:
            local[k] = v.detach().clone()
    gathered: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(gathered, local)
    if ctx.rank != 0:
        return
    params = {k: v for part in gathered for k, v in part.items()}
    if args.print_params_hash:
        print(f"final params sha256 {common.params_hash(params)}", flush=True)
    if args.dump_final:
        torch.save(params, args.dump_final)


if __name__ == "__main__":
    common.main_guard(main)
