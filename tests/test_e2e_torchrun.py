"""End to end under torchrun: a rank is SIGKILLed mid-run, torchrun restarts the worker
group, training resumes from the local memory tier, and the final parameters equal —
bit for bit — those of a run that never failed.

Both runs use ``examples/train_fsdp2.py`` (FSDP2 over 2 CPU ranks, gloo, one thread
per rank, deterministic data and seeds). The failure-free run does not checkpoint at
all, so equality also shows that checkpointing itself leaves training untouched.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "train_fsdp2.py"
MODEL = ["--layers", "2", "--d-model", "64", "--heads", "4", "--seq", "32", "--batch", "4"]
STEPS = 12
FAIL_AT = 6


def _tier_root() -> Path:
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix="gemini_e2e_", dir=base))


def _torchrun(args: list[str], env_extra: dict[str, str], timeout: float, script: Path = SCRIPT) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.update(
        # torchrun shares its rendezvous store across restarts without a per-attempt key
        # prefix; restarted workers may then read dead workers' gloo addresses.
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        **env_extra,
    )
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "--max-restarts", "2", "--monitor-interval", "0.1", str(script), *(MODEL if script == SCRIPT else []), *args,
    ]
    return subprocess.run(cmd, env=env, text=True, capture_output=True, timeout=timeout, cwd=REPO)


def _losses(path: Path) -> dict[int, str]:
    out: dict[int, str] = {}
    for line in path.read_text().splitlines():
        step, hexloss = line.split()
        out[int(step)] = hexloss  # a re-run step overwrites: the resumed run's value counts
    return out


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_killed_rank_resumes_from_memory_bit_exact(tmp_path: Path, mode: str) -> None:
    """A rank is SIGKILLed mid-run; torchrun restarts the group; the run resumes from memory bit-exact.

    ``async``: the example saves through ``AsyncCheckpointer`` (``--async-ckpt``): the copy of
    step t runs during step t+1, so the newest committed step at the kill may be one older.
    """
    extra = ["--async-ckpt"] if mode == "async" else []
    root = _tier_root()
    try:
        ref = _torchrun(
            ["--steps", str(STEPS), "--ckpt-backend", "none",
             "--dump-final", str(tmp_path / "ref.pt"), "--loss-log", str(tmp_path / "ref.loss")],
            {"GEMINI_DCP_ROOT": str(root)}, timeout=110,
        )
        assert ref.returncode == 0, f"reference run failed:\n{ref.stdout[-3000:]}\n{ref.stderr[-3000:]}"

        job = f"e2e-{uuid.uuid4().hex[:8]}"
        run = _torchrun(
            ["--steps", str(STEPS), "--fail-at-step", str(FAIL_AT), "--job-id", job, "--cleanup", *extra,
             "--dump-final", str(tmp_path / "run.pt"), "--loss-log", str(tmp_path / "run.loss")],
            {"GEMINI_DCP_ROOT": str(root)}, timeout=150,
        )
        out = run.stdout + run.stderr
        assert run.returncode == 0, f"failing run did not recover:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
        assert f"injected failure: SIGKILL myself during step {FAIL_AT}" in out
        resumed = [int(m) for m in re.findall(r"resumed from step (\d+) \(tier: local,", out)]
        want_steps = [FAIL_AT - 1] if mode == "sync" else [FAIL_AT - 2, FAIL_AT - 1]
        assert len(resumed) == 1 and resumed[0] in want_steps, out[-3000:]
        assert "attempt 1;" in out  # the step came back through a torchrun restart

        want = torch.load(tmp_path / "ref.pt")
        got = torch.load(tmp_path / "run.pt")
        assert sorted(want) == sorted(got)
        diff = [k for k in want if not torch.equal(want[k], got[k])]
        assert not diff, f"parameters differ after resume: {diff[:5]}"

        # The loss curve continues exactly: every step's loss, bit for bit.
        ref_loss, run_loss = _losses(tmp_path / "ref.loss"), _losses(tmp_path / "run.loss")
        assert sorted(run_loss) == list(range(1, STEPS + 1))
        assert run_loss == ref_loss
        # --cleanup removed the job's memory-tier files.
        assert not (root / job).exists()
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.skipif(importlib.util.find_spec("torchrec") is None, reason="torchrec not installed")
def test_torchrec_killed_rank_resumes_bit_exact(tmp_path: Path) -> None:
    """DLRM with TABLE_WISE-sharded EmbeddingBagCollection under DistributedModelParallel
    (ShardedTensor weights, fused row-wise Adagrad state): same kill-and-resume, same bits."""
    script = REPO / "examples" / "train_torchrec.py"
    root = _tier_root()
    try:
        common = ["--steps", "8", "--rows", "1000", "--batch", "32", "--print-params-hash"]
        ref = _torchrun(["--ckpt-backend", "none", *common], {"GEMINI_DCP_ROOT": str(root)}, timeout=90, script=script)
        assert ref.returncode == 0, ref.stdout[-2000:] + ref.stderr[-2000:]
        run = _torchrun(["--fail-at-step", "4", "--cleanup", *common], {"GEMINI_DCP_ROOT": str(root)}, timeout=120, script=script)
        out = run.stdout + run.stderr
        assert run.returncode == 0, out[-4000:]
        assert "resumed from step 3 (tier: local," in out, out[-3000:]
        want = re.findall(r"final params sha256 ([0-9a-f]+)", ref.stdout)
        got = re.findall(r"final params sha256 ([0-9a-f]+)", run.stdout)
        assert want and got == want
    finally:
        shutil.rmtree(root, ignore_errors=True)
