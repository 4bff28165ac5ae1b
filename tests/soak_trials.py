"""The feature soak: random trials that combine every feature with every fault, and their oracle.

A *trial* (:class:`Trial`, drawn from a seed by :func:`draw`) is one small job of 2-4 real rank
processes (gloo on CPU) on 2-4 simulated nodes (each node its own tier root), forked from a
forkserver that has torch and gemini_dcp imported once (``fault_harness.context``). Each feature
is drawn with a probability and combined freely (:data:`FEATURES`): ``replicas`` 1/2/3 or a
parity group of 3/4 nodes, the placement, incremental saves (with or without ``full_every``),
``AsyncCheckpointer`` (``on_busy`` block/skip) or ``dcp.save``, ``fast_load`` or ``dcp.load``,
``nonfinite`` mark/refuse with NaN put into one rank's shard at one step, an in-process rollback
followed by re-saves (a new timeline), the peer transport (NIXL only where it imports), a
persistent store drained every step with the drain bridge on or off, the launch method
(``env://``, ``tcp://``, ``file://``, a ``Store``), a second job sharing the roots and failure
domains named by the nodes (spread placement). The fault
(:data:`FAULTS`): SIGKILL/SIGTERM/SIGSTOP at a named phase (:data:`gemini_dcp.core.faults.PHASES`
and the conditional ones), a node's memory wiped, a byte flipped in a slot, replica or parity
file, ENOSPC on a node's tier or on the store (a small tmpfs mounted there), or a stale process
holding the job's launch lock or its drain lock.

**The oracle** (:func:`judge`): the trainer's ranks journal every step whose save returned, its
health and its timeline; every element of every saved tensor is a function of (job, timeline,
step), so a restore is classified exactly: the newest step that is committed, healthy and on the
current timeline (or, where a fault may have destroyed it, an older one or a clean error), bit-exact;
never ``torn`` (values of no save), ``foreign`` (the other job's), ``abandoned`` (a timeline
rolled back from) or ``poisoned`` (a NaN step while a healthy one is restorable). Every error is
the package's own (or, for a rank whose peer died, one caused by that death), every process group
ends within its bound, and ``remove_job`` returns every root to empty once the job is gone.

Run by ``scripts/soak.sh``; results accumulate into one file (``benchmarks/results/soak.json``;
:func:`accumulate`). A failing trial is reproduced by its seed::

    PYTHONPATH=. python tests/soak_trials.py --seed-only SEED
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fault_harness as fh  # noqa: E402 - the forkserver, run_group and the drain helpers

from gemini_dcp.core.faults import CONDITIONAL_PHASES, PHASES  # noqa: E402

JOBS = ("soak", "other")  # the trial's job, and the second job sharing the roots
ROWS, COLS = 24, 8  # rows divide 2, 3 and 4 ranks
LAYOUTS_2N = ((0, 1), (0, 0, 1), (0, 0, 1, 1))
LAYOUTS_3N = ((0, 1, 2), (0, 0, 1, 2))
LAYOUTS_4N = ((0, 1, 2, 3),)


def nixl_available() -> bool:
    try:
        import importlib.util

        return importlib.util.find_spec("nixl") is not None
    except (ImportError, ValueError):
        return False


#: feature -> its values (drawn uniformly unless weighted in :func:`draw`)
FEATURES: dict[str, tuple[str, ...]] = {
    "redundancy": ("replicas1", "replicas2", "replicas3", "parity3", "parity4"),
    "placement": ("group", "ring", "mixed"),
    "incremental": ("off", "on", "full_every"),
    "saver": ("dcp.save", "async_block", "async_skip"),
    "loader": ("dcp.load", "fast_load"),
    "nonfinite": ("mark", "refuse"),
    "nan": ("no", "yes"),
    "rollback": ("no", "yes"),
    "transport": ("gloo", "nixl") if nixl_available() else ("gloo",),
    "persistent": ("off", "thread", "bridge", "no_bridge"),
    "launch": ("env", "tcp", "file", "store"),
    "two_jobs": ("no", "yes"),
    "domains": ("none", "set"),  # each simulated node names a failure domain (node index mod 2)
}

#: feature -> weights of its values where not uniform. A drain *process* imports torch afresh (~10 s
#: on a loaded 2-core host): drawn less often than a drain thread, still some hundreds of times in 10,000.
WEIGHTS: dict[str, tuple[float, ...]] = {"persistent": (6, 3, 0.6, 0.6)}
STORE_ON = ("thread", "bridge", "no_bridge")
#: the weights of a focused draw (:func:`draw`): drain processes were drawn some 500 times each before any
#: focus, and their trials cost ~3x a drain thread's (each node's process imports torch, again after a kill)
FOCUS_WEIGHTS: dict[str, tuple[float, ...]] = {"persistent": (6, 3, 0.2, 0.2)}

SIGNALS = ("SIGKILL", "SIGTERM", "SIGSTOP")
SAVE_PHASES = tuple(p for p in PHASES if p.split(".")[0] in ("save", "replicate", "commit", "health"))
LOAD_PHASES = tuple(p for p in PHASES if p.startswith("load.")) + ("rollback.marker",)
DRAIN_PHASES = tuple(p for p in PHASES if p.startswith("drain.")) + ("drain.bridge_upload",)
NIXL_PHASES = tuple(p for p in CONDITIONAL_PHASES if p.startswith("nixl."))
#: fault kind -> weight
FAULTS: dict[str, int] = {
    "none": 4, "signal": 40, "wipe": 10, "flip": 14, "enospc_tier": 6, "enospc_store": 6, "stale_lock": 6,
}
FLIP_TARGETS = ("slot", "replica", "parity")


@dataclasses.dataclass
class Trial:
    """One trial's parameters, all derived from ``seed`` by :func:`draw`."""

    seed: int
    layout: tuple[int, ...]
    features: dict[str, str]
    fault: dict[str, Any]
    steps: int = 4
    keep: int = 2
    nan_at: tuple[int, int] | None = None  # (rank, step): NaN put into that rank's shard at that step
    rollback_after: int | None = None  # after saving this step, restore the newest healthy older one
    timeout_s: float = 20.0
    focus: dict[str, int] | None = None  # the weights it was drawn under (:func:`focus_of`), if any

    @property
    def world(self) -> int:
        return len(self.layout)

    @property
    def nodes(self) -> int:
        return max(self.layout) + 1

    @property
    def replicas(self) -> int:
        r = self.features["redundancy"]
        return int(r[-1]) if r.startswith("replicas") else 1

    @property
    def parity(self) -> int | None:
        r = self.features["redundancy"]
        return int(r[-1]) if r.startswith("parity") else None

    def label(self) -> str:
        f = self.fault
        if f["kind"] == "signal":
            return f"signal {f['phase']}@{f['nth']}:{f['sig']}/{f['rank']}"
        return f["kind"] + "".join(f" {k}={v}" for k, v in sorted(f.items()) if k != "kind")


#: fired signals each (phase, signal) pair should reach in the results file; below it a soak focuses on it
FOCUS_TARGET = 100


def signal_pairs() -> tuple[str, ...]:
    """Every ``phase:SIGNAL`` a trial can draw (NIXL's phases only where NIXL is installed)."""
    phases = dict.fromkeys(SAVE_PHASES + LOAD_PHASES + DRAIN_PHASES + (NIXL_PHASES if nixl_available() else ()))
    return tuple(f"{p}:{s}" for p in phases for s in SIGNALS)


def focus_of(doc: dict[str, Any], target: int = FOCUS_TARGET) -> dict[str, int]:
    """The (phase, signal) pairs that fired fewer than ``target`` times in a results file, each weighted by the
    draws it still needs: what it lacks over the share of its draws that fired so far (a restore phase fires in
    about a third: a training fault may leave nothing to restore). A soak given this draws signals at them
    until each is reached (``{}``: none lacks)."""
    faults = doc.get("faults", {})
    out = {}
    for k in signal_pairs():
        fired, drawn = faults.get(f"fired:{k}", 0), faults.get(f"phase:{k}", 0)
        if fired < target:
            rate = fired / drawn if drawn >= 20 else 1.0
            out[k] = math.ceil((target - fired) / max(rate, 0.1))
    return out


def draw(seed: int, focus: dict[str, int] | None = None) -> Trial:
    """The trial of ``seed``: every feature drawn, then one fault fitted to them.

    ``focus`` (from :func:`focus_of`): nine trials in ten are then a signal, at a ``phase:SIGNAL`` drawn by
    these weights, with the features its phase needs to be reached, and drain processes are drawn less often
    (:data:`FOCUS_WEIGHTS`). The same seed and focus give the same
    trial; a failure's record keeps its focus so that ``--seed-only`` reproduces it."""
    rng = random.Random(seed)
    weights_of = WEIGHTS | FOCUS_WEIGHTS if focus else WEIGHTS
    f = {k: rng.choices(v, weights=weights_of.get(k))[0] for k, v in FEATURES.items()}
    red = f["redundancy"]
    if red in ("replicas3", "parity3"):
        layout = rng.choice(LAYOUTS_3N + LAYOUTS_4N)
    elif red == "parity4":
        layout = rng.choice(LAYOUTS_4N)
    else:
        layout = rng.choice(LAYOUTS_2N + LAYOUTS_3N + LAYOUTS_4N)
    world = len(layout)
    if f["placement"] == "group" and (max(layout) + 1) % max(1, int(red[-1]) if red.startswith("replicas") else 1):
        f["placement"] = rng.choice(("ring", "mixed"))  # group placement needs replicas | nodes (a ConfigError)
    steps = rng.randint(3, 5)
    keep = rng.choice((1, 2, 2))
    nan_at = (rng.randrange(world), rng.randint(2, steps)) if f["nan"] == "yes" else None
    rollback_after = rng.randint(2, steps) if f["rollback"] == "yes" else None
    weights = dict(FAULTS)
    if focus:
        weights["signal"] = 9 * sum(w for k, w in FAULTS.items() if k != "signal")
    kind = rng.choices(list(weights), weights=list(weights.values()))[0]
    fault: dict[str, Any] = {"kind": kind}
    nodes = max(layout) + 1
    if kind == "signal":
        sig = None
        if focus:
            phase, sig = rng.choices(list(focus), weights=list(focus.values()))[0].rsplit(":", 1)
            if phase.startswith("drain.") and f["persistent"] == "off":  # by the feature's weights (a drain
                f["persistent"] = rng.choices(STORE_ON, weights=weights_of["persistent"][1:])[0]  # process costs ~3 CPU-s)
            if phase.startswith("nixl."):
                f["transport"] = "nixl"
            if phase.startswith("replicate.") and red in ("replicas1", "parity3", "parity4"):
                f["redundancy"] = red = "replicas2"  # copies to send (parity has no replicate step)
                if f["placement"] == "group" and nodes % 2:
                    f["placement"] = rng.choice(("ring", "mixed"))
            if phase == "rollback.marker" and rollback_after is None:
                f["rollback"] = "yes"
                rollback_after = rng.randint(2, steps)
        else:
            pools = [SAVE_PHASES, LOAD_PHASES]
            if f["persistent"] != "off":
                pools.append(DRAIN_PHASES)
            if f["transport"] == "nixl":
                pools.append(NIXL_PHASES)
            phase = rng.choice(rng.choice(pools))
        if phase == "drain.bridge_upload":
            f["persistent"] = "bridge"  # reached only by a bridge (a drain process still importing torch)
        rank = rng.randrange(world)
        if phase.startswith("commit."):  # only a node leader (its lowest rank) writes a record
            rank = min(r for r, n in enumerate(layout) if n == layout[rank])
        # a restore reaches a load phase once per rank: only its first reach can fire
        nth = 1 if phase in LOAD_PHASES else rng.randint(1, 2)
        if sig is None:
            sig = rng.choices(SIGNALS, weights=(60, 20, 20))[0]
        fault.update(phase=phase, nth=nth, sig=sig, rank=rank)
    elif kind in ("wipe", "enospc_tier"):
        fault["node"] = rng.randrange(nodes)
        if kind == "enospc_tier":
            fault["kib"] = rng.choice((24, 48, 96, 192))
    elif kind == "flip":
        fault.update(node=rng.randrange(nodes), target=rng.choice(FLIP_TARGETS), offset=rng.randrange(256),
                     bit=rng.randrange(8))
    elif kind == "enospc_store":
        fault["kib"] = rng.choice((8, 24, 48))
        if f["persistent"] == "off":
            f["persistent"] = rng.choice(STORE_ON)
    elif kind == "stale_lock":
        fault.update(lock=rng.choice(("launch", "drain")), node=rng.randrange(nodes))
        if fault["lock"] == "drain" and f["persistent"] == "off":
            f["persistent"] = rng.choice(STORE_ON)
    timeout = 6.0 if fault.get("sig") == "SIGSTOP" else 20.0
    return Trial(seed=seed, layout=layout, features=f, fault=fault, steps=steps, keep=keep, nan_at=nan_at,
                 rollback_after=rollback_after, timeout_s=timeout, focus=dict(focus) if focus else None)


# ---- the values: every element a function of (job, timeline, step) --------------------------------
def local_values(job: int, tl: int, step: int, rank: int, world: int, nan: bool = False) -> dict[str, Any]:
    """This rank's shards of step ``step`` on timeline ``tl`` of job ``job`` (plain tensors)."""
    import torch

    rows = ROWS // world
    lo = rank * rows
    idx = torch.arange(lo * COLS, (lo + rows) * COLS, dtype=torch.float32).reshape(rows, COLS)
    w = idx + 512.0 * (step + 64 * (tl + 4 * job))  # exact in fp32
    if nan:
        w[0, 0] = float("nan")
    r = torch.arange(lo, lo + rows, dtype=torch.float64).unsqueeze(1).expand(rows, COLS).clone()
    e = r + 1000.0 * job
    touched = step % ROWS
    if lo <= touched < lo + rows:  # a row delta: one row changes per step
        e[touched - lo] += step + 100.0 * tl
    h = ((idx % 8) * 0.125 + job).to(torch.bfloat16)  # frozen: carried by incremental saves
    return {"w": w, "e": e, "h": h}


def same(a: Any, b: Any) -> bool:
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())
    return bool(torch.equal(a, b))


def _state(mesh: Any, job: int, tl: int, step: int, rank: int, world: int, nan: bool) -> dict[str, Any]:
    import torch
    from torch.distributed.tensor import DTensor, Shard

    v = local_values(job, tl, step, rank, world, nan)
    sd = {k: DTensor.from_local(t, mesh, [Shard(0)], run_check=False) for k, t in v.items()}
    return {"model": sd, "extra": {"i": torch.arange(6, dtype=torch.int64) + step * 1000 + tl * 100 + job * 10},
            "meta": {"job": job, "tl": tl, "step": step}}


def _update(sd: dict[str, Any], job: int, tl: int, step: int, rank: int, world: int, nan: bool) -> None:
    """Training: the state dict's tensors take step ``step``'s values in place."""
    v = local_values(job, tl, step, rank, world, nan)
    for k, t in v.items():
        sd["model"][k].to_local().copy_(t)
    sd["extra"]["i"].copy_(sd["extra"]["i"].new_tensor(range(6)) + step * 1000 + tl * 100 + job * 10)
    sd["meta"] = {"job": job, "tl": tl, "step": step}


def _blank(mesh: Any, rank: int, world: int) -> dict[str, Any]:
    sd = _state(mesh, 0, 0, 0, rank, world, False)
    for t in sd["model"].values():
        t.to_local().fill_(-7)
    sd["extra"]["i"].fill_(-7)
    sd["meta"] = {"job": -1, "tl": -1, "step": -1}
    return sd


def _consistent(sd: dict[str, Any], rank: int, world: int, nan_at: tuple[int, int, int] | None) -> list[str]:
    """Keys of a restored state that differ from the save its ``meta`` names (a torn restore)."""
    m = sd["meta"]
    if not isinstance(m, dict) or m.get("step", -1) < 0:
        return ["meta"]
    nan = nan_at is not None and m["job"] == 0 and (nan_at[0], nan_at[1], nan_at[2]) == (rank, m["step"], m["tl"])
    want = local_values(m["job"], m["tl"], m["step"], rank, world, nan)
    bad = [k for k, t in want.items() if not same(sd["model"][k].to_local(), t)]
    exp_i = sd["extra"]["i"].new_tensor(range(6)) + m["step"] * 1000 + m["tl"] * 100 + m["job"] * 10
    if not same(sd["extra"]["i"], exp_i):
        bad.append("extra.i")
    return bad


# ---- one rank process -----------------------------------------------------------------------------
def _init_group(spec: dict[str, Any]) -> Any:
    import datetime

    import torch.distributed as dist

    rank, world = spec["rank"], spec["world"]
    timeout = datetime.timedelta(seconds=spec["pg_timeout"])
    how = spec["launch"]
    if how == "tcp":
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec['port']}", rank=rank, world_size=world,
                                timeout=timeout)
    elif how == "file":
        dist.init_process_group("gloo", init_method=f"file://{spec['out']}/rdzv-{spec['mode']}-{spec['port']}",
                                rank=rank, world_size=world, timeout=timeout)
    elif how == "store":
        store = dist.TCPStore("127.0.0.1", spec["port"], world, is_master=rank == 0, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


def _journal(out: Path, rank: int, **event: Any) -> None:
    with open(out / f"journal-{rank}.jsonl", "a") as f:
        f.write(json.dumps(event) + "\n")


def _error_of(exc: BaseException) -> dict[str, Any]:
    from gemini_dcp import find_gemini_error

    err = find_gemini_error(exc)
    return {"error": type(err if err is not None else exc).__name__, "gemini": err is not None,
            "message": str(err if err is not None else exc)[-600:]}


def _writer(spec: dict[str, Any], job: str, *, main: bool) -> Any:
    from gemini_dcp import GeminiStorageWriter

    f = spec["features"]
    if not main:
        return GeminiStorageWriter(root=spec["root"], job_id=job, keep=2, timeout_s=spec["timeout_s"])
    return GeminiStorageWriter(
        root=spec["root"], job_id=job, keep=spec["keep"], replicas=spec["replicas"], parity_group=spec["parity"],
        placement=f["placement"], timeout_s=spec["timeout_s"], persistent=spec.get("store"), persist_every=1,
        incremental=f["incremental"] != "off", full_every=2 if f["incremental"] == "full_every" else None,
        nonfinite=f["nonfinite"], peer_transport=None if f["transport"] == "gloo" else "nixl",
        failure_domain=f"dom{spec['node'] % 2}" if f.get("domains") == "set" else None,
    )


def _reader(spec: dict[str, Any], job: str, persistent: str | None = None) -> Any:
    from gemini_dcp import GeminiStorageReader

    return GeminiStorageReader(root=spec["root"], job_id=job, timeout_s=spec["timeout_s"], persistent=persistent)


def _restore(spec: dict[str, Any], mesh: Any, job: str, step: int | None, persistent: str | None) -> dict[str, Any]:
    """Restore ``job`` (newest, or ``step``) into a blank state; what came back and whether it is whole."""
    import torch.distributed.checkpoint as dcp

    from gemini_dcp import fast_load

    rank, world = spec["rank"], spec["world"]
    sd = _blank(mesh, rank, world)
    reader = _reader(spec, job, persistent)
    res: dict[str, Any] = {"job": job}
    try:
        if spec["features"]["loader"] == "fast_load":
            got = fast_load(sd, storage_reader=reader, step=step, timeout_s=spec["timeout_s"])
            res["step"] = got.step
            res["from"] = {k: v for k, v in got.restored_from.items() if v}
            res["path"] = got.path
        else:
            dcp.load(sd, storage_reader=reader, checkpoint_id=step)
            res["step"] = reader.restored_step
            res["from"] = {k: v for k, v in dict(reader.restored_from).items() if v}
    except BaseException as exc:  # noqa: BLE001 - classified by the parent (DCP's CheckpointException is one)
        res.update(_error_of(exc))
        res["touched"] = [k for k, t in sd["model"].items() if not bool((t.to_local() == -7).all())]
        return res
    res["meta"] = sd["meta"]
    res["bad"] = _consistent(sd, rank, world, spec.get("nan"))
    res["skipped_unhealthy"] = list(getattr(reader, "skipped_unhealthy", []) or [])
    return res


def rank_main(spec: dict[str, Any]) -> None:
    """One rank process (forked from the forkserver): ``train`` or ``restore``, results in files."""
    rank, out = spec["rank"], Path(spec["out"])
    log_fd = os.open(out / f"{spec['mode']}-{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    import faulthandler

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # run_group asks a rank past its bound where it waits
    os.environ.update({
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(spec["port"]), "RANK": str(rank),
        "WORLD_SIZE": str(spec["world"]), "LOCAL_RANK": str(rank), "OMP_NUM_THREADS": "1",
        "GEMINI_DCP_DRAIN_IDLE_S": "1", "GEMINI_DCP_DRAIN_PEER_TIMEOUT_S": "3", "GEMINI_DCP_DRAIN_ATTEMPTS": "2",
        "GEMINI_DCP_DRAIN_BRIDGE": "0" if spec["features"]["persistent"] == "no_bridge" else "1",
        "GEMINI_DCP_DRAIN_MODE": "thread" if spec["features"]["persistent"] == "thread" else "process",
        "GEMINI_DCP_NODE_ID": f"node{spec['node']}",
    })
    for k in (fh.ENV_FAULT, fh.ENV_FAULT_LOG):
        os.environ.pop(k, None)
    if spec.get("fault"):
        os.environ[fh.ENV_FAULT] = spec["fault"]
    if spec.get("fault_log"):
        os.environ[fh.ENV_FAULT_LOG] = spec["fault_log"]
    result: dict[str, Any] = {"rank": rank}
    code = 0
    prof = None
    if os.environ.get("GEMINI_SOAK_PROFILE"):  # CPU profile of each rank (a slow trial's cost, by function)
        import cProfile

        prof = cProfile.Profile(time.process_time)
        prof.enable()
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        t0 = time.monotonic()
        mesh = _init_group(spec)
        result["init_s"] = round(time.monotonic() - t0, 3)
        try:
            if spec["mode"] == "train":
                _train(spec, mesh, out, result)
            else:
                result["restores"] = [_restore(spec, mesh, j, None, spec.get("store")) for j in spec["jobs"]]
        finally:
            result["work_s"] = round(time.monotonic() - t0 - result["init_s"], 3)
            dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        code = 3
        result.update(_error_of(exc))
        result["traceback"] = traceback.format_exc()[-1500:]
    if prof is not None:
        prof.disable()
        prof.dump_stats(os.path.join(os.environ["GEMINI_SOAK_PROFILE"], f"{spec['mode']}-{rank}-{os.getpid()}.prof"))
    result["cpu_s"] = round(time.process_time(), 3)
    final = out / f"result-{spec['mode']}-{rank}.json"
    tmp = final.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, default=str))
    os.replace(tmp, final)
    sys.stdout.flush()
    sys.exit(code)


def _train(spec: dict[str, Any], mesh: Any, out: Path, result: dict[str, Any]) -> None:
    """Save steps 1..K (NaN at one, a rollback after one, a second job beside), journaling each
    step whose save returned. A package error ends training (journaled); any other error too."""
    import torch.distributed.checkpoint as dcp

    from gemini_dcp import AsyncCheckpointer

    rank, world, f = spec["rank"], spec["world"], spec["features"]
    job = JOBS[0]
    nan_at = spec.get("nan_at")
    tl = 0
    sd = _state(mesh, 0, tl, 1, rank, world, False)
    other = _state(mesh, 1, 0, 1, rank, world, False) if f["two_jobs"] == "yes" else None
    ck = None
    if f["saver"] != "dcp.save":
        ck = AsyncCheckpointer(_writer(spec, job, main=True), interleave=False,
                               on_busy="skip" if f["saver"] == "async_skip" else "block", timeout_s=spec["timeout_s"])
    pending: list[tuple[Any, int, int, bool]] = []

    def settle(wait: bool) -> None:
        for h, s, t, nan in list(pending):
            if wait and not h.done():
                try:
                    h.wait(spec["timeout_s"] * 3)
                except BaseException as exc:  # noqa: BLE001 - the handle keeps it: classified below
                    if h.error is None:
                        raise
                    del exc
            if h.done():
                pending.remove((h, s, t, nan))
                if h.skipped:
                    _journal(out, rank, e="skipped", step=s, tl=t)
                elif h.error is None:
                    _journal(out, rank, e="saved", job=0, step=s, tl=t, nan=nan)
                elif "non-finite" in str(h.error):
                    _journal(out, rank, e="refused", step=s, tl=t)
                else:
                    _journal(out, rank, e="failed", step=s, tl=t, **_error_of(h.error))
                    raise h.error

    step, done_saves, rolled, other_step = 1, 0, False, 0
    try:
        while done_saves < spec["steps"] + (2 if spec.get("rollback_after") else 0):
            nan = nan_at is not None and tuple(nan_at) == (rank, step) and tl == 0
            if ck is not None:
                settle(False)
            _update(sd, 0, tl, step, rank, world, nan)
            _journal(out, rank, e="begin", job=0, step=step, tl=tl)
            try:
                if ck is None:
                    dcp.save(sd, storage_writer=_writer(spec, job, main=True), checkpoint_id=step)
                    _journal(out, rank, e="saved", job=0, step=step, tl=tl, nan=nan)
                else:
                    h = ck.save(sd, step)
                    pending.append((h, step, tl, nan))
                    h.wait_copied(spec["timeout_s"] * 3)  # the documented contract without a guard: copied before mutating
            except BaseException as exc:  # noqa: BLE001
                err = _error_of(exc)
                if err["error"] in ("UnhealthyStateError", "AsyncCheckpointError") and "non-finite" in err["message"]:
                    _journal(out, rank, e="refused", step=step, tl=tl)
                else:
                    raise
            if other is not None:
                # the second job's dcp.save runs while the async save's background commit may still run:
                # the checkpointer's writer has a control-group scope of its own (transport.comm.get_comm)
                other_step += 1  # the second job never rolls back: its own step count
                _update(other, 1, 0, other_step, rank, world, False)
                _journal(out, rank, e="begin", job=1, step=other_step, tl=0)
                dcp.save(other, storage_writer=_writer(spec, JOBS[1], main=False), checkpoint_id=other_step)
                _journal(out, rank, e="saved", job=1, step=other_step, tl=0, nan=False)
            done_saves += 1
            if spec.get("rollback_after") == step and not rolled:
                rolled = True
                if ck is not None:
                    settle(True)
                back = _agreed_target(out, rank, step, nan_at, spec["keep"])
                if back is not None:
                    _journal(out, rank, e="rolling", to=back, tl=tl + 1)
                    got = _restore(spec, mesh, job, back, None)
                    if "error" in got:
                        raise RuntimeError(f"rollback to {back} failed: {got}")
                    tl += 1
                    _journal(out, rank, e="rolled", to=back, tl=tl, ok=not got["bad"] and got["meta"]["step"] == back,
                             got=got)
                    step = back
            step += 1
        if ck is not None:
            settle(True)
    finally:
        if ck is not None:
            try:
                ck.close()
            except BaseException as exc:  # noqa: BLE001
                result["close_error"] = _error_of(exc)


def _agreed_target(out: Path, rank: int, below: int, nan_at: Any, keep: int) -> int | None:
    """The rollback target: the newest step < ``below`` every rank journaled saved, not the NaN step,
    and still kept (``keep`` newest; an older one may be evicted by design), agreed with an all-reduce
    as a training loop would agree on its loss. None: no such step, no rollback."""
    import torch
    import torch.distributed as dist

    best = 0
    for ev in read_journal(out, rank):
        if (ev.get("e") == "saved" and ev.get("job") == 0 and below - keep < ev["step"] < below and ev["tl"] == 0
                and not (nan_at is not None and ev["step"] == nan_at[1])):
            best = max(best, ev["step"])
    t = torch.tensor([best], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item()) or None


def read_journal(out: Path, rank: int) -> list[dict[str, Any]]:
    p = out / f"journal-{rank}.jsonl"
    if not p.exists():
        return []
    evs = []
    for line in p.read_text().splitlines():
        try:
            evs.append(json.loads(line))
        except ValueError:
            pass  # a line cut by a kill
    return evs


def stale_main(spec: dict[str, Any]) -> None:
    """A stale process of an earlier launch: holds the job's launch lock on one node (a writer built
    in a 1-rank group), says so, and stops itself (a hung straggler of a dead job)."""
    out = Path(spec["out"])
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(spec["port"]), "RANK": "0",
                       "WORLD_SIZE": "1", "LOCAL_RANK": "0", "GEMINI_DCP_NODE_ID": f"node{spec['node']}"})
    for k in (fh.ENV_FAULT, fh.ENV_FAULT_LOG):
        os.environ.pop(k, None)
    _die_with_parent()
    try:
        import torch.distributed as dist

        from gemini_dcp import GeminiStorageWriter

        dist.init_process_group("gloo", rank=0, world_size=1)
        w = GeminiStorageWriter(root=spec["root"], job_id=JOBS[0], keep=1, timeout_s=5.0)
        (out / "stale-ready").write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)
        del w
    except BaseException as exc:  # noqa: BLE001
        (out / "stale-ready").write_text(f"error {exc!r}")
    sys.exit(0)


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the soak driver dies (a killed soak leaves no stale holder)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _hold_drain_lock(persist_dir: Path) -> int:
    """A stale drain server: a child that holds ``daemon.lock`` of the job's persist dir, stopped."""
    import fcntl

    for d in (persist_dir.parent, persist_dir):
        d.mkdir(mode=0o700, exist_ok=True)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: lock, tell the parent, stop
        try:
            _die_with_parent()
            os.close(r)
            fd = os.open(persist_dir / "daemon.lock", os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.write(w, b"1")
            os.kill(os.getpid(), signal.SIGSTOP)
        finally:
            os._exit(0)
    os.close(w)
    os.read(r, 1)
    os.close(r)
    return pid


# ---- the parent ----------------------------------------------------------------------------------
_CTX: Any = None


def context() -> Any:
    """fault_harness's forkserver, with this module preloaded as well."""
    global _CTX
    if _CTX is None:
        import multiprocessing as mp

        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload([
            "torch", "torch._dynamo", "torch.distributed.checkpoint", "torch.distributed.tensor", "gemini_dcp",
            "gemini_dcp.dcp.writer", "gemini_dcp.dcp.reader", "gemini_dcp.peer.push", "gemini_dcp.peer.fetch",
            "gemini_dcp.snapshot.checkpointer", "gemini_dcp.dcp.fast_load", "gemini_dcp.persistent.store",
            "gemini_dcp.persistent.adopt", "gemini_dcp.persistent.drain.client", "fault_harness", "soak_trials",
            "soak_forkserver",  # last: gc.freeze of everything above
        ])
        _CTX = ctx
        fh._CTX = ctx  # fh.run_group forks from it
    return _CTX


def _mount_tmpfs(path: Path, kib: int) -> bool:
    """A tmpfs of ``kib`` KiB at ``path`` (ENOSPC on demand); False where mounting is not allowed."""
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k,mode=0700", "tmpfs", str(path)],
                           capture_output=True, timeout=20)
        return r.returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _umount(path: Path) -> None:
    try:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        pass


def _clear(root: Path) -> None:
    """A node's memory lost: everything under its root gone (the root itself may be a mount point)."""
    for child in root.iterdir() if root.exists() else []:
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)


def _flip(root: Path, layout: tuple[int, ...], node: int, target: str, offset: int, bit: int) -> str | None:
    """Flip one bit in the newest slot (own rank), replica (another node's rank) or parity file of
    ``node``; falls back to whichever kind exists. Returns what was flipped."""
    own = {r for r, n in enumerate(layout) if n == node}
    files: dict[str, list[Path]] = {"slot": [], "replica": [], "parity": []}
    for p in (root / JOBS[0] / "ranks").glob("rank-*/*.bin"):
        r = int(p.parent.name.split("-")[1])
        kind = "parity" if p.name.startswith("parity-") else ("slot" if r in own else "replica")
        if p.name.startswith(("slot-", "parity-")):
            files[kind].append(p)
    pool = files[target] or files["slot"] or files["replica"] or files["parity"]
    if not pool:
        return None
    victim = max(pool, key=lambda p: p.stat().st_mtime_ns)
    size = victim.stat().st_size
    if size == 0:
        return None
    off = offset % min(size, 2048)
    with open(victim, "r+b") as fobj:
        fobj.seek(off)
        b = fobj.read(1)
        fobj.seek(off)
        fobj.write(bytes([b[0] ^ (1 << bit)]))
    return f"{victim.relative_to(root)}@{off}"


def _specs(t: Trial, mode: str, roots: list[Path], out: Path, *, fault: str | None, fault_log: str | None,
           store: str | None, jobs: tuple[str, ...] = JOBS[:1]) -> list[dict[str, Any]]:
    nan = (t.nan_at[0], t.nan_at[1], 0) if t.nan_at is not None else None
    return [{
        "rank": r, "world": t.world, "node": t.layout[r], "root": str(roots[t.layout[r]]), "out": str(out),
        "mode": mode, "steps": t.steps, "keep": t.keep, "replicas": t.replicas, "parity": t.parity,
        "features": t.features, "timeout_s": t.timeout_s, "pg_timeout": t.timeout_s, "fault": fault,
        "fault_log": fault_log, "store": store, "launch": t.features["launch"], "nan_at": t.nan_at, "nan": nan,
        "rollback_after": t.rollback_after, "jobs": list(jobs),
    } for r in range(t.world)]


def _run(t: Trial, specs: list[dict[str, Any]], *, kill_on_death: bool) -> fh.GroupRun:
    context()
    # every wait of the package ends within a few timeout_s; the slack is for a nice-19 soak starved
    # of CPU beside other work (a bound overrun is reported as a hang, and the trial is rerun)
    bound = t.timeout_s * 6 + 60
    return fh.run_group(specs, bound, kill_on_death=kill_on_death, target=rank_main)


def _stacks(out: Path, mode: str, run: fh.GroupRun, obs: dict[str, Any]) -> None:
    """The stacks the ranks of a group past its bound logged (SIGUSR1, faulthandler): where a hang waited."""
    if not run.timed_out:
        return
    for r in run.killed_by_parent:
        try:
            text = (out / f"{mode}-{r}.log").read_text(errors="replace")
        except OSError:
            continue
        marks = [i for i in (text.find("Thread 0x"), text.find("Current thread 0x")) if i >= 0]
        obs.setdefault("stacks", {})[f"{mode}-{r}"] = text[min(marks) if marks else 0:][-6000:]


def _results(out: Path, mode: str, world: int) -> list[dict[str, Any] | None]:
    return fh._results(out, mode, world)


def run_trial(t: Trial, base: str | None = None) -> dict[str, Any]:
    """Run trial ``t``; its record (features, fault, what happened, the verdict of :func:`judge`)."""
    context()
    t0 = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="gemini-soak-", dir=base or fh._tmp_base()))
    mounts: list[Path] = []
    stale: list[int] = []
    rec: dict[str, Any] = {"seed": t.seed, "fault": t.label(), "fault_kind": t.fault["kind"], "features": t.features,
                           "layout": list(t.layout), "steps": t.steps, "keep": t.keep, "nan_at": t.nan_at,
                           "rollback_after": t.rollback_after}
    if t.focus:
        rec["focus"] = t.focus
    obs: dict[str, Any] = {"hangs": []}
    try:
        roots = [tmp / f"node{n}" for n in range(t.nodes)]
        for r in roots:
            r.mkdir(mode=0o700)
        out, logs = tmp / "out", tmp / "log"
        out.mkdir()
        logs.mkdir()
        fk = t.fault
        store_dir = tmp / "store"
        store = f"file://{store_dir}" if t.features["persistent"] != "off" else None
        if store:
            store_dir.mkdir(mode=0o700)
        if fk["kind"] == "enospc_tier":
            obs["mounted"] = _mount_tmpfs(roots[fk["node"]], fk["kib"])
            if obs["mounted"]:
                mounts.append(roots[fk["node"]])
        if fk["kind"] == "enospc_store":
            obs["mounted"] = _mount_tmpfs(store_dir, fk["kib"])
            if obs["mounted"]:
                mounts.append(store_dir)
        if fk["kind"] == "stale_lock":
            if fk["lock"] == "drain":
                stale.append(_hold_drain_lock(roots[fk["node"]] / JOBS[0] / "persist"))
            else:
                ctx = context()
                p = ctx.Process(target=stale_main, args=({"out": str(out), "root": str(roots[fk["node"]]),
                                                          "node": fk["node"], "port": fh.free_port()},))
                p.start()
                deadline = time.monotonic() + 60
                while not (out / "stale-ready").exists() and time.monotonic() < deadline and p.exitcode is None:
                    time.sleep(0.02)
                stale.append(p.pid)
                obs["stale"] = (out / "stale-ready").read_text() if (out / "stale-ready").exists() else "never ready"
        sig_fault = None
        load_fault = None
        if fk["kind"] == "signal":
            spec = f"{fk['phase']}@{fk['nth']}:{fk['sig']}/{fk['rank']}"
            if fk["phase"] in LOAD_PHASES and t.rollback_after is None:
                load_fault = spec
            else:
                sig_fault = spec
        stop = fk.get("sig") == "SIGSTOP"
        train = _run(t, _specs(t, "train", roots, out, fault=sig_fault, fault_log=str(logs), store=store,
                               jobs=JOBS), kill_on_death=not stop)
        obs["train"] = {"codes": train.codes, "timed_out": train.timed_out, "killed": train.killed_by_parent,
                        "seconds": round(train.seconds, 2)}
        obs["train_results"] = _results(out, "train", t.world)
        _stacks(out, "train", train, obs)
        obs["journal"] = [read_journal(out, r) for r in range(t.world)]
        if train.timed_out:
            obs["hangs"].append(f"the training group outlived its bound (codes {train.codes})")
        if stop and train.killed_by_parent:
            obs["hangs"].append(f"ranks {train.killed_by_parent} still waited after a peer stopped")
        # a drain process idles out 1 s after its last step, once it has imported torch (tens of
        # seconds at nice 19 on a loaded 2-core host): 90 s is a hang, not a slow start
        # a stale holder of daemon.lock: the node's new drain server stands by for it, by design for up to
        # gemini_dcp.persistent.drain.lock.STANDBY_S (600 s; a previous server may still be uploading)
        stale_drain = fk["kind"] == "stale_lock" and fk["lock"] == "drain"
        left = fh._wait_drains([str(r) for r in roots], 5.0 if stale_drain else 90.0 if store else 2.0)
        if left and stale_drain:
            obs["standby_drains"] = len(left)
        elif left and not (stop and fk["phase"].startswith("drain.")):
            obs["hangs"].append(f"drain processes {left} alive 90 s after the job")
        for pid in stale:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        obs["fired"] = fh._fired(logs, fk.get("phase"))
        if fk["kind"] == "wipe":
            _clear(roots[fk["node"]])
        if fk["kind"] == "flip":
            obs["flipped"] = _flip(roots[fk["node"]], t.layout, fk["node"], fk["target"], fk["offset"], fk["bit"])
        jobs = JOBS if t.features["two_jobs"] == "yes" else JOBS[:1]
        if load_fault is not None:
            run = _run(t, _specs(t, "restore", roots, out, fault=load_fault, fault_log=str(logs), store=None, jobs=jobs),
                       kill_on_death=not stop)
            obs["fired"] = fh._fired(logs, fk.get("phase"))
            _results(out, "restore", t.world)
            if run.timed_out or (stop and run.killed_by_parent):
                obs["hangs"].append(f"the faulted restore outlived its bound (codes {run.codes})")
        run = _run(t, _specs(t, "restore", roots, out, fault=None, fault_log=None, store=None, jobs=jobs),
                   kill_on_death=True)
        obs["restore"] = {"codes": run.codes, "timed_out": run.timed_out, "seconds": round(run.seconds, 2)}
        obs["restore_results"] = _results(out, "restore", t.world)
        _stacks(out, "restore", run, obs)
        if run.timed_out:
            obs["hangs"].append(f"the restore outlived its bound (codes {run.codes})")
        if store:
            for r in roots:
                _clear(r)
            run = _run(t, _specs(t, "restore", roots, out, fault=None, fault_log=None, store=store), kill_on_death=True)
            obs["store_restore"] = {"codes": run.codes, "timed_out": run.timed_out}
            obs["store_results"] = _results(out, "restore", t.world)
            _stacks(out, "restore", run, obs)
            if run.timed_out:
                obs["hangs"].append(f"the restore from the store outlived its bound (codes {run.codes})")
            # the store restore can start a drain process too (it imports torch afresh: tens of seconds
            # on a loaded host, as after training)
            left = fh._wait_drains([str(r) for r in roots], 90.0)
            if left:
                obs["hangs"].append(f"drain processes {left} alive 90 s after the store restore")
        obs["gc"] = _gc(roots, jobs)
    except Exception as exc:  # noqa: BLE001 - a harness error is recorded, not hidden
        obs["harness_error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-1200:]}"
    finally:
        for pid in stale:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for m in mounts:
            _umount(m)
        if os.environ.get("GEMINI_FAULT_KEEP") and not obs.get("pass"):
            rec["kept_dir"] = str(tmp)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    rec["seconds"] = round(time.monotonic() - t0, 3)
    rec["groups_s"] = {k: obs[k]["seconds"] for k in ("train", "restore") if k in obs}
    rec["ranks_s"] = {k: [(x or {}).get(f) for x in obs.get(f"{k}_results") or [] for f in ("init_s", "work_s", "cpu_s")]
                      for k in ("train", "restore")}
    if obs.get("stacks"):
        rec["stacks"] = obs["stacks"]
    rec["events"] = events(obs)
    rec.update(judge(t, obs))
    return rec


def events(obs: dict[str, Any]) -> dict[str, int]:
    """What really happened in a trial (so the file shows each feature was exercised, not only drawn):
    journal events of rank 0 (saved, refused, skipped, rolled...), train errors by name, and the
    parent's own actions (a bit flipped, a tmpfs mounted, a restore that came from a peer or parity)."""
    out: dict[str, int] = {}
    for ev in (obs.get("journal") or [[]])[0]:
        out[ev.get("e", "?")] = out.get(ev.get("e", "?"), 0) + 1
    for res in obs.get("train_results") or []:
        if res and "error" in res:
            key = f"train_error:{res['error']}"
            out[key] = out.get(key, 0) + 1
    if obs.get("flipped"):
        out["flipped"] = 1
    if obs.get("mounted"):
        out["tmpfs"] = 1
    if obs.get("standby_drains"):
        out["standby_drain"] = 1
    for key in ("restore_results", "store_results"):
        for res in obs.get(key) or []:
            for r in (res or {}).get("restores", []):
                if r and "error" in r:
                    k = f"{key.split('_')[0]}_error:{r['error']}"
                    out[k] = out.get(k, 0) + 1
                for tier in (r or {}).get("from", {}):
                    out[f"restored_from:{tier}"] = 1
                if (r or {}).get("path"):
                    out[f"fast_load:{r['path']}"] = 1
    return out


def _gc(roots: list[Path], jobs: tuple[str, ...]) -> list[str]:
    """Remove every job from every root (``gemini-dcp gc --remove-job``); what was left behind."""
    from gemini_dcp.ops.housekeeping import remove_job

    left = []
    # "once the job is gone": a drain process that idled out may still be closing its files
    fh.wait_exits([str(r) for r in roots])
    for root in roots:
        for job in jobs:
            if (root / job).exists():
                try:
                    remove_job(str(root), job, exclude_pids=[os.getpid()])
                except Exception as exc:  # noqa: BLE001
                    left.append(f"{root.name}/{job}: remove_job raised {type(exc).__name__}: {exc}")
        rest = sorted(p.name for p in root.iterdir()) if root.exists() else []
        if rest:
            left.append(f"{root.name}: left {rest}")
    return left


# ---- the oracle ----------------------------------------------------------------------------------
@dataclasses.dataclass
class History:
    """What the trainer recorded: per job, per (timeline, step), the ranks whose save returned."""

    world: int
    saved: dict[tuple[int, int, int], set[int]]  # (job, tl, step) -> ranks
    begun: set[tuple[int, int, int]]  # (job, tl, step) some rank began to save (it may have committed)
    refused: set[tuple[int, int]]  # (tl, step) refused as unhealthy
    rolled_to: int | None  # the rollback's target, once every rank restored it
    rolling: bool  # some rank began a rollback
    rollback_bad: list[str]

    def committed(self, job: int, tl: int) -> list[int]:
        return sorted(s for (j, t, s), r in self.saved.items() if j == job and t == tl and len(r) == self.world)

    def attempted(self, job: int, tl: int, step: int) -> bool:
        return (job, tl, step) in self.saved or (job, tl, step) in self.begun


def history(t: Trial, journals: list[list[dict[str, Any]]]) -> History:
    saved: dict[tuple[int, int, int], set[int]] = {}
    begun: set[tuple[int, int, int]] = set()
    refused: set[tuple[int, int]] = set()
    rolled: list[int | None] = []
    rolling, bad = False, []
    for rank, evs in enumerate(journals):
        to = None
        for ev in evs:
            e = ev.get("e")
            if e == "saved":
                saved.setdefault((ev["job"], ev["tl"], ev["step"]), set()).add(rank)
            elif e == "begin":
                begun.add((ev["job"], ev["tl"], ev["step"]))
            elif e == "refused":
                refused.add((ev["tl"], ev["step"]))
            elif e == "rolling":
                rolling = True
            elif e == "rolled":
                to = ev["to"]
                if not ev.get("ok"):
                    bad.append(f"rank {rank}: the rollback to step {ev['to']} restored {ev.get('got')}")
        rolled.append(to)
    everyone = rolled[0] if rolled and all(r == rolled[0] for r in rolled) else None
    return History(t.world, saved, begun, refused, everyone, rolling, bad)


KNOWN_50 = "issue 50"


def judge(t: Trial, obs: dict[str, Any]) -> dict[str, Any]:
    """The verdict of one trial: ``outcome`` pass / fail / hang / harness-error, ``detail``, and
    ``known`` (an open issue that explains a failure) where one does."""
    if "harness_error" in obs:
        return {"outcome": "harness-error", "detail": obs["harness_error"]}
    fk = t.fault
    fired = bool(obs.get("fired"))
    out: dict[str, Any] = {"fired": fired if fk["kind"] == "signal" else None}
    if obs["hangs"]:
        return {**out, "outcome": "hang", "detail": "; ".join(obs["hangs"])}
    h = history(t, obs.get("journal", []))
    problems: list[str] = []
    problems += h.rollback_bad
    # training's errors: each explained by the fault (or by a peer's death), and the package's own
    train = obs.get("train") or {}
    keep1_full = t.keep == 1 and t.nan_at is not None and t.features["nonfinite"] == "mark" and any(
        "TierFullError" in f"{(x or {}).get('error')} {(x or {}).get('message', '')}" and "healthy" in (x or {}).get(
            "message", "") for x in obs.get("train_results") or [])
    for r, res in enumerate(obs.get("train_results") or []):
        code = (train.get("codes") or [0] * t.world)[r]
        if res is None and code not in (0, None) and r not in train.get("killed", []) and not (
                fk["kind"] == "signal" and fired):
            problems.append(f"training rank {r} died with exit code {code} and no fault fired "
                            f"(an abort, not an error)")
        if res is None or "error" not in res:
            continue
        name, gem = res["error"], res.get("gemini")
        if fk["kind"] == "signal" and fired:
            continue  # a rank whose peer was killed or stopped fails as gloo or the package says
        if gem and fk["kind"] in ("enospc_tier", "enospc_store", "stale_lock"):
            continue  # TierFullError, PersistentTierError, JobConflictError: the fault, said clearly
        if keep1_full:
            continue  # docs/health.md: keep=1 cannot hold the newest healthy step and one more; the save
            # refuses (under AsyncCheckpointer on the rank that found it; its peers then fail as gloo says)
        if fk["kind"] in ("enospc_tier", "enospc_store", "stale_lock") and any(
                (x or {}).get("gemini") for x in obs["train_results"]):
            continue  # a peer left with the fault's error: this rank fails as gloo says
        problems.append(f"training rank {r} raised {name}{'' if gem else ' (not the package error)'}: "
                        f"{res.get('message', '')[:300]}")
    # the restore of each job
    # a fault that may destroy the only copy of a committed step: an older step or a clean error is fine
    loss = fk["kind"] in ("wipe", "flip") and t.replicas == 1 and t.parity is None
    # docs/parity.md: a present but corrupt data slot is not rebuilt from parity (only a lost one is)
    loss = loss or (fk["kind"] == "flip" and t.parity is not None and "/slot-" in str(obs.get("flipped")))
    for job_i, job in enumerate(JOBS if t.features["two_jobs"] == "yes" else JOBS[:1]):
        res = [(x or {}).get("restores", [None] * 2)[job_i] if x and "restores" in x else x
               for x in (obs.get("restore_results") or [])]
        problems += _judge_restore(t, h, job_i, res, loss=loss or (job_i == 1 and fk["kind"] in ("wipe", "flip")),
                                   where="memory")
    if obs.get("store_results") is not None:
        res = [(x or {}).get("restores", [None])[0] if x and "restores" in x else x for x in obs["store_results"]]
        problems += _judge_restore(t, h, 0, res, loss=True, where="store")
    problems += [f"gc: {g}" for g in obs.get("gc", [])]
    if not problems:
        return {**out, "outcome": "pass", "detail": ""}
    detail = "; ".join(problems)[:1500]
    known = None
    if (t.rollback_after is not None and any(w in detail for w in ("abandoned", "rollback", "timeline", "lost"))) or (
            t.nan_at is not None and "poisoned" in detail):
        known = KNOWN_50
    return {**out, "outcome": "fail", "detail": detail, **({"known": known} if known else {})}


def _judge_restore(t: Trial, h: History, job: int, res: list[Any], *, loss: bool, where: str) -> list[str]:
    """Problems of one restore (every rank's result for one job)."""
    if not res or any(r is None for r in res):
        return [f"{where} restore of job {job}: a rank died without a result"]
    tl_new = 1 if h.rolled_to is not None and h.committed(job, 1) else 0
    # the lineage of the current timeline: (tl, step) pairs that may be restored
    def lineage(tl: int) -> set[tuple[int, int]]:
        known = set(h.saved) | h.begun
        if tl == 0:
            return {(0, s) for (j, t_, s) in known if j == job and t_ == 0}
        assert h.rolled_to is not None
        return {(0, s) for (j, t_, s) in known if j == job and t_ == 0 and s <= h.rolled_to} | {
            (1, s) for (j, t_, s) in known if j == job and t_ == 1}
    legal = lineage(tl_new)
    if tl_new == 0 and h.rolled_to is not None:
        legal |= lineage(1)  # the new timeline began but committed nowhere for sure: either is current
    nan_step = (0, t.nan_at[1]) if t.nan_at is not None and job == 0 else None
    unhealthy = {nan_step} if nan_step and t.features["nonfinite"] == "mark" else set()
    committed = [(tl, s) for tl in (0, 1) for s in h.committed(job, tl) if (tl, s) in lineage(tl_new)]
    healthy_committed = [x for x in committed if x not in unhealthy]
    expect = max(healthy_committed, key=lambda x: (x[1], x[0]), default=None)
    errors = [r for r in res if "error" in r]
    if errors:
        names = sorted({r["error"] for r in errors})
        if not all(r.get("gemini") for r in errors):
            return [f"{where} restore of job {job} raised {names} (not the package's error): {errors[0]['message'][:300]}"]
        touched = sorted({k for r in errors for k in r.get("touched", [])})
        if touched:
            return [f"{where} restore of job {job} failed with {names} but changed {touched}"]
        if len(errors) != len(res):
            return [f"{where} restore of job {job}: some ranks restored, others raised {names}"]
        if expect is None or loss:
            return []
        return [f"{where} restore of job {job} raised {names} with step {expect[1]} (timeline {expect[0]}) "
                f"committed: {errors[0]['message'][:300]}"]
    metas = {json.dumps(r["meta"], sort_keys=True) for r in res}
    steps = {r["step"] for r in res}
    if len(metas) != 1 or len(steps) != 1:
        return [f"{where} restore of job {job}: ranks restored different steps {sorted(metas)}"]
    m = res[0]["meta"]
    got = (m["tl"], m["step"])
    bad = sorted({k for r in res for k in r["bad"]})
    if bad:
        return [f"{where} restore of job {job}: torn step {got} (wrong values in {bad})"]
    if m["job"] != job:
        return [f"{where} restore of job {job}: foreign step {got} of job {m['job']}"]
    if m["step"] != res[0]["step"]:
        return [f"{where} restore of job {job}: the reader says step {res[0]['step']}, the values are step {got}"]
    if not h.attempted(job, *got):
        return [f"{where} restore of job {job}: step {got} was never saved"]
    if got not in legal:
        return [f"{where} restore of job {job}: abandoned step {got} (rolled back to {h.rolled_to})"]
    if job == 0 and (got[0], got[1]) in h.refused:
        return [f"{where} restore of job {job}: poisoned step {got} that nonfinite='refuse' refused"]
    if got in unhealthy and healthy_committed and not loss and where == "memory":
        return [f"{where} restore of job {job}: poisoned step {got} restored while healthy {expect} was committed"]
    if where == "memory" and expect is not None and not loss and (got[1], got[0]) < (expect[1], expect[0]):
        return [f"{where} restore of job {job}: restored {got}, but {expect} was committed (lost)"]
    return []


# ---- the results file ----------------------------------------------------------------------------
RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "soak.json"
MAX_FAILURES = 2000  # failures kept in the file (counts go on beyond)


def tally(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts of a batch of trial records, in the results file's shape (added by :func:`accumulate`)."""
    doc: dict[str, Any] = {"trials": 0, "seconds": 0.0, "outcomes": {}, "features": {}, "faults": {},
                           "by_feature": {}, "by_fault": {}, "known": {}, "events": {},
                           "seconds_by": {}}

    def bump(d: dict[str, Any], k: str, n: float = 1) -> None:
        d[k] = d.get(k, 0) + n

    for r in records:
        doc["trials"] += 1
        doc["seconds"] += r.get("seconds", 0.0)
        for key in (f"fault={r['fault_kind']}", f"persistent={r['features'].get('persistent')}",
                    f"ranks={len(r.get('layout', ()))}"):
            bump(doc["seconds_by"], key, round(r.get("seconds", 0.0), 3))
        outcome = r["outcome"] if not r.get("known") else "known"
        bump(doc["outcomes"], outcome)
        if r.get("known"):
            bump(doc["known"], r["known"])
        for k, v in r["features"].items():
            key = f"{k}={v}"
            bump(doc["features"], key)
            doc["by_feature"].setdefault(key, {})
            bump(doc["by_feature"][key], outcome)
        for k, n in r.get("events", {}).items():
            bump(doc["events"], k, n)
        keys = fault_keys(r)
        for key in keys:
            bump(doc["faults"], key)
            doc["by_fault"].setdefault(key, {})
            bump(doc["by_fault"][key], outcome)
    return doc


def fault_keys(r: dict[str, Any]) -> list[str]:
    """The fault counters a trial adds to: its kind, and for a signal its signal, phase and whether it fired."""
    label = r["fault"]
    kind = r["fault_kind"]
    if kind == "signal":
        phase_sig = label.split(" ", 1)[1]
        phase, rest = phase_sig.split("@", 1)
        sig = rest.split(":", 1)[1].split("/", 1)[0]
        keys = [f"signal:{sig}", f"phase:{phase}", f"phase:{phase}:{sig}"]
        if r.get("fired"):
            keys.append(f"fired:{phase}:{sig}")
        return keys
    if kind == "flip":
        return ["flip", f"flip:{label.split('target=')[1].split(' ')[0]}"]
    if kind == "stale_lock":
        return ["stale_lock", f"stale_lock:{label.split('lock=')[1].split(' ')[0]}"]
    return [kind]


def _merge(into: dict[str, Any], add: dict[str, Any]) -> None:
    for k, v in add.items():
        if isinstance(v, dict):
            _merge(into.setdefault(k, {}), v)
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            into[k] = round(into.get(k, 0) + v, 3)
        else:
            into[k] = v


def accumulate(records: list[dict[str, Any]], path: Path = RESULTS, run: dict[str, Any] | None = None) -> dict[str, Any]:
    """Add ``records`` to the results file (read, merged and replaced atomically under a lock), so a
    soak killed at any moment loses at most the trials since its last call."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        doc: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
        doc.setdefault("about", "tests/soak_trials.py: random trials of every feature with every fault; "
                                "docs/reliability.md's table is made from this file by scripts/soak_table.py")
        failures = doc.pop("failures", [])
        runs = doc.pop("runs", [])
        _merge(doc, tally(records))
        failures += [_failure(r) for r in records if r["outcome"] != "pass"]
        doc["failures"] = failures[-MAX_FAILURES:]
        if run is not None:
            runs = [x for x in runs if x.get("id") != run.get("id")] + [run]
        doc["runs"] = runs
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1, sort_keys=True, default=str) + "\n")
        os.replace(tmp, path)
    return doc


def reclassify(seed: int, known: str, path: Path = RESULTS) -> bool:
    """Mark the failure of ``seed`` as explained (``known``: an issue, or a harness fix and its commit):
    its counts move from its outcome to ``known``. False if the file has no such unexplained failure."""
    import fcntl

    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        doc = json.loads(path.read_text())
        hit = next((f for f in doc["failures"] if f["seed"] == seed and not f.get("known")), None)
        if hit is None:
            return False
        was = hit["outcome"]
        hit["known"] = known
        kind = hit.get("fault_kind") or hit["fault"].split(" ", 1)[0]
        rec = {**hit, "fault_kind": kind}
        tables = [doc["outcomes"]] + [doc["by_feature"].get(f"{k}={v}", {}) for k, v in hit["features"].items()] + [
            doc["by_fault"].get(k, {}) for k in fault_keys(rec)]
        for t in tables:
            if t.get(was, 0) > 0:
                t[was] -= 1
                t["known"] = t.get("known", 0) + 1
        doc.setdefault("known", {})[known] = doc.get("known", {}).get(known, 0) + 1
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1, sort_keys=True, default=str) + "\n")
        os.replace(tmp, path)
    return True


def _failure(r: dict[str, Any]) -> dict[str, Any]:
    keep = ("seed", "outcome", "known", "fault", "fault_kind", "features", "layout", "steps", "keep", "nan_at", "rollback_after",
            "detail", "fired", "seconds", "rerun", "focus", "stacks")
    return {k: r[k] for k in keep if k in r}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=None, help="the run's base seed (default: from the clock)")
    ap.add_argument("--out", default=str(RESULTS), help="the results file trials accumulate into")
    ap.add_argument("--deadline", type=float, default=0.0, help="stop starting trials at this unix time (0: none)")
    ap.add_argument("--flush-every", type=int, default=5, help="trials between writes of the results file")
    ap.add_argument("--pause-file", default="",
                    help="while this file exists, start no trial (a benchmark can borrow a quiet machine: the "
                         "trials in flight finish, the next waits)")
    ap.add_argument("--seed-only", type=int, default=None, help="run the trial of this seed, print its record, exit")
    ap.add_argument("--reclassify", type=int, default=None, metavar="SEED",
                    help="mark the failure of SEED in --out as explained by --known, and exit")
    ap.add_argument("--known", default="", help="with --reclassify: the issue or harness fix that explains it")
    args = ap.parse_args(argv)
    if args.reclassify is not None:
        if not args.known:
            ap.error("--reclassify needs --known")
        return 0 if reclassify(args.reclassify, args.known, Path(args.out)) else 1
    if args.seed_only is not None:
        rec = run_trial(draw(args.seed_only, _focus_of_failure(args.seed_only, Path(args.out))))
        print(json.dumps(rec, indent=1, default=str))
        return 0 if rec["outcome"] == "pass" else 1
    # SIGTERM (a stopped soak) unwinds like an exception: the trial's finally kills its stale
    # holders and unmounts its tmpfs; the trials done so far are already in the file
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    base = args.seed if args.seed is not None else int(time.time())
    out = Path(args.out)
    run = {"id": f"{base}-{os.getpid()}", "seed": base, "started_unix": round(time.time()), "trials": 0, "seconds": 0.0,
           "commit": _commit()}
    batch: list[dict[str, Any]] = []
    t0 = time.time()
    bad = 0
    # the pairs still short of FOCUS_TARGET fired signals in the file, re-read at every write
    focus = focus_of(json.loads(out.read_text())) if out.exists() else {}
    try:
        for i in range(args.trials):
            if args.deadline and time.time() > args.deadline:
                break
            while args.pause_file and os.path.exists(args.pause_file) and not (
                    args.deadline and time.time() > args.deadline):
                time.sleep(1.0)
            t = draw(base * 1_000_003 + i, focus)
            rec = run_trial(t)
            if rec["outcome"] != "pass":
                # run it again at once: a failure that repeats is deterministic, one that does not is a
                # race or the host's load (a hang bound overrun by a starved nice-19 job); both are kept
                again = run_trial(draw(rec["seed"], t.focus))
                rec["rerun"] = {"outcome": again["outcome"], "detail": again.get("detail", "")[:600]}
            batch.append(rec)
            run["trials"] += 1
            if rec["outcome"] != "pass":
                bad += 1
                print(json.dumps(_failure(rec), default=str), flush=True)
            if len(batch) >= args.flush_every:
                run["seconds"] = round(time.time() - t0, 1)
                doc = accumulate(batch, out, run)
                focus = focus_of(doc)
                batch = []
                print(f"[{run['trials']}] {run['seconds']:.0f}s {run['seconds'] / run['trials']:.2f} s/trial; "
                      f"file: {doc['trials']} trials {doc['outcomes']}", flush=True)
    finally:
        import multiprocessing

        for child in multiprocessing.active_children():
            child.kill()  # a rank the stopped trial left (SIGSTOPped: the exit's join would wait for it forever)
        run["seconds"] = round(time.time() - t0, 1)
        accumulate(batch, out, run)  # the finished trials since the last write, even when stopped
    return 0 if bad == 0 else 1


def _focus_of_failure(seed: int, path: Path) -> dict[str, int] | None:
    """The focus the failure of ``seed`` in the results file was drawn under (None: none, or no such failure)."""
    if not path.exists():
        return None
    hit = next((f for f in json.loads(path.read_text()).get("failures", []) if f["seed"] == seed), None)
    return hit.get("focus") if hit else None


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).resolve().parent).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


if __name__ == "__main__":
    import soak_trials  # noqa: E402 - re-imported by name, so the forkserver finds rank_main there

    raise SystemExit(soak_trials.main())
