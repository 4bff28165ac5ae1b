"""Issue 5: traffic interleaving (gemini_dcp.snapshot.interleave) — packing as pure functions, the
online pacer on a fake clock, and a 2-rank integration run where the scheduled copy
lands in the gaps between training collectives and restores bit-exact."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from typing import Any

import pytest
import torch
from mp_utils import run_ranks

from gemini_dcp.snapshot.interleave import (
    CollectiveProfiler,
    IterationTrace,
    LiveTimeline,
    Pacer,
    Period,
    Span,
    choose_chunk_bytes,
    complement,
    gap_lengths,
    idle_spans,
    intersect,
    merge,
    pack,
    periods,
    split_chunks,
    timeline_cv,
)

MB = 1_000_000


# ---- interval algebra ------------------------------------------------------------------------
def test_interval_algebra() -> None:
    assert merge([(3, 4), (0, 1), (0.5, 2), (5, 5)]) == [(0, 2), (3, 4)]
    assert complement([(1, 2), (3, 4)], 0, 5) == [(0, 1), (2, 3), (4, 5)]
    assert complement([(0, 5)], 1, 4) == []
    assert complement([], 0, 2) == [(0, 2)]
    assert intersect([(0, 2), (3, 6)], [(1, 4), (5, 7)]) == [(1, 2), (3, 4), (5, 6)]


def _trace(deadline: float, *busy: tuple[float, float]) -> IterationTrace:
    return IterationTrace(deadline=deadline, busy=tuple(busy))


def test_periods_and_positions() -> None:
    t = _trace(0.1, (0.01, 0.02), (0.05, 0.06))
    assert [(p.kind, p.pos, p.start, p.end) for p in periods(t)] == [
        ("idle", 0, 0.0, 0.01),
        ("busy", 0, 0.01, 0.02),
        ("idle", 1, 0.02, 0.05),
        ("busy", 1, 0.05, 0.06),
        ("idle", 2, 0.06, 0.1),
    ]
    # overlapping async collectives form one busy period; the next idle period's position counts both
    t2 = _trace(0.1, (0.01, 0.05), (0.02, 0.03), (0.04, 0.06))
    assert [(p.kind, p.pos) for p in periods(t2)] == [("idle", 0), ("busy", 0), ("idle", 3)]
    assert periods(_trace(0.1))[0] == Period("idle", 0, 0.0, 0.1)


def test_gap_lengths_min_at_each_position_even_when_iterations_shift() -> None:
    traces = [
        _trace(0.100, (0.010, 0.020), (0.050, 0.060)),
        _trace(0.130, (0.040, 0.052), (0.081, 0.090)),  # this one ran 30 ms late: same gaps, shifted
        _trace(0.098, (0.010, 0.022), (0.051, 0.060)),
    ]
    g = gap_lengths(traces, where="between", min_gap_s=0.0)
    assert {k: round(v, 3) for k, v in g.items()} == {0: 0.010, 1: 0.029, 2: 0.038}
    d = gap_lengths(traces, where="during", min_gap_s=0.0)
    assert {k: round(v, 3) for k, v in d.items()} == {0: 0.010, 1: 0.009}
    assert set(gap_lengths(traces, min_gap_s=0.015)) == {1, 2}  # short gaps are ignored
    spans = idle_spans(traces, min_gap_s=0.015)
    assert [(s.pos, round(s.start, 3), round(s.length, 3)) for s in spans] == [(1, 0.022, 0.029), (2, 0.06, 0.038)]
    # a position missing in one iteration is not a gap
    assert 2 not in gap_lengths([*traces, _trace(0.1, (0.01, 0.02))], min_gap_s=0.0)
    assert gap_lengths([]) == {} and idle_spans([]) == []
    assert timeline_cv(traces[::2]) < 0.05


# ---- packing -----------------------------------------------------------------------------
def test_pack_greedy_in_order_with_alpha() -> None:
    spans = [Span(0.0, 0.010), Span(0.020, 0.030)]  # 10 ms each
    # 1 GB/s x 10 ms x alpha 0.5 = 5 MB per span
    p = pack([2 * MB, 2 * MB, 2 * MB, 1 * MB, 4 * MB, 1 * MB], spans, bandwidth=1e9, alpha=0.5)
    assert p.capacity == (5 * MB, 5 * MB)
    # third chunk does not fit in span 0 (4+2 > 5) -> span 1; chunk 4 (1 MB) stays in order (span 1),
    # chunk 5 (4 MB) does not fit (2+1+4 > 5) -> leftover, and so does everything after it
    assert p.assign == (0, 0, 1, 1, None, None)
    assert p.span_bytes == (4 * MB, 3 * MB) and p.leftover_bytes == 5 * MB
    assert p.scheduled_bytes == 7 * MB


def test_pack_edge_cases() -> None:
    assert pack([MB], [], bandwidth=1e9).assign == (None,)
    big = pack([50 * MB, MB], [Span(0, 0.01)], bandwidth=1e9, alpha=1.0)
    assert big.assign == (None, None)  # a chunk larger than every span: leftover, and order is kept
    assert pack([], [Span(0, 1)], bandwidth=1e9).leftover_bytes == 0
    with pytest.raises(ValueError):
        pack([1], [Span(0, 1)], bandwidth=1e9, alpha=0)
    # spans are taken in time order whatever order they are given in
    assert pack([MB, MB], [Span(1, 1.001), Span(0, 0.001)], bandwidth=1e9, alpha=1.0).assign == (0, 1)


def test_split_and_choose_chunks() -> None:
    assert split_chunks([10, 3, 0, 8], 4) == [4, 4, 2, 3, 4, 4]
    with pytest.raises(ValueError):
        split_chunks([1], 0)
    spans = [Span(0, 0.004), Span(0.01, 0.014)]  # 4 ms -> 2.8 MB at 1 GB/s, alpha 0.7
    c = choose_chunk_bytes(spans, 1e9, 0.7, max_chunk_bytes=4 << 20)
    assert c == 512 << 10  # quarter of 2.8 MB rounded down to a power of two
    assert choose_chunk_bytes([], 1e9) == 4 << 20
    assert choose_chunk_bytes([Span(0, 1e-6)], 1e9) == 64 << 10  # floor


# ---- the online pacer, driven by a hand-fed live timeline ----------------------------------
class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _goes(pacer: Pacer, n: int, timeout: float = 0.3) -> bool:
    """Does pace(n) return within ``timeout``? (It is left running in a thread otherwise.)"""
    th = threading.Thread(target=pacer, args=(n,), daemon=True)
    th.start()
    th.join(timeout)
    return not th.is_alive()


def test_pacer_fills_gaps_greedily_then_leftover() -> None:
    clock = FakeClock()
    tl = LiveTimeline(clock)
    gaps = {1: 0.010, 3: 0.010}  # 10 ms x 1 GB/s x 0.5 = 5 MB each
    pacer = Pacer(gaps, tl, bandwidth=1e9, alpha=0.5, chunk_bytes=MB, max_wait_s=0.01)
    tl.iteration_start()
    assert not _goes(pacer, MB, 0.1)  # idle position 0 is not a gap: wait
    tl.issued_one()
    tl.completed_one()  # -> idle, position 1: a gap
    # the blocked call now goes; four more fit; the sixth does not (5 MB budget)
    for _ in range(100):
        if pacer.stats.bytes_in_spans:
            break
        time.sleep(0.01)
    assert pacer.stats.bytes_in_spans == MB
    for _ in range(4):
        assert _goes(pacer, MB)
    assert pacer.stats.bytes_in_spans == 5 * MB
    sixth = threading.Thread(target=pacer, args=(MB,), daemon=True)
    sixth.start()
    time.sleep(0.05)
    assert sixth.is_alive()  # waits for the next gap
    tl.issued_one()
    tl.completed_one()  # position 2: not a gap
    time.sleep(0.05)
    assert sixth.is_alive()
    tl.issued_one()
    tl.completed_one()  # position 3: the last gap
    sixth.join(1)
    assert not sixth.is_alive() and pacer.stats.bytes_in_spans == 6 * MB and pacer.stats.gaps_used == 2
    clock.t += 0.0099  # the gap is nearly over: a chunk no longer fits in the time left -> leftover
    assert _goes(pacer, MB)
    assert pacer.stats.bytes_leftover == MB


def test_pacer_past_last_gap_is_asap_and_hurry_releases() -> None:
    clock = FakeClock()
    tl = LiveTimeline(clock)
    tl.iteration_start()
    for _ in range(3):
        tl.issued_one()
        tl.completed_one()
    late = Pacer({1: 0.01}, tl, bandwidth=1e9, chunk_bytes=MB)
    assert _goes(late, MB) and late.stats.bytes_leftover == MB  # the save started after the last gap

    tl.iteration_start()
    waiting = Pacer({2: 0.01}, tl, bandwidth=1e9, chunk_bytes=MB, max_wait_s=1.0)
    th = threading.Thread(target=lambda: (waiting(MB), waiting(MB)), daemon=True)
    th.start()
    time.sleep(0.05)
    assert th.is_alive()
    waiting.hurry()
    th.join(1)
    assert not th.is_alive() and waiting.stats.bytes_hurried == 2 * MB


def test_pacer_of_one_iteration_stops_pacing_when_the_next_begins() -> None:
    """The replication's pacer (no guard bounds it) uses the gaps of its first iteration only."""
    clock = FakeClock()
    tl = LiveTimeline(clock)
    tl.iteration_start()
    gaps = {1: 0.010}  # 10 ms x 1 GB/s x 0.5 = 5 MB
    bounded = Pacer(gaps, tl, bandwidth=1e9, alpha=0.5, chunk_bytes=MB, max_wait_s=0.01, one_iteration=True)
    free = Pacer(gaps, tl, bandwidth=1e9, alpha=0.5, chunk_bytes=MB, max_wait_s=0.01)
    assert not _goes(bounded, MB, 0.05) and not _goes(free, MB, 0.05)  # position 0 is no gap: both wait
    tl.iteration_start()  # the next iteration: the bounded pacer lets everything go, the other waits on
    time.sleep(0.05)
    assert bounded.stats.bytes_leftover == MB and _goes(bounded, MB) and bounded.stats.bytes_leftover == 2 * MB
    assert free.stats.bytes_leftover == 0 and free.stats.bytes_in_spans == 0  # its first call still waits
    free.hurry()


def test_replication_messages_split_a_slot_exactly() -> None:
    from gemini_dcp.transport.p2p import messages

    assert messages(10, 0) == [(0, 10)] and messages(10, 16) == [(0, 10)]
    assert messages(10, 4) == [(0, 4), (4, 4), (8, 2)]
    assert sum(n for _, n in messages(MB + 3, 4096)) == MB + 3


def test_pacer_without_gaps_only_measures() -> None:
    pacer = Pacer(bandwidth=1e9, chunk_bytes=MB)
    for _ in range(5):
        pacer(MB)
        time.sleep(0.002)  # "copy" at ~0.5 GB/s
    assert pacer.stats.waited_s == 0 and pacer.stats.gaps_used == 0  # no gaps: never held back
    assert pacer.stats.bytes_leftover == 5 * MB
    assert pacer.bandwidth < 1e9  # learned from the timed chunks


def test_pacer_with_a_rate_spreads_the_copy_and_hurry_ends_the_cap() -> None:
    """InterleaveOptions.spread's pacer: without gaps, chunk k waits until the rate carried the bytes before it;
    the first goes at once; a hurry releases every wait; with gaps the rate is not used."""
    pacer = Pacer(bandwidth=1e9, chunk_bytes=MB, rate=40 * MB)
    t = time.perf_counter()
    for _ in range(5):
        pacer(MB)
    assert time.perf_counter() - t >= 4 / 40 * 0.95  # 4 MB before the last chunk at 40 MB/s
    assert pacer.stats.bytes_leftover == 5 * MB and pacer.stats.rate == 40 * MB and pacer.stats.waited_s > 0.05

    slow = Pacer(bandwidth=1e9, chunk_bytes=MB, rate=MB)  # 1 s per chunk
    th = threading.Thread(target=lambda: [slow(MB) for _ in range(4)], daemon=True)
    th.start()
    time.sleep(0.1)
    assert th.is_alive()
    slow.hurry()
    th.join(1)
    assert not th.is_alive() and slow.stats.bytes_hurried == 3 * MB and slow.stats.bytes_leftover == MB

    tl = LiveTimeline(FakeClock())
    assert Pacer({1: 0.01}, tl, bandwidth=1e9, chunk_bytes=MB, rate=MB).rate is None
    with pytest.raises(ValueError, match="rate"):
        Pacer(bandwidth=1e9, rate=0)


def test_pacer_waiting_for_gaps_goes_at_once_after_its_deadline() -> None:
    """A copy paced into gaps of an iteration that never comes (training ended, no guard to hurry it) stops
    waiting ``deadline_s`` after its first chunk."""
    tl = LiveTimeline()
    tl.iteration_start()
    pacer = Pacer({2: 0.01}, tl, bandwidth=1e9, chunk_bytes=MB, max_wait_s=0.01, deadline_s=0.15)
    t = time.perf_counter()
    th = threading.Thread(target=lambda: (pacer(MB), pacer(MB)), daemon=True)
    th.start()
    time.sleep(0.05)
    assert th.is_alive()  # position 0 is no gap: it waits
    th.join(2)
    assert not th.is_alive() and pacer.stats.bytes_leftover == 2 * MB and time.perf_counter() - t >= 0.15


# ---- the profiler, fed by hand ---------------------------------------------------------------
def _feed(prof: CollectiveProfiler, clock: FakeClock, deadlines: list[float], busy: list[tuple[float, float]]) -> None:
    for d in deadlines:
        t0 = clock.t
        prof.iteration_start()
        for s, e in busy:
            prof.record(t0 + s, t0 + e)
        clock.t = t0 + d
        prof.iteration_deadline()
        clock.t += 0.005  # the optimizer step


def test_profiler_collects_after_warmup() -> None:
    clock = FakeClock()
    prof = CollectiveProfiler(warmup=2, iterations=3, clock=clock, min_gap_s=0.0)
    _feed(prof, clock, [0.5, 0.5], [(0.0, 0.4)])  # warm-up iterations are ignored
    assert prof.profile() is None
    _feed(prof, clock, [0.1, 0.1, 0.1], [(0.01, 0.02), (0.05, 0.06)])
    assert prof.done.is_set() and prof.reason is None
    assert {k: round(v, 3) for k, v in prof.gaps().items()} == {0: 0.01, 1: 0.03, 2: 0.04}
    summ = prof.summary()
    assert summ["iterations"] == 3 and summ["collectives_per_iteration"] == [2]
    assert [g[0] for g in summ["gaps"]] == [0, 1, 2]


def test_profiler_rejects_unstable_or_empty_timeline() -> None:
    clock = FakeClock()
    prof = CollectiveProfiler(warmup=0, iterations=3, clock=clock)
    _feed(prof, clock, [0.1, 0.3, 0.1], [(0.01, 0.02)])
    assert prof.done.is_set() and "unstable" in prof.reason and prof.gaps() is None
    prof3 = CollectiveProfiler(warmup=0, iterations=2, clock=clock)
    _feed(prof3, clock, [0.1], [(0.01, 0.02)])
    _feed(prof3, clock, [0.1], [(0.01, 0.02), (0.03, 0.04)])
    assert "varies" in prof3.reason
    prof2 = CollectiveProfiler(warmup=0, iterations=2, clock=clock)
    _feed(prof2, clock, [0.1, 0.1], [])
    assert "no training collective" in prof2.reason and prof2.gaps() is None


# ---- integration: 2 gloo ranks ---------------------------------------------------------------
GAP_S = 0.060


def _interleaved_run(rank: int, world: int, root: str, replicas: int = 1) -> dict[str, Any]:
    """A training stand-in with known gaps: all_reduce, 60 ms of 'compute', all_reduce,
    60 ms, optimizer step. The checkpoint copy (and, with ``replicas``, the peer
    replication) must land in the gaps."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from gemini_dcp import GeminiStorageReader, GeminiStorageWriter
    from gemini_dcp.snapshot.checkpointer import AsyncCheckpointer, InterleaveOptions

    torch.manual_seed(0)  # plain tensors are replicated in DCP's model: same values on every rank
    params = [torch.nn.Parameter(torch.randn(1 << 20)) for _ in range(6)]  # 24 MiB (+ momentum)
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    grad = torch.zeros(1 << 16)
    live: list[tuple[float, float]] = []
    chunk_log: list[tuple[float, int, bool, bool]] = []
    sends: list[tuple[float, int, bool, bool]] = []

    def recording(inner: Any, log: list[tuple[float, int, bool, bool]]) -> Any:
        """``inner`` (a pacer, or None) that also logs when each chunk was let go, and whether the
        pacer released it into a gap (its ``bytes_in_spans`` grew)."""
        if inner is None:
            return None

        class Rec:
            block_bytes = inner.block_bytes
            stats = inner.stats

            def __getattr__(self, k: str) -> Any:
                return getattr(inner, k)

            def __call__(self, n: int) -> None:
                before = inner.stats.bytes_in_spans
                inner(n)
                log.append((time.perf_counter(), n, inner.hurried, inner.stats.bytes_in_spans > before))

        return Rec()

    class Recording(AsyncCheckpointer):
        def _make_replication_pacer(self) -> Any:
            return recording(super()._make_replication_pacer(), sends)

        def _make_pacer(self) -> Any:
            return recording(super()._make_pacer(), chunk_log)

    ck = Recording(
        GeminiStorageWriter(root=root, job_id="il", keep=2, replicas=replicas),
        optimizer=opt,
        interleave=InterleaveOptions(warmup=1, iterations=4, alpha=0.6, where="between"),
    )
    ck.profiler.max_cv = 0.5  # this machine is shared; the test is about placement, not stability

    def step(n: int, save: bool) -> None:
        for p in params:
            p.grad = torch.full_like(p, 0.01 * (n + 1))
        for _ in range(2):
            t = time.perf_counter()
            dist.all_reduce(grad)
            live.append((t, time.perf_counter()))
            time.sleep(GAP_S)  # 'compute'
        opt.step()
        if save:
            ck.save({"params": {str(i): p for i, p in enumerate(params)}, "opt": opt.state_dict()}, n)

    n = 0
    while not ck.profiler.done.is_set() and n < 40:
        step(n, save=False)
        n += 1
    spans = ck.profiler.spans()
    first_saved = n
    for _ in range(4):
        step(n, save=True)
        n += 1
    last = n - 1
    ref = {str(i): p.detach().clone() for i, p in enumerate(params)}
    ck.wait()
    stats = [h.as_dict() for h in ck.history]
    ck.close()
    # which in-span chunks started while a training collective was running?
    # (reported for a reader, never asserted: on a loaded host a released chunk can start late)
    in_coll = sum(1 for t, _, hurried, _g in chunk_log if not hurried and any(s <= t <= e for s, e in live))
    sends_in_coll = sum(1 for t, _, hurried, _g in sends if not hurried and any(s <= t <= e for s, e in live))
    target = {"params": {k: torch.zeros_like(v) for k, v in ref.items()}, "opt": opt.state_dict()}
    dcp.load(target, storage_reader=GeminiStorageReader(root=root, job_id="il"), checkpoint_id=last)
    exact = all(torch.equal(target["params"][k], ref[k]) for k in ref)
    return {
        "spans": [(s.start, s.end) for s in spans or []],
        "gaps": ck.profiler.gaps(),
        "summary": ck.profiler.summary(),
        "first_saved": first_saved,
        "stats": stats,
        "chunks": len(chunk_log),
        "chunks_in_collectives": in_coll,
        "sends": len(sends),
        "sends_in_collectives": sends_in_coll,
        "chunks_in_spans": sum(1 for *_, in_gap in chunk_log if in_gap),
        "sends_in_spans": sum(1 for *_, in_gap in sends if in_gap),
        "last": last,
        "digest": _digest(ref),
        "exact": exact,
    }


def _digest(params: dict[str, torch.Tensor]) -> str:
    import hashlib

    h = hashlib.sha256()
    for k in sorted(params):
        h.update(params[k].numpy().tobytes())
    return h.hexdigest()


def _restore_params(rank: int, world: int, root: str, step: int) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    from gemini_dcp import GeminiStorageReader

    target = {"params": {str(i): torch.zeros(1 << 20) for i in range(6)}}
    reader = GeminiStorageReader(root=root, job_id="il")
    dcp.load(target, storage_reader=reader, checkpoint_id=step)
    return {"digest": _digest(target["params"]), "restored_from": dict(reader.restored_from)}


def _profile_fsdp_and_ddp(rank: int, world: int, root: str) -> dict[str, Any]:
    """The profiler sees FSDP2's collectives (wrapped torch.distributed calls) and DDP's (comm hook)."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gemini_dcp.snapshot.interleave import ddp_allreduce_hook

    out: dict[str, Any] = {}
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32))
    for layer in m:
        fully_shard(layer)
    fully_shard(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    prof = CollectiveProfiler(warmup=1, iterations=3, max_cv=10).install(opt)
    x = torch.randn(4, 32)
    for _ in range(5):
        m(x).sum().backward()
        opt.step()
    out["fsdp"] = prof.summary()
    prof.remove()

    d = DDP(torch.nn.Linear(16, 16))
    opt2 = torch.optim.SGD(d.parameters(), lr=0.1)
    prof2 = CollectiveProfiler(warmup=1, iterations=3, max_cv=10)
    prof2.install(opt2, patch_dist=False)
    d.register_comm_hook(prof2, ddp_allreduce_hook)
    for _ in range(5):
        d(torch.randn(4, 16)).sum().backward()
        opt2.step()
    out["ddp"] = prof2.summary()
    return out


@pytest.fixture
def root() -> Any:
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    d = tempfile.mkdtemp(prefix="gemini-il-", dir=base)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.slow
def test_scheduled_copy_lands_in_gaps_and_restores(root: str) -> None:
    out = run_ranks(_interleaved_run, 2, root)
    for r in out:
        assert r["exact"], r
        assert r["summary"]["done"] and r["summary"]["collectives_per_iteration"] == [2]
        # the two 60 ms 'compute' gaps are found (minus the collectives' jitter)
        long_gaps = [s for s in r["spans"] if s[1] - s[0] > GAP_S * 0.5]
        assert len(long_gaps) >= 2, r["spans"]
        saves = [s for s in r["stats"] if s["pacer"] and s["step"] >= r["first_saved"]]
        assert saves and all(s["error"] is None for s in saves)
        # the mechanism, not the clock: every chunk went through the pacer, which had the profiled gaps.
        # Which branch released a chunk (a gap, past the last gap, the deadline) is the host's business:
        # on a starved host the trainer's gaps pass before a chunk is ready and the deadline releases it
        # (gaps_used 0 under load ~25, 2026-11-29). The gap branch itself is tested with a fake clock:
        # test_pacer_fills_gaps_greedily_then_leftover; overlaps are measured in benchmarks/interleave.
        paced = sum(s["pacer"][k] for s in saves for k in ("bytes_in_spans", "bytes_leftover", "bytes_hurried"))
        assert paced > 0, saves
        assert all(s["pacer"]["chunks"] > 0 for s in saves), saves


@pytest.mark.slow
def test_replication_is_paced_into_gaps_and_restores_from_the_peer() -> None:
    """2 simulated nodes, replicas=2: each save's peer replication goes in messages paced into
    the profiled gaps (none starts during a training collective), and after node 1's memory is
    wiped its state restores bit-exact from node 0's replicas."""
    base = tempfile.mkdtemp(prefix="gemini-ilrep-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
    roots = [os.path.join(base, f"node{i}") for i in range(2)]
    for r in roots:
        os.mkdir(r)
    try:
        out = run_ranks(_interleaved_run, 2, roots, replicas=2)
        for r in out:
            assert r["exact"], r
            saves = [s for s in r["stats"] if s["replication_pacer"] and s["step"] >= r["first_saved"]]
            assert saves and all(s["error"] is None for s in saves), r["stats"]
            assert r["sends"] >= 2 * len(saves), r  # several messages per save, not one
            # the mechanism, not the clock: every message went through the replication pacer; which of
            # its branches released it depends on the host's load (see the test above), so it is not asserted
            paced = sum(s["replication_pacer"][k] for s in saves
                        for k in ("bytes_in_spans", "bytes_leftover", "bytes_hurried"))
            assert paced > 0, saves
        shutil.rmtree(roots[1])  # node 1's memory is gone; its replacement starts empty
        os.mkdir(roots[1])
        back = run_ranks(_restore_params, 2, roots, step=out[0]["last"])
        assert all(b["digest"] == out[0]["digest"] for b in back), back
        assert back[1]["restored_from"]["peer"] > 0, back
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.slow
def test_profiler_sees_fsdp2_and_ddp_collectives(root: str) -> None:
    out = run_ranks(_profile_fsdp_and_ddp, 2, root)
    for r in out:
        assert r["fsdp"]["done"] and r["fsdp"]["collectives_per_iteration"][0] >= 4, r["fsdp"]  # all-gathers + reduce-scatters
        assert r["ddp"]["done"] and r["ddp"]["collectives_per_iteration"][0] >= 1, r["ddp"]


def test_the_copy_chunk_is_chosen_once_per_profile(root: str) -> None:
    """The local copy's chunk is the writer's copy block: chosen once per profile, not from each save's learned
    rate. A block that moved with the rate rebuilt the save's program at every flip (the unfused per-item copy:
    twice the background CPU in a long torchtitan run). The save's program is built once across rates."""
    from gemini_dcp import GeminiStorageWriter
    from gemini_dcp.snapshot import AsyncCheckpointer

    clock = FakeClock()
    prof = CollectiveProfiler(warmup=0, iterations=3, clock=clock, min_gap_s=0.0)
    _feed(prof, clock, [0.1, 0.1, 0.1], [(0.01, 0.02), (0.05, 0.06)])
    assert prof.gaps()
    w = torch.nn.Parameter(torch.zeros(64, 1024))
    opt = torch.optim.SGD([w], lr=0.1)
    writer = GeminiStorageWriter(root=root, job_id="chunk", keep=2)
    ck = AsyncCheckpointer(writer, optimizer=opt, timeout_s=30)
    try:
        ck.profiler.remove()
        ck.profiler = prof
        gaps = prof.gaps().values()
        assert choose_chunk_bytes(gaps, 1e8) != choose_chunk_bytes(gaps, 1e10)  # the rate alone would move it
        first = ck._gap_pacer(1e8)
        assert first is not None and ck._gap_pacer(1e10).block_bytes == first.block_bytes
        sd = {"w": w, "b": {str(i): torch.full((100,), float(i)) for i in range(20)}}
        for step, bw in enumerate([1e8, 1e10, 1e8, 1e10]):
            ck._bandwidth = bw
            ck.save(sd, step).wait_copied(30)
            ck.wait(30)  # the pacer waits for gaps of a timeline nobody feeds: wait() hurries it
        assert writer.local_writer.programs_built == 1
    finally:
        ck.close()
