"""SlotPool: the ring's other slots get their pages at the first save (prefault), so a fresh
writer's second save lands in a slot already grown; a slot a save holds is left to that save."""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from gemini_dcp import GeminiStorageWriter


def _wait_for(cond, deadline_s: float = 60.0) -> bool:  # a bounded poll: the mechanism, not a clock
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def test_first_save_grows_the_other_slots_of_the_ring(tmp_path: Path) -> None:
    root = tmp_path / "tier"
    root.mkdir(mode=0o700)
    sd = {f"t{i}": torch.full((1 << 18,), float(i)) for i in range(4)}  # 4 MiB
    writer = GeminiStorageWriter(root=str(root), job_id="pf", keep=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, storage_writer=writer, checkpoint_id=1)
    pool = writer.slot_pool
    paths = [pool.tier.slot_path(0, idx) for idx in range(3)]
    need = sum(t.numel() * 4 for t in sd.values())
    assert _wait_for(lambda: all(p.exists() and p.stat().st_size >= need for p in paths)), \
        [p.stat().st_size if p.exists() else None for p in paths]
    # Only once per slot: a second save with the same plan starts no prefault.
    assert pool.prefault(0, need, len(sd)) is None


def test_a_slot_a_save_holds_is_left_to_that_save(tmp_path: Path) -> None:
    root = tmp_path / "tier"
    root.mkdir(mode=0o700)
    writer = GeminiStorageWriter(root=str(root), job_id="held", keep=1)
    pool = writer.slot_pool
    held = pool.slot(0, 0)
    with held.lock:
        thread = pool.prefault(0, 8 << 20, 1)
        assert thread is not None
        thread.join(60)
        assert not thread.is_alive()
        assert held.capacity == 0  # left alone: the save holding it grows it
    assert pool.slot(0, 1).capacity >= 8 << 20
