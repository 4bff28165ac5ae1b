"""DeepSpeed ZeRO training checkpointed every step into gemini_dcp's tiers, resumed after a failure.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc-per-node 2 --max-restarts 1 \
        examples/deepspeed_resume.py --job-id demo --steps 12 --fail-at-step 7 --configs 3:fp32:async

CPU, gloo (DeepSpeed's CPU accelerator without oneCCL); an MLP, a client ``torch.optim.AdamW`` and a LambdaLR
schedule, so a resumed run matches an uninterrupted one only if the weights, optimizer partitions, schedule
and step come back. The batch of a step is drawn from the step and the rank (no data position to restore).
The unchanged DeepSpeed loop is the lines between the ``docs:`` markers (docs/integrations.md shows them).

``--configs`` trains one engine after another in the same processes (a launch costs ~25 s of imports), each a
``stage:precision:mode`` (``1:fp32:sync``, ``3:bf16:async``...) with a job id of its own; mode ``sync`` /
``async``: checkpoints through ``use_gemini`` (``async_save``), ``disk``: DeepSpeed's own ``save_checkpoint``
to the checkpoint directory (no gemini_dcp), ``none``: no checkpoints (the last two are
benchmarks/bench_deepspeed.py's baselines). A config named twice gets a ``-<index>`` suffix. ``--fail-at-step N``:
on torchrun attempt ``a`` the last rank SIGKILLs itself during step N of config ``a`` (after backward, before
the optimizer step), so with ``--max-restarts len(configs)`` every config is killed once and resumed.
``--node-root`` / ``--ckpt-dir`` may hold ``{node}``: each rank is then a simulated node with a tier root and a
checkpoint directory of its own; ``--wipe-on-restart``: on every even restart the last rank's node is replaced
(its tier root and checkpoint directory removed before it starts), so it resumes from its peer's copy
(``--replicas 2``). ``--nan-at-step N``: in a config that started afresh the weights hold a NaN after step N
(its checkpoints are marked unhealthy, the next launch passes over them). ``--save-16bit-model``:
``save_16bit_model`` into the checkpoint directory after the last step (a file on disk, never a step).
``--loss-log`` (rank 0 appends ``config step loss.hex()``), ``--save-log`` (every rank appends ``attempt rank
config step committed`` once ``save_checkpoint`` returned), ``--dump-final`` (rank 0 saves every config's final
weights, gathered), ``--timing-json`` (every step's seconds, the save included; the seconds inside
``save_checkpoint`` and inside the engine; the load's) and ``--save-blocks B`` (checkpoints in steps 1..B,
2B+1..3B, ... only) are for
tests/test_deepspeed_e2e.py and benchmarks/bench_deepspeed.py.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import time
from typing import Any

import deepspeed
import torch
import torch.distributed as dist

from gemini_dcp.integrations.deepspeed import use_gemini


def batch(step: int, rank: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * step + rank)
    x = torch.randn(n, 64, generator=g)
    return x, x.sum(dim=1, keepdim=True).tanh()


def ds_config(stage: int, bf16: bool, micro_batch: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True},
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": bf16},
        "steps_per_print": 1 << 30,
    }


class Hooks:
    """Failure injection, node replacement, logs and timings around the loop (lines marked ``# example-only``)."""

    def __init__(self, args: argparse.Namespace, rank: int, world: int) -> None:
        self.args, self.rank, self.world = args, rank, world
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.times: dict[str, dict[int, float]] = {}
        self.loads: dict[str, float] = {}
        self.save_times: dict[str, dict[int, float]] = {}  # seconds inside save_checkpoint
        self.t_save = 0.0
        self.engine_times: dict[str, dict[int, float]] = {}  # seconds inside GeminiCheckpointEngine
        self.t0 = time.perf_counter()
        self.fresh = True

    def before_optimizer_step(self, index: int, step: int, engine: Any) -> None:
        if self.attempt == index and step == self.args.fail_at_step and self.rank == self.world - 1:
            print(f"[rank {self.rank}] injected failure: SIGKILL during step {step} of config {index}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if self.fresh and step == self.args.nan_at_step:
            with torch.no_grad():
                for p in engine.optimizer.optimizer.param_groups[0]["params"][:1]:
                    p.view(-1)[0] = float("nan")  # the master weights: the next step's checkpoint holds a NaN

    def baseline(self, engine: Any, ckpt: Any, mode: str) -> Any:
        """``disk``: DeepSpeed's own checkpoint engine and load back (the benchmark's baseline); ``none``: no saves."""
        if mode == "disk":
            from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

            ckpt.close()
            engine.checkpoint_engine = TorchCheckpointEngine()
            for attr in ("load_checkpoint", "save_16bit_model", "destroy"):  # use_gemini's wrappers on the instance
                vars(engine).pop(attr, None)
            return None
        if mode == "none":
            engine.save_checkpoint = lambda *_, **__: True
        b, save = self.args.save_blocks, engine.save_checkpoint
        if b:  # saves in steps 1..B, 2B+1..3B, ... only: steps with and without a save in one config

            def blocked(*args: Any, **kwargs: Any) -> Any:
                return (engine.global_steps - 1) // b % 2 == 0 and save(*args, **kwargs)

            engine.save_checkpoint = blocked
        return ckpt

    def loaded(self, name: str, load_path: Any, ckpt: Any, seconds: float) -> None:
        self.loads[name], self.fresh = seconds, load_path is None
        if self.rank == 0:
            where = "nothing to resume" if load_path is None else (
                f"resumed step {ckpt.restored_step} ({load_path}) bytes per tier {ckpt.restored_from}"
                if ckpt is not None else f"resumed {load_path} from disk")
            print(f"config {name} attempt {self.attempt}: {where} in {seconds:.3f} s", flush=True)
        self.t0 = time.perf_counter()

    def save_start(self) -> None:
        self.t_save = time.perf_counter()

    def saved(self, name: str, step: int, ckpt: Any) -> None:
        self.save_times.setdefault(name, {})[step] = time.perf_counter() - self.t_save
        if ckpt is not None and ckpt.last_save_seconds is not None:
            self.engine_times.setdefault(name, {})[step], ckpt.last_save_seconds = ckpt.last_save_seconds, None
        if self.args.save_log and ckpt is not None:
            with open(self.args.save_log, "a") as f:
                f.write(f"{self.attempt} {self.rank} {name} {step} {ckpt.last_committed_step}\n")

    def step_done(self, name: str, step: int, loss: torch.Tensor) -> None:
        now = time.perf_counter()
        self.times.setdefault(name, {})[step], self.t0 = now - self.t0, now
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        mean /= self.world
        if self.rank == 0 and self.args.loss_log:
            with open(self.args.loss_log, "a") as f:
                f.write(f"{name} {step} {float(mean).hex()}\n")

    def finish(self, name: str, engine: Any, finals: dict[str, Any]) -> None:
        params = list(engine.module.parameters())
        with deepspeed.zero.GatheredParameters(params, enabled=hasattr(params[0], "ds_id")):
            finals[name] = {k: v.detach().float().clone() for k, v in engine.module.named_parameters()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--job-id", required=True)
    p.add_argument("--configs", default="3:fp32:sync", help="stage:fp32|bf16:sync|async, comma-separated")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--ckpt-dir", default="ckpt", help="DeepSpeed's save_dir / load_dir ({node}: one per rank)")
    p.add_argument("--node-root", default=None, help="gemini_dcp tier root ({node}: one per rank)")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--wipe-on-restart", action="store_true")
    p.add_argument("--fail-at-step", type=int, default=None)
    p.add_argument("--nan-at-step", type=int, default=None)
    p.add_argument("--save-16bit-model", action="store_true", help="save_16bit_model(ckpt dir) after the last step")
    p.add_argument("--save-blocks", type=int, default=0, help="save in steps 1..B, 2B+1..3B, ... only")
    p.add_argument("--loss-log", default=None)
    p.add_argument("--save-log", default=None)
    p.add_argument("--dump-final", default=None)
    p.add_argument("--timing-json", default=None)
    args = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    hooks = Hooks(args, rank, world)
    root = None if args.node_root is None else args.node_root.format(node=rank)
    base_dir = args.ckpt_dir.format(node=rank)
    if args.wipe_on_restart and hooks.attempt and hooks.attempt % 2 == 0 and rank == world - 1:  # example-only
        print(f"[rank {rank}] replaced node: removing {root} and {base_dir}", flush=True)
        for d in (root, base_dir):
            if d:
                shutil.rmtree(d, ignore_errors=True)
    if root:  # a (replaced) node's tier root: a private directory on a memory-backed file system
        os.makedirs(root, mode=0o700, exist_ok=True)
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    finals: dict[str, Any] = {}
    specs = args.configs.split(",")
    for index, spec in enumerate(specs):
        stage, precision, mode = spec.split(":")
        name = f"z{stage}-{precision}-{mode}" + (f"-{index}" if specs.count(spec) > 1 else "")
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, args.width), torch.nn.ReLU(), torch.nn.Linear(args.width, args.width),
                                    torch.nn.ReLU(), torch.nn.Linear(args.width, 1))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + 0.1 * s))
        save_dir = os.path.join(base_dir, name)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                               config=ds_config(int(stage), precision == "bf16", args.batch))
        t0 = time.perf_counter()
        # docs: deepspeed
        ckpt = use_gemini(engine, job_id=f"{args.job_id}-{name}", root=root, replicas=args.replicas,
                          async_save=mode == "async")
        ckpt = hooks.baseline(engine, ckpt, mode)  # example-only
        load_path, _ = engine.load_checkpoint(save_dir)   # the newest step in any tier; (None, None): first launch
        hooks.loaded(name, load_path, ckpt, time.perf_counter() - t0)  # example-only
        for step in range(engine.global_steps + 1, args.steps + 1):
            x, y = batch(step, rank, args.batch)
            loss = torch.nn.functional.mse_loss(engine(x.to(dtype)).float(), y)
            engine.backward(loss)
            hooks.before_optimizer_step(index, step, engine)  # example-only
            engine.step()
            hooks.save_start()  # example-only
            engine.save_checkpoint(save_dir)              # every rank: one gemini_dcp step (tag global_step<N>)
            hooks.saved(name, step, ckpt)  # example-only
            hooks.step_done(name, step, loss)  # example-only
        if args.save_16bit_model:  # example-only: a file on disk, never a training step
            engine.save_16bit_model(save_dir)  # example-only
        hooks.finish(name, engine, finals)  # example-only
        engine.destroy()                                  # with async_save: waits for the last commit
        # /docs
    if rank == 0 and args.dump_final:
        torch.save(finals, args.dump_final)
    if rank == 0 and args.timing_json:
        with open(args.timing_json, "w") as f:
            json.dump({"step_seconds": hooks.times, "save_seconds": hooks.save_times,
                       "engine_seconds": hooks.engine_times, "load_seconds": hooks.loads}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
