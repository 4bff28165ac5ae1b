"""Accelerate end to end (CPU, 2 processes, DDP over gloo, torchrun): a rank is SIGKILLed mid-run, torchrun
restarts the group, ``GeminiAcceleratorCheckpoint.resume`` restores the newest step from node memory, and every
logged loss and the final parameters equal, bit for bit, those of a run that never failed (the model has
dropout and a LambdaLR schedule: the RNG, optimizer and schedule must come back too).

The model is small (``--width 16 --batch 8``): a step takes a few milliseconds, much less than a save's commit, so
with ``async_save=True`` every ``save()`` finds the previous step still committing — the case where a save queued
behind it let a crash lose two steps (issue 51). The bound is checked as a mechanism, not a timing: every rank logs,
once ``save(step)`` returned, the newest step it saw committed (never older than ``step - 1``), and the resumed step
is never older than the last step whose ``save()`` returned, minus one. One uninterrupted run is the reference of
both modes (the save mode does not change the training).

Runs ``examples/accelerate_resume.py`` (the file docs/integrations.md shows). Skipped where accelerate is not
importable: run it in the venv ``scripts/integrations_venv.sh`` builds. About 30-50 s on 2 shared cores.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest
from integration_runs import REPO, assert_same_final, launch, losses, private_tier_root

SCRIPT = REPO / "examples" / "accelerate_resume.py"
STEPS, FAIL_AT = 12, 9
SMALL = ["--width", "16", "--batch", "8"]  # steps of a few ms: shorter than a commit

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("accelerate") is None,
    reason="accelerate is not installed in this python: run from the venv of scripts/integrations_venv.sh",
)


@pytest.fixture(scope="module")
def tier_root() -> Iterator[Path]:
    with private_tier_root("gemini_acc_") as root:
        yield root


@pytest.fixture(scope="module")
def reference(tier_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run, shared by both modes."""
    out = tmp_path_factory.mktemp("acc_ref")
    ref = launch(tier_root, out, str(SCRIPT), "--job-id", "acc-ref", "--steps", str(STEPS), *SMALL)
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    return out


def saves(out: Path) -> list[tuple[int, int, int, int | None]]:
    """--save-log lines: (attempt, rank, step whose save() returned, newest step that rank saw committed)."""
    rows = [line.split() for line in (out / "saves").read_text().splitlines()]
    return [(int(a), int(r), int(s), None if c == "None" else int(c)) for a, r, s, c in rows]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_accelerate_kill_and_resume_bit_exact(tmp_path: Path, tier_root: Path, reference: Path, mode: str) -> None:
    """torchrun restarts the group in place (``--max-restarts 1``) after the SIGKILL; ``async``: saves through
    ``AsyncCheckpointer``, so the newest committed step at the kill may be one older than the last save."""
    extra = ["--async-save"] if mode == "async" else []
    run = launch(tier_root, tmp_path, str(SCRIPT), "--job-id", f"acc-kill-{mode}", "--steps", str(STEPS), *SMALL,
                 "--fail-at-step", str(FAIL_AT), "--save-log", str(tmp_path / "saves"), *extra, restarts=1)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-6000:]
    assert "injected failure" in log
    rows = saves(tmp_path)
    first = {}  # (attempt, rank) -> the first step it saved (its checkpointer knew no commit before)
    for attempt, rank, step, committed in rows:  # the mechanism: save(step) returned once step - 1 had committed
        if first.setdefault((attempt, rank), step) == step:
            continue
        assert committed is not None and committed >= step - (1 if mode == "async" else 0), (attempt, rank, step, committed)
    last_returned = max(step for attempt, _, step, _ in rows if attempt == 0)
    resumed = next(int(ln.split()[3]) for ln in log.splitlines() if ln.startswith("resumed from step "))
    assert resumed >= last_returned - (1 if mode == "async" else 0), (resumed, last_returned)
    assert resumed >= FAIL_AT - (2 if mode == "async" else 1)
    got, want = losses(tmp_path), losses(reference)
    assert sorted(got) == list(range(1, STEPS + 1))  # the step counter continues where the checkpoint was
    assert got == want
    assert_same_final(tmp_path, reference)
