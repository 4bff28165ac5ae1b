"""The Lightning and Accelerate integrations' own pieces, without Lightning or Accelerate installed (CI runs these).

- ``GeminiAcceleratorCheckpoint`` never imports Accelerate: driven here with a stand-in ``accelerator`` (it only reads
  ``process_index``) over a DDP model on 2 gloo ranks: nothing to resume on a first launch; a second launch gets
  the model, optimizer, scheduler, step and each rank's RNG back, and trains on bit for bit as the first did.
- ``integrations.rng``: the RNG states round-trip.
- ``integrations.lightning``: its checkpoint paths; importing it needs no Lightning.

The full loops run in tests/test_lightning_e2e.py and tests/test_accelerate_e2e.py (their own venv).
"""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from mp_utils import node_root_factory, run_ranks

REPO = Path(__file__).resolve().parents[1]


def test_rng_round_trip() -> None:
    import numpy as np
    import torch

    from gemini_dcp.integrations.rng import rng_state, set_rng_state

    saved = rng_state()
    want = (torch.rand(3), random.random(), np.random.rand(2))
    torch.rand(5), random.random(), np.random.rand(7)  # move every generator on
    set_rng_state(saved)
    got = (torch.rand(3), random.random(), np.random.rand(2))
    assert torch.equal(got[0], want[0]) and got[1] == want[1] and (got[2] == want[2]).all()


def test_lightning_paths_and_lazy_import() -> None:
    from gemini_dcp.integrations.lightning import RESUME, gemini_path, parse_gemini_path

    assert parse_gemini_path(gemini_path(12)) == 12
    assert parse_gemini_path(RESUME) is None
    assert parse_gemini_path("checkpoints/last.ckpt") is False
    code = ("import sys, gemini_dcp, gemini_dcp.integrations.lightning, gemini_dcp.integrations.accelerate\n"
            "print(sorted(m for m in ('lightning', 'accelerate') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def _accelerate_loop(rank: int, world_size: int, root: str, first: int, last: int) -> dict[str, Any]:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from gemini_dcp.integrations.accelerate import GeminiAcceleratorCheckpoint

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Dropout(0.2),
                                                        torch.nn.Linear(32, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    ckpt = GeminiAcceleratorCheckpoint(SimpleNamespace(process_index=rank), model, opt, sched,
                                       root=root, job_id="acc-unit")
    restored = ckpt.resume()
    losses = {}
    for step in range((restored or 0) + 1, last + 1):
        x = torch.randn(4, 8)  # from the (restored) RNG: a resume that lost it draws other batches
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        losses[step] = loss.item()
        if step <= first:
            ckpt.save(step)
    return {"restored": restored, "losses": losses, "lr": opt.param_groups[0]["lr"],
            "params": [p.detach().clone() for p in model.parameters()]}


@pytest.mark.slow
def test_accelerator_checkpoint_resumes_bit_exact() -> None:
    roots, cleanup = node_root_factory("acc_unit")
    try:
        nodes = roots(2)
        ref = run_ranks(_accelerate_loop, 2, nodes, first=3, last=6)  # saves 1..3, trains on to 6
        assert [r["restored"] for r in ref] == [None, None]
        again = run_ranks(_accelerate_loop, 2, nodes, first=0, last=6)  # resumes at 3
        for a, b in zip(again, ref):
            assert a["restored"] == 3
            assert a["losses"] == {k: v for k, v in b["losses"].items() if k > 3}
            assert a["lr"] == b["lr"]
            assert all(x.equal(y) for x, y in zip(a["params"], b["params"]))
    finally:
        cleanup()
