"""Issue 5: asynchronous per-step snapshots (gemini_dcp.snapshot.checkpointer).

The multi-process test trains an FSDP2 model (2 gloo ranks, spawned) whose every
parameter and optimizer-state element changes every step, checkpoints every
step asynchronously with the copy deliberately slowed down so that it overlaps
the next step's forward/backward, and then loads every retained step in fresh
processes and compares it bit-exact with a reference taken at the save call. A
negative control without the optimizer guard must show mixed steps — that
proves the test can see the hazard the guard removes.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from mp_utils import run_ranks

from gemini_dcp import GeminiStorageReader, GeminiStorageWriter, TierFullError, find_gemini_error
from gemini_dcp.snapshot import AsyncCheckpointer, AsyncCheckpointError, AsyncGeminiStorageWriter, snapshot_structure


@pytest.fixture
def root() -> Any:
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    d = tempfile.mkdtemp(prefix="gemini-snap-", dir=base)
    yield d
    shutil.rmtree(d, ignore_errors=True)


BACKWARD_DONE = threading.Event()  # set by the multi-process training loop after each backward


class SlowPacer:
    """Makes the copy overlap training: the first chunk waits until the next step's
    backward is done (when a loop signals it), then every chunk sleeps ``delay``;
    ``hurry()`` (the guard waiting) lets everything go at once."""

    def __init__(self, delay: float, block: int = 16 << 10, wait_backward: bool = False) -> None:
        self.delay = delay
        self.block_bytes = block
        self.wait_backward = wait_backward
        self._hurry = threading.Event()
        self.calls = 0
        self.stats = type("S", (), {"as_dict": lambda s: {}, "chunks": 0})()
        self.bandwidth = 1e9
        self.hurried = False

    def hurry(self) -> None:
        self._hurry.set()
        self.hurried = True

    def __call__(self, nbytes: int) -> None:
        self.calls += 1
        if self.calls == 1 and self.wait_backward:
            deadline = time.monotonic() + 5
            while not self._hurry.is_set() and not BACKWARD_DONE.wait(0.002) and time.monotonic() < deadline:
                pass
        self._hurry.wait(self.delay)


class SlowCheckpointer(AsyncCheckpointer):
    delay = 0.003
    wait_backward = False

    def _make_pacer(self) -> Any:
        return SlowPacer(self.delay, wait_backward=self.wait_backward)


# ---- unit tests (one process) ---------------------------------------------------------------
def test_snapshot_structure_copies_containers_not_tensors() -> None:
    w = torch.ones(4)
    bn = torch.nn.BatchNorm1d(3)
    sd = {"m": {"w": w, "rm": bn.running_mean, "l": [w, {"x": 1}]}, "opt": {"param_groups": [{"lr": 0.1}]}}
    from gemini_dcp.snapshot.structure import buffer_storages

    snap = snapshot_structure(sd, buffer_storages(bn))
    assert snap["m"]["w"] is w and snap["m"]["l"][0] is w  # zero copy
    assert snap["m"] is not sd["m"] and snap["m"]["l"] is not sd["m"]["l"]
    assert snap["m"]["rm"] is not bn.running_mean and torch.equal(snap["m"]["rm"], bn.running_mean)  # buffer cloned
    sd["opt"]["param_groups"][0]["lr"] = 0.5
    sd["m"]["new"] = 1
    assert snap["opt"]["param_groups"][0]["lr"] == 0.1 and "new" not in snap["m"]
    bn.running_mean.add_(1)
    assert snap["m"]["rm"].sum() == 0


def _load_plain(root: str, job: str, step: int, like: dict[str, Any]) -> dict[str, Any]:
    target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in like.items()}
    dcp.load(target, storage_reader=GeminiStorageReader(root=root, job_id=job), checkpoint_id=step)
    return target


def test_save_returns_fast_and_roundtrips(root: str) -> None:
    big = {f"t{i}": torch.rand(4 << 20) for i in range(16)}  # 256 MiB
    ck = AsyncCheckpointer(GeminiStorageWriter(root=root, job_id="fast", keep=1))
    blocked, copies = [], []
    try:
        for step in range(4):
            for t in big.values():
                t.fill_(step)
            h = ck.save(big, step)
            blocked.append(h.blocked_s)
            # The caller's guard would be wait_copied() (we modify the tensors next); waiting for the commit keeps
            # the next save() from waiting for it (the bound), so blocked_s is save()'s own work.
            h.wait()
            copies.append(h.copy_s)
        ck.wait()
        assert ck.last_committed_step == 3
        assert ck.stats()["plans"] == {"planned": 1, "replayed": 3}  # planned once by dcp.save, then replayed
    finally:
        ck.close()
    # the mechanism, not the clock: save() returns without doing the copy (it blocks a small fraction
    # of what the background copy of the same bytes takes, however slow a loaded host makes both)
    assert statistics.median(blocked) < 0.5 * statistics.median(copies), (blocked, copies)
    got = _load_plain(root, "fast", 3, big)
    assert all(torch.equal(got[k], torch.full_like(v, 3)) for k, v in big.items())


def test_a_pacer_without_statistics_does_not_strand_the_guard(root: str, caplog: pytest.LogCaptureFixture) -> None:
    """The bookkeeping after a save (the pacer's statistics) cannot keep its handle from finishing: a pacer
    that is a bare function is logged, and the guard and wait() return at once instead of at the timeout."""

    class Bare:  # paces nothing; no .stats: reading them raises
        hurried = False

        def __call__(self, n: int) -> None:
            pass

        def hurry(self) -> None:
            pass

    class BarePacing(AsyncCheckpointer):
        def _make_pacer(self) -> Any:
            return Bare()

    ck = BarePacing(GeminiStorageWriter(root=root, job_id="bare", keep=1), timeout_s=30)
    try:
        t = time.perf_counter()
        h = ck.save({"w": torch.ones(1000)}, 0)
        h.wait_copied(10)
        ck.wait(10)
        assert h.finished.is_set() and time.perf_counter() - t < 10
    finally:
        ck.close()
    assert "statistics could not be read" in caplog.text


def test_spread_caps_a_gapless_copy_from_the_iteration_and_the_last_save(root: str) -> None:
    """InterleaveOptions.spread: after two optimizer steps and one save, the next copy is capped at the last
    save's bytes over spread x the iteration; the guard ends the cap (the step is exact, nothing waits long);
    spread=0 and interleave=False copy at once; a spread outside [0, 1) is refused."""
    from gemini_dcp import ConfigError
    from gemini_dcp.snapshot import InterleaveOptions

    w = torch.nn.Parameter(torch.zeros(1 << 20))  # 4 MiB
    opt = torch.optim.SGD([w], lr=1.0)
    ck = AsyncCheckpointer(GeminiStorageWriter(root=root, job_id="spread", keep=2), optimizer=opt,
                           interleave=InterleaveOptions(spread=0.5), timeout_s=30)
    off = AsyncCheckpointer(GeminiStorageWriter(root=root, job_id="spread-off", keep=2), optimizer=opt,
                            interleave=InterleaveOptions(spread=0), timeout_s=30)
    try:
        assert ck._spread_rate() is None  # no iteration measured, no save yet
        for step in range(4):
            w.grad = torch.ones_like(w)
            opt.step()  # the guard waits for (and hurries) the copy of the previous save
            ck.save({"w": w}, step)
            off.save({"w": w}, step)
            time.sleep(0.2)
        it = ck.iteration_s()
        assert it is not None and it > 0.15  # at least the 0.2 s sleep (no upper bound: a busy host is slow)
        ck.wait(30)
        off.wait(30)
        rates = [(h.pacer_stats or {}).get("rate", 0.0) for h in ck.history]
        assert rates[0] == 0.0 and all(r > 0 for r in rates[2:]), rates  # capped once a save and an iteration exist
        assert all((h.pacer_stats or {}).get("rate") == 0.0 for h in off.history)
        want = ck._paced_bytes / (0.5 * it)
        assert ck._paced_bytes >= w.numel() * 4 and ck._spread_rate() == pytest.approx(want)
    finally:
        ck.close()
        off.close()
    got = _load_plain(root, "spread", 3, {"w": w})
    assert torch.equal(got["w"], w.detach())
    for bad in (1, 1.5, -0.1, True, "0.4"):
        with pytest.raises(ConfigError, match="spread"):
            AsyncCheckpointer(GeminiStorageWriter(root=root, job_id="bad"), interleave=InterleaveOptions(spread=bad))


def test_optimizer_guard_keeps_step_exact(root: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ck = SlowCheckpointer(GeminiStorageWriter(root=root, job_id="guard", keep=3), optimizer=opt, model=model, interleave=False)
    refs = {}
    x = torch.randn(8, 64)
    try:
        for step in range(4):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
            sd = {"model": model.state_dict(), "step": step}
            refs[step] = {k: v.clone() for k, v in sd["model"].items()}
            h = ck.save(sd, step)
        ck.wait()
    finally:
        ck.close()
    assert h.copy_s is not None and h.guard_wait_s >= 0
    for step in (1, 2, 3):
        got = _load_plain(root, "guard", step, {f"model.{k}": v for k, v in refs[step].items()})
        for k, v in refs[step].items():
            assert torch.equal(got[f"model.{k}"], v), (step, k)


def test_save_returns_only_once_the_previous_step_committed(root: str) -> None:
    """The bound (docs/async.md): with steps much shorter than a save (a slowed copy, a 2 ms "step"), every
    ``save(N)`` returns only after step N-1 committed, so a crash finds N-1 or N; ``on_busy="skip"`` skips
    instead of waiting; ``max_pending=2`` lets one more save be uncommitted."""
    sd = {"w": torch.zeros(1 << 16)}
    ck = SlowCheckpointer(GeminiStorageWriter(root=root, job_id="bound", keep=2), interleave=False)
    try:
        for step in range(1, 9):
            sd["w"].fill_(step)
            ck.save(sd, step)
            assert ck.last_committed_step == (step - 1 if step > 1 else None)  # the mechanism, not the clock
            ck.wait_copied()
            time.sleep(0.002)
        ck.wait()
        assert ck.last_committed_step == 8
    finally:
        ck.close()
    skip = SlowCheckpointer(GeminiStorageWriter(root=root, job_id="bound-skip", keep=2), interleave=False,
                            on_busy="skip")
    try:
        first = skip.save(sd, 1)
        second = skip.save(sd, 2)
        assert second.skipped or first.finished.is_set()  # skipped unless step 1 already committed
        skip.wait()
    finally:
        skip.close()
    two = SlowCheckpointer(GeminiStorageWriter(root=root, job_id="bound-two", keep=2), interleave=False, max_pending=2)
    try:
        for step in range(1, 6):
            two.save(sd, step)
            assert step <= 2 or (two.last_committed_step or 0) >= step - 2
        two.wait()
    finally:
        two.close()


def test_errors_surface_on_next_call(root: str) -> None:
    ck = AsyncCheckpointer(GeminiStorageWriter(root=root, job_id="err", keep=1, capacity_bytes=16 << 20))
    sd = {"w": torch.zeros(16 << 20)}  # 2 slots of 64 MiB > 16 MiB budget
    h = ck.save(sd, 1)
    h.finished.wait(60)
    with pytest.raises(AsyncCheckpointError) as ei:
        ck.save({"w": torch.zeros(4)}, 2)  # raises step 1's error; this save is not taken
    assert isinstance(find_gemini_error(ei.value.__cause__), TierFullError)
    ck.save({"w": torch.zeros(4)}, 2)  # the step-1 error was reported once, not again
    ck.wait()
    assert ck.last_committed_step == 2
    ck.close()
    with pytest.raises(AsyncCheckpointError):
        ck.save(sd, 3)


def test_skip_mode_forgets_committed_saves(root: str) -> None:
    """on_busy="skip": save() no longer prunes at its top (failures are settled in its agreement), so the
    agreement itself forgets committed saves: the list of outstanding saves stays bounded."""
    ck = AsyncCheckpointer(GeminiStorageWriter(root=root, job_id="skipgc", keep=1), on_busy="skip", interleave=False)
    sd = {"w": torch.zeros(64)}
    for step in range(1, 7):
        ck.save(sd, step).wait(60)
        assert len(ck._outstanding) <= 1
    ck.close()


def test_wait_raises_error_of_its_handle(root: str) -> None:
    ck = AsyncCheckpointer(GeminiStorageWriter(root=root, job_id="err2", keep=1, capacity_bytes=16 << 20))
    h = ck.save({"w": torch.zeros(16 << 20)}, 5)
    with pytest.raises(AsyncCheckpointError):
        h.wait(60)
    ck.close()  # already surfaced: close does not raise it again


# ---- multi-process: FSDP2, every parameter changes every step --------------------------------
def _fsdp_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(48, 64), torch.nn.BatchNorm1d(64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)
    )
    for m in model:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _local(sd: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    if isinstance(sd, dict):
        for k, v in sd.items():
            out.update(_local(v, f"{prefix}{k}."))
    elif isinstance(sd, (list, tuple)):
        for i, v in enumerate(sd):
            out.update(_local(v, f"{prefix}{i}."))
    elif isinstance(sd, torch.Tensor):
        out[prefix[:-1]] = (sd.to_local() if hasattr(sd, "to_local") else sd).detach().clone()
    return out


def _train_async(rank: int, world: int, root: str, *, steps: int, out: str) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    # same batch on every rank: BatchNorm buffers are replicated, DCP saves rank 0's copy
    x = torch.randn(16, 48, generator=torch.Generator().manual_seed(0))
    info: dict[str, Any] = {}
    for job in ("guard", "noguard", "dcp_async"):
        model, opt = _fsdp_model()
        refs: dict[int, dict[str, torch.Tensor]] = {}
        writer: Any
        if job == "dcp_async":
            writer = AsyncGeminiStorageWriter(root=root, job_id=job, keep=steps, model=model)
            writer.install_guard(opt)
            ck = None
        else:
            ck = SlowCheckpointer(
                GeminiStorageWriter(root=root, job_id=job, keep=steps),
                optimizer=opt if job == "guard" else None,  # negative control: no guard
                model=model,
                interleave=False,
            )
        if ck is not None:
            ck.wait_backward = True
        fut = None
        waits = []
        BACKWARD_DONE.clear()
        for step in range(steps):
            model(x).square().mean().backward()
            BACKWARD_DONE.set()
            opt.step()
            opt.zero_grad()
            msd, osd = get_state_dict(model, opt)
            sd = {"model": msd, "optim": osd, "step": step}
            refs[step] = _local(sd)
            BACKWARD_DONE.clear()  # this save's copy waits for the next backward
            if ck is not None:
                ck.save(sd, step)
            else:
                if fut is not None:
                    fut.result()
                writer.hooks = dataclasses.replace(writer.hooks, pace=SlowPacer(SlowCheckpointer.delay, wait_backward=True))
                fut = writer.track(dcp.async_save(sd, storage_writer=writer, checkpoint_id=step, process_group=writer.checkpoint_group))
        replayed = None
        if ck is not None:
            ck.close()
            waits = [h.guard_wait_s for h in ck.history]
            replayed = (ck.replay.planned, ck.replay.replayed) if ck.replay is not None else None
        else:
            fut.result()
            writer.close()
        torch.save(refs, Path(out, f"{job}-{rank}.pt"))
        info[job] = {"guard_wait_s": waits, "plans": replayed}
    return info


def _load_steps(rank: int, world: int, root: str, *, steps: int, out: str) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    res: dict[str, Any] = {}
    for job in ("guard", "noguard", "dcp_async"):
        refs = torch.load(Path(out, f"{job}-{rank}.pt"))
        model, opt = _fsdp_model()
        per_step = {}
        for step in range(steps):
            msd, osd = get_state_dict(model, opt)
            sd = {"model": msd, "optim": osd, "step": -1}
            reader = GeminiStorageReader(root=root, job_id=job)
            dcp.load(sd, storage_reader=reader, checkpoint_id=step)
            got = _local(sd)
            want = refs[step]
            assert set(got) == set(want), (set(got) ^ set(want))
            bad = sorted(k for k in want if not torch.equal(got[k], want[k]))
            # "mixed": a tensor that matches another step's reference instead of this one's
            mixed = sorted(k for k in bad if any(torch.equal(got[k], refs[s][k]) for s in refs if s != step))
            changed = min(
                (want[k] != refs[step + 1][k]).float().mean().item() for k in want if step + 1 in refs and want[k].numel() > 1
            ) if step + 1 in refs else 1.0
            per_step[step] = {"ok": not bad and sd["step"] == step, "bad": bad[:5], "n_bad": len(bad), "mixed": mixed[:5], "changed": changed}
        res[job] = per_step
    return res


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    r = tempfile.mkdtemp(prefix="gemini-snap-mp-", dir=base)
    out = str(tmp_path_factory.mktemp("refs"))
    try:
        steps = 6
        train = run_ranks(_train_async, 2, r, steps=steps, out=out)
        load = run_ranks(_load_steps, 2, r, steps=steps, out=out)
        yield {"train": train, "load": load}
    finally:
        shutil.rmtree(r, ignore_errors=True)


@pytest.mark.slow
def test_fsdp2_every_step_async_is_never_mixed(trained: dict[str, Any]) -> None:
    for rank_res in trained["load"]:
        for step, r in rank_res["guard"].items():
            assert r["changed"] > 0.9, (step, r)  # the workload really changes (almost) every element every step
            assert r["ok"], (step, r)
    # the guard did hold the optimizer back at least once (the copy really overlapped training)
    assert any(w > 0 for t in trained["train"] for w in t["guard"]["guard_wait_s"])
    # the first save was planned by dcp.save, every later one replayed its plan (DTensor shards)
    assert [t["guard"]["plans"] for t in trained["train"]] == [(1, 5), (1, 5)]


@pytest.mark.slow
def test_negative_control_without_guard_mixes_steps(trained: dict[str, Any]) -> None:
    bad = [(step, r) for rank_res in trained["load"] for step, r in rank_res["noguard"].items() if not r["ok"]]
    assert bad, "without the guard the slowed-down copy should have captured later steps"
    assert any(r["mixed"] for _, r in bad), bad[:3]


@pytest.mark.slow
def test_dcp_async_save_with_gemini_stager_is_exact(trained: dict[str, Any]) -> None:
    for rank_res in trained["load"]:
        for step, r in rank_res["dcp_async"].items():
            assert r["ok"], (step, r)


def _plain_async_save(rank: int, world: int, root: str, *, job: str) -> list[int]:
    """``dcp.async_save`` with a plain GeminiStorageWriter: DCP stages, our writer saves in DCP's thread."""
    sd = {"w": torch.arange(4096, dtype=torch.float32), "step": 0}  # replicated: saved once, by rank 0
    writer = GeminiStorageWriter(root=root, job_id=job)
    for step in (1, 2, 3):
        sd["w"].add_(1.0)
        sd["step"] = step
        fut = dcp.async_save(sd, storage_writer=writer, checkpoint_id=step)
        fut.result(timeout=120)
    out = {"w": torch.zeros(4096), "step": -1}
    reader = GeminiStorageReader(root=root, job_id=job)
    dcp.load(out, storage_reader=reader)
    assert torch.equal(out["w"], sd["w"]) and out["step"] == 3
    return [reader.restored_step, int(reader.restored_from["local"] > 0)]


@pytest.mark.timeout(240)
def test_plain_dcp_async_save_with_gemini_writer(root: str) -> None:
    """The stock ``dcp.async_save`` path (DefaultStager) works with an unmodified writer, 2 gloo ranks."""
    assert run_ranks(_plain_async_save, 2, root, job="plain-async") == [[3, 1], [3, 1]]


def test_the_async_api_is_exported_from_the_package(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.staging import AsyncStager

    import gemini_dcp
    from gemini_dcp import snapshot

    for name in ("AsyncCheckpointer", "AsyncGeminiStorageWriter", "InterleaveOptions"):
        assert getattr(gemini_dcp, name) is getattr(snapshot, name) and name in gemini_dcp.__all__
    writer = gemini_dcp.AsyncGeminiStorageWriter(root=tmp_path, job_id="exported")
    assert isinstance(writer, AsyncStager) and isinstance(writer, GeminiStorageWriter)
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        gemini_dcp.Nope  # noqa: B018


def _async_beside_plain(rank: int, world: int, root: str) -> list[int]:
    """An AsyncCheckpointer's background commit runs while the training thread saves and loads another
    job with plain dcp.save / dcp.load: their collectives run on different control groups."""
    from gemini_dcp.transport.comm import get_comm

    a = {"w": torch.arange(2048, dtype=torch.float32), "step": 0}  # replicated (DCP saves it once)
    b = {"v": torch.zeros(1024)}
    ck = AsyncCheckpointer(GeminiStorageWriter(root=root, job_id="bg"), on_busy="block")
    plain = get_comm(ck.writer.options.timeout_s)
    assert ck.group is not None and ck.group is not plain.group  # the background commit's own group
    for step in range(1, 6):
        a["w"].add_(1.0)
        a["step"] = step
        ck.save(a, step).wait_copied(120)  # commit still running in the background
        b["v"].add_(1.0)
        dcp.save(b, storage_writer=GeminiStorageWriter(root=root, job_id="fg"), checkpoint_id=step)
        got = {"v": torch.zeros(1024)}
        dcp.load(got, storage_reader=GeminiStorageReader(root=root, job_id="fg"), checkpoint_id=step)
        assert torch.equal(got["v"], b["v"])
    ck.close()
    out = {"w": torch.zeros(2048), "step": -1}
    reader = GeminiStorageReader(root=root, job_id="bg")
    dcp.load(out, storage_reader=reader)
    assert torch.equal(out["w"], a["w"]) and out["step"] == 5
    return [int(reader.restored_step or -1)]


@pytest.mark.timeout(240)
def test_a_background_commit_never_shares_a_group_with_the_training_thread(root: str) -> None:
    """Two threads' collectives on one gloo group could pair up differently on different ranks (the soak saw
    a gloo abort): AsyncCheckpointer's writer has a control-group scope of its own."""
    assert run_ranks(_async_beside_plain, 2, root) == [[5], [5]]


def _skip_together(rank: int, world: int, root: str) -> list[Any]:
    """Rank 0 is busy at step 2 (an uncommitted save of its own), rank 1 is not: both skip step 2."""
    from gemini_dcp.snapshot.handles import SnapshotHandle

    sd = {"w": torch.arange(1024, dtype=torch.float32), "step": 0}
    ck = AsyncCheckpointer(GeminiStorageWriter(root=root, job_id="skip"), on_busy="skip", interleave=False)
    out = []
    for step in range(1, 5):
        sd["w"].add_(1.0)
        sd["step"] = step
        busy = SnapshotHandle(-1)  # never finishes: this rank has no room
        if rank == 0 and step == 2:
            ck._outstanding.append(busy)
        h = ck.save(sd, step)
        if busy in ck._outstanding:
            ck._outstanding.remove(busy)
        if not h.skipped:
            h.wait(120)
        out.append(h.skipped)
    ck.close()
    return out


@pytest.mark.timeout(240)
def test_on_busy_skip_skips_the_same_step_on_every_rank(root: str) -> None:
    """A step skipped on one rank only would wait forever for its commit on the others (the soak saw 20 s
    gloo timeouts): save() agrees on the skip."""
    assert run_ranks(_skip_together, 2, root) == [[False, True, False, False]] * 2


def _failure_seen_at_different_times(rank: int, world: int, root: str) -> dict[str, list[str]]:
    """Step 2 is refused (a NaN, ``nonfinite="refuse"``) on both ranks, but the ranks learn it at different
    calls: rank 0's ``wait_copied()`` finds the failed save finished and raises it there, rank 1 learns it
    at ``save(3)``. Every rank must then do the same with step 3 (rank 1 raises, rank 0 skips it: it raised
    the failure already), so step 4 commits on both. Before issue 55's fix rank 0 queued step 3 (block) or
    ran the skip all-reduce alone (skip), and the ranks' collectives no longer matched: gloo timeouts."""
    out: dict[str, list[str]] = {}
    for on_busy in ("skip", "block"):
        job = f"refuse-{on_busy}"
        sd = {"w": torch.zeros(256), "step": 0}
        ck = AsyncCheckpointer(GeminiStorageWriter(root=root, job_id=job, nonfinite="refuse", timeout_s=30),
                               on_busy=on_busy, interleave=False)
        seen = out[on_busy] = []
        for step in range(1, 5):
            sd["w"].fill_(float("nan") if step == 2 else float(step))
            sd["step"] = step
            try:
                h = ck.save(sd, step)
            except AsyncCheckpointError as exc:
                assert "non-finite" in str(exc), exc
                seen.append(f"save({step}) raised")
                continue
            if h.skipped:
                seen.append(f"save({step}) skipped")
                continue
            h.finished.wait(60)  # both ranks know the outcome; only the calls that learn it differ
            if rank == 0:
                try:
                    h.wait_copied(60)
                except AsyncCheckpointError:
                    seen.append(f"wait_copied({step}) raised")
                    continue
            if h.error is None:
                seen.append(f"step {step} committed")
        ck.close()
        got = {"w": torch.zeros(256), "step": -1}
        reader = GeminiStorageReader(root=root, job_id=job)
        dcp.load(got, storage_reader=reader)
        assert reader.restored_step == 4 and got["step"] == 4 and bool((got["w"] == 4.0).all())
    return out


@pytest.mark.timeout(240)
def test_a_failure_learnt_at_different_calls_keeps_every_rank_in_step(root: str) -> None:
    """The soak's gloo timeouts (issue 55: parity, on_busy="skip", a refused NaN step, a second job): a
    failed save is settled by save() alike on every rank, whichever call first found it finished."""
    r0, r1 = run_ranks(_failure_seen_at_different_times, 2, root)
    for mode in ("skip", "block"):
        assert r0[mode] == ["step 1 committed", "wait_copied(2) raised", "save(3) skipped", "step 4 committed"]
        assert r1[mode] == ["step 1 committed", "save(3) raised", "step 4 committed"]


def _slow_leader(rank: int, world: int, root: str) -> list[bool]:
    """The node leader (rank 0) writes its records slowly; rank 1's replayed saves return only once they exist."""
    from gemini_dcp.local.tier import LocalTier

    if rank == 0:
        original = LocalTier.write_record

        def slow(self: Any, record: Any) -> Any:
            time.sleep(0.5)
            return original(self, record)

        LocalTier.write_record = slow  # type: ignore[method-assign]
    sd = {"w": torch.arange(1024, dtype=torch.float32)}
    ck = AsyncCheckpointer(GeminiStorageWriter(root=root, job_id="lead"), interleave=False)
    seen = []
    for step in range(1, 4):
        sd["w"].add_(1.0)
        ck.save(sd, step).wait(120)
        seen.append(step in LocalTier(root, "lead").steps())  # committed on this node when save returned
    ck.close()
    return seen


@pytest.mark.timeout(240)
def test_a_save_returns_on_a_non_leader_only_once_its_node_committed(root: str) -> None:
    """A replayed save runs no collective after the gather: without waiting for its leader's record, a rank
    could return, train on and be killed with the step not committed on its node (issue 51's two-back resume)."""
    assert run_ranks(_slow_leader, 2, root) == [[True] * 3, [True] * 3]
