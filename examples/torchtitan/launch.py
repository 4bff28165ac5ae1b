"""Run torchtitan's trainer on CPU (gloo) with gemini_dcp checkpoints: ``torchrun ... launch.py <torchtitan args>``.

Applies the CPU workarounds of ``cpu_patches.py`` (not needed on GPUs), then calls ``torchtitan.train.main()``.
Two switches for the kill-and-resume test, read from the environment:

- ``TITAN_FAIL_AT_STEP=K`` (+ ``TITAN_FAIL_RANK``, default 1): on the first attempt of the worker group
  (``TORCHELASTIC_RESTART_COUNT=0``) that rank SIGKILLs itself during step K, before its save;
- ``TITAN_DUMP_FINAL=PATH``: after training, rank 0 writes the full (unsharded) model parameters there;
- ``TITAN_GEMINI_BLOCKS=K`` (benchmarks): gemini_dcp saves in alternating blocks of K steps (steps 1..K save,
  K+1..2K do not, ...), so one run holds iterations with and without a checkpoint under the same load;
- ``TITAN_CHECK_STATES=1``: at every gemini_dcp save, the state dict it saves (its model part from
  ``ModelStatesCache``) is compared, bit for bit, with what torchtitan's own ``_flattened_model_states_sd()``
  returns at that point; a difference raises, and each rank prints ``states check: N saves exact`` at the end;
- ``TITAN_GC_STATS=1`` (benchmarks): each rank prints its Python garbage collections at exit (count, wall time per
  generation, how many ran on the training thread);
- ``TITAN_PACER_STATS=1`` (benchmarks): each rank prints, at close, the interleaving profile and the last saves'
  pacer statistics (``pacer stats rank R ...``);
- ``TITAN_GEMINI_SPREAD=F`` / ``TITAN_GEMINI_WHERE=during`` / ``TITAN_GEMINI_PACING=0|1`` (benchmarks): the
  integration's ``AsyncCheckpointer`` uses ``InterleaveOptions(spread=F)`` / ``InterleaveOptions(where="during")`` /
  never paces its copy into the profiled gaps (0), or paces it even for a model on the CPU (1: the integration's
  default there is not to, ``interleave_for``);
- ``TITAN_GEMINI_BG_NICE=N`` (benchmarks): ``AsyncCheckpointer``'s background thread at nice ``N``;
- ``TITAN_GEMINI_WAIT_COPY=1`` (benchmarks): the training thread waits for each save's local copy after ``save()``;
- ``TITAN_PIN_CORES=0``: leave the rank unpinned (run_cpu.sh's ``PIN_CORES``; by default each rank is pinned to
  its own share of the CPUs, before torch starts a thread: see ``_pin_to_cores``);
- ``TITAN_PROFILE_BACKGROUND=PREFIX`` (benchmarks): cProfile ``AsyncCheckpointer``'s background thread (its CPU
  time), written to ``PREFIX.<rank>`` when the checkpointer closes (read with ``python -m pstats``).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _pin_to_cores() -> None:
    """Pin this rank to its own share of the CPUs it may use (local rank r of w: the r-th of w contiguous
    slices; more ranks than CPUs: CPU ``r mod n``), as CPU training is deployed. Every thread started after
    this inherits the set — torch's, gloo's and gemini_dcp's snapshot thread — so a rank's background copy
    competes with its own training thread, whose delay every rank meets at the same point of the step,
    instead of with another rank's, whose delays add up across ranks in lockstep (docs/deploying.md, "CPU training")."""
    cpus = sorted(os.sched_getaffinity(0))
    rank, world = int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if world <= 1:
        return
    n = len(cpus)
    mine = cpus[rank * n // world:(rank + 1) * n // world] if world <= n else [cpus[rank % n]]
    os.sched_setaffinity(0, mine)
    print(f"launch: local rank {rank} of {world} pinned to CPUs {mine}", flush=True)


if os.environ.get("TITAN_PIN_CORES", "1") != "0" and hasattr(os, "sched_setaffinity"):
    _pin_to_cores()

import cpu_patches  # noqa: E402

cpu_patches.apply()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402


def _install_test_hooks() -> None:
    fail_at = int(os.environ.get("TITAN_FAIL_AT_STEP", "0"))
    fail_rank = int(os.environ.get("TITAN_FAIL_RANK", "1"))
    dump = os.environ.get("TITAN_DUMP_FINAL")
    train_step, train = Trainer.train_step, Trainer.train

    def train_step_maybe_die(self: Trainer, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if (fail_at and self.step == fail_at and dist.get_rank() == fail_rank
                and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
            print(f"injected failure: SIGKILL rank {fail_rank} during step {fail_at}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return train_step(self, *args, **kwargs)

    def train_and_dump(self: Trainer) -> None:
        train(self)
        if dump:
            full = {}
            for part in self.model_parts:
                for name, p in part.state_dict().items():
                    full[name] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            if dist.get_rank() == 0:
                torch.save(full, dump)

    if os.environ.get("TITAN_CHECK_STATES") == "1":
        _check_states()
    if int(os.environ.get("TITAN_GEMINI_BLOCKS", "0")) > 0:
        _save_in_blocks(int(os.environ["TITAN_GEMINI_BLOCKS"]))
    if os.environ.get("TITAN_PROFILE_BACKGROUND"):
        _profile_background(os.environ["TITAN_PROFILE_BACKGROUND"])
    if os.environ.get("TITAN_GC_STATS") == "1":
        _gc_stats()
    if os.environ.get("TITAN_PACER_STATS") == "1":
        _pacer_stats()
    if os.environ.get("TITAN_GEMINI_PACING") == "1":
        _paced_on_the_cpu()
    if os.environ.get("TITAN_GEMINI_SPREAD") or os.environ.get("TITAN_GEMINI_WHERE") or (
            os.environ.get("TITAN_GEMINI_PACING") == "0"):
        _options(float(os.environ.get("TITAN_GEMINI_SPREAD") or 0), os.environ.get("TITAN_GEMINI_PACING") != "0",
                 os.environ.get("TITAN_GEMINI_WHERE") or "between")
    if os.environ.get("TITAN_GEMINI_WAIT_COPY") == "1":
        _wait_copy()
    if os.environ.get("TITAN_GEMINI_BG_NICE"):
        _background_nice(int(os.environ["TITAN_GEMINI_BG_NICE"]))
    Trainer.train_step = train_step_maybe_die  # type: ignore[method-assign]
    Trainer.train = train_and_dump  # type: ignore[method-assign]


def _gc_stats() -> None:
    """Python's collections (count and wall time per generation, and how many ran on the training
    thread), printed by each rank at exit: ``gc stats: ...``."""
    import atexit
    import gc
    import threading

    main = threading.main_thread()
    stats = {g: [0, 0.0, 0] for g in range(3)}  # generation -> [collections, seconds, on the main thread]
    started: list[float] = [0.0]

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
            return
        st = stats[info["generation"]]
        st[0] += 1
        took = time.perf_counter() - started[0]
        st[1] += took
        if info["generation"] and os.environ.get("TITAN_GC_STATS_EACH") == "1":
            print(f"gc gen{info['generation']} {1e3 * took:.1f} ms at {time.strftime('%H:%M:%S')}"
                  f" on {threading.current_thread().name}", flush=True)
        st[2] += threading.current_thread() is main

    gc.callbacks.append(callback)
    atexit.register(lambda: print(f"gc stats rank {dist.get_rank() if dist.is_initialized() else '?'}: " + ", ".join(
        f"gen{g} {n} in {1e3 * t:.0f} ms ({m} on the training thread)" for g, (n, t, m) in stats.items()), flush=True))


def _pacer_stats() -> None:
    """At close, each rank prints the interleaving profile and the last saves' pacer statistics:
    ``pacer stats rank R: ...``."""
    from gemini_dcp.snapshot.checkpointer import AsyncCheckpointer

    close = AsyncCheckpointer.close

    def close_and_print(self):  # noqa: ANN001, ANN202
        try:
            return close(self)
        finally:
            rank = dist.get_rank() if dist.is_initialized() else "?"
            print(f"pacer stats rank {rank}: {self.stats()}", flush=True)
            for h in self.history[-4:]:
                print(f"pacer stats rank {rank} step {h.step}: copy {1e3 * (h.copy_s or 0):.0f} ms {h.pacer_stats}",
                      flush=True)

    AsyncCheckpointer.close = close_and_print  # type: ignore[method-assign]


def _options(spread: float, pacing: bool, where: str) -> None:
    """The integration's AsyncCheckpointer with ``InterleaveOptions(spread=..., where=...)`` and, ``pacing=False``,
    its copy never paced into the profiled gaps (benchmarks: A/B runs)."""
    import dataclasses

    from gemini_dcp.snapshot.checkpointer import AsyncCheckpointer

    init = AsyncCheckpointer.__init__

    def init_spread(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        init(self, *args, **kwargs)
        self.opts = dataclasses.replace(self.opts, spread=spread, where=where)
        self.pacing = pacing
        if self.profiler is not None:
            self.profiler.where = where  # before its profile is done: it is read when the gaps are computed

    AsyncCheckpointer.__init__ = init_spread  # type: ignore[method-assign]


def _paced_on_the_cpu() -> None:
    """The integration's AsyncCheckpointer with ``interleave=True`` whatever ``interleave_for`` decided (benchmarks:
    the copy paced into the profiled gaps even for a model on the CPU, the integration's default before)."""
    from gemini_dcp.snapshot.checkpointer import AsyncCheckpointer

    init = AsyncCheckpointer.__init__

    def init_paced(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        kwargs["interleave"] = True
        init(self, *args, **kwargs)

    AsyncCheckpointer.__init__ = init_paced  # type: ignore[method-assign]


def _background_nice(nice: int) -> None:
    """``AsyncCheckpointer``'s background thread at this nice value (benchmarks: negative = ahead of training, so
    each rank's save runs in one burst at ``save()``, aligned across ranks)."""
    import threading

    from gemini_dcp.snapshot.checkpointer import AsyncCheckpointer

    run = AsyncCheckpointer._run

    def run_niced(self):  # noqa: ANN001, ANN202
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        return run(self)

    AsyncCheckpointer._run = run_niced  # type: ignore[method-assign]


def _wait_copy() -> None:
    """The training thread waits for each save's local copy right after ``save()`` (benchmarks: the copy at
    the same point of every rank, on a core training has left; the commit stays in the background)."""
    from gemini_dcp.snapshot.checkpointer import AsyncCheckpointer

    save = AsyncCheckpointer.save

    def save_and_wait(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        h = save(self, *args, **kwargs)
        h.wait_copied(self.timeout_s, surface=False)
        return h

    AsyncCheckpointer.save = save_and_wait  # type: ignore[method-assign]


def _save_in_blocks(k: int) -> None:
    from gemini_dcp.integrations import torchtitan as tt

    saves_at = tt.saves_at

    def in_block(step: int, every: int) -> bool:
        return ((step - 1) // k) % 2 == 0 and saves_at(step, every)

    tt.saves_at = in_block  # the manager's _save looks it up in its module at each call


def _profile_background(prefix: str) -> None:
    import cProfile

    from gemini_dcp.snapshot.checkpointer import AsyncCheckpointer

    run = AsyncCheckpointer._run

    def profiled(self):  # noqa: ANN001, ANN202
        # The thread's CPU time, not wall time: a call that releases the GIL would otherwise be charged
        # for the wait to take it back from the training thread.
        prof = cProfile.Profile(time.thread_time)
        prof.enable()
        try:
            return run(self)
        finally:
            prof.disable()
            prof.dump_stats(f"{prefix}.{dist.get_rank()}")

    AsyncCheckpointer._run = profiled  # type: ignore[method-assign]


def _check_states() -> None:
    from torchtitan.components.checkpointer.base import MODEL

    from gemini_dcp.integrations.torchtitan import checkpoint_manager_class

    cls = checkpoint_manager_class()
    ours = cls._gemini_states
    checked = [0]
    split = [0]  # values compared as a fused-qkv split's rows

    def local(t):  # noqa: ANN001, ANN202
        return getattr(t, "_local_tensor", t)

    def same(t, placements, ours, theirs):  # noqa: ANN001, ANN202
        """Bit for bit; a fused-qkv split (gemini_dcp.integrations.fused_qkv) is ``Shard(0)`` where torchtitan's
        hook replicates: its rows are compared with the same rows of torchtitan's whole tensor."""
        want = getattr(theirs, "placements", None)
        if want == placements:
            return torch.equal(t, local(theirs))
        from torch.distributed.tensor import Replicate, Shard

        if placements != (Shard(0),) or any(not isinstance(p, Replicate) for p in want or ()) or ours.shape != theirs.shape:
            return False
        at = ours.device_mesh.get_local_rank() * t.shape[0]
        split[0] += 1
        return torch.equal(t, local(theirs)[at : at + t.shape[0]])

    def gemini_states_checked(self):  # noqa: ANN001, ANN202
        sd = ours(self)
        model_keys = list(self.states[MODEL].cached_state_dict)
        before = {k: (local(sd[k]).clone(), getattr(sd[k], "placements", None)) for k in model_keys}
        theirs = self._flattened_model_states_sd()  # torchtitan's: model.state_dict() and ModelWrapper's merge
        if list(theirs) != list(sd) or any(theirs[k] is not sd[k] for k in theirs if k not in before):
            raise AssertionError(f"state dict keys differ: {sorted(set(theirs) ^ set(sd))[:5]}")
        diff = [k for k, (t, placements) in before.items() if not same(t, placements, sd[k], theirs[k])]
        if diff:
            raise AssertionError(f"the saved state differs from torchtitan's at {diff[:5]}")
        checked[0] += 1
        return sd

    def report() -> None:
        print(f"states check: {checked[0]} saves exact ({split[0]} fused-qkv split values)", flush=True)

    import atexit

    atexit.register(report)
    cls._gemini_states = gemini_states_checked


if __name__ == "__main__":
    _install_test_hooks()
    from torchtitan.train import main

    main()
