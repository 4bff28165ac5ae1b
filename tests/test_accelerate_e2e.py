"""Accelerate end to end (CPU, 2 processes, DDP over gloo, torchrun): a rank is SIGKILLed mid-run, torchrun
restarts the group, ``GeminiAcceleratorCheckpoint.resume`` restores the newest step from node memory, and every
logged loss and the final parameters equal, bit for bit, those of a run that never failed (the model has
dropout and a LambdaLR schedule: the RNG, optimizer and schedule must come back too).

Runs ``examples/accelerate_resume.py`` (the file docs/integrations.md shows). Skipped where accelerate is not
importable: run it in the venv ``scripts/integrations_venv.sh`` builds. About 20-40 s on 2 shared cores.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest
from integration_runs import REPO, assert_same_final, launch, losses, private_tier_root

SCRIPT = REPO / "examples" / "accelerate_resume.py"
STEPS, FAIL_AT = 8, 5

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("accelerate") is None,
    reason="accelerate is not installed in this python: run from the venv of scripts/integrations_venv.sh",
)


@pytest.fixture
def tier_root() -> Iterator[Path]:
    with private_tier_root("gemini_acc_") as root:
        yield root


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_accelerate_kill_and_resume_bit_exact(tmp_path: Path, tier_root: Path, mode: str) -> None:
    """torchrun restarts the group in place (``--max-restarts 1``) after the SIGKILL; ``async``: saves through
    ``AsyncCheckpointer``, so the newest committed step at the kill may be one older."""
    ref = launch(tier_root, tmp_path / "ref", str(SCRIPT), "--job-id", "acc-ref", "--steps", str(STEPS))
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    extra = ["--async-save"] if mode == "async" else []
    run = launch(tier_root, tmp_path / "kill", str(SCRIPT), "--job-id", "acc-kill", "--steps", str(STEPS),
                 "--fail-at-step", str(FAIL_AT), *extra, restarts=1)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-6000:]
    assert "injected failure" in log
    resumed = [FAIL_AT - 1] if mode == "sync" else [FAIL_AT - 2, FAIL_AT - 1]
    assert any(f"resumed from step {s} " in log for s in resumed), log[-4000:]
    got, want = losses(tmp_path / "kill"), losses(tmp_path / "ref")
    assert sorted(got) == list(range(1, STEPS + 1))  # the step counter continues where the checkpoint was
    assert got == want
    assert_same_final(tmp_path / "kill", tmp_path / "ref")
