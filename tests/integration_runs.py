"""Launching the integration examples under torchrun for the end-to-end tests (2 processes, CPU, gloo)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def launch(root: Path, out: Path, *args: str, restarts: int = 0) -> subprocess.CompletedProcess[str]:
    """``torchrun --nproc-per-node 2`` of an example script with ``--loss-log out/losses --dump-final out/final.pt``."""
    # A fresh rendezvous store per restart: torch shares one across restarts without a per-attempt prefix, and a
    # restarted worker can then reach a dead worker's gloo address (examples/common.py, "setup").
    env = dict(os.environ, GEMINI_DCP_ROOT=str(root), OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", str(restarts),
           "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", *args,
           "--loss-log", str(out / "losses"), "--dump-final", str(out / "final.pt")]
    out.mkdir(parents=True, exist_ok=True)
    return subprocess.run(cmd, env=env, text=True, capture_output=True, timeout=240, cwd=out)


def losses(out: Path) -> dict[int, str]:
    """``step -> loss.hex()``; a step logged twice (before the kill and after the resume) keeps its last line."""
    return {int(s): v for s, v in (line.split() for line in (out / "losses").read_text().splitlines())}


def assert_same_final(a: Path, b: Path) -> None:
    x, y = torch.load(a / "final.pt", weights_only=True), torch.load(b / "final.pt", weights_only=True)
    assert x.keys() == y.keys()
    for k in x:
        assert torch.equal(x[k], y[k]), k


@contextlib.contextmanager
def private_tier_root(prefix: str) -> Iterator[Path]:
    """A fresh tier root (on /dev/shm where writable), removed afterwards."""
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    root = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)
