"""Wasted time per failure, end to end under torchrun: gemini_dcp vs stock DCP to disk.

What one failure costs = lost progress + restart + retrieval (GEMINI, SOSP'23, §2:
t_ckpt + 1/(2f) + t_rtvl, plus the restart itself). Every figure here comes from real
``torchrun`` jobs of ``examples/train_fsdp2.py`` (FSDP2 LM, 2 ranks, gloo on CPU or nccl
on GPU) in which a failure is injected, measured from the wall-clock events the training
processes log (``--events``):

* lost progress = kill time - time the restored step had finished training
  (the work redone: the rest of the interval, the checkpoints taken in it, the partial step);
* restart = kill -> the new workers start restoring (failure detection, teardown, process
  spawn, ``import torch``, process groups, model construction);
* retrieval = the restore itself (``dcp.load`` + ``set_state_dict``) until training can go on;
  the JSON also has the restore call alone (``resume_s``, of which the tier read ``reader_s``) and
  the first step after the resume (``first_step_s``, ``first_step_extra_s`` over the steady
  iteration), where work a resume leaves for later shows up.

Scenarios (each run once with gemini_dcp and once with stock DCP, in the same invocation):

* ``software``: a rank is SIGKILLed; torchrun restarts the worker group on the same node;
  gemini restores from the node's memory (local tier).
* ``node``: 2 simulated nodes (c10d rendezvous, own tier roots); one node's agent and workers
  are SIGKILLed and its memory wiped; a replacement node joins; gemini (``replicas=2``)
  restores the lost node's shards from the peer's memory.
* ``all-memory``: the whole job dies and every node's memory is wiped; gemini restores from its
  persistent tier (``persistent=file://<disk>``, drained in the background every P steps, P = the
  stock K) — without a persistent tier all progress would be lost.

* ``nan`` (its own JSON, ``recovery-nan.json``): a bad batch puts NaN into one rank's weights at
  step K (``--inject-nan-at``), the loss of step K+1 is not finite. Three recoveries, same run:
  gemini's in-process rollback to the newest healthy step (``fast_load``, no restart); a torchrun
  restart that restores the newest healthy step (gemini passes over the unhealthy ones); and stock
  DCP, restarted from its newest checkpoint on disk (every step here: it holds the NaNs, so the
  restarted job fails again until torchrun gives up). Wasted time = from the end of step K-1 (the
  last healthy state) until training goes on from a healthy state.

Stock DCP writes ``FileSystemWriter`` checkpoints (fsync'ed) to a local disk directory every K
steps, K chosen so that its checkpoint overhead per step matches gemini's
(K = round(t_ckpt_stock / t_ckpt_gemini), measured in this run); its files are evicted from
the page cache after writing, so a restore reads them from the device, as it would from remote
storage or on a replacement machine. The failure is injected mid-interval (K//2 steps after a
checkpoint, after backward), so measured lost progress is close to the expected one.

Outputs: ``benchmarks/results/recovery.json`` (``recovery-<tag>.json`` for other tags),
``docs/img/recovery.png`` and the table between the markers in ``docs/recovery.md``.

    python benchmarks/bench_recovery.py                # CPU, ~10 min on 2 cores
    python benchmarks/bench_recovery.py --quick        # smaller model
    python benchmarks/bench_recovery.py --tag h100     # on a GPU machine (1 GPU: --nproc 1)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import IMG, REPO, RESULTS, free_port, machine_info, write_json  # noqa: E402  (benchmarks/common.py)

TRAIN = REPO / "examples" / "train_fsdp2.py"
DOC = REPO / "docs" / "recovery.md"
SCENARIOS = ("software", "node", "all-memory", "nan")
TITLES = {
    "software": "software failure (rank killed, memory survives)",
    "node": "one node replaced (its memory lost)",
    "all-memory": "all memory lost (whole job, every node)",
    "nan": "NaN in the weights (a bad batch): rollback vs restart",
}
NAN_SYSTEMS = ("gemini-rollback", "gemini-restart", "stock-restart")


def run_nan(bench: Bench, inject: int = 6, steps: int = 9) -> dict[str, Any]:
    """Scenario ``nan``: the three recoveries of one poisoned step, in turn (see the module docstring)."""
    out: dict[str, Any] = {"inject_at": inject, "steps": steps}
    for system in NAN_SYSTEMS:
        job = f"nan-{system}-{uuid.uuid4().hex[:6]}"
        events = bench.disk / f"{job}.events.jsonl"
        log = bench.logs / f"{job}.log"
        root = bench.shm / job
        root.mkdir(parents=True)
        train = ["--steps", str(steps), "--job-id", job, "--events", str(events), *bench.model(),
                 "--inject-nan-at", str(inject), "--on-nan", "rollback" if system == "gemini-rollback" else "exit"]
        if system.startswith("gemini"):
            train += ["--ckpt-backend", "gemini", "--ckpt-every", "1"]
        else:
            train += ["--ckpt-backend", "stock", "--ckpt-every", "1", "--stock-dir", str(bench.disk / "stock" / job),
                      "--stock-drop-cache"]
        print(f"  - {job}: NaN at step {inject}, {steps} steps", flush=True)
        t0 = time.time()
        rc = Agent(bench.standalone(bench.args.nproc, 2, train), bench.env(root), log).wait(bench.args.run_timeout)
        evs = [json.loads(ln) for ln in events.read_text().splitlines() if ln.strip()]
        first_pid = next(e["pid"] for e in evs if e["ev"] == "start")
        t_good = next(e["t"] for e in evs if e["ev"] == "step_done" and e["pid"] == first_pid and e["step"] == inject - 1)
        nans = [e["t"] for e in evs if e["ev"] == "nan"]
        res: dict[str, Any] = {"exit_code": rc, "nan_events": len(nans), "attempts": len({e["pid"] for e in evs if e["ev"] == "start"}),
                               "wall_s": round(time.time() - t0, 2), "detect_s": round(nans[0] - t_good, 3) if nans else None}
        if system == "gemini-rollback":
            rb = next(e for e in evs if e["ev"] == "rollback")
            res.update(restored_step=rb["to"], rollback_restore_s=rb["seconds"], wasted_s=round(rb["t"] - t_good, 3),
                       recovered=rc == 0)
        else:
            ends = [e for e in evs if e["ev"] == "restore_end" and e["pid"] != first_pid]
            readies = [e for e in evs if e["ev"] == "ready" and e["pid"] != first_pid]
            res.update(restored_steps=[e["step"] for e in ends], recovered=rc == 0)
            if rc == 0 and readies:
                res.update(restored_step=ends[-1]["step"], restore_s=ends[-1].get("seconds"),
                           wasted_s=round(readies[-1]["t"] - t_good, 3))
            else:  # restored the poisoned step: failed again after every restart
                last = max(e["t"] for e in evs)
                res.update(wasted_s=None, failed_after_s=round(last - t_good, 3))
        out[system] = res
        print(f"     {system}: {res}", flush=True)
    return out


# ---- processes ------------------------------------------------------------------------------
class Agent:
    """One torchrun agent (a simulated node) started by this script, output to a log file."""

    def __init__(self, cmd: list[str], env: dict[str, str], log: Path) -> None:
        log.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log, "a")
        self._log.write("$ " + " ".join(cmd) + "\n")
        self._log.flush()
        self.p = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
        self.pids: set[int] = {self.p.pid}

    def track(self) -> None:
        try:
            import psutil

            self.pids.update(c.pid for c in psutil.Process(self.p.pid).children(recursive=True))
        except Exception:  # noqa: BLE001 - gone already
            pass

    def wait_down(self, timeout: float) -> int:
        """Wait for the agent to exit, remembering its workers; then SIGKILL any leftover of them."""
        deadline = time.monotonic() + timeout
        while self.p.poll() is None:
            self.track()
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        self.kill()
        return self.p.wait()

    def wait(self, timeout: float) -> int:
        try:
            return self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.track()
            self.kill()
            return -999

    def kill(self) -> None:
        for pid in self.pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def kill_drain_servers(root: Path) -> list[int]:
    """SIGKILL the background persistent-drain processes our jobs started for ``root`` (they live
    on the 'machine' whose memory is lost)."""
    killed = []
    try:
        import psutil
    except ImportError:
        return killed
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(proc.info.get("cmdline") or [])
        if str(root) in cmd and "drain" in cmd and proc.pid != os.getpid():
            try:
                os.kill(proc.pid, signal.SIGKILL)
                killed.append(proc.pid)
            except (ProcessLookupError, PermissionError):
                pass
    return killed


def drop_page_cache(path: Path) -> None:
    """Evict ``path``'s files from the page cache (the stock checkpointer's ``--stock-drop-cache`` helper)."""
    sys.path.insert(0, str(REPO))
    from examples.common import drop_page_cache as drop  # noqa: PLC0415

    drop(path)


def tail(path: Path, n: int = 40) -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if not ln.startswith("[rank") or "Error" in ln]
        return "\n".join(lines[-n:])
    except OSError:
        return ""


# ---- one measured run ------------------------------------------------------------------------
@dataclass
class Plan:
    scenario: str
    system: str               # "gemini" | "stock"
    interval: int             # checkpoint interval (steps) of the tier the restore comes from
    fail_step: int
    steps: int
    persist_every: int | None = None


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
        self.shm = Path(tempfile.mkdtemp(prefix="gemini_recovery_", dir=shm))
        self.disk = Path(tempfile.mkdtemp(prefix="gemini_recovery_", dir=args.disk_dir))
        self.logs = self.disk / "logs"

    def cleanup(self) -> None:
        kill_drain_servers(self.shm)
        shutil.rmtree(self.shm, ignore_errors=True)
        if not self.args.keep:
            shutil.rmtree(self.disk, ignore_errors=True)

    def env(self, root: Path) -> dict[str, str]:
        env = dict(os.environ)
        env.update(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", OMP_NUM_THREADS=str(self.args.threads),
                   PYTHONUNBUFFERED="1", GEMINI_DCP_ROOT=str(root))
        return env

    def model(self) -> list[str]:
        a = self.args
        return ["--d-model", str(a.d_model), "--layers", str(a.layers), "--heads", str(a.heads),
                "--seq", str(a.seq), "--batch", str(a.batch), "--threads", str(a.threads)]

    def train_args(self, plan: Plan, job: str, events: Path) -> list[str]:
        out = ["--steps", str(plan.steps), "--job-id", job, "--events", str(events), *self.model()]
        if plan.system == "none":
            out += ["--ckpt-backend", "none"]
        elif plan.system == "gemini":
            out += ["--ckpt-backend", "gemini", "--ckpt-every", "1", "--replicas", "2" if plan.scenario == "node" else "1"]
            if not self.args.sync_gemini:
                out += ["--async-ckpt"]
            if plan.persist_every:
                out += ["--persistent", f"file://{self.disk / 'persistent'}", "--persist-every", str(plan.persist_every)]
        else:
            out += ["--ckpt-backend", "stock", "--ckpt-every", str(plan.interval),
                    "--stock-dir", str(self.disk / "stock" / job), "--stock-drop-cache"]
        return out

    def standalone(self, nproc: int, max_restarts: int, train: list[str]) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                "--max-restarts", str(max_restarts), "--monitor-interval", "0.1", str(TRAIN), *train]

    def node_agent(self, node_rank: int, port: int, run_id: str, train: list[str]) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node_rank),
                "--nproc-per-node", str(self.args.nproc // 2 or 1), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
                "--rdzv-conf", f"is_host={'true' if node_rank == 0 else 'false'},join_timeout=300",
                "--max-restarts", "3", "--monitor-interval", "0.1", str(TRAIN), *train]

    def run(self, plan: Plan, calibrate: bool = False) -> dict[str, Any]:
        job = f"{plan.scenario}-{plan.system}-{uuid.uuid4().hex[:6]}"
        events = self.disk / f"{job}.events.jsonl"
        log = self.logs / f"{job}.log"
        train = self.train_args(plan, job, events)
        fail = ["--fail-at-step", str(plan.fail_step)]
        limit = self.args.run_timeout
        t0 = time.time()
        harness: dict[str, float] = {}
        print(f"  - {job}: {plan.system}, checkpoint every {plan.interval} step(s)"
              f"{'' if calibrate else f', failure during step {plan.fail_step}'}, {plan.steps} steps", flush=True)
        if calibrate:
            root = self.shm / job
            root.mkdir()
            rc = Agent(self.standalone(self.args.nproc, 0, train), self.env(root), log).wait(limit)
        elif plan.scenario == "software":
            root = self.shm / job
            root.mkdir()
            rc = Agent(self.standalone(self.args.nproc, 1, train + fail + ["--fail-mode", "rank"]), self.env(root), log).wait(limit)
        elif plan.scenario == "node":
            roots = [self.shm / job / "node0", self.shm / job / "node1"]
            for r in roots:
                r.mkdir(parents=True)
            port = free_port()
            n0 = Agent(self.node_agent(0, port, job, train), self.env(roots[0]), log)
            time.sleep(1.0)  # node 0 hosts the rendezvous store
            n1 = Agent(self.node_agent(1, port, job, train + fail + ["--fail-mode", "node"]), self.env(roots[1]),
                       self.logs / f"{job}.node1.log")
            n1.wait_down(limit)
            t_down = time.time()
            kill_drain_servers(roots[1])
            shutil.rmtree(roots[1], ignore_errors=True)  # the machine and its memory are gone
            roots[1].mkdir()
            drop_page_cache(self.disk)  # a replacement machine has a cold page cache
            harness = {"down": t_down, "relaunch": time.time()}
            n1b = Agent(self.node_agent(1, port, job, train), self.env(roots[1]), self.logs / f"{job}.node1b.log")
            rc = max(abs(n0.wait(limit)), abs(n1b.wait(limit)))
        else:  # all-memory
            root = self.shm / job
            root.mkdir()
            first = Agent(self.standalone(self.args.nproc, 0, train + fail + ["--fail-mode", "node"]), self.env(root), log)
            first.wait_down(limit)
            t_down = time.time()
            kill_drain_servers(root)
            t_killed = time.time()
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir()
            t_wiped = time.time()
            drop_page_cache(self.disk)
            harness = {"down": t_down, "drains_killed": t_killed, "wiped": t_wiped, "relaunch": time.time()}
            rc = Agent(self.standalone(self.args.nproc, 0, train), self.env(root), log).wait(limit)
        if rc != 0:
            raise RuntimeError(f"{job}: torchrun exited {rc}; log {log}:\n{tail(log)}")
        evs = [json.loads(ln) for ln in events.read_text().splitlines() if ln.strip()]
        out = analyze(evs, plan, calibrate, harness)
        out.update(job=job, wall_s=round(time.time() - t0, 2), plan=asdict(plan))
        return out


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def analyze(evs: list[dict[str, Any]], plan: Plan, calibrate: bool, harness: dict[str, float] | None = None) -> dict[str, Any]:
    """Split the failure's cost from the events of rank 0 (and of the killed ranks).

    ``harness``: wall-clock marks of this script's own simulation of the lost machine between the
    old agent going down and the new one starting (SIGKILL of its drain processes, deleting its
    tier memory, evicting the disk's page cache). A replacement machine does none of that, so the
    span is reported (``harness_s``, ``harness_phases``) and left out of the restart term.
    """
    kills = [e["t"] for e in evs if e["ev"] == "kill"]
    t_kill = min(kills) if kills else math.inf
    before = [e for e in evs if e["t"] < t_kill]
    # Skip the warm-up: the first save creates and faults the tier's slots (with the async
    # checkpointer, in the background during steps 2-3) and the interleave profiler learns.
    done_steps = [(e["step"], e["seconds"]) for e in before if e["ev"] == "step_done"]
    iters = [s for st, s in done_steps if st > 3]
    if len(iters) < 3:
        iters = [s for st, s in done_steps if st > 1]
    ck = sorted((e["step"], e["seconds"]) for e in before if e["ev"] == "ckpt")
    ckpts = [s for _, s in ck[1:]] or [s for _, s in ck]  # the first save sets up slots / files
    out: dict[str, Any] = {
        "iter_s": _median(iters),
        "ckpt_s": _median(ckpts),
        "ckpt_s_all": [round(s, 4) for _, s in ck],
    }
    if calibrate:
        return out
    fin = [e for e in evs if e["ev"] == "finished"]
    if not fin or not kills:
        raise RuntimeError(f"run did not finish or no failure was injected: {[e['ev'] for e in evs][-10:]}")
    pid = fin[-1]["pid"]

    def of_final(name: str) -> dict[str, Any]:
        return [e for e in evs if e["ev"] == name and e["pid"] == pid][-1]

    rb, rend, ready, start = of_final("restore_begin"), of_final("restore_end"), of_final("ready"), of_final("start")
    r = int(rend["step"])
    done = {e["step"]: e["t"] for e in before if e["ev"] == "step_done"}
    if r > 0:
        t_r = done[r]
    else:  # nothing restorable: everything since training started is lost
        t_r = min(e["t"] for e in before if e["ev"] == "ready")
    # The first training step after the resume, against the steady iteration before the kill: work
    # the resume leaves for later shows up here (e.g. DTensor's first sharding propagation of the
    # optimizer's ops, paid by torch's initializing step inside the resume or by this step).
    after = [e["seconds"] for e in evs if e["ev"] == "step_done" and e["pid"] == pid and e["t"] >= ready["t"]]
    tiers = {k: v for k, v in (rend.get("tiers") or {}).items() if v}
    harness = harness or {}
    harness_s = (harness["relaunch"] - harness["down"]) if harness else 0.0
    lost, restart, retrieval = t_kill - t_r, rb["t"] - t_kill - harness_s, ready["t"] - rb["t"]
    out.update(
        restored_step=r,
        restored_from=tiers,
        restored_bytes=sum(tiers.values()),
        lost_s=lost,
        restart_s=restart,
        restart_spawn_s=start["t"] - t_kill - harness_s,   # kill -> the new rank-0 process exists (less the harness)
        harness_s=harness_s,
        harness_phases={k: round(v - harness["down"], 3) for k, v in harness.items()} if harness else {},
        retrieval_s=retrieval,
        reader_s=rend.get("reader_seconds"),
        resume_s=rend.get("seconds"),            # the checkpointer's restore call (examples' ResumeInfo.seconds)
        first_step_s=after[0] if after else None,
        first_step_extra_s=(after[0] - out["iter_s"]) if after and out["iter_s"] is not None else None,
        wasted_s=lost + restart + retrieval,
        attempts=len({e["pid"] for e in evs if e["ev"] == "start"}),
    )
    return out


def expected(res: dict[str, Any], interval: int, per_step_ckpt: bool) -> dict[str, float]:
    """GEMINI's model with this run's measured parts: a failure at a uniformly random time loses
    half a checkpoint cycle plus one checkpoint time (a failure during a checkpoint rolls back)."""
    it, ck = res["iter_s"] or 0.0, res["ckpt_s"] or 0.0
    cycle = interval * it + (interval if per_step_ckpt else 1) * ck
    lost = ck + cycle / 2
    return {"lost_s": lost, "wasted_s": lost + res["restart_s"] + res["retrieval_s"],
            "paper_s": lost + res["retrieval_s"]}


# ---- report ----------------------------------------------------------------------------------
def fmt(x: float | None, spec: str = ".2f") -> str:
    return "–" if x is None else format(x, spec)


def tier_text(res: dict[str, Any]) -> str:
    t = res.get("restored_from") or {}
    if not t:
        return "nothing (from scratch)"
    return " + ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in sorted(t.items(), key=lambda kv: -kv[1]))


def table(data: dict[str, Any]) -> str:
    rows = [
        "| scenario | system | checkpoint | ckpt overhead / step (blocked + slowdown) | restored (step, from) | lost progress | restart | retrieval "
        "| **wasted (measured)** | wasted (expected) | lost + retrieval (expected) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for sc in data["scenarios"]:
        for sysname in ("gemini", "stock"):
            res = sc[sysname]
            plan = res["plan"]
            if sysname == "gemini":
                what = "every step → memory" + (f" (+ persistent every {plan['persist_every']})" if plan.get("persist_every") else "")
                if sc["scenario"] == "node":
                    what += ", replicas=2"
            else:
                what = f"every {plan['interval']} steps → disk"
            ovh = res["overhead_s"] if res.get("overhead_s") is not None else (
                (res["ckpt_s"] or 0) / (plan["interval"] if sysname == "stock" else 1))
            rows.append(
                f"| {sc['scenario'] if sysname == 'gemini' else ''} | {'gemini_dcp' if sysname == 'gemini' else 'stock DCP'} | {what} "
                f"| {fmt(ovh * 1e3, '.0f')} ms ({fmt(100 * ovh / res['iter_s'] if res['iter_s'] else None, '.0f')}%) "
                f"| {res['restored_step']}, {tier_text(res)} | {fmt(res['lost_s'])} s | {fmt(res['restart_s'])} s "
                f"| {fmt(res['retrieval_s'])} s | **{fmt(res['wasted_s'])} s** | {fmt(res['expected']['wasted_s'])} s "
                f"| {fmt(res['expected']['paper_s'])} s |"
            )
        rows.append(
            f"| | *stock / gemini* | | | | | | | **{fmt(sc['ratio_measured'], '.1f')}×** | {fmt(sc['ratio_expected'], '.1f')}× "
            f"| {fmt(sc['ratio_paper'], '.1f')}× |"
        )
    return "\n".join(rows)


def plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scs = data["scenarios"]
    fig, ax = plt.subplots(figsize=(9, 4.8))
    width, xs, labels = 0.36, [], []
    parts = [("lost_s", "lost progress", "#4C72B0"), ("restart_s", "restart (torchrun, spawn, init)", "#BBBBBB"),
             ("retrieval_s", "retrieval", "#DD8452")]
    for i, sc in enumerate(scs):
        for j, sysname in enumerate(("gemini", "stock")):
            res = sc[sysname]
            x = i + (j - 0.5) * width
            bottom = 0.0
            for key, name, color in parts:
                v = res[key]
                ax.bar(x, v, width * 0.95, bottom=bottom, color=color, edgecolor="black", linewidth=0.5,
                       label=name if (i, j) == (0, 0) else None, hatch="//" if sysname == "stock" else None)
                bottom += v
            ax.annotate(f"{'gemini' if sysname == 'gemini' else 'stock'}\n{bottom:.1f} s", (x, bottom), xytext=(0, 2),
                        textcoords="offset points", ha="center", va="bottom", fontsize=7)
        xs.append(i)
        labels.append(f"{TITLES[sc['scenario']]}\nstock/gemini: {sc['ratio_measured']:.1f}× "
                      f"(lost+retrieval {sc['ratio_paper']:.1f}×)")
    ax.set_xticks(xs)
    ax.set_xticklabels(labels, fontsize=7.5)
    ax.set_ylabel("wasted time per failure (s)")
    m = data["machine"]
    ax.set_title(f"Wasted time per failure, measured under torchrun — {data['device']}; model {data['model_desc']}\n"
                 f"gemini_dcp: every step in memory; stock DCP: FileSystemWriter to disk every K steps (same overhead)",
                 fontsize=8.5)
    ax.legend(fontsize=7.5, loc="upper left")
    ax.margins(y=0.2)
    fig.text(0.99, 0.01, f"{m.get('cores')} cores, torch {m.get('torch')}, load {m.get('loadavg_1_5_15')}", ha="right", fontsize=6, color="gray")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)


def update_doc(tag: str, text: str) -> None:
    begin, end = f"<!-- recovery:{tag}:begin -->", f"<!-- recovery:{tag}:end -->"
    doc = DOC.read_text() if DOC.exists() else "# Recovery: wasted time per failure\n"
    block = f"{begin}\n{text}\n{end}"
    if begin in doc and end in doc:
        doc = re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _m: block, doc, flags=re.S)
    else:
        doc = doc.rstrip("\n") + "\n\n" + block + "\n"
    DOC.write_text(doc)


# ---- main ------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tag", default="cpu", help="name of this machine's results (cpu -> recovery.json, else recovery-<tag>.json)")
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--nproc", type=int, default=2, help="ranks in all (the node scenario splits them over 2 nodes)")
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="a small model (d_model 256, 2 layers)")
    p.add_argument("--k", type=int, default=None, help="force the stock checkpoint interval K")
    p.add_argument("--max-k", type=int, default=12, help="cap on the automatically chosen K (bounds the run time)")
    p.add_argument("--sync-gemini", action="store_true",
                   help="gemini saves with a blocking dcp.save every step (default: AsyncCheckpointer, --async-ckpt)")
    p.add_argument("--disk-dir", default="/var/tmp", help="disk directory for stock checkpoints and the persistent tier")
    p.add_argument("--run-timeout", type=float, default=900)
    p.add_argument("--keep", action="store_true", help="keep logs and checkpoints (printed path)")
    p.add_argument("--no-doc", action="store_true", help="do not rewrite the table in docs/recovery.md")
    args = p.parse_args(argv)
    if args.quick:
        args.d_model, args.layers = 256, 2
    scenarios = [s for s in args.scenarios.split(",") if s]
    for s in scenarios:
        if s not in SCENARIOS:
            p.error(f"unknown scenario {s!r}; choose from {SCENARIOS}")
    import torch

    device = (f"{torch.cuda.get_device_name(0)} (nccl)" if torch.cuda.is_available() else f"CPU, {os.cpu_count()} cores (gloo)")
    bench = Bench(args)
    print(f"== recovery benchmark on {device}; scratch {bench.shm} (memory) and {bench.disk} (disk)", flush=True)
    if scenarios == ["nan"]:  # its own runs and JSON (no calibration, no table of the failure scenarios)
        try:
            data = {"benchmark": "recovery-nan", "device": device, "machine": machine_info(),
                    "model_desc": f"d_model {args.d_model}, {args.layers} layers, {args.nproc} ranks",
                    "config": {k: v for k, v in vars(args).items() if k not in ("keep", "no_doc")}, "nan": run_nan(bench)}
            data["machine_after"] = {"loadavg_1_5_15": machine_info()["loadavg_1_5_15"]}
            out = RESULTS / ("recovery-nan.json" if args.tag == "cpu" else f"recovery-nan-{args.tag}.json")
            write_json(out, data)
            print(f"wrote {out.relative_to(REPO)}")
            return 0
        finally:
            bench.cleanup()
    scenarios = [s for s in scenarios if s != "nan"]
    try:
        print("== calibration: stock DCP checkpoint every step, no failure", flush=True)
        cal = bench.run(Plan("calibration", "stock", 1, 0, 5), calibrate=True)
        t_stock, t_iter = cal["ckpt_s"], cal["iter_s"]
        bare = bench.run(Plan("calibration", "none", 0, 0, 7), calibrate=True)
        t_bare = bare["iter_s"]
        print(f"     iteration {t_iter:.3f} s ({t_bare:.3f} s with no checkpointing), stock checkpoint {t_stock:.3f} s",
              flush=True)
        results = []
        k_software = None
        for sc in scenarios:
            print(f"== scenario: {TITLES[sc]}", flush=True)
            if sc == "all-memory":
                pe = k_software or args.k or 2
                # The drain server starts with the first request (it imports torch: seconds here) and
                # then stays up; fail only after ~20 s of training so the drain is in steady state.
                m = max(3, math.ceil(20.0 / (pe * (t_iter + t_stock / 2))))
                g_plan = Plan(sc, "gemini", pe, m * pe + pe // 2 + 1, m * pe + pe // 2 + 3, persist_every=pe)
            else:
                g_plan = Plan(sc, "gemini", 1, 8, 10)
            g = bench.run(g_plan)
            # gemini's cost per step: what training blocks for (the save call and, async, the
            # optimizer-step guard) plus the slowdown of the iteration itself (background copy).
            g["overhead_s"] = (g["ckpt_s"] or 0.0) + max(0.0, (g["iter_s"] or t_bare) - t_bare)
            k = args.k or min(args.max_k, max(1, round(t_stock / max(g["overhead_s"], 1e-3))))
            if sc == "software":
                k_software = k
            if sc == "all-memory" and not args.k:
                k = g_plan.persist_every or k  # same cadence as gemini's persistent tier
            m = max(1, math.ceil(3 / k))
            s_plan = Plan(sc, "stock", k, k * m + k // 2 + 1, k * m + k // 2 + 3)
            s = bench.run(s_plan)
            s["ckpt_s"] = s["ckpt_s"] if s["ckpt_s"] is not None else t_stock
            g["expected"] = expected(g, g_plan.interval, per_step_ckpt=(sc != "all-memory"))
            if sc == "all-memory":  # the memory tier's per-step cost is paid on every step as well
                g["expected"]["note"] = "cycle = P iterations + P in-memory checkpoints; the drain itself is asynchronous"
            s["expected"] = expected(s, k, per_step_ckpt=False)
            entry = {
                "scenario": sc,
                "title": TITLES[sc],
                "k": k,
                "gemini": g,
                "stock": s,
                "ratio_measured": s["wasted_s"] / g["wasted_s"],
                "ratio_expected": s["expected"]["wasted_s"] / g["expected"]["wasted_s"],
                "ratio_paper": s["expected"]["paper_s"] / g["expected"]["paper_s"],
            }
            results.append(entry)
            for name, res in (("gemini_dcp", g), ("stock DCP", s)):
                print(f"     {name:10s}: restored step {res['restored_step']} from {tier_text(res)}; lost {res['lost_s']:.2f} s + "
                      f"restart {res['restart_s']:.2f} s + retrieval {res['retrieval_s']:.2f} s = {res['wasted_s']:.2f} s "
                      f"(expected {res['expected']['wasted_s']:.2f} s); harness left out {res.get('harness_s', 0.0):.2f} s "
                      f"{res.get('harness_phases') or ''}", flush=True)
                print(f"     {'':10s}  resume {fmt(res.get('resume_s'), '.3f')} s (tier read {fmt(res.get('reader_s'), '.3f')} s); "
                      f"first step after it {fmt(res.get('first_step_s'), '.3f')} s vs steady {fmt(res.get('iter_s'), '.3f')} s",
                      flush=True)
        model_desc = f"d_model {args.d_model}, {args.layers} layers, {args.nproc} ranks"
        data = {
            "benchmark": "recovery",
            "device": device,
            "model_desc": model_desc,
            "machine": machine_info(),
            "config": {**{k: v for k, v in vars(args).items() if k not in ("keep", "no_doc")},
                       "peer_transport": os.environ.get("GEMINI_DCP_PEER_TRANSPORT") or "gloo",
                       "ucx_tls": os.environ.get("UCX_TLS")},
            "calibration": cal,
            "calibration_no_checkpoint": bare,
            "scenarios": results,
        }
        out = RESULTS / ("recovery.json" if args.tag == "cpu" else f"recovery-{args.tag}.json")
        write_json(out, data)
        img = IMG / ("recovery.png" if args.tag == "cpu" else f"recovery-{args.tag}.png")
        try:
            plot(data, img)
        except ImportError as exc:  # matplotlib missing (e.g. a bare GPU machine): JSON and table only
            print(f"no plot: {exc}", flush=True)
        md = table(data)
        print("\n" + md + "\n", flush=True)
        if not args.no_doc:
            header = (f"Measured {data['machine']['date']} on {device} ({model_desc}; checkpoint "
                      f"{cal.get('ckpt_bytes') or ''}iteration {t_iter:.2f} s, stock checkpoint {t_stock:.2f} s; "
                      f"load average {data['machine']['loadavg_1_5_15']}). JSON: `{out.relative_to(REPO)}`.\n\n"
                      f"![wasted time per failure]({img.relative_to(REPO / 'docs')})\n")
            update_doc(args.tag, header + "\n" + md)
        print(f"wrote {out.relative_to(REPO)}, {img.relative_to(REPO)}" + ("" if args.no_doc else f", {DOC.relative_to(REPO)}"))
        if args.keep:
            print(f"logs and checkpoints kept in {bench.disk}")
        return 0
    finally:
        bench.cleanup()


if __name__ == "__main__":
    sys.exit(main())
