"""An Accelerate training loop checkpointed every step into gemini_dcp's tiers, resumed after a failure.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc-per-node 2 --max-restarts 1 \
        examples/accelerate_resume.py --job-id demo --steps 12 --fail-at-step 7

CPU, DDP over gloo (Accelerate's MULTI_CPU); a model with dropout, AdamW and a LambdaLR schedule, so that
the resumed run matches an uninterrupted one only if the model, optimizer, schedule, step and every
process's RNG come back. The batch of a step is drawn from the step and the rank (no data position to
restore). ``--fail-at-step N``: on the first attempt the last rank SIGKILLs itself during step N (after
backward, before the optimizer step); torchrun restarts the group and the loop resumes from memory.
``--loss-log`` (rank 0 appends ``step loss.hex()``), ``--save-log`` (every rank appends ``attempt rank step
committed`` once ``save(step)`` returned: the newest step it saw committed), ``--dump-final`` (rank 0 saves the final parameters),
``--timing-json`` (every step's seconds, the save included) are for tests/test_accelerate_e2e.py and
benchmarks/bench_integrations.py; ``--save-blocks B`` saves in steps 1..B, 2B+1..3B, ... only (the
same run with and without a checkpoint per step); ``--every 0`` never saves.
docs/integrations.md ("Accelerate") shows the lines between the ``docs:`` markers.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import torch
import torch.distributed as dist
from accelerate import Accelerator

from gemini_dcp.integrations.accelerate import GeminiAcceleratorCheckpoint

BATCH = 32


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * step + rank)
    x = torch.randn(BATCH, 64, generator=g)
    return x, x.sum(dim=1, keepdim=True).tanh()


class Hooks:
    """Failure injection, loss log and timings around the loop (lines marked ``# example-only``)."""

    def __init__(self, args: argparse.Namespace, rank: int) -> None:
        self.args, self.rank, self.times, self.t0 = args, rank, {}, time.perf_counter()

    def before_optimizer_step(self, step: int) -> None:
        first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if first and step == self.args.fail_at_step and self.rank == dist.get_world_size() - 1:
            print(f"[rank {self.rank}] injected failure: SIGKILL during step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    def attach(self, ckpt: GeminiAcceleratorCheckpoint) -> None:
        """--every 0: no saves; --save-blocks B: saves in blocks of B steps, every other block."""
        save, b = ckpt.save, self.args.save_blocks

        def blocked(step: int, **kw: bool) -> bool:
            return self.args.every > 0 and (not b or (step - 1) // b % 2 == 0) and save(step, **kw)

        ckpt.save = blocked  # type: ignore[method-assign]

    def resumed(self, step: int | None, ckpt: GeminiAcceleratorCheckpoint) -> None:
        if self.rank == 0:
            print("nothing to resume: starting at step 1" if step is None else
                  f"resumed from step {ckpt.restored_step} (bytes per tier: {ckpt.restored_from}) in "
                  f"{ckpt.restore_seconds:.2f} s", flush=True)
        self.t0 = time.perf_counter()

    def saved(self, step: int, ckpt: GeminiAcceleratorCheckpoint) -> None:
        """--save-log: 'attempt rank step committed' once save(step) returned (the async bound's mechanism)."""
        if self.args.save_log:
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            with open(self.args.save_log, "a") as f:
                f.write(f"{attempt} {self.rank} {step} {ckpt.last_committed_step}\n")

    def step_done(self, step: int, loss: torch.Tensor) -> None:
        now = time.perf_counter()
        self.times[step], self.t0 = now - self.t0, now
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        mean /= dist.get_world_size()
        if self.rank == 0:
            print(f"step {step} loss {float(mean):.6f} {self.times[step] * 1e3:.1f} ms", flush=True)
            if self.args.loss_log:
                with open(self.args.loss_log, "a") as f:
                    f.write(f"{step} {float(mean).hex()}\n")

    def finish(self, model: torch.nn.Module) -> None:
        params = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if self.rank == 0 and self.args.dump_final:
            torch.save(params, self.args.dump_final)
        if self.rank == 0 and self.args.timing_json:
            with open(self.args.timing_json, "w") as f:
                json.dump({"step_seconds": self.times, "save_blocks": self.args.save_blocks,
                           "every": self.args.every}, f)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--job-id", required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--every", type=int, default=1, help="save every N steps (0: never)")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--async-save", action="store_true", help="save through AsyncCheckpointer")
    p.add_argument("--fail-at-step", type=int, default=None)
    p.add_argument("--save-blocks", type=int, default=0)
    p.add_argument("--loss-log", default=None)
    p.add_argument("--dump-final", default=None)
    p.add_argument("--timing-json", default=None)
    p.add_argument("--save-log", default=None, help="every rank appends 'attempt rank step committed' after each save")
    args = p.parse_args()
    global BATCH
    BATCH = args.batch
    torch.set_num_threads(1)
    torch.manual_seed(0)

    accelerator = Accelerator(cpu=True)
    model = torch.nn.Sequential(torch.nn.Linear(64, args.width), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(args.width, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + 0.1 * s))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    hooks = Hooks(args, accelerator.process_index)

    # docs: accelerate
    ckpt = GeminiAcceleratorCheckpoint(accelerator, model, optimizer, scheduler, job_id=args.job_id,
                                       every_n_steps=max(args.every, 1), async_save=args.async_save)
    hooks.attach(ckpt)  # example-only
    restored = ckpt.resume()                       # every process; None: nothing to resume
    hooks.resumed(restored, ckpt)  # example-only
    for step in range((restored or 0) + 1, args.steps + 1):
        x, y = batch(step, accelerator.process_index)
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        hooks.before_optimizer_step(step)  # example-only
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        ckpt.save(step)                            # every process: the state after this step, into node memory
        hooks.saved(step, ckpt)  # example-only
        hooks.step_done(step, loss)  # example-only
    ckpt.close()                                   # every process: with async_save, waits for the last commit
    # /docs
    hooks.finish(accelerator.unwrap_model(model))
    accelerator.end_training()


if __name__ == "__main__":
    main()
