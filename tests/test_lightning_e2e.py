"""Lightning end to end (CPU, 2 processes, FSDP2 through ``GeminiModelParallelStrategy`` over gloo, torchrun): a
rank is SIGKILLed mid-run, torchrun restarts the group, ``trainer.fit(ckpt_path=RESUME)`` restores the newest step from
node memory, and every logged loss and the final parameters equal, bit for bit, those of a run that never failed
(dropout and a LambdaLR schedule: RNG, optimizer, scheduler and ``global_step`` must come back).

Runs ``examples/lightning_resume.py`` (the file docs/integrations.md shows). Skipped where lightning is not
importable: run it in the venv ``scripts/integrations_venv.sh`` builds. About 60 s on 2 shared cores.
"""

from __future__ import annotations

import importlib.util
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from integration_runs import REPO, assert_same_final, launch, losses, private_tier_root

SCRIPT = REPO / "examples" / "lightning_resume.py"
STEPS, FAIL_AT = 8, 5

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("lightning") is None,
    reason="lightning is not installed in this python: run from the venv of scripts/integrations_venv.sh",
)


@pytest.fixture
def tier_root() -> Iterator[Path]:
    with private_tier_root("gemini_lit_") as root:
        yield root


def test_lightning_kill_and_resume_bit_exact(tmp_path: Path, tier_root: Path) -> None:
    """torchrun restarts the group in place (``--max-restarts 1``); the restarted ranks resume (``ckpt_path=RESUME``)."""
    ref = launch(tier_root, tmp_path / "ref", str(SCRIPT), "--job-id", "lit-ref", "--steps", str(STEPS))
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    run = launch(tier_root, tmp_path / "kill", str(SCRIPT), "--job-id", "lit-kill", "--steps", str(STEPS),
                 "--fail-at-step", str(FAIL_AT), restarts=1)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-6000:]
    assert "injected failure" in log and "nothing to resume" in log
    assert f"resumed from step {FAIL_AT - 1}" in log, log[-4000:]
    got, want = losses(tmp_path / "kill"), losses(tmp_path / "ref")
    assert sorted(got) == list(range(1, STEPS + 1))  # the step counter continues where the checkpoint was
    assert got == want
    assert_same_final(tmp_path / "kill", tmp_path / "ref")
    # Lightning's own ModelCheckpoint kept writing its sharded folder beside the saves into memory ...
    assert (tmp_path / "kill" / "checkpoints" / "last.ckpt" / ".metadata").exists()
    # ... and RESUME takes it when memory lost the job (a replaced node, no persistent tier): steps 9, 10 follow 8
    shutil.rmtree(tier_root / "lit-kill")
    more = launch(tier_root, tmp_path / "kill", str(SCRIPT), "--job-id", "lit-kill", "--steps", str(STEPS + 2))
    log = more.stdout + more.stderr
    assert more.returncode == 0, log[-6000:]
    assert f"resumed from step {STEPS} (Lightning's" in log, log[-4000:]
    assert sorted(losses(tmp_path / "kill")) == list(range(1, STEPS + 3))
