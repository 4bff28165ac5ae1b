"""Issue 26: ranks with nothing (or only a part) to load, beside ranks that restore — real processes.

A survivor that keeps its own state still takes part in the collective ``dcp.load`` with ``{}``
(it serves its peers' chunks), or loads only a part of its state, while the replaced ranks
restore theirs from peer memory or from the persistent tier. Every rank must finish, bit-exact
where it loads, and exit cleanly: a rank that aborts at exit (SIGABRT, "terminate called without
an active exception", from a thread of the restore still running while the interpreter tears
down) fails ``run_ranks`` through its exit code. Simulated nodes: one tier root each.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from mp_utils import free_port, node_root_factory, run_ranks, wipe

from gemini_dcp import GeminiStorageReader, GeminiStorageWriter
from gemini_dcp.local.tier import LocalTier
from gemini_dcp.persistent.drain import drain_status, wait_idle
from gemini_dcp.persistent.store import PersistentTier

N_TENSORS = 8
ELEMS = (1 << 20) // 4  # 1 MiB float32 each


def rank_state(rank: int, step: int) -> dict[str, Any]:
    """What ``rank`` saves at ``step``: its own tensors (several dtypes), and a plain value."""
    g = torch.Generator().manual_seed(rank * 1000 + step)
    sd: dict[str, Any] = {f"r{rank}.t{i}": torch.rand(ELEMS, generator=g) for i in range(N_TENSORS)}
    sd[f"r{rank}.h"] = torch.rand(33, 7, generator=g).to(torch.bfloat16)
    sd[f"r{rank}.i"] = torch.arange(step, step + 100, dtype=torch.int64)
    sd[f"r{rank}.step"] = step
    return sd


def save(rank: int, world_size: int, root: str, *, job: str, steps: int, **writer_kw: Any) -> None:
    for step in range(1, steps + 1):
        dcp.save(rank_state(rank, step), storage_writer=GeminiStorageWriter(root=root, job_id=job, **writer_kw), checkpoint_id=step)
    if writer_kw.get("persistent"):
        assert wait_idle(LocalTier(root, job).layout.persist_dir, 180), drain_status(LocalTier(root, job).layout.persist_dir)


def load(rank: int, world_size: int, root: str, *, job: str, want: dict[int, str], expect: int, **reader_kw: Any) -> dict[str, Any]:
    """``want[rank]``: "all" (its whole state), "part" (every other key) or "none" (``{}``)."""
    full = rank_state(rank, expect)
    keys = {"all": list(full), "part": list(full)[::2], "none": []}[want[rank]]
    target: dict[str, Any] = {k: torch.zeros_like(full[k]) if isinstance(full[k], torch.Tensor) else 0 for k in keys}
    reader = GeminiStorageReader(root=root, job_id=job, **reader_kw)
    dcp.load(target, storage_reader=reader)
    ok = reader.restored_step == expect and all(
        torch.equal(target[k], full[k]) if isinstance(full[k], torch.Tensor) else target[k] == full[k] for k in keys
    )
    return {"ok": ok, "loaded": len(keys), "from": dict(reader.restored_from), "rank_from": dict(reader.rank_restored_from)}


@pytest.fixture
def node_roots() -> Any:
    make, cleanup = node_root_factory("gemini-pl")
    yield make
    cleanup()


def _load_then_exit(rank: int, roots: list[str], port: int, out_dir: str, kw: dict[str, Any]) -> None:
    """A training script's shape: load, then leave the interpreter at once (no destroy_process_group)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(len(roots)),
                      OMP_NUM_THREADS="1")
    dist.init_process_group("gloo", rank=rank, world_size=len(roots))
    result = load(rank, len(roots), roots[rank], **kw)
    Path(out_dir, f"{rank}.ok").write_text("1" if result["ok"] else repr(result))


def test_survivor_loads_nothing_while_the_replaced_rank_restores_from_it(node_roots: Any, tmp_path: Path) -> None:
    """The issue's case: rank 0 (survivor) loads ``{}`` and serves rank 1, whose node was wiped;
    each process exits right after ``dcp.load`` (on 91fd047 rank 0 aborted there with SIGABRT:
    a daemon thread still unmapping the served slots when the interpreter finalized)."""
    roots = node_roots(2)
    run_ranks(save, 2, roots, job="s", steps=5, replicas=2)
    wipe(roots[1])
    out = run_ranks(load, 2, roots, job="s", want={0: "none", 1: "all"}, expect=5)
    assert all(o["ok"] for o in out), out
    assert out[1]["rank_from"]["peer"] > 0 and out[0]["rank_from"] == {"local": 0, "peer": 0, "persistent": 0}, out
    # The abort this guards against was systematic (4 of 4 exits on a loaded host). A rarer one,
    # about 1 exit in 10-20 on a loaded 2-core host, is torch's: a gloo worker thread releasing a
    # finished collective's tensors after the interpreter began finalizing (needs the GIL, ends
    # the thread inside a noexcept destructor; docs/failure-semantics.md). The package's exit
    # guard (transport/exit_guard, tests/test_exit_guard.py) now waits for those workers at exit;
    # as it could not be reproduced unaided here to prove a zero rate, one aborting attempt is
    # still retried, and a second abort fails.
    aborts: list[list[int | None]] = []
    for attempt in range(4):
        out_dir = tmp_path / f"exit-{attempt}"
        out_dir.mkdir()
        kw = {"job": "s", "want": {0: "none", 1: "all"}, "expect": 5}
        ctx = mp.start_processes(_load_then_exit, args=(roots, free_port(), str(out_dir), kw), nprocs=2, join=False,
                                 start_method="spawn")
        for p in ctx.processes:
            p.join(240)
        codes = [p.exitcode for p in ctx.processes]
        if codes != [0, 0]:
            aborts.append(codes)
            assert len(aborts) < 2 and -6 in codes, f"exit codes {aborts} (-6: SIGABRT at exit)"
            continue
        assert [(out_dir / f"{r}.ok").read_text() for r in range(2)] == ["1", "1"]
        if attempt - len(aborts) >= 1:  # two clean exits
            break


def test_any_subset_loads_nothing_or_a_part_across_two_nodes(node_roots: Any) -> None:
    """4 ranks on 2 nodes, node 1 wiped: one replaced rank restores everything, the other nothing;
    one survivor loads a part of its state, the other nothing."""
    n = node_roots(2)
    roots = [n[0], n[0], n[1], n[1]]
    run_ranks(save, 4, roots, job="q", steps=3, replicas=2)
    wipe(n[1])
    out = run_ranks(load, 4, roots, job="q", want={0: "none", 1: "part", 2: "all", 3: "none"}, expect=3)
    assert all(o["ok"] for o in out), out
    assert out[2]["rank_from"]["peer"] > 0 and out[1]["rank_from"]["local"] > 0, out
    assert out[3]["rank_from"]["peer"] == 0 and out[0]["rank_from"]["local"] == 0, out
    # every rank loads nothing: still a clean collective
    out = run_ranks(load, 4, roots, job="q", want=dict.fromkeys(range(4), "none"), expect=3)
    assert all(o["ok"] for o in out), out


def test_persistent_only_restore_with_ranks_loading_nothing_or_a_part(node_roots: Any, tmp_path: Path) -> None:
    """Every memory copy lost: rank 0 loads ``{}``, rank 1 a part, from the persistent tier alone."""
    roots = node_roots(2)
    url = f"file://{tmp_path / 'store'}"
    run_ranks(save, 2, roots, job="p", steps=2, persistent=url, persist_every=1)
    assert PersistentTier(url, "p").committed_steps()[-1] == 2
    for r in roots:
        wipe(r)
    out = run_ranks(load, 2, roots, job="p", want={0: "none", 1: "part"}, expect=2, persistent=url)
    assert all(o["ok"] for o in out), out
    assert out[1]["rank_from"]["persistent"] > 0 and out[0]["rank_from"]["persistent"] == 0, out
    out = run_ranks(load, 2, roots, job="p", want={0: "all", 1: "none"}, expect=2, persistent=url)
    assert all(o["ok"] for o in out), out
