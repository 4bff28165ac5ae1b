"""Shared pieces of the example training scripts: distributed setup, the resume /
checkpoint loop, failure injection, timing events and bit-exact fingerprints.

Both examples (``train_fsdp2.py``, ``train_torchrec.py``) run the same loop::

    ckpt = make_checkpointer(args, ctx)            # gemini_dcp (memory tiers) or stock DCP to disk
    app = TrainState(model, optim, data, ctx)      # a DCP Stateful: model+optim+step+RNG+data position
    info = ckpt.restore(app)                       # newest restorable step, or None: start from scratch
    for step in range(app.step + 1, args.steps + 1):
        loss = train_one_step(step)                # failure injection points inside (maybe_fail)
        app.step = step
        ckpt.maybe_save(step, app)                 # every --ckpt-every steps

The state is saved with ``torch.distributed.checkpoint.state_dict.get_state_dict``
/ ``set_state_dict`` (so FSDP2 DTensors and torchrec ShardedTensors are saved as
their shards), plus the step counter, every rank's RNG states and the data
loader position, so that a resumed run continues the same loss curve, bit for
bit, as one that never failed.

``--events PATH`` appends one JSON line per event (process start, step done,
checkpoint saved, kill, restore) with wall-clock times; ``benchmarks/bench_recovery.py``
reads them to split the wasted time of a failure into lost progress, restart
and retrieval.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import os
import shutil
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

# Wall-clock time this process started (before the heavy imports), for the restart measurement.
PROCESS_START = float(os.environ.get("_EXAMPLE_PROCESS_START", time.time()))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.stateful import Stateful  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

MiB = float(1 << 20)


# ---- command line ---------------------------------------------------------------------------
def add_common_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, default=20, help="train until this step (steps count from 1)")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--lr", type=float, default=3e-3)
    g.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank (1: deterministic, no oversubscription)")
    g.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step (simulates a longer iteration)")
    g.add_argument("--log-every", type=int, default=1)
    c = p.add_argument_group("checkpointing")
    c.add_argument("--ckpt-backend", choices=("gemini", "stock", "none"), default="gemini",
                   help="gemini: gemini_dcp memory tiers; stock: DCP FileSystemWriter to --stock-dir; none: no checkpoints")
    c.add_argument("--ckpt-every", type=int, default=1, help="checkpoint every N steps")
    c.add_argument("--root", default=None, help="gemini tier root (default $GEMINI_DCP_ROOT, else /dev/shm/gemini_dcp)")
    c.add_argument("--job-id", default=None, help="gemini job id (default $TORCHELASTIC_RUN_ID)")
    c.add_argument("--replicas", type=int, default=1, help="copies in CPU memory, the node's own included (2: one peer copy)")
    c.add_argument("--keep", type=int, default=2, help="committed steps kept in memory")
    c.add_argument("--async-ckpt", action="store_true",
                   help="gemini: save through gemini_dcp.snapshot.checkpointer.AsyncCheckpointer (the copy runs during the next "
                        "forward/backward; only the next optimizer step waits for it) instead of a blocking dcp.save")
    c.add_argument("--persistent", default=None, help="fsspec URL of the persistent tier (gemini backend)")
    c.add_argument("--persist-every", type=int, default=10, help="drain every K-th step to --persistent")
    c.add_argument("--stock-dir", default=None, help="directory of the stock DCP checkpoints (--ckpt-backend stock)")
    c.add_argument("--stock-keep", type=int, default=2)
    c.add_argument("--stock-drop-cache", action="store_true",
                   help="evict the stock checkpoint files from the page cache after each save, so a restore reads "
                        "them from the device (as from remote storage or on a replaced machine), not from RAM")
    c.add_argument("--no-resume", action="store_true", help="do not look for a checkpoint on start")
    c.add_argument("--cleanup", action="store_true", help="delete this job's memory-tier files after the last step")
    f = p.add_argument_group("failure injection (first attempt only: $TORCHELASTIC_RESTART_COUNT == 0)")
    f.add_argument("--fail-at-step", type=int, default=None, help="SIGKILL during this step (after backward, before the optimizer step)")
    f.add_argument("--fail-mode", choices=("rank", "node"), default="rank",
                   help="rank: SIGKILL one rank (torchrun restarts the group); node: SIGKILL every rank of this node and its torchrun agent")
    f.add_argument("--fail-rank", type=int, default=None, help="global rank killed in rank mode (default: the last)")
    o = p.add_argument_group("outputs")
    o.add_argument("--events", default=None, help="append JSON-lines timing events here (rank 0; with --fail-mode node also the victims)")
    o.add_argument("--print-params-hash", action="store_true", help="print a sha256 over all full parameters at the end")
    o.add_argument("--dump-final", default=None, help="rank 0 writes the full final parameters here (torch.save)")
    o.add_argument("--loss-log", default=None, help="rank 0 appends 'step loss.hex()' lines here")
    return p


# ---- distributed setup ----------------------------------------------------------------------
@dataclass
class Ctx:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    restart_count: int
    device: torch.device
    backend: str
    events: "EventLog"

    @property
    def is_first_attempt(self) -> bool:
        return self.restart_count == 0

    def log(self, msg: str) -> None:
        if self.rank == 0:
            print(msg, flush=True)


def setup(args: argparse.Namespace) -> Ctx:
    """Initialize torch.distributed from torchrun's environment (gloo on CPU, nccl+gloo on GPU)."""
    torch.set_num_threads(max(1, args.threads))
    if "RANK" not in os.environ:  # plain `python script.py`: a single-process group
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "cuda:nccl,cpu:gloo"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0:
        # torchrun shares one TCPStore across restarts without a per-attempt key prefix, so a
        # restarted worker can read the gloo address of a dead worker of the previous attempt
        # ("Gloo connectFullMesh failed ... Connection refused") and the restart fails or hangs.
        print("warning: launch torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 so that restarts "
              "get a fresh rendezvous store (torch shares it across restarts without a per-attempt prefix)",
              file=sys.stderr, flush=True)
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    ctx = Ctx(
        rank=rank,
        world_size=world,
        local_rank=local_rank,
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        node_rank=int(os.environ.get("GROUP_RANK", "0")),
        restart_count=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        device=device,
        backend=backend,
        events=EventLog(args.events, rank),
    )
    ctx.events.emit("start", t=PROCESS_START, restart_count=ctx.restart_count, world_size=world,
                    node_rank=ctx.node_rank, host=socket.gethostname())
    ctx.events.emit("dist_ready")
    return ctx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def teardown() -> None:
    if dist.is_initialized():
        # Let gloo's worker threads drop finished collectives' tensors (they need the GIL) before
        # destroy_process_group() takes the group's lock with the GIL held: torch 2.7 can deadlock.
        gc.collect()
        time.sleep(0.05)
        dist.destroy_process_group()


# ---- events ---------------------------------------------------------------------------------
class EventLog:
    """JSON lines with wall-clock times. Written by rank 0 (``force=True``: any rank)."""

    def __init__(self, path: str | None, rank: int) -> None:
        self.path = path
        self.rank = rank

    def emit(self, ev: str, *, force: bool = False, t: float | None = None, **kw: Any) -> None:
        if not self.path or (self.rank != 0 and not force):
            return
        rec = {"ev": ev, "t": time.time() if t is None else t, "rank": self.rank, "pid": os.getpid(), **kw}
        # O_APPEND writes of one short line are atomic; the page cache keeps them through a SIGKILL.
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")


# ---- the saved application state -------------------------------------------------------------
class TrainState(Stateful):
    """Everything a resumed run needs to continue bit-exact.

    ``model`` / ``optim`` go through ``get_state_dict`` / ``set_state_dict`` (sharded
    state stays sharded); ``step`` and the data position are ints (replicated);
    RNG states are per rank, under a per-rank key (DCP saves a key held by one
    rank only from that rank, and each rank loads back its own).
    """

    def __init__(self, model: torch.nn.Module, optim: torch.optim.Optimizer, data: Any, ctx: Ctx) -> None:
        self.model, self.optim, self.data, self.ctx = model, optim, data, ctx
        self.step = 0
        # Seconds of the last state_dict() / load_state_dict() (the restore's torch part) and how
        # the last load put the state in ("in place" or "set_state_dict").
        self.timings: dict[str, float] = {}
        self.last_load = ""
        self.optim_init = ""  # how the last prepare_load() initialized the optimizer's state
        # The last get_state_dict() result and the live tensors it aliases (see model_optim_state).
        self._sd_cache: tuple[dict[str, Any], dict[str, Any]] | None = None
        self._sd_tensors: list[tuple[int, int]] = []

    def _rng(self) -> dict[str, torch.Tensor]:
        out = {"cpu": torch.get_rng_state()}
        if self.ctx.device.type == "cuda":
            out["cuda"] = torch.cuda.get_rng_state(self.ctx.device)
        return out

    def _live_tensors(self) -> list[tuple[int, int]]:
        """(id, data pointer) of every parameter, buffer and optimizer state tensor: what a cached
        state dict aliases."""
        tensors = [*self.model.parameters(), *self.model.buffers()]
        tensors += [v for st in self.optim.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
        out = []
        for t in tensors:
            loc = _local(t)
            out.append((id(t), loc.data_ptr() if loc is not None else -1))
        return out

    def model_optim_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """``get_state_dict(model, optim)``, computed once and reused while the live tensors stay the same.

        Under FSDP2 ``get_state_dict`` walks the module hooks and makes a DTensor view per parameter: tens
        of milliseconds per call on a small CPU, in the training thread, at every save. Its tensors alias
        the live parameters and optimizer state (updated in place by the optimizer step), so while those
        are the same objects at the same addresses the dicts of the last call are still right; only the
        param groups' values (the learning rate of this step) are refreshed. AsyncCheckpointer copies the
        live bytes behind its guard either way, so reusing the dicts changes nothing it saves.
        """
        from torch.distributed.checkpoint.state_dict import get_state_dict

        if self._sd_cache is not None and self._sd_tensors == self._live_tensors():
            msd, osd = self._sd_cache
            for group, saved in zip(self.optim.param_groups, osd["param_groups"]):
                saved.update({k: v for k, v in group.items() if k != "params"})
            return msd, osd
        msd, osd = get_state_dict(self.model, self.optim)
        if self.optim.state:  # a cache before the first optimizer step would miss the state it creates
            self._sd_cache, self._sd_tensors = (msd, osd), self._live_tensors()
        return msd, osd

    def load_model_optim(self, model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        if _loaded_in_place(self.model, self.optim, model_sd, optim_sd):
            # The restore wrote into the tensors get_state_dict handed out, which are the live
            # parameters and optimizer state (gemini_dcp.fast_load and dcp.load both load tensors in
            # place): only the param groups' values (lr, betas, ...) are left to set. set_state_dict
            # would copy every tensor onto itself and rebuild the optimizer state.
            for group, loaded in zip(self.optim.param_groups, optim_sd["param_groups"]):
                group.update({k: v for k, v in loaded.items() if k != "params"})
            self.last_load = "in place"
            return
        set_state_dict(self.model, self.optim, model_state_dict=model_sd, optim_state_dict=optim_sd)
        self.last_load = "set_state_dict"

    def state_dict(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        msd, osd = self.model_optim_state()
        self.timings["state_dict"] = time.perf_counter() - t0
        sd = {
            "model": msd,
            "optim": osd,
            "step": self.step,
            "rng": {f"rank{self.ctx.rank}": self._rng()},
        }
        # Non-tensor values as top-level leaves, never as a dict of plain values: when
        # ranks hold different keys (per-rank RNG, torchrec's per-table optimizer state),
        # DCP's load planner retries the pre-2.4 flattening, which names such a dict
        # differently ("app.data" instead of "app.data.pos") and then misses it.
        sd.update({f"data_{k}": v for k, v in self.data.state_dict().items()})
        return sd

    def prepare_load(self) -> None:
        """Before a restore: give a fresh optimizer its state without a step.

        ``get_state_dict`` needs optimizer state to hand out tensors to load into; for an
        optimizer without state it runs ``step()`` over zero gradients (through DTensor under
        FSDP2: DTensor's first sharding propagation of every foreach op, most of a resume's
        time). ``gemini_dcp.init_optimizer_state`` creates the state the optimizer's first step
        would create (zeros, step 0) instead; ``optim_init`` says how (its reason when refused:
        then ``get_state_dict`` takes torch's way).
        """
        from gemini_dcp import init_optimizer_state

        t0 = time.perf_counter()
        why = init_optimizer_state(self.optim)
        self.timings["optim_init"] = time.perf_counter() - t0
        self.optim_init = "optimizer state created without a step" if not why else f"torch's initializing step ({why})"

    def forget_optimizer_init(self) -> None:
        """Undo the side effect of a ``state_dict()`` call before the first optimizer step.

        When ``prepare_load`` could not create the state (an optimizer other than Adam/AdamW),
        ``get_state_dict`` initializes it by running ``step()`` with zero grads and lr 0, which
        leaves Adam's step counters at 1. After a load attempt that found no checkpoint, drop
        that state so a fresh start trains exactly like a run that never looked for one (the
        state ``prepare_load`` creates would train the same; it is dropped all the same).
        """
        self.optim.state.clear()
        self._sd_cache = None

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self._sd_cache = None  # a load may replace the optimizer's state tensors
        t0 = time.perf_counter()
        self.load_model_optim(sd["model"], sd["optim"])
        self.timings["load_state_dict"] = time.perf_counter() - t0
        self.step = int(sd["step"])
        self.data.load_state_dict({k[len("data_"):]: v for k, v in sd.items() if k.startswith("data_")})
        rng = sd["rng"][f"rank{self.ctx.rank}"]
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and self.ctx.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], self.ctx.device)


def _local(t: Any) -> torch.Tensor | None:
    """The local tensor of a DTensor or a plain tensor / Parameter; None for anything else (a
    ShardedTensor, a tensor subclass): the in-place shortcut below is then not taken."""
    if type(t) is DTensor:
        return t._local_tensor  # type: ignore[no-any-return]
    return t if type(t) in (torch.Tensor, torch.nn.Parameter) else None


def _loaded_in_place(model: torch.nn.Module, optim: torch.optim.Optimizer, model_sd: dict[str, Any],
                     optim_sd: dict[str, Any]) -> bool:
    """Every tensor of the loaded model and optimizer state dicts is a live parameter, buffer or
    optimizer state tensor (the same memory, the same size), and the param groups line up."""
    live: dict[int, int] = {}
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [v for st in optim.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        loc = _local(t)
        if loc is None:
            return False
        live[loc.data_ptr()] = loc.numel()
    groups = optim_sd.get("param_groups")
    if not isinstance(groups, list) or len(groups) != len(optim.param_groups):
        return False
    state = optim_sd.get("state")
    if not isinstance(state, dict):
        return False
    for v in list(model_sd.values()) + [v for st in state.values() for v in st.values()]:
        loc = _local(v)
        if loc is None or (loc.numel() and live.get(loc.data_ptr()) != loc.numel()):
            return False
    return True


# ---- checkpointers --------------------------------------------------------------------------
@dataclass
class ResumeInfo:
    step: int
    seconds: float                 # whole restore: planning + reading + set_state_dict
    tiers: dict[str, int] = field(default_factory=dict)  # tier -> bytes, summed over ranks
    reader_seconds: float | None = None
    torch_seconds: dict[str, float] = field(default_factory=dict)  # optim_init / state_dict / load_state_dict
    path: str = ""  # gemini: "fast" or "dcp" (gemini_dcp.fast_load), and how the state went in

    def describe(self) -> str:
        used = {t: b for t, b in self.tiers.items() if b}
        if not used:
            tier = "none"
        elif len(used) == 1:
            (t, b), = used.items()
            tier = f"{t}, {b / MiB:.1f} MiB"
        else:
            tier = " + ".join(f"{t} {b / MiB:.1f} MiB" for t, b in sorted(used.items(), key=lambda kv: -kv[1]))
        line = f"resumed from step {self.step} (tier: {tier}) in {self.seconds:.2f} s"
        if self.reader_seconds is not None:
            # The rest is torch's, not the tiers': the optimizer state's creation (optim_init;
            # else get_state_dict's fake step through DTensor), state_dict / load_state_dict.
            line += f" (reading the tiers {self.reader_seconds:.2f} s, torch state-dict setup the rest"
            if self.torch_seconds:
                line += ": " + ", ".join(f"{k} {v:.2f} s" for k, v in self.torch_seconds.items())
            line += f"; {self.path})" if self.path else ")"
        return line


def save_planner() -> Any:
    """DCP's default planner with plan caching (both backends): the state dict's layout does not
    change between steps, so after the first save the plans are not exchanged again."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    try:
        return DefaultSavePlanner(enable_plan_caching=True)
    except TypeError:  # torch without plan caching
        return DefaultSavePlanner()


class Checkpointer:
    every: int = 1
    last_parts: tuple[float, float] = (0.0, 0.0)  # the last save's (seconds in save(), guard wait before it)

    def maybe_save(self, step: int, app: TrainState, ctx: Ctx) -> float | None:
        if self.every <= 0 or step % self.every:
            return None
        t0 = time.perf_counter()
        self.save(step, app)
        saved = time.perf_counter() - t0
        waited = self.deferred_blocking()
        self.last_parts = (saved, waited)
        ctx.events.emit("ckpt", step=step, seconds=saved + waited)
        return saved + waited

    def save(self, step: int, app: TrainState) -> None:
        raise NotImplementedError

    def deferred_blocking(self) -> float:
        """Seconds training waited for the previous checkpoint outside ``save`` (an async guard)."""
        return 0.0

    def restore(self, app: TrainState, ctx: Ctx) -> ResumeInfo | None:
        raise NotImplementedError

    def close(self, ctx: Ctx) -> None:
        pass


class NoCheckpointer(Checkpointer):
    every = 0

    def restore(self, app: TrainState, ctx: Ctx) -> ResumeInfo | None:
        return None


class GeminiCheckpointer(Checkpointer):
    """gemini_dcp: every step into node memory (+ peers with replicas > 1, + persistent drain)."""

    def __init__(self, args: argparse.Namespace) -> None:
        from gemini_dcp import GeminiStorageWriter

        self.args = args
        self.every = args.ckpt_every
        root = args.root or os.environ.get("GEMINI_DCP_ROOT")
        if root:  # an explicit root must exist: create it for the user (private to them)
            os.makedirs(root, mode=0o700, exist_ok=True)
        # One writer for the whole run: its slot files stay mapped and pre-faulted between steps.
        self.writer = GeminiStorageWriter(
            root=args.root, job_id=args.job_id, keep=args.keep, replicas=args.replicas,
            persistent=args.persistent, persist_every=args.persist_every,
        )
        self.snapshots: Any = None  # AsyncCheckpointer with --async-ckpt
        self._previous: Any = None
        self._last: Any = None

    def save(self, step: int, app: TrainState) -> None:
        if not self.args.async_ckpt:
            dcp.save({"app": app}, storage_writer=self.writer, checkpoint_id=step, planner=save_planner())
            return
        if self.snapshots is None:  # collective (creates the checkpoint group): every rank saves this step
            from gemini_dcp.snapshot.checkpointer import AsyncCheckpointer

            self.snapshots = AsyncCheckpointer(self.writer, optimizer=app.optim, model=app.model)
        self._previous, self._last = self._last, self.snapshots.save({"app": app}, step)

    def deferred_blocking(self) -> float:
        # The guard of the previous save ran inside this step's optimizer.step().
        return self._previous.guard_wait_s if self._previous is not None else 0.0

    def restore(self, app: TrainState, ctx: Ctx) -> ResumeInfo | None:
        from gemini_dcp import GeminiStorageReader, fast_load, newest_restorable_step

        t0 = time.perf_counter()
        reader = GeminiStorageReader(root=self.args.root, job_id=self.args.job_id, persistent=self.args.persistent)
        step = newest_restorable_step(reader)  # all ranks; None: nothing in any tier to resume
        if step is None:
            ctx.log("no checkpoint of this job in any tier: starting from scratch")
            return None
        app.prepare_load()
        # Straight from the node's slots into the live tensors when the structure is the one
        # saved; else (a reshard, a wiped node, the persistent tier) dcp.load with this reader.
        got = fast_load({"app": app}, storage_reader=reader, step=step)
        path = (f"{got.path} path" + (f" ({got.reason})" if got.reason else "")
                + f", {app.optim_init}, state put in {app.last_load}")
        return ResumeInfo(step=int(reader.restored_step), seconds=time.perf_counter() - t0,
                          tiers=dict(reader.restored_from), reader_seconds=reader.restore_seconds,
                          torch_seconds=dict(app.timings), path=path)

    def close(self, ctx: Ctx) -> None:
        if self.snapshots is not None:  # waits for the last commit; raises a pending error
            self.snapshots.close()
            self.snapshots = None
        if not self.args.cleanup:
            return
        dist.barrier()
        if ctx.local_rank == 0:  # one rank per node removes the node's files of this job
            from gemini_dcp.local.tier import LocalTier

            LocalTier(self.args.root, self.args.job_id, create=False).remove_job()


class StockCheckpointer(Checkpointer):
    """Stock DCP: ``FileSystemWriter`` (fsync'ed) into ``<dir>/step-<N>`` every K steps.

    A step directory counts only once its ``.metadata`` exists (DCP writes it
    last, in ``finish``); the newest such step is restored; rank 0 keeps the
    newest ``--stock-keep`` directories.
    """

    def __init__(self, args: argparse.Namespace) -> None:
        if not args.stock_dir:
            raise SystemExit("--ckpt-backend stock needs --stock-dir")
        self.dir = Path(args.stock_dir)
        self.every = args.ckpt_every
        self.keep = args.stock_keep
        self.drop_cache = args.stock_drop_cache

    def _steps(self) -> list[int]:
        out = []
        if self.dir.is_dir():
            for p in self.dir.iterdir():
                if p.name.startswith("step-") and (p / ".metadata").exists():
                    out.append(int(p.name[5:]))
        return sorted(out)

    def save(self, step: int, app: TrainState) -> None:
        from torch.distributed.checkpoint import FileSystemWriter

        path = self.dir / f"step-{step}"
        dcp.save({"app": app}, storage_writer=FileSystemWriter(str(path), sync_files=True), planner=save_planner())
        if self.drop_cache:
            drop_page_cache(path)
        if dist.get_rank() == 0:
            for old in self._steps()[:-self.keep]:
                shutil.rmtree(self.dir / f"step-{old}", ignore_errors=True)

    def restore(self, app: TrainState, ctx: Ctx) -> ResumeInfo | None:
        from torch.distributed.checkpoint import FileSystemReader

        t0 = time.perf_counter()
        steps = self._steps()
        # All ranks must agree on the step: rank 0 decides.
        box = [steps[-1] if steps else None]
        dist.broadcast_object_list(box, src=0)
        step = box[0]
        if step is None:
            ctx.log(f"no stock checkpoint in {self.dir}: starting from scratch")
            return None
        path = self.dir / f"step-{step}"
        app.prepare_load()
        dcp.load({"app": app}, storage_reader=FileSystemReader(str(path)))
        nbytes = sum(f.stat().st_size for f in path.glob("*.distcp"))
        return ResumeInfo(step=step, seconds=time.perf_counter() - t0, tiers={"disk": nbytes})


def drop_page_cache(path: Path) -> None:
    """Evict the (already fsync'ed, so clean) pages of every file under ``path`` from the page cache."""
    for f in [path] if path.is_file() else path.rglob("*"):
        if not f.is_file():
            continue
        try:
            fd = os.open(f, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError as e:  # advisory only: the restore then reads from RAM, and says so
            print(f"drop_page_cache: {f}: {e}", file=sys.stderr)
        finally:
            os.close(fd)


def make_checkpointer(args: argparse.Namespace) -> Checkpointer:
    if args.ckpt_backend == "gemini":
        return GeminiCheckpointer(args)
    if args.ckpt_backend == "stock":
        return StockCheckpointer(args)
    return NoCheckpointer()


def resume(ckpt: Checkpointer, app: TrainState, ctx: Ctx, args: argparse.Namespace) -> ResumeInfo | None:
    """Restore the newest restorable step into ``app`` (collective), print and log it."""
    ctx.events.emit("restore_begin")
    info = None if args.no_resume else ckpt.restore(app, ctx)
    if info is None:
        app.forget_optimizer_init()  # a fresh start trains as a run that never looked for a checkpoint
        ctx.events.emit("restore_end", step=0, seconds=0.0, tiers={})
        return None
    ctx.log(info.describe())
    ctx.events.emit("restore_end", step=info.step, seconds=info.seconds, reader_seconds=info.reader_seconds, tiers=info.tiers)
    return info


# ---- failure injection -----------------------------------------------------------------------
def maybe_fail(step: int, args: argparse.Namespace, ctx: Ctx) -> None:
    """SIGKILL at ``--fail-at-step`` on the first attempt only, so the restarted run goes through.

    rank mode: the chosen rank dies; torchrun sees it and restarts the whole worker group.
    node mode: every rank of this node dies together with its torchrun agent (the
    parent process), as when the machine goes down; surviving nodes' workers fail
    on their next collective and their agents re-rendezvous.
    """
    if args.fail_at_step is None or step != args.fail_at_step or not ctx.is_first_attempt:
        return
    if args.fail_mode == "rank":
        victim = ctx.world_size - 1 if args.fail_rank is None else args.fail_rank
        if ctx.rank != victim:
            return
        ctx.events.emit("kill", force=True, step=step, mode="rank")
        print(f"[rank {ctx.rank}] injected failure: SIGKILL myself during step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    else:
        ctx.events.emit("kill", force=True, step=step, mode="node", node_rank=ctx.node_rank)
        print(f"[rank {ctx.rank}] injected failure: node {ctx.node_rank} goes down during step {step} "
              "(SIGKILL of its torchrun agent and workers)", flush=True)
        if "TORCHELASTIC_RUN_ID" in os.environ:  # we run under torchrun: the parent is the agent
            try:
                os.kill(os.getppid(), signal.SIGKILL)
            except ProcessLookupError:
                pass
        os.kill(os.getpid(), signal.SIGKILL)


# ---- the loop --------------------------------------------------------------------------------
def run_loop(args: argparse.Namespace, ctx: Ctx, app: TrainState, ckpt: Checkpointer,
             train_step: Callable[[int], torch.Tensor],
             on_nonfinite: Callable[[int, float], int] | None = None) -> list[tuple[int, float]]:
    """Resume, then train ``app.step+1 .. args.steps``, checkpointing as configured.

    ``train_step(step)`` runs forward/backward/optimizer step for ``step`` and
    returns the global mean loss (a 0-dim tensor, same on every rank); it must
    call ``maybe_fail(step, args, ctx)`` between backward and the optimizer step.
    ``on_nonfinite(step, loss)``, when given, is called instead of recording a step whose loss
    is not finite, and returns the step to train next (a rollback: the restored step + 1).
    """
    resume(ckpt, app, ctx, args)
    ctx.events.emit("ready", step=app.step)
    losses: list[tuple[int, float]] = []
    step = app.step + 1
    while step <= args.steps:
        t0 = time.perf_counter()
        loss = float(train_step(step))
        if args.step_sleep:
            time.sleep(args.step_sleep)
        if on_nonfinite is not None and not math.isfinite(loss):
            step = on_nonfinite(step, loss)
            continue
        app.step = step
        t_train = time.perf_counter() - t0
        ctx.events.emit("step_done", step=step, seconds=t_train, loss=loss)
        ckpt_s = ckpt.maybe_save(step, app, ctx)
        t_step = time.perf_counter() - t0  # the whole step as training sees it: train + checkpoint
        losses.append((step, loss))
        if ctx.rank == 0 and args.loss_log:
            with open(args.loss_log, "a") as f:
                f.write(f"{step} {loss.hex()}\n")
        if step % args.log_every == 0 or step == args.steps:
            # ckpt: the time training waited for checkpointing (a blocking save; AsyncCheckpointer:
            # save()'s return plus the guard in the next optimizer step, already inside iter);
            # wall: the whole step, what scripts/main_job.sh compares with a run without checkpoints.
            extra = ""
            if ckpt_s is not None:
                saved, waited = ckpt.last_parts
                extra = f"  ckpt {ckpt_s * 1e3:.1f} ms" + (f" (save {saved * 1e3:.1f}, guard {waited * 1e3:.1f})" if waited else "")
            ctx.log(f"step {step:4d}  loss {loss:.6f}  iter {t_train * 1e3:.1f} ms{extra}  wall {t_step * 1e3:.1f} ms")
        step += 1
    ctx.events.emit("finished", step=app.step)
    return losses


# ---- fingerprints for the bit-exact test -----------------------------------------------------
def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) parameters on CPU, on every rank (collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        if hasattr(v, "full_tensor"):
            v = v.full_tensor()
        out[k] = v.detach().cpu().clone()
    return out


def params_hash(params: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k in sorted(params):
        t = params[k].contiguous()
        h.update(k.encode())
        h.update(str(t.dtype).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def finish_outputs(args: argparse.Namespace, ctx: Ctx, model: torch.nn.Module) -> None:
    if not (args.print_params_hash or args.dump_final):
        return
    params = full_params(model)
    if ctx.rank != 0:
        return
    if args.print_params_hash:
        print(f"final params sha256 {params_hash(params)}", flush=True)
    if args.dump_final:
        Path(args.dump_final).parent.mkdir(parents=True, exist_ok=True)
        torch.save(params, args.dump_final)


def main_guard(fn: Callable[[], int | None]) -> None:
    """Run ``fn`` and exit with its status; errors print and exit 1 (torchrun records them)."""
    try:
        rc = fn()
    finally:
        teardown()
    sys.exit(rc or 0)
