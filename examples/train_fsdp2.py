"""A small transformer language model under FSDP2, checkpointed every step with gemini_dcp.

Runs on CPU (gloo) and on GPU (nccl). Under torchrun, a killed rank is restarted
with the whole worker group and the run resumes from the newest step in CPU
memory (local tier; a peer's memory when the node was replaced), continuing the
very same loss curve::

    torchrun --standalone --nproc-per-node 2 --max-restarts 2 examples/train_fsdp2.py \\
        --steps 12 --fail-at-step 6
    ...
    [rank 1] injected failure: SIGKILL myself during step 6
    ...
    resumed from step 5 (tier: local, 2.3 MiB) in 0.04 s
    step    6  loss ...

Data is synthetic and deterministic: the batch of step ``s`` on rank ``r`` comes
from a generator seeded with ``(seed, s, r)``, so the data position is just the
step, and a resumed run sees exactly the batches a failure-free run would.
See ``examples/common.py`` for the checkpoint/resume loop and the flags.

``--inject-nan-at K``: a bad batch puts NaN into one rank's weight shard at step K (after its
optimizer step). Step K's checkpoint is then marked unhealthy (gemini_dcp counts NaN/Inf while it
copies), the loss of step K+1 is not finite, and the loop rolls back *in-process* to the newest
healthy step (``fast_load``: step K-1), skips the bad batch and trains on; no restart. Saves of
K, K+1, ... start a new timeline (docs/health.md)::

    torchrun --standalone --nproc-per-node 2 examples/train_fsdp2.py --steps 12 --inject-nan-at 6
    ...
    step 7: loss nan: rolled back in-process to step 5 (fast path ...) in 0.03 s; skipping batch 6
"""

from __future__ import annotations

import time

_T0 = time.time()
import os  # noqa: E402

os.environ.setdefault("_EXAMPLE_PROCESS_START", repr(_T0))

import argparse  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


# ---- model ------------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class TinyLM(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, seq: int, dropout: float) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


# ---- data -------------------------------------------------------------------------------------
class SyntheticTokens:
    """Deterministic token batches indexed by position: batch ``pos`` of rank ``r`` is
    generated from a seed derived from (seed, pos, r). Sequences follow a noisy
    affine rule (next = 7*cur + 3 mod vocab, 10% random), so the loss goes down."""

    def __init__(self, seed: int, rank: int, batch: int, seq: int, vocab: int) -> None:
        self.seed, self.rank, self.batch, self.seq, self.vocab = seed, rank, batch, seq, vocab
        self.pos = 0  # batches consumed

    def batch_at(self, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + pos) * 4099 + self.rank)
        x = torch.empty(self.batch, self.seq + 1, dtype=torch.long)
        x[:, 0] = torch.randint(self.vocab, (self.batch,), generator=g)
        noise = torch.randint(self.vocab, (self.batch, self.seq), generator=g)
        use_noise = torch.rand(self.batch, self.seq, generator=g) < 0.1
        for t in range(self.seq):
            nxt = (x[:, t] * 7 + 3) % self.vocab
            x[:, t + 1] = torch.where(use_noise[:, t], noise[:, t], nxt)
        return x[:, :-1], x[:, 1:]

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.batch_at(self.pos)
        self.pos += 1
        return out

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.pos = int(sd["pos"])


# ---- main -------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    m = p.add_argument_group("model")
    m.add_argument("--vocab", type=int, default=256)
    m.add_argument("--d-model", type=int, default=128)
    m.add_argument("--layers", type=int, default=4)
    m.add_argument("--heads", type=int, default=4)
    m.add_argument("--seq", type=int, default=64)
    m.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    m.add_argument("--dropout", type=float, default=0.1)
    common.add_common_args(p)
    p.add_argument("--inject-nan-at", type=int, default=None,
                   help="a bad batch puts NaN into the last rank's weights at this step (first attempt); the loop "
                        "notices the non-finite loss, rolls back in-process to the newest healthy step and skips it")
    p.add_argument("--on-nan", choices=("rollback", "exit"), default="rollback",
                   help="on a non-finite loss: roll back in-process (default), or exit so that torchrun restarts the "
                        "job from the newest restorable step (benchmarks/bench_recovery.py scenario nan compares them)")
    return p.parse_args(argv)


def build(args: argparse.Namespace, ctx: common.Ctx) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(args.seed)  # identical full init on every rank; fully_shard keeps each rank's shard
    model = TinyLM(args.vocab, args.d_model, args.layers, args.heads, args.seq, args.dropout).to(ctx.device)
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, foreach=True)
    torch.manual_seed(args.seed + 1 + ctx.rank)  # per-rank dropout streams (saved in the checkpoint)
    return model, optim


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Warmup then cosine, a pure function of the step (nothing extra to checkpoint)."""
    warm = max(1, args.steps // 10)
    if step <= warm:
        return args.lr * step / warm
    return args.lr * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, args.steps - warm)))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ctx = common.setup(args)
    model, optim = build(args, ctx)
    data = SyntheticTokens(args.seed, ctx.rank, args.batch, args.seq, args.vocab)
    app = common.TrainState(model, optim, data, ctx)
    ckpt = common.make_checkpointer(args)
    n_params = sum(p.numel() for p in model.parameters())
    ctx.log(f"TinyLM {n_params / 1e6:.2f} M params, FSDP2 over {ctx.world_size} ranks ({ctx.backend}, {ctx.device.type}); "
            f"attempt {ctx.restart_count}; checkpoints: {args.ckpt_backend} every {args.ckpt_every} step(s)")

    def train_step(step: int) -> torch.Tensor:
        model.train()
        for g in optim.param_groups:
            g["lr"] = lr_at(step, args)
        x, y = data.next()
        x, y = x.to(ctx.device), y.to(ctx.device)
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        common.maybe_fail(step, args, ctx)
        optim.step()
        optim.zero_grad(set_to_none=True)
        if step == args.inject_nan_at and ctx.is_first_attempt and not injected:
            injected.append(step)
            if ctx.rank == ctx.world_size - 1:  # the bad batch's update: NaN in this rank's weight shard
                w = model.blocks[0].fc1.weight
                with torch.no_grad():
                    (w.to_local() if hasattr(w, "to_local") else w).view(-1)[0] = float("nan")
                ctx.log(f"injected NaN into blocks.0.fc1.weight (rank {ctx.rank}'s shard) at step {step}")
        avg = loss.detach().clone()
        torch.distributed.all_reduce(avg)
        return (avg / ctx.world_size).cpu()

    injected: list[int] = []
    rollbacks = 0

    def roll_back(step: int, loss: float) -> int:
        """The loop's answer to a non-finite loss: restore the newest healthy step (the default choice of
        every gemini restore) in-process, skip the batch that came right after it (the bad one), go on
        from there. Saves after the rollback start a new timeline."""
        nonlocal rollbacks
        ctx.events.emit("nan", step=step)
        if args.on_nan == "exit":
            ctx.log(f"step {step}: loss {loss}: exiting; torchrun restarts the job from the newest restorable step")
            raise SystemExit(3)
        last = getattr(ckpt, "_last", None)  # --async-ckpt: the save in flight commits before the restore decides
        if last is not None and hasattr(last, "wait"):
            last.wait()
        rollbacks += 1
        if rollbacks > 3:
            raise SystemExit(f"step {step}: loss {loss} after {rollbacks - 1} rollbacks: giving up")
        info = ckpt.restore(app, ctx)  # in-process: the newest healthy step (fast_load)
        if info is None:
            raise SystemExit(f"step {step}: loss {loss} and no checkpoint to roll back to")
        bad = app.data.pos + 1
        app.data.pos += 1  # skip the batch that poisoned the weights
        ctx.events.emit("rollback", step=step, to=info.step, seconds=info.seconds, skipped_batch=bad)
        ctx.log(f"step {step}: loss {loss}: rolled back in-process to step {info.step} ({info.path}) in "
                f"{info.seconds:.3f} s; skipping batch {bad}")
        return app.step + 1

    common.run_loop(args, ctx, app, ckpt, train_step, on_nonfinite=None if args.inject_nan_at is None else roll_back)
    common.finish_outputs(args, ctx, model)
    ckpt.close(ctx)
    return 0


if __name__ == "__main__":
    common.main_guard(main)
