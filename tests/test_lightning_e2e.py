"""Lightning end to end (CPU, 2 processes, FSDP2 through ``GeminiModelParallelStrategy`` over gloo, torchrun): ranks
are SIGKILLed mid-run twice, torchrun restarts the group each time, ``trainer.fit(ckpt_path=RESUME)`` restores the
newest step from node memory, and every logged loss and the final parameters equal, bit for bit, those of a run that
never failed (dropout and a LambdaLR schedule: RNG, optimizer, scheduler and ``global_step`` must come back).

The data come from real loaders (``examples/lightning_resume.py --loader combined``): Lightning's ``CombinedLoader``
of torchdata's ``StatefulDataLoader`` (shuffled, a worker: its position must come back) and a plain ``DataLoader``
without a generator (shuffled, a worker: its iterator draws its base seed from the global generator), each given
a ``DistributedSampler`` by Lightning; 4 steps per epoch. The first kill (step 6) restores step 5, within epoch 1;
the second (step 9) restores step 8, which ended epoch 1 (the next epoch's iterators are built after the restore).
Then the job is wiped from memory and resumes from Lightning's own folder checkpoint, and another job in the same
folder does not resume it (issue 51).

Runs ``examples/lightning_resume.py`` (the file docs/integrations.md shows). Skipped where lightning or torchdata is
not importable: run it in the venv ``scripts/integrations_venv.sh`` builds. About 60-90 s on 2 shared cores.
"""

from __future__ import annotations

import importlib.util
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from integration_runs import REPO, assert_same_final, launch, losses, private_tier_root

SCRIPT = REPO / "examples" / "lightning_resume.py"
STEPS, KILLS = 10, (6, 9)  # 4 steps per epoch: step 5 is within epoch 1, step 8 ends it

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("lightning") is None or importlib.util.find_spec("torchdata") is None,
    reason="lightning / torchdata are not installed in this python: run from the venv of scripts/integrations_venv.sh",
)


@pytest.fixture
def tier_root() -> Iterator[Path]:
    with private_tier_root("gemini_lit_") as root:
        yield root


def test_lightning_kill_and_resume_bit_exact(tmp_path: Path, tier_root: Path) -> None:
    """torchrun restarts the group in place (``--max-restarts 2``); the restarted ranks resume (``ckpt_path=RESUME``)."""
    common = [str(SCRIPT), "--steps", str(STEPS), "--loader", "combined"]
    ref = launch(tier_root, tmp_path / "ref", *common, "--job-id", "lit-ref")
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    run = launch(tier_root, tmp_path / "kill", *common, "--job-id", "lit-kill",
                 "--fail-at-step", ",".join(map(str, KILLS)), restarts=len(KILLS))
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-6000:]
    assert log.count("injected failure") == 2 and "nothing to resume" in log
    for step in (k - 1 for k in KILLS):
        assert f"resumed from step {step} (bytes per tier: {{'local': " in log, log[-4000:]
    # Within an epoch, the plain loader's position cannot come back: one warning names it (here its data do not
    # depend on the position, so the run is still exact); a step that ended its epoch loses nothing: no warning.
    warned = [ln for ln in log.splitlines() if "cannot be restored" in ln]
    assert len(warned) == 1 and "step 5 within an epoch" in warned[0] and "#1 (DataLoader)" in warned[0], warned
    got, want = losses(tmp_path / "kill"), losses(tmp_path / "ref")
    assert sorted(got) == list(range(1, STEPS + 1))  # the step counter continues where the checkpoint was
    assert got == want
    assert_same_final(tmp_path / "kill", tmp_path / "ref")
    # Lightning's own ModelCheckpoint kept writing its sharded folder beside the saves into memory ...
    assert (tmp_path / "kill" / "checkpoints" / "last.ckpt" / ".metadata").exists()
    # ... and RESUME takes it when memory lost the job (a replaced node, no persistent tier): steps 11, 12 follow 10
    shutil.rmtree(tier_root / "lit-kill")
    more = launch(tier_root, tmp_path / "kill", *common[:-2], "--job-id", "lit-kill", "--steps", str(STEPS + 2))
    log = more.stdout + more.stderr
    assert more.returncode == 0, log[-6000:]
    assert f"resumed from step {STEPS} (Lightning's" in log, log[-4000:]
    assert sorted(losses(tmp_path / "kill")) == list(range(1, STEPS + 3))
    # Another job in the same folder does not resume this job's folder checkpoints: it starts at step 1, warned.
    other = launch(tier_root, tmp_path / "kill", str(SCRIPT), "--job-id", "lit-other", "--steps", "1")
    log = other.stdout + other.stderr
    assert other.returncode == 0, log[-6000:]
    assert "nothing to resume: starting at step 1" in log, log[-4000:]
    assert "it was written by job 'lit-kill', and this run is job 'lit-other'" in log, log[-4000:]
