"""Zero-stall snapshot benchmark: per-step checkpointing of a small FSDP2 model on 2 gloo ranks.

    python benchmarks/bench_async.py                       # defaults (~3-4 min on 2 cores)
    python benchmarks/bench_async.py --width 1024 --layers 8 --batch 512 --steps 16 --rounds 3
    python benchmarks/bench_async.py --device cuda ...     # GPU variant (one rank per GPU, or 1 rank)
    python benchmarks/bench_async.py --replicas 2 --modes gemini gemini_asap   # + peer replication

Modes, run in the same processes, in rotating order per round (the machine is
shared, so passes drift; interleaving cancels most of it):

* ``none``   — training only (forward, backward, AdamW step): the baseline;
* ``gemini`` — ``AsyncCheckpointer`` saving every step into the memory tier,
  copy paced into the profiled idle spans (traffic interleaving);
* ``gemini_asap`` — the same with pacing off (copy as fast as possible);
* ``gemini_planned`` — ``gemini`` with every save planned by ``dcp.save``
  (``DefaultSavePlanner`` with DCP's own plan caching) instead of replaying
  the recorded plan (gemini_dcp.snapshot.replay): the A/B of the replay;
* ``gemini_dcp_async`` — ``dcp.async_save`` with ``AsyncGeminiStorageWriter``
  as its stager (zero-copy staging, optimizer-step guard, no pacing);
* ``stock``  — ``dcp.async_save`` with ``DefaultStager`` (every staging option
  that works on CPU: async staging in a thread, shared-memory staging buffers,
  cached between calls; pinned memory and non-blocking copies need an
  accelerator) + ``FileSystemWriter`` into /dev/shm (3 rotating directories),
  guarded as DCP requires: the optimizer step waits for the staging future,
  the next save for the previous upload.

Figures: median step time per mode and ratio to ``none``; the *paired* ratio
(median over rounds of the mode's median step / ``none``'s median step in the
same round: robust to the host drifting between rounds); time the training
thread is blocked per save (the ``save()``/``async_save`` call, and separately
the optimizer-step guard wait). With ``--replicas 2`` every rank is a simulated
node of its own (its own tier root) and each gemini save also replicates to a
peer: ``gemini`` paces the replication into the gaps too, ``gemini_asap`` sends it
in one message at once; the share of replicated bytes sent inside gaps is reported. Rank 0 writes benchmarks/results/async.json
and docs/img/async_steps.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REPO = Path(__file__).resolve().parents[1]
MODES = ("none", "gemini", "gemini_asap", "gemini_planned", "gemini_dcp_async", "stock")


def _med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def build(args: argparse.Namespace, device: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    if args.model == "transformer":  # pre-norm encoder blocks (SDPA attention), each block its own FSDP2 unit
        blocks = [
            torch.nn.TransformerEncoderLayer(args.width, args.heads, 4 * args.width, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(args.layers)
        ]
        tmodel = torch.nn.Sequential(*blocks).to(device)
        for b in tmodel:
            fully_shard(b)
        fully_shard(tmodel)
        return tmodel, torch.optim.AdamW(tmodel.parameters(), lr=1e-4)
    layers: list[torch.nn.Module] = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers).to(device)
    for m in model:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from gemini_dcp import GeminiStorageWriter
    from gemini_dcp.snapshot import AsyncCheckpointer, AsyncGeminiStorageWriter, InterleaveOptions, checkpoint_group

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if os.environ.get("BENCH_SWITCH_INTERVAL"):
        sys.setswitchinterval(float(os.environ["BENCH_SWITCH_INTERVAL"]))
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group("cpu:gloo,cuda:nccl", rank=rank, world_size=world)
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        device = torch.device("cpu")
    model, opt = build(args, device)
    if args.model == "transformer":
        x = torch.randn(args.batch, args.seq, args.width, device=device)
    else:
        x = torch.randn(args.batch, args.width, device=device)
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def train_step() -> None:
        for _ in range(args.accum):  # gradient accumulation: micro-batches, then one optimizer step
            with amp:
                loss = model(x).float().square().mean()
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)

    base = tempfile.mkdtemp(prefix="bench-async-", dir=args.shm) if rank == 0 else None
    box = [base]
    dist.broadcast_object_list(box, src=0)
    base = box[0]
    root = base
    if args.replicas > 1:  # every rank a simulated node: its own tier root
        root = os.path.join(base, f"node{rank}")
        os.makedirs(root, exist_ok=True)
    group = checkpoint_group()
    ck = AsyncCheckpointer(
        GeminiStorageWriter(root=root, job_id="bench", keep=2, replicas=args.replicas),
        optimizer=opt,
        model=model,
        interleave=InterleaveOptions(warmup=args.profile_warmup, iterations=args.profile_iters, where=args.where, alpha=args.alpha),
    )
    stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=True, use_async_staging=True, use_non_blocking_copy=cuda))
    stock_state: dict[str, Any] = {"staging": None, "upload": None}

    def stock_guard(*_: Any) -> None:
        f = stock_state["staging"]
        if f is not None:
            t = time.perf_counter()
            try:
                f.result()
            except Exception as exc:  # noqa: BLE001 - recorded; the stock mode stops, the others go on
                stock_state["error"] = f"{type(exc).__name__}: {exc}"
                stock_state["upload"] = None
            stock_state["guard"].append(time.perf_counter() - t)
            stock_state["staging"] = None

    opt.register_step_pre_hook(stock_guard)
    gwriter = AsyncGeminiStorageWriter(root=root, job_id="bench_dcp", keep=2, model=model)
    gwriter.install_guard(opt)
    gstate: dict[str, Any] = {"upload": None}
    replay = ck.replay
    planned = DefaultSavePlanner(enable_plan_caching=True)
    planned._cached_plans_key = "bench_async.gemini_planned"  # DCP's cache is class-level: a key of our own

    # warm-up training, then profile the timeline (no checkpoint traffic while profiling)
    for _ in range(args.warmup):
        train_step()
    sync()
    t = time.perf_counter()
    while not (ck.profiler is None or ck.profiler.done.is_set()):
        train_step()
        if time.perf_counter() - t > 600:
            break
    sync()
    profile = ck.profiler.summary() if ck.profiler is not None else None

    records: dict[str, dict[str, list[float]]] = {m: {"step": [], "round": [], "blocked": [], "guard": [], "copy": [], "commit": [], "cpu": [], "in_gaps": [], "repl_in_gaps": []} for m in MODES}
    step_no = 0
    order = list(args.modes)
    for rnd in range(args.rounds):
        for mode in order[rnd % len(order) :] + order[: rnd % len(order)]:
            ck.pacing = mode != "gemini_asap"
            ck.replay, ck.planner = (None, planned) if mode == "gemini_planned" else (replay, None)
            stock_state["guard"] = records[mode]["guard"]
            dist.barrier()
            handles = []
            for i in range(args.steps):
                sync()
                t0 = time.perf_counter()
                train_step()
                if mode in ("gemini", "gemini_asap", "gemini_planned"):
                    msd, osd = get_state_dict(model, opt)
                    h = ck.save({"model": msd, "optim": osd, "step": step_no}, step_no)
                    handles.append(h)
                    records[mode]["blocked"].append(h.blocked_s)
                elif mode == "gemini_dcp_async":
                    msd, osd = get_state_dict(model, opt)
                    tb = time.perf_counter()
                    if gstate["upload"] is not None:
                        gstate["upload"].result()  # DCP: one async_save in flight
                    gstate["upload"] = gwriter.track(
                        dcp.async_save({"model": msd, "optim": osd, "step": step_no}, storage_writer=gwriter,
                                       checkpoint_id=step_no, process_group=group)
                    )
                    records[mode]["blocked"].append(time.perf_counter() - tb)
                elif mode == "stock" and stock_state.get("error") is None:
                    msd, osd = get_state_dict(model, opt)
                    tb = time.perf_counter()
                    path = os.path.join(root, "stock", f"s{step_no % 3}")
                    state = {"model": msd, "optim": osd, "step": step_no}
                    try:
                        if stock_state["upload"] is not None:
                            stock_state["upload"].result()  # DCP: one async_save in flight
                        if cuda:
                            # DCP's pinned staging on a GPU: FileSystemWriter's cached pinned CPU state dict, copied
                            # into inside async_save (DefaultStager's pinned path fails on DTensor state dicts
                            # with torch 2.11: KeyError <class 'type'> in its deepcopy).
                            if stock_state.get("writer") is None:
                                stock_state["writer"] = dcp.FileSystemWriter(path, overwrite=True, cache_staged_state_dict=True)
                            fut = dcp.async_save(state, storage_writer=stock_state["writer"], checkpoint_id=path, process_group=group)
                            stock_state["staging"], stock_state["upload"] = None, getattr(fut, "upload_completion", fut)
                        else:
                            w = dcp.FileSystemWriter(path, overwrite=True)
                            resp = dcp.async_save(state, storage_writer=w, async_stager=stager, process_group=group)
                            stock_state["staging"], stock_state["upload"] = resp.staging_completion, resp.upload_completion
                    except Exception as exc:  # noqa: BLE001 - a stock failure must not lose the other modes' figures
                        stock_state["error"] = f"{type(exc).__name__}: {exc}"
                        stock_state["staging"] = stock_state["upload"] = None
                    records[mode]["blocked"].append(time.perf_counter() - tb)
                sync()
                if i >= args.skip:
                    records[mode]["step"].append(time.perf_counter() - t0)
                    records[mode]["round"].append(rnd)
                step_no += 1
            # drain this mode's outstanding work before the next mode
            if mode.startswith("gemini"):
                ck.wait()
                for h in handles[args.skip :]:
                    records[mode]["guard"].append(h.guard_wait_s)
                    if h.copy_s is not None:
                        records[mode]["copy"].append(h.copy_s)
                    if h.total_s is not None:
                        records[mode]["commit"].append(h.total_s)
                    if h.cpu_s is not None:
                        records[mode]["cpu"].append(h.cpu_s)
                    p = h.pacer_stats or {}
                    tot = sum(p.get(k, 0) for k in ("bytes_in_spans", "bytes_leftover", "bytes_hurried"))
                    if tot:
                        records[mode]["in_gaps"].append(p.get("bytes_in_spans", 0) / tot)
                    rp = h.replication_pacer_stats
                    if args.replicas > 1:  # no replication pacer: one message at once, nothing in gaps
                        rtot = sum((rp or {}).get(k, 0) for k in ("bytes_in_spans", "bytes_leftover", "bytes_hurried"))
                        records[mode]["repl_in_gaps"].append((rp or {}).get("bytes_in_spans", 0) / rtot if rtot else 0.0)
            elif mode == "gemini_dcp_async":
                if gstate["upload"] is not None:
                    gstate["upload"].result()
                    gstate["upload"] = None
            elif mode == "stock":
                stock_guard()
                if stock_state["upload"] is not None:
                    try:
                        stock_state["upload"].result()
                    except Exception as exc:  # noqa: BLE001 - recorded, see above
                        stock_state["error"] = f"{type(exc).__name__}: {exc}"
                    stock_state["upload"] = None
    trace = None
    if args.trace and rank == 0:
        trace = profile_steps(args, train_step, ck, model, opt, sync, step_no)
    dist.barrier()
    ck.close()
    stager.close()
    gwriter.close()
    state_bytes = sum(
        t.to_local().numel() * t.element_size() if hasattr(t, "to_local") else t.numel() * t.element_size()
        for sd in get_state_dict(model, opt)
        for t in _tensors(sd)
    )
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, {"records": records, "state_bytes": state_bytes, "profile": profile, "trace": trace,
                                      "stock_error": stock_state.get("error")})
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
        shutil.rmtree(base, ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()


def profile_steps(args: argparse.Namespace, train_step: Any, ck: Any, model: Any, opt: Any, sync: Any, step_no: int) -> dict[str, Any]:
    """``torch.profiler`` over 2 plain steps then 2 steps each followed by an AsyncCheckpointer save;
    the Chrome trace goes to ``args.trace`` (drawn by benchmarks/plot_gpu_trace.py)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.profiler import ProfilerActivity, profile, record_function

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    ck.pacing = True
    sync()
    with profile(activities=acts) as prof:
        for i in range(4):
            save = i >= 2
            with record_function(f"bench.step{i}.{'checkpointed' if save else 'plain'}"):
                train_step()
                if save:
                    msd, osd = get_state_dict(model, opt)
                    ck.save({"model": msd, "optim": osd, "step": step_no + i}, step_no + i)
            sync()
        ck.wait()
        sync()
    Path(args.trace).parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(args.trace))
    return {"trace": str(args.trace)}


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def summarize(per_rank: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    modes: dict[str, Any] = {}
    for mode in args.modes:
        steps = [s for r in per_rank for s in r["records"][mode]["step"]]
        blocked = [s for r in per_rank for s in r["records"][mode]["blocked"]]
        guard = [s for r in per_rank for s in r["records"][mode]["guard"]]
        copy = [s for r in per_rank for s in r["records"][mode]["copy"]]
        commit = [s for r in per_rank for s in r["records"][mode]["commit"]]
        cpu = [s for r in per_rank for s in r["records"][mode]["cpu"]]
        in_gaps = [s for r in per_rank for s in r["records"][mode]["in_gaps"]]
        repl_in_gaps = [s for r in per_rank for s in r["records"][mode]["repl_in_gaps"]]
        modes[mode] = {
            "step_median_s": _med(steps),
            "step_mean_s": statistics.fmean(steps) if steps else None,
            "steps": len(steps),
            "blocked_median_ms": None if not blocked else _med(blocked) * 1e3,
            "blocked_p95_ms": None if not blocked else _pct(blocked, 0.95) * 1e3,
            "blocked_max_ms": None if not blocked else max(blocked) * 1e3,
            "guard_wait_median_ms": None if not guard else _med(guard) * 1e3,
            "guard_wait_mean_ms": None if not guard else statistics.fmean(guard) * 1e3,
            "local_copy_median_ms": None if not copy else _med(copy) * 1e3,
            "commit_median_ms": None if not commit else _med(commit) * 1e3,
            "background_cpu_median_ms": None if not cpu else _med(cpu) * 1e3,
            "bytes_in_gaps_mean": None if not in_gaps else statistics.fmean(in_gaps),
            "replicated_bytes_in_gaps_mean": None if not repl_in_gaps else statistics.fmean(repl_in_gaps),
        }
    # Paired per-round ratios: each round runs every mode back to back, so the ratio of a mode's
    # median to the baseline's median *in the same round* cancels the host's drift between rounds.
    def round_medians(mode: str) -> dict[int, float]:
        by: dict[int, list[float]] = {}
        for r in per_rank:
            for s_, rd in zip(r["records"][mode]["step"], r["records"][mode]["round"]):
                by.setdefault(rd, []).append(s_)
        return {rd: _med(v) for rd, v in by.items()}

    base_rounds = round_medians("none") if "none" in modes else {}
    for mode in modes:
        mine = round_medians(mode)
        ratios = [mine[rd] / base_rounds[rd] for rd in sorted(mine) if rd in base_rounds and base_rounds[rd]]
        modes[mode]["round_ratios"] = ratios
        modes[mode]["paired_ratio_median"] = _med(ratios) if ratios else None
    base = modes["none"]["step_median_s"]
    for m in modes.values():
        m["step_ratio_vs_none"] = None if not (base and m["step_median_s"]) else m["step_median_s"] / base
        m["mean_ratio_vs_none"] = (
            None if not (modes["none"]["step_mean_s"] and m["step_mean_s"]) else m["step_mean_s"] / modes["none"]["step_mean_s"]
        )
    return {
        "config": {k: v for k, v in vars(args).items() if k not in ("out",)},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform(),
                    **({"gpu": torch.cuda.get_device_name(), "cuda": torch.version.cuda} if args.device == "cuda" else {})},
        "state_bytes_per_rank": [r["state_bytes"] for r in per_rank],
        "profile_rank0": per_rank[0]["profile"],
        "trace_rank0": per_rank[0].get("trace"),
        "stock_error_rank0": per_rank[0].get("stock_error"),
        "modes": modes,
    }


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in res["modes"] if res["modes"][m]["step_median_s"]]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    steps = [res["modes"][m]["step_median_s"] * 1e3 for m in modes]
    colors = {"none": "#888", "gemini": "#2a7", "gemini_asap": "#7c7", "gemini_planned": "#9b6", "gemini_dcp_async": "#4a9", "stock": "#c55"}
    a.bar(modes, steps, color=[colors[m] for m in modes])
    a.tick_params(axis="x", labelsize=7)
    for i, m in enumerate(modes):
        r = res["modes"][m]["step_ratio_vs_none"]
        a.text(i, steps[i], f"{r:.3f}x", ha="center", va="bottom")
    a.set_ylabel("median step time (ms)")
    a.set_title("step time, checkpoint every step")
    ck = [m for m in modes if res["modes"][m]["blocked_median_ms"] is not None]
    blk = [res["modes"][m]["blocked_median_ms"] for m in ck]
    grd = [res["modes"][m]["guard_wait_median_ms"] or 0.0 for m in ck]
    xs = range(len(ck))
    b.bar([x - 0.2 for x in xs], blk, width=0.4, label="save call (median)")
    b.bar([x + 0.2 for x in xs], grd, width=0.4, label="optimizer-step guard wait (median)")
    b.set_xticks(list(xs), ck, fontsize=7)
    b.set_yscale("log")
    b.set_ylabel("ms blocked per save")
    b.axhline(5, color="k", lw=0.8, ls="--")
    b.legend(fontsize=8)
    b.set_title("training thread blocked")
    cfg = res["config"]
    what = "transformer" if cfg.get("model") == "transformer" else "MLP"
    extra = f", seq {cfg['seq']}, accum {cfg['accum']}{', bf16' if cfg.get('bf16') else ''}" if what == "transformer" else ""
    fig.suptitle(
        f"FSDP2 {what} {cfg['layers']}x{cfg['width']}{extra}, batch {cfg['batch']}, {cfg['world']} ranks ({cfg['device']}), "
        f"{res['state_bytes_per_rank'][0] / 2**20:.0f} MiB state/rank"
        + (f"; replicas={cfg['replicas']}, each rank a simulated node" if cfg.get("replicas", 1) > 1 else ""),
        fontsize=9,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=("mlp", "transformer"), default="mlp",
                    help="mlp: Linear+GELU layers (batch x width input); transformer: pre-norm encoder blocks (batch x seq x width)")
    ap.add_argument("--heads", type=int, default=16, help="transformer attention heads")
    ap.add_argument("--seq", type=int, default=1024, help="transformer sequence length")
    ap.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step (gradient accumulation)")
    ap.add_argument("--bf16", action="store_true", help="autocast forward/backward to bfloat16 (parameters stay float32)")
    ap.add_argument("--trace", default=None, help="also profile 2 plain + 2 checkpointed steps (rank 0) into this Chrome trace")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--batch", type=int, default=768)
    ap.add_argument("--steps", type=int, default=14, help="steps per mode per round")
    ap.add_argument("--skip", type=int, default=2, help="first steps of each pass not timed")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--profile-warmup", type=int, default=2)
    ap.add_argument("--profile-iters", type=int, default=8)
    ap.add_argument("--where", choices=("between", "during"), default="between")
    ap.add_argument("--alpha", type=float, default=0.7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--replicas", type=int, default=1, help="2: each rank its own simulated node, saves replicated to a peer")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--shm", default="/dev/shm")
    ap.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "async.json"))
    ap.add_argument("--png", default=str(REPO / "docs" / "img" / "async_steps.png"))
    args = ap.parse_args()
    if "none" not in args.modes:
        args.modes = ["none", *args.modes]

    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "res.json")
        mp.start_processes(worker, args=(args.world, port, args, out), nprocs=args.world, start_method="spawn")
        per_rank = json.loads(Path(out).read_text())
    res = summarize(per_rank, args)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(res, indent=1))
    if args.png:
        try:
            plot(res, Path(args.png))
        except ImportError:
            print("matplotlib missing: no plot")
    print(f"state per rank: {res['state_bytes_per_rank'][0] / 2**20:.1f} MiB; profile: {json.dumps(res['profile_rank0'])}")
    print(
        f"{'mode':16s} {'step ms':>9s} {'ratio':>7s} {'mean r':>7s} {'paired':>7s} {'save ms':>8s} {'p95':>7s} {'guard ms':>9s} "
        f"{'copy ms':>8s} {'commit ms':>9s} {'bg cpu ms':>9s} {'in gaps':>7s} {'repl in gaps':>12s}"
    )
    for m, r in res["modes"].items():
        f = lambda v, p=2: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
        print(
            f"{m:16s} {f(r['step_median_s'] * 1e3 if r['step_median_s'] else None, 1):>9s} {f(r['step_ratio_vs_none'], 3):>7s} "
            f"{f(r['mean_ratio_vs_none'], 3):>7s} {f(r['paired_ratio_median'], 3):>7s} {f(r['blocked_median_ms']):>8s} {f(r['blocked_p95_ms']):>7s} "
            f"{f(r['guard_wait_median_ms']):>9s} {f(r['local_copy_median_ms'], 1):>8s} {f(r['commit_median_ms'], 1):>9s} "
            f"{f(r['background_cpu_median_ms'], 1):>9s} {f(r['bytes_in_gaps_mean'], 2):>7s} "
            f"{f(r['replicated_bytes_in_gaps_mean'], 2):>12s}"
        )
    print(f"wrote {args.json}" + (f" and {args.png}" if args.png else ""))


if __name__ == "__main__":
    main()
