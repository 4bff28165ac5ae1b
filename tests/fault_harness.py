"""Fault-injection harness: real rank processes, several simulated nodes, a kill at a named phase.

A *trial* runs a small job of 2-4 ranks on 2-3 simulated nodes (each node its own tier root
under a temporary directory) that saves steps 1..K with deterministic per-step values, while
one rank (or its node's drain process) kills itself at a named phase boundary
(``gemini_dcp.core.faults``; SIGKILL, sometimes SIGTERM or SIGSTOP). Like torchrun, the parent
then kills the rest of the worker group. Then it "restarts": fresh processes load with
:class:`~gemini_dcp.GeminiStorageReader` (optionally after wiping one node's root: that
node's memory is lost; ``replicas=2`` keeps a copy elsewhere) and check that

* the restored step's tensors are bit-exact for that step (every element encodes the step,
  so a mix of steps cannot pass);
* the restored step is >= the newest step whose ``dcp.save`` returned on every rank before
  the fault (no committed step lost while enough copies exist);
* every process ends within a bound (no wait without a deadline), and every loading
  process exits 0 (no abort at interpreter exit).

Trial kinds: ``save`` (fault while saving), ``load`` (clean saves, fault while loading, then a
clean load), ``drain`` (fault in a node's drain process; then the store alone must restore a
bit-exact step or none), ``survivor`` (the group is *not* killed: the surviving ranks must
fail on their own within their timeout), ``none`` (no fault).

Speed: every rank process is forked from a forkserver that has torch and gemini_dcp imported
(~1-2 s a trial instead of ~3 s per process). The parent never initializes torch.distributed.

Usage (the feature soak, ``tests/soak_trials.py`` run by ``scripts/soak.sh``, forks its ranks from
this module's forkserver and uses :func:`run_group`)::

    python tests/fault_harness.py --trials 1000 --seed 7 --out benchmarks/results/soak-DATE.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

from gemini_dcp.core.faults import ENV_FAULT, ENV_FAULT_LOG, PHASES

SAVE_PHASES: tuple[str, ...] = tuple(p for p in PHASES if p.split(".")[0] in ("save", "replicate", "commit"))
DRAIN_PHASES: tuple[str, ...] = tuple(p for p in PHASES if p.startswith("drain."))
LOAD_PHASES: tuple[str, ...] = tuple(p for p in PHASES if p.startswith("load."))

# (world size, node of each rank): 2-4 ranks on 2-3 simulated nodes.
LAYOUTS: tuple[tuple[int, ...], ...] = ((0, 1), (0, 0, 1), (0, 1, 2), (0, 0, 1, 1), (0, 0, 1, 2))

JOB = "fault"
ROWS, COLS = 24, 11


# ---- the state a rank saves: every value encodes (step, key, element) ----------------------------
def state_at(step: int, world_size: int) -> dict[str, Any]:
    """The state dict of ``step``: DTensor shards (fp32, fp64, bf16), a replicated int64 tensor and
    a bytes item. Every element is a distinct function of the step, so values of two steps never
    coincide and a restore that mixes steps fails the comparison."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    idx = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)
    w = idx + step * 4096.0                                   # exact in fp32 for step < 4000
    b = torch.arange(ROWS * 3, dtype=torch.float64) * 1e-3 + step
    h = (torch.arange(ROWS * 2, dtype=torch.float32) % 8) * 0.125 + step  # exact in bf16 for step < 32
    return {
        "model": {
            "w": distribute_tensor(w, mesh, [Shard(0)]),
            "b": distribute_tensor(b, mesh, [Shard(0)]),
            "h": distribute_tensor(h.to(torch.bfloat16).reshape(ROWS, 2), mesh, [Shard(0)]),
        },
        "extra": {"i": torch.arange(10, dtype=torch.int64) + step * 1000},
        "step": step,
    }


def blank_state(world_size: int) -> dict[str, Any]:
    """A state dict of the right structure whose tensors hold values no step has (-7)."""
    sd = state_at(0, world_size)
    for v in sd["model"].values():
        v.to_local().fill_(-7)
    sd["extra"]["i"].fill_(-7)
    sd["step"] = -1
    return sd


def matches(sd: dict[str, Any], step: int, world_size: int) -> list[str]:
    """The keys of ``sd`` that differ from the state saved at ``step`` (collective: full_tensor)."""
    import torch

    want = state_at(step, world_size)
    bad = [f"model.{k}" for k in ("w", "b", "h") if not torch.equal(sd["model"][k].full_tensor(), want["model"][k].full_tensor())]
    if not torch.equal(sd["extra"]["i"], want["extra"]["i"]):
        bad.append("extra.i")
    if sd["step"] != step:
        bad.append("step")
    return bad


# ---- one rank process -----------------------------------------------------------------------------
def rank_main(spec: dict[str, Any]) -> None:
    """Body of one rank process (forked from the forkserver): save or load, then report in files."""
    rank, out = spec["rank"], Path(spec["out"])
    # the ranks' own output (DCP's tracebacks, warnings) goes to a file per process, not the soak's log
    log_fd = os.open(out / f"{spec['mode']}-{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    env = {
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(spec["port"]), "RANK": str(rank),
        "WORLD_SIZE": str(spec["world"]), "LOCAL_RANK": str(rank), "OMP_NUM_THREADS": "1",
        "GEMINI_DCP_DRAIN_IDLE_S": "1", "GEMINI_DCP_DRAIN_PEER_TIMEOUT_S": "3",
    }
    os.environ.update(env)
    for k in (ENV_FAULT, ENV_FAULT_LOG):
        os.environ.pop(k, None)
    if spec.get("fault"):
        os.environ[ENV_FAULT] = spec["fault"]
    if spec.get("fault_log"):
        os.environ[ENV_FAULT_LOG] = spec["fault_log"]
    if spec.get("node_id"):
        os.environ["GEMINI_DCP_NODE_ID"] = spec["node_id"]  # fixed identities: a copied tree is the same nodes
    result: dict[str, Any] = {"rank": rank}
    code = 0
    t0 = time.monotonic()
    try:
        import datetime

        import torch
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        from gemini_dcp import GeminiStorageReader, GeminiStorageWriter, find_gemini_error

        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=spec["world"],
                                timeout=datetime.timedelta(seconds=spec["pg_timeout"]))
        result["init_s"] = round(time.monotonic() - t0, 3)
        try:
            if spec["mode"] == "save":
                first = spec.get("first_step", 1)
                for step in range(first, first + spec["steps"]):
                    writer = GeminiStorageWriter(
                        root=spec["root"], job_id=JOB, keep=spec["keep"], replicas=spec["replicas"],
                        timeout_s=spec["timeout_s"], persistent=spec.get("persistent"), persist_every=1,
                    )
                    dcp.save(state_at(step, spec["world"]), storage_writer=writer, checkpoint_id=step)
                    (out / f"saved-{rank}-{step}").touch()
            else:
                sd = blank_state(spec["world"])
                reader = GeminiStorageReader(root=spec["root"], job_id=JOB, timeout_s=spec["timeout_s"],
                                             persistent=spec.get("persistent"))
                try:
                    dcp.load(sd, storage_reader=reader)
                except BaseException as exc:  # noqa: BLE001 - classified for the parent (DCP's CheckpointException is a BaseException)
                    err = find_gemini_error(exc)
                    result["error"] = type(err).__name__ if err is not None else type(exc).__name__
                    result["gemini_error"] = err is not None  # one of gemini_dcp's errors (a GeminiError)
                    result["message"] = str(err if err is not None else exc)[-800:]
                    # a failed restore must leave the caller's tensors as they were (all -7)
                    result["touched"] = [f"model.{k}" for k in ("w", "b", "h") if not bool((sd["model"][k].to_local() == -7).all())]
                    result["touched"] += ["extra.i"] if not bool((sd["extra"]["i"] == -7).all()) else []
                else:
                    result["restored"] = reader.restored_step
                    result["bad_keys"] = matches(sd, reader.restored_step, spec["world"])
                    result["from"] = dict(reader.restored_from)
        finally:
            result["work_s"] = round(time.monotonic() - t0 - result["init_s"], 3)
            t_destroy = time.monotonic()
            dist.destroy_process_group()
            result["destroy_s"] = round(time.monotonic() - t_destroy, 3)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        code = 3
        from gemini_dcp import find_gemini_error

        err = find_gemini_error(exc)
        result["late" if "error" in result else "error"] = type(err if err is not None else exc).__name__
        result["late_message" if "message" in result else "message"] = f"{err or exc}\n{traceback.format_exc()[-1500:]}"
    result["total_s"] = round(time.monotonic() - t0, 3)
    final = out / f"result-{spec['mode']}-{rank}.json"
    tmp = final.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, final)  # whole or absent: the parent may SIGKILL this process at any moment
    sys.stdout.flush()
    sys.exit(code)


# ---- the parent ----------------------------------------------------------------------------------
_CTX: Any = None


def context() -> Any:
    """The forkserver context, with torch and gemini_dcp imported once in the server."""
    global _CTX
    if _CTX is None:
        here = str(Path(__file__).resolve().parent)
        if here not in sys.path:
            sys.path.insert(0, here)
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload([
            # torch._dynamo: DTensor's first distribute_tensor imports it (~2 s a process otherwise)
            "torch", "torch._dynamo", "torch.distributed.checkpoint", "torch.distributed.tensor", "gemini_dcp",
            "gemini_dcp.dcp.writer", "gemini_dcp.dcp.reader", "gemini_dcp.peer.push", "gemini_dcp.peer.fetch", __name__,
        ])
        _CTX = ctx
    return _CTX


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class GroupRun:
    """How one worker group ended."""

    codes: list[int | None]
    seconds: float
    timed_out: bool  # some process outlived the group's bound and was killed
    killed_by_parent: list[int]  # ranks the parent killed after another died (torchrun's reaction)
    timed_hit: bool = False  # a timed kill (``kill_at``) reached a live process


def run_group(specs: list[dict[str, Any]], bound_s: float, *, kill_on_death: bool = True,
              kill_at: tuple[int, float, int] | None = None, target: Any = None) -> GroupRun:
    """Start one process per spec; when one exits non-zero, SIGKILL the others (unless
    ``kill_on_death`` is False); anything alive after ``bound_s`` is killed and reported.
    ``kill_at=(rank, delay_s, signal)``: the parent sends ``signal`` to that rank ``delay_s``
    after the start (a fault at a random point, not at a named phase). ``target``: the body of each
    process (default :func:`rank_main`; ``tests/soak_trials.py`` passes its own)."""
    ctx = context()
    port = free_port()
    t0 = time.monotonic()
    procs = []
    for s in specs:
        p = ctx.Process(target=target or rank_main, args=({**s, "port": port},), daemon=False)
        p.start()
        procs.append(p)
    timed_out = False
    stopped = [False] * len(procs)
    timed_hit = False
    while any(p.exitcode is None for p in procs):
        if kill_at is not None and time.monotonic() - t0 >= kill_at[1]:
            victim = procs[kill_at[0]]
            if victim.exitcode is None:
                try:
                    os.kill(victim.pid, kill_at[2])
                    timed_hit = True
                except ProcessLookupError:
                    pass
            kill_at = None
        if time.monotonic() - t0 > bound_s:
            timed_out = True
            break
        died = [p for p in procs if p.exitcode not in (None, 0)]
        if kill_on_death and died:
            break
        if not kill_on_death and _only_stopped_left(procs, stopped):
            break
        time.sleep(0.01)
    killed = [r for r, p in enumerate(procs) if p.exitcode is None and not _is_stopped(p.pid)]
    if timed_out and killed:  # where they wait: a rank that registered faulthandler on SIGUSR1 logs its stacks
        for r in killed:
            try:
                os.kill(procs[r].pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        time.sleep(1.0)
    for p in procs:
        if p.exitcode is None:
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        p.join(10)
    return GroupRun([p.exitcode for p in procs], time.monotonic() - t0, timed_out, killed, timed_hit)


def _is_stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "T"
    except (OSError, IndexError):
        return False


def _only_stopped_left(procs: list[Any], stopped: list[bool]) -> bool:
    alive = [p for p in procs if p.exitcode is None]
    return bool(alive) and all(_is_stopped(p.pid) for p in alive)


@dataclasses.dataclass
class Trial:
    """One trial's parameters (all derived from ``seed`` when made by :func:`random_trial`)."""

    seed: int
    kind: str  # "save" | "timed" | "load" | "drain" | "survivor" | "none"
    phase: str | None = None
    nth: int = 1
    signal: str = "SIGKILL"
    rank: int = 0  # the rank whose process (or whose node's drain) is killed
    layout: tuple[int, ...] = (0, 1)
    steps: int = 3
    keep: int = 2
    replicas: int = 2
    wipe: tuple[int, ...] = ()  # nodes whose root is emptied before the restart
    timeout_s: float = 20.0
    delay_s: float = 0.0  # "timed": the parent kills ``rank`` this long after the save job starts
    resume: bool = True  # after the restart: save the next step (a new launch) and restore exactly it

    @property
    def world(self) -> int:
        return len(self.layout)

    @property
    def nodes(self) -> int:
        return max(self.layout) + 1

    def fault(self) -> str | None:
        if self.kind == "timed":
            return f"t+{self.delay_s:.3f}s:{self.signal}/{self.rank}"
        if self.phase is None:
            return None
        return f"{self.phase}@{self.nth}:{self.signal}/{self.rank}"


def random_trial(seed: int) -> Trial:
    """A trial drawn from ``seed``: kind, phase, nth, signal, rank, layout, keep, wipe."""
    rng = random.Random(seed)
    layout = rng.choice(LAYOUTS)
    kind = rng.choices(["save", "timed", "load", "drain", "survivor", "none"], weights=[62, 12, 14, 4, 3, 2])[0]
    replicas = 2 if rng.random() < 0.8 else 1
    steps = rng.randint(2, 4)
    keep = rng.choice([1, 2, 2])
    phase: str | None = None
    nth = 1
    delay_s = 0.0
    sig = rng.choices(["SIGKILL", "SIGTERM"], weights=[85, 15])[0]
    if kind == "save":
        phase = rng.choice(SAVE_PHASES)
        nth = rng.randint(1, steps)
    elif kind == "load":
        phase = rng.choice(LOAD_PHASES)
    elif kind == "timed":
        delay_s = round(rng.uniform(0.1, 1.0), 3)  # a save job of 2-4 steps runs ~0.3-1 s here
    elif kind == "drain":
        phase = rng.choice(DRAIN_PHASES)
        nth = rng.randint(1, 2)
        replicas = 2
    elif kind == "survivor":
        phase = rng.choice(["save.after_copy", "replicate.mid_send", "commit.before_record"])
        nth = rng.randint(1, steps)
        sig = rng.choice(["SIGKILL", "SIGSTOP"])
    if phase is not None and phase.startswith("replicate."):
        replicas = 2  # replicas=1 never replicates: the fault could not fire
    rank = rng.randrange(len(layout))
    if phase in ("commit.before_record", "commit.after_record", "commit.after_evict"):
        # only a node leader (the lowest rank on its node) writes a record
        rank = min(r for r, n in enumerate(layout) if n == layout[rank])
    wipe: tuple[int, ...] = ()
    if replicas == 2 and kind != "drain" and rng.random() < 0.4:
        wipe = (rng.randrange(max(layout) + 1),)
    return Trial(seed=seed, kind=kind, phase=phase, nth=nth, signal=sig, rank=rank, layout=layout, steps=steps,
                 keep=keep, replicas=replicas, wipe=wipe, timeout_s=5.0 if kind == "survivor" else 20.0,
                 delay_s=delay_s, resume=rng.random() < 0.5)


def _specs(t: Trial, mode: str, roots: list[str], out: Path, *, fault: str | None, fault_log: str | None,
           persistent: str | None, node_ids: bool = False) -> list[dict[str, Any]]:
    return [
        {
            "rank": r, "world": t.world, "root": roots[t.layout[r]], "out": str(out), "mode": mode,
            "steps": t.steps, "keep": t.keep, "replicas": t.replicas, "timeout_s": t.timeout_s,
            "pg_timeout": t.timeout_s, "fault": fault, "fault_log": fault_log, "persistent": persistent,
            "node_id": f"node{t.layout[r]}" if node_ids else None,
        }
        for r in range(t.world)
    ]


def _results(out: Path, mode: str, world: int) -> list[dict[str, Any] | None]:
    res: list[dict[str, Any] | None] = []
    for r in range(world):
        p = out / f"result-{mode}-{r}.json"
        res.append(json.loads(p.read_text()) if p.exists() else None)
        if p.exists():
            p.unlink()
        p.with_suffix(".tmp").unlink(missing_ok=True)
    return res


def _committed(out: Path, world: int, steps: int) -> int:
    """The newest step whose save returned on every rank (0: none)."""
    done = 0
    for s in range(1, steps + 1):
        if all((out / f"saved-{r}-{s}").exists() for r in range(world)):
            done = s
        else:
            break
    return done


def _fired(log_dir: Path, phase: str | None) -> bool:
    if phase is None:
        return False
    for f in log_dir.glob("*.phases"):
        for line in f.read_text().splitlines():
            if line.endswith(f"{phase} fire"):
                return True
    return False


def _drain_pids(roots: list[str]) -> list[int]:
    """Live drain processes serving any of ``roots`` (found by their command line, which names
    the node's persist directory: a process still importing has no pid file yet)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().decode(errors="replace")
        except OSError:
            continue
        if "gemini_dcp.persistent.drain.server" in cmd and any(r in cmd for r in roots) and _alive(int(entry)):
            pids.append(int(entry))
    return pids


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _exiting_holders(roots: list[str]) -> list[int]:
    """Processes on their way out that still hold a file under any of ``roots``.

    A process that exits releases its memory before its files: for that moment its
    ``/proc/PID/cmdline`` reads empty (so :func:`_drain_pids` no longer sees a drain process)
    while ``/proc/PID/fd`` still names the node's files (so ``gemini-dcp gc`` finds it holding
    them). On a loaded host the moment lasts long enough to be met."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if f.read():
                    continue
            fds = [os.readlink(f"/proc/{entry}/fd/{fd}") for fd in os.listdir(f"/proc/{entry}/fd")]
        except OSError:
            continue
        if any(fd.startswith(r.rstrip("/") + "/") for fd in fds for r in roots):
            pids.append(int(entry))
    return pids


def wait_exits(roots: list[str], bound_s: float = 10.0) -> list[int]:
    """Wait for the processes still exiting with files under ``roots`` (:func:`_exiting_holders`)
    to finish; those left after ``bound_s``."""
    deadline = time.monotonic() + bound_s
    pids = _exiting_holders(roots)
    while pids and time.monotonic() < deadline:
        time.sleep(0.05)
        pids = _exiting_holders(roots)
    return pids


def _wait_drains(roots: list[str], bound_s: float) -> list[int]:
    """Wait for the nodes' drain processes to exit; kill and return those still alive after ``bound_s``."""
    deadline = time.monotonic() + bound_s
    pids = _drain_pids(roots)
    while pids and time.monotonic() < deadline:
        time.sleep(0.1)
        pids = _drain_pids(roots)
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


def _wipe(root: str) -> None:
    shutil.rmtree(root, ignore_errors=True)
    os.mkdir(root, 0o700)


def _check_load(res: list[dict[str, Any] | None], run: GroupRun, committed: int, steps: int,
                *, may_be_empty: bool) -> tuple[str, int | None, str]:
    """(outcome, restored step, detail) of a restart load."""
    if run.timed_out:
        return "hang", None, f"the restart load did not finish in time (exit codes {run.codes})"
    if any(r is None for r in res):
        return "fail", None, f"a loading rank died without a result (exit codes {run.codes})"
    errors = {r["error"] for r in res if r and "error" in r}  # type: ignore[index]
    if errors:
        msg = next(r["message"] for r in res if r and "error" in r)  # type: ignore[index]
        if may_be_empty and committed == 0 and errors <= {"CheckpointNotFoundError", "StepNotFoundError", "ShardUnavailableError"}:
            return "pass", None, f"nothing restorable: {sorted(errors)}"
        return "fail", None, f"restore raised {sorted(errors)} with step {committed} committed: {msg}"
    steps_seen = {r["restored"] for r in res}  # type: ignore[index]
    if len(steps_seen) != 1:
        return "fail", None, f"ranks restored different steps {sorted(steps_seen)}"
    got = steps_seen.pop()
    bad = sorted({k for r in res for k in r["bad_keys"]})  # type: ignore[index]
    if bad:
        return "fail", got, f"step {got} restored with wrong values in {bad} (a torn or mixed restore)"
    if got < committed or got > steps:
        return "fail", got, f"restored step {got}, but step {committed} was committed on every rank (lost)"
    if any(c != 0 for c in run.codes):
        return "fail", got, f"a loading process exited {run.codes} after a successful restore"
    return "pass", got, ""


def run_trial(t: Trial, base: str | None = None) -> dict[str, Any]:
    """Run one trial and return its JSON record."""
    t0 = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="gemini-fault-", dir=base or _tmp_base()))
    record: dict[str, Any] = {**dataclasses.asdict(t), "fault": t.fault()}
    try:
        roots = [str(tmp / f"node{n}") for n in range(t.nodes)]
        for r in roots:
            os.mkdir(r, 0o700)
        out, logs = tmp / "out", tmp / "log"
        out.mkdir()
        logs.mkdir()
        store = f"file://{tmp / 'store'}" if t.kind == "drain" else None
        if store:
            (tmp / "store").mkdir()
        save_fault = t.fault() if t.kind in ("save", "drain", "survivor") else None
        kill_at = (t.rank, t.delay_s, int(getattr(signal, t.signal))) if t.kind == "timed" else None
        # a group killed on the first death ends at once; survivors left alone must fail on their
        # own: bounded by the control group's and the training group's timeouts (both timeout_s)
        bound = t.timeout_s * 4 + 10 if t.kind == "survivor" else t.timeout_s * 3 + 30
        save = run_group(_specs(t, "save", roots, out, fault=save_fault, fault_log=str(logs), persistent=store),
                         bound, kill_on_death=t.kind != "survivor", kill_at=kill_at)
        record["save_codes"] = save.codes
        committed = _committed(out, t.world, t.steps)
        record["committed"] = committed
        outcome, detail = "pass", ""
        if save.timed_out:
            outcome, detail = "hang", f"the save group was still running after {bound:.0f} s (codes {save.codes})"
        leftover = _wait_drains(roots, 25.0 if store else 2.0)
        if leftover:
            outcome, detail = "hang", f"drain processes {leftover} still alive 25 s after the job"
        record["fired"] = _fired(logs, t.phase) if t.kind != "load" else None  # a drain fires after the job
        if t.kind == "timed":  # fired: the signal, not a normal exit, ended that rank
            record["fired"] = save.timed_hit and save.codes[t.rank] == -int(getattr(signal, t.signal))
        record["save_seconds"] = round(save.seconds, 3)
        if t.kind == "survivor" and outcome == "pass" and record["fired"] and save.killed_by_parent:
            # the group was not killed for the fault: every other rank had to end on its own, in bounded time
            outcome, detail = "hang", (f"ranks {save.killed_by_parent} were still waiting {bound:.0f} s after a peer "
                                       f"{'stopped' if t.signal == 'SIGSTOP' else 'died'} (timeout_s={t.timeout_s})")
        _results(out, "save", t.world)
        if t.kind == "load" and outcome == "pass":
            run = run_group(_specs(t, "load", roots, out, fault=t.fault(), fault_log=str(logs), persistent=None), bound)
            record["fired"] = _fired(logs, t.phase)
            _results(out, "load", t.world)
            if run.timed_out:
                outcome, detail = "hang", f"the faulted load was still running after {bound:.0f} s"
        for n in t.wipe:
            _wipe(roots[n])
        restored: int | None = None
        if outcome == "pass":
            run = run_group(_specs(t, "load", roots, out, fault=None, fault_log=None, persistent=None), bound)
            outcome, restored, detail = _check_load(_results(out, "load", t.world), run, committed, t.steps,
                                                    may_be_empty=True)
            if outcome == "pass" and restored is None and committed > 0:
                outcome, detail = "fail", f"nothing restored with step {committed} committed"
        if outcome == "pass" and not store and t.resume:
            # training resumes (a new launch): the next step saves, and a restart restores exactly it
            nxt = (restored or 0) + 1
            specs = [{**s, "first_step": nxt, "steps": 1} for s in _specs(t, "save", roots, out, fault=None,
                                                                           fault_log=None, persistent=None)]
            run = run_group(specs, bound)
            res = _results(out, "save", t.world)
            if run.codes != [0] * t.world:
                errs = sorted({f"{r.get('error')}: {r.get('message', '')[:300]}" for r in res if r and "error" in r})
                outcome, detail = "fail", f"resume: saving step {nxt} after restoring {restored} failed {run.codes}: {errs}"
            else:
                run = run_group(_specs(t, "load", roots, out, fault=None, fault_log=None, persistent=None), bound)
                r_outcome, r_step, r_detail = _check_load(_results(out, "load", t.world), run, nxt, nxt, may_be_empty=False)
                record["resumed"] = r_step
                if r_outcome != "pass":
                    outcome, detail = r_outcome, f"resume: after saving step {nxt} on top of restored {restored}: {r_detail}"
        if outcome == "pass" and store:
            # the store alone (every node's memory lost) restores a bit-exact step, or none at all
            for r in roots:
                _wipe(r)
            run = run_group(_specs(t, "load", roots, out, fault=None, fault_log=None, persistent=store), bound)
            p_outcome, p_step, p_detail = _check_load(_results(out, "load", t.world), run, 0, t.steps, may_be_empty=True)
            record["store_restored"] = p_step
            if p_outcome != "pass":
                outcome, detail = p_outcome, f"from the store: {p_detail}"
            _wait_drains(roots, 5.0)
        record.update(outcome=outcome, restored=restored, detail=detail)
    except Exception as exc:  # noqa: BLE001 - a harness error is recorded, not hidden
        record.update(outcome="harness-error", restored=None, detail=f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-1200:]}")
    finally:
        if os.environ.get("GEMINI_FAULT_KEEP") and record.get("outcome") != "pass":
            record["kept_dir"] = str(tmp)  # for a post-mortem of a failed trial
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    record["seconds"] = round(time.monotonic() - t0, 3)
    return record


def _tmp_base() -> str | None:
    return "/dev/shm" if os.access("/dev/shm", os.W_OK) else None


def phases_reached(base: str | None = None) -> set[str]:
    """Run one clean 2-node job (save with replicas=2 and a store drained every step, then a load)
    with the phase log on; return every phase some process reported reaching."""
    t = Trial(seed=0, kind="none", layout=(0, 1), steps=3, keep=1, replicas=2)
    tmp = Path(tempfile.mkdtemp(prefix="gemini-phases-", dir=base or _tmp_base()))
    try:
        roots = [str(tmp / "node0"), str(tmp / "node1")]
        for r in roots:
            os.mkdir(r, 0o700)
        out, logs = tmp / "out", tmp / "log"
        out.mkdir()
        logs.mkdir()
        store = f"file://{tmp / 'store'}"
        run_group(_specs(t, "save", roots, out, fault=None, fault_log=str(logs), persistent=store), 90)
        _wait_drains(roots, 30.0)
        run_group(_specs(t, "load", roots, out, fault=None, fault_log=str(logs), persistent=None), 60)
        reached: set[str] = set()
        for f in logs.glob("*.phases"):
            reached.update(line.split()[1] for line in f.read_text().splitlines() if len(line.split()) >= 2)
        return reached
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---- soak ------------------------------------------------------------------------------------------
def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts per (kind, phase, signal, outcome) and the failing records."""
    counts: Counter[tuple[str, str, str, str]] = Counter()
    for r in records:
        timed = r["kind"] == "timed"
        phase = r["phase"] or ("(random time)" if timed else "-")
        counts[(r["kind"], phase, r["signal"] if r["phase"] or timed else "-", r["outcome"])] += 1
    return {
        "trials": len(records),
        "outcomes": dict(Counter(r["outcome"] for r in records)),
        "fired": sum(1 for r in records if r.get("fired")),
        "table": [
            {"kind": k, "phase": p, "signal": s, "outcome": o, "count": n} for (k, p, s, o), n in sorted(counts.items())
        ],
        "failures": [r for r in records if r["outcome"] != "pass"],
    }


def markdown_table(summary: dict[str, Any]) -> str:
    """The (kind, phase, signal, outcome, count) table of a soak summary, as Markdown."""
    lines = ["| kind | phase | signal | outcome | trials |", "|---|---|---|---|---:|"]
    for row in summary["table"]:
        lines.append(f"| {row['kind']} | {row['phase']} | {row['signal']} | {row['outcome']} | {row['count']} |")
    return "\n".join(lines)


def _dump(doc: dict[str, Any]) -> str:
    """The soak file: the summary readable, then one compact line per trial record."""
    head = {k: v for k, v in doc.items() if k not in ("failures", "trials_run")}
    lines = [json.dumps(head, indent=1, default=str)[:-2] + ","]
    for key in ("failures", "trials_run"):
        rows = [json.dumps(r, default=str, separators=(",", ":")) for r in doc.get(key, [])]
        lines.append(f' "{key}": [\n  ' + ",\n  ".join(rows) + "\n ]" + ("," if key == "failures" else ""))
    return "\n".join(lines) + "\n}\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", required=True, help="JSON file for the summary and every trial (read by --table)")
    ap.add_argument("--deadline", type=float, default=0.0, help="stop starting trials at this unix time (0: none)")
    ap.add_argument("--table", action="store_true", help="print the Markdown table of the --out soak file and exit")
    args = ap.parse_args(argv)
    if args.table:
        print(markdown_table(json.loads(Path(args.out).read_text())))
        return 0
    records: list[dict[str, Any]] = []
    t0 = time.time()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for i in range(args.trials):
        if args.deadline and time.time() > args.deadline:
            break
        rec = run_trial(random_trial(args.seed * 1_000_003 + i))
        records.append(rec)
        if rec["outcome"] != "pass":
            print(json.dumps(rec), flush=True)
        if (i + 1) % 25 == 0 or i + 1 == args.trials:
            summary = summarize(records)
            print(f"[{i + 1}/{args.trials}] {summary['outcomes']} {time.time() - t0:.0f}s", flush=True)
            doc = {"seed": args.seed, "started_unix": t0, "seconds": round(time.time() - t0, 1), **summary, "trials_run": records}
            out.write_text(_dump(doc))
    summary = summarize(records)
    doc = {"seed": args.seed, "started_unix": t0, "seconds": round(time.time() - t0, 1), **summary, "trials_run": records}
    out.write_text(_dump(doc))
    print(json.dumps({k: summary[k] for k in ("trials", "outcomes", "fired")}), flush=True)
    return 0 if not summary["failures"] else 1


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import fault_harness  # noqa: E402 - re-imported by name, so the forkserver can find rank_main

    raise SystemExit(fault_harness.main())
