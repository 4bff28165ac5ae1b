"""A Lightning ``Trainer`` (FSDP2 through ``ModelParallelStrategy``) checkpointed every step into gemini_dcp's
tiers, resumed after a failure.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc-per-node 2 --max-restarts 1 \
        examples/lightning_resume.py --job-id demo --steps 12 --fail-at-step 7

CPU, FSDP2 (``fully_shard`` in ``configure_model``) over gloo; a model with dropout, AdamW and a LambdaLR schedule
stepped by Lightning, and Lightning's own ``ModelCheckpoint`` writing its sharded folder every ``--folder-every``
steps beside the per-step saves into memory. The data come from ``train_dataloader`` (``--loader``):
``stateful`` (default) torchdata's ``StatefulDataLoader``, shuffled, one worker: its position is saved with
each step and restored; ``plain`` a ``torch.utils.data.DataLoader`` without a generator, shuffled, one worker
(its position restarts at the epoch's start after a restore within an epoch: the strategy warns);
``combined`` Lightning's ``CombinedLoader`` of both, the plain one over data that do not depend on the position
(every loader kind in one run: the plain loader's iterator draws its base seed from the global generator).
Lightning puts a ``DistributedSampler`` into each. An epoch is ``--epoch-steps`` steps.
``--fail-at-step N[,M...]``: on attempt k (torchrun's restart count) the last rank SIGKILLs itself during the
k-th listed step; torchrun restarts the group (or the job is launched again) and ``trainer.fit(ckpt_path=RESUME)``
resumes from memory. ``--loss-log``, ``--dump-final``, ``--timing-json``, ``--save-blocks``, ``--every 0``: as in
examples/accelerate_resume.py (tests/test_lightning_e2e.py, benchmarks/bench_integrations.py).
docs/integrations.md ("Lightning") shows the lines between the ``docs:`` markers.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities import CombinedLoader
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, Dataset

from gemini_dcp.integrations.lightning import RESUME, GeminiModelParallelStrategy

try:
    from torchdata.stateful_dataloader import StatefulDataLoader
except ImportError:  # --loader plain runs without torchdata
    StatefulDataLoader = None


class Samples(Dataset):
    """Sample i: 64 numbers drawn from seed i (the same in every process, run and worker)."""

    def __init__(self, n: int, constant: bool = False) -> None:
        self.n, self.constant = n, constant

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.constant:  # --loader combined: a loader whose position does not matter
            return torch.ones(64)
        return torch.randn(64, generator=torch.Generator().manual_seed(i))


class Net(L.LightningModule):
    def __init__(self, width: int, batch: int = 32, epoch_steps: int = 4) -> None:
        super().__init__()
        self.width, self.batch = width, batch
        self.data = Samples(2 * batch * epoch_steps)  # 2 ranks: the DistributedSampler gives each half

    def configure_model(self) -> None:
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(64, self.width), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                       torch.nn.Linear(self.width, 1))
        fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x = batch["x"] * batch["scale"] if isinstance(batch, dict) else batch
        return torch.nn.functional.mse_loss(self.net(x), x.sum(dim=1, keepdim=True).tanh())

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


# docs: lightning
class Model(Net):  # Net (above): configure_model (fully_shard), training_step, configure_optimizers
    def train_dataloader(self) -> Any:
        # torchdata's StatefulDataLoader: its position is saved with every step and restored
        return StatefulDataLoader(self.data, batch_size=self.batch, shuffle=True, num_workers=1)
# /docs


class PlainModel(Net):
    def train_dataloader(self) -> Any:
        return DataLoader(self.data, batch_size=self.batch, shuffle=True, num_workers=1)  # no generator


class CombinedModel(Net):
    def train_dataloader(self) -> Any:
        plain = DataLoader(Samples(len(self.data), constant=True), batch_size=self.batch, shuffle=True, num_workers=1)
        stateful = StatefulDataLoader(self.data, batch_size=self.batch, shuffle=True, num_workers=1)
        return CombinedLoader({"x": stateful, "scale": plain}, "max_size_cycle")


MODELS = {"stateful": Model, "plain": PlainModel, "combined": CombinedModel}


class Hooks(Callback):
    """Failure injection, loss log and timings (what the tests and the benchmark read)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.times, self.t0 = args, {}, time.perf_counter()
        self.started: float | None = None

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if trainer.global_rank == 0:
            st = trainer.strategy
            where = (f"Lightning's {st.restored_folder}" if st.restored_folder else
                     f"bytes per tier: {st.restored_from}")
            print(f"resumed from step {st.restored_step} ({where}) in {st.restore_seconds:.2f} s"
                  if st.restored_step is not None else "nothing to resume: starting at step 1", flush=True)
        self.t0 = time.perf_counter()

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        now = time.perf_counter()
        if self.started is not None:  # the previous step, its save (at on_train_batch_end) included
            self.times[trainer.global_step] = now - self.started
        self.started = now

    def on_before_optimizer_step(self, trainer: L.Trainer, module: L.LightningModule, optimizer: Any) -> None:
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        fail = [int(s) for s in self.args.fail_at_step.split(",")] if self.args.fail_at_step else []
        step = trainer.global_step + 1
        if attempt < len(fail) and step == fail[attempt] and trainer.global_rank == trainer.world_size - 1:
            print(f"[rank {trainer.global_rank}] injected failure: SIGKILL during step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, *args: Any) -> None:
        step = trainer.global_step
        mean = outputs["loss"].detach().clone()
        dist.all_reduce(mean)
        mean /= trainer.world_size
        if trainer.global_rank == 0:
            print(f"step {step} loss {float(mean):.6f}", flush=True)
            if self.args.loss_log:
                with open(self.args.loss_log, "a") as f:
                    f.write(f"{step} {float(mean).hex()}\n")

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        params = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                  for k, v in module.net.state_dict().items()}
        if trainer.global_rank == 0 and self.args.dump_final:
            torch.save(params, self.args.dump_final)
        if trainer.global_rank == 0 and self.args.timing_json:
            with open(self.args.timing_json, "w") as f:
                json.dump({"step_seconds": self.times, "save_blocks": self.args.save_blocks, "every": self.args.every}, f)


class BlockSaves(Callback):
    """--save-blocks B: the gemini saves only in steps 1..B, 2B+1..3B, ... (same run, with and without)."""

    def __init__(self, blocks: int) -> None:
        self.blocks = blocks

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        saving = (trainer.global_step - 1) // self.blocks % 2 == 0  # runs before the save of this step
        for cb in trainer.callbacks:
            if type(cb).__name__ == "SaveEveryNSteps":
                cb.every = 1 if saving else 1 << 30


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--job-id", required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--every", type=int, default=1, help="save into memory every N steps (0: never)")
    p.add_argument("--folder", default="checkpoints", help="Lightning's own ModelCheckpoint folder")
    p.add_argument("--folder-every", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--fail-at-step", default=None, help="N[,M...]: attempt k kills itself during the k-th step")
    p.add_argument("--loader", choices=sorted(MODELS), default="stateful")
    p.add_argument("--epoch-steps", type=int, default=4, help="steps per epoch (the data set's size)")
    p.add_argument("--save-blocks", type=int, default=0)
    p.add_argument("--loss-log", default=None)
    p.add_argument("--dump-final", default=None)
    p.add_argument("--timing-json", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    callbacks: list[Callback] = [Hooks(args)]
    if args.save_blocks:
        callbacks.insert(0, BlockSaves(args.save_blocks))
    callbacks.append(ModelCheckpoint(dirpath=args.folder, every_n_train_steps=args.folder_every, save_last=True))

    model = MODELS[args.loader](args.width, args.batch, args.epoch_steps)

    # docs: lightning
    strategy = GeminiModelParallelStrategy(job_id=args.job_id, every_n_steps=args.every,
                                           data_parallel_size=2, tensor_parallel_size=1)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=args.steps,
                        callbacks=callbacks, logger=False, enable_progress_bar=False)
    trainer.fit(model, ckpt_path=RESUME)   # the newest restorable step; none: a fresh start
    # /docs


if __name__ == "__main__":
    main()
