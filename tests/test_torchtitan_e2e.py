"""torchtitan end to end (CPU, 2 ranks, FSDP2 over gloo): a rank is SIGKILLed mid-run, torchrun restarts
the group, ``GeminiCheckpointManager`` resumes from gemini_dcp's memory tier (newer than torchtitan's own
folder checkpoint), and the final parameters equal, bit for bit, those of a run that never failed.

Runs ``examples/torchtitan/run_cpu.sh`` (the llama3 debugmodel, seq 64 x batch 2, 8 steps, torchtitan's default
activation checkpointing), with blocking per-step
saves (``sync``) and through ``AsyncCheckpointer`` (``async``, the default: the copy of step t overlaps step t+1, so
the newest committed step at the kill may be one older); at every save, launch.py's ``TITAN_CHECK_STATES`` compares
the state dict saved with torchtitan's own ``_flattened_model_states_sd()``, bit for bit. Skipped where
torchtitan is not importable — CI does not install it (it downgrades fsspec); see examples/torchtitan/README.md
for the venv (torch 2.13 + torchtitan 0.3.0) in which this passes: ``/work/venv-titan/bin/python -m pytest
tests/test_torchtitan_e2e.py``. About 180 s on 2 shared cores (one reference launch shared by both modes,
then per mode one launch with a restart).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "torchtitan" / "run_cpu.sh"
STEPS, FAIL_AT, INTERVAL = 8, 6, 4

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torchtitan") is None or importlib.util.find_spec("tokenizers") is None,
    reason="torchtitan (0.3.0) and tokenizers are not installed in this python: CI does not install torchtitan "
    "(it downgrades fsspec); run this test from a venv that has it (examples/torchtitan/README.md)",
)


def _run(out: Path, root: Path, job: str, env_extra: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.update(PYTHON=sys.executable, GEMINI_DCP_ROOT=str(root), JOB_ID=job, STEPS=str(STEPS),
               INTERVAL=str(INTERVAL), PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]),
               **env_extra)
    return subprocess.run(["bash", str(SCRIPT), str(out), *args], env=env, text=True, capture_output=True,
                          timeout=300, cwd=REPO)


def _losses(log: str) -> dict[int, str]:
    plain = re.sub(r"\x1b\[[0-9;]*m", "", log)
    return {int(s): v for s, v in re.findall(r"step:\s+(\d+)\s+loss:\s+([0-9.]+)", plain)}  # resumed steps overwrite


@pytest.fixture(scope="module")
def tier_root() -> Iterator[Path]:
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    root = Path(tempfile.mkdtemp(prefix="gemini_titan_", dir=base))
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, tier_root: Path) -> tuple[Path, str]:
    """An uninterrupted run without checkpoints: its final parameters and its log."""
    out = tmp_path_factory.mktemp("titan-ref")
    ref = _run(out / "ref", tier_root, "titan-ref", {"TITAN_DUMP_FINAL": str(out / "ref.pt")}, "--checkpoint.no-enable")
    assert ref.returncode == 0, f"reference run failed:\n{ref.stdout[-3000:]}\n{ref.stderr[-3000:]}"
    return out / "ref.pt", ref.stdout + ref.stderr


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_torchtitan_killed_rank_resumes_from_memory_bit_exact(
    tmp_path: Path, tier_root: Path, reference: tuple[Path, str], mode: str
) -> None:
    import torch

    ref_pt, ref_log = reference
    run = _run(tmp_path / "run", tier_root, f"titan-{mode}",
               {"TITAN_DUMP_FINAL": str(tmp_path / "run.pt"), "TITAN_FAIL_AT_STEP": str(FAIL_AT),
                "GEMINI_ASYNC": "true" if mode == "async" else "false", "TITAN_CHECK_STATES": "1"})
    out = run.stdout + run.stderr
    assert run.returncode == 0, f"failing run did not recover:\n{out[-4000:]}"
    assert f"injected failure: SIGKILL rank 1 during step {FAIL_AT}" in out
    # Every save held exactly what torchtitan's own state dict held at that step (launch.py's check; the
    # model part comes from ModelStatesCache, not a full model.state_dict(), after the first save).
    assert re.search(r"states check: [1-9]\d* saves exact \([1-9]\d* fused-qkv split values\)", out), out[-4000:]
    assert re.search(r"model states: [1-9]\d* reused", out), out[-4000:]
    # With torchtitan's default activation checkpointing (selective; the example's default too): the cache sees
    # through the checkpoint wrapper, so each launch builds the model states at its first save (and once more
    # after the resume's load, which replaces torchtitan's dict) and reuses them at every other save.
    assert "Applied SelectiveAC activation checkpointing" in out, out[-4000:]
    assert "gemini_dcp: model states: reused at every save" in out and "full state_dict() at every save" not in out
    built = [int(b) for b in re.findall(r"model states: \d+ reused, (\d+) built", out)]
    assert len(built) >= 2 * (STEPS - 1) and max(built) <= 2, built
    # A torchrun restart of the same job is not another job's checkpoint (dcp/reader.py's launch note).
    assert "may be another job's checkpoint" not in out, [ln for ln in out.splitlines() if "saved by launch" in ln]
    # Resumed from gemini_dcp's local tier at the step before the kill (async: maybe the one before),
    # newer than (or tied with) torchtitan's folder step.
    resumed = re.findall(r"gemini_dcp: resumed from step (\d+) \(local: \d+ B.*?folder newest: (\w+)\)", out)
    want = [FAIL_AT - 1] if mode == "sync" else [FAIL_AT - 2, FAIL_AT - 1]
    assert len(resumed) == 1 and int(resumed[0][0]) in want and resumed[0][1] == str(INTERVAL), out[-4000:]
    # ... through fast_load's fast path: the saved structure (a fused-qkv split included) is the one loaded into.
    assert re.search(r"gemini_dcp: resumed from step \d+ .*? \(fast path,", out), [ln for ln in out.splitlines() if "resumed" in ln]
    # The resume says how the fresh optimizer got its state: gemini_dcp.init_optimizer_state, or torchtitan's
    # zero-gradient step with init_optimizer_state's reason (torchtitan's default AdamW is fused=True, which
    # init_optimizer_state leaves to torch for DTensor parameters).
    assert re.search(r"optimizer state (created without a step|by torch's step \(fused=True with DTensor parameters\))\)",
                     out), [ln for ln in out.splitlines() if "resumed" in ln]
    # torchtitan's own interval checkpoints kept working beside gemini_dcp's.
    folder = tmp_path / "run" / "dump" / "checkpoint"
    assert sorted(p.name for p in folder.iterdir()) == [f"step-{INTERVAL}", f"step-{STEPS}"]

    want, got = torch.load(ref_pt), torch.load(tmp_path / "run.pt")
    assert sorted(want) == sorted(got)
    diff = [k for k in want if not torch.equal(want[k], got[k])]
    assert not diff, f"parameters differ after resume: {diff[:5]}"
    assert _losses(out) == _losses(ref_log)
    assert sorted(_losses(out)) == list(range(1, STEPS + 1))
