"""DeepSpeed ZeRO end to end (CPU, 2 ranks over gloo, torchrun, 2 simulated nodes with ``replicas=2``).

One launch trains ZeRO-1, ZeRO-2, ZeRO-3 and ZeRO-3 + bf16 one engine after another (sync and async saves
mixed), each checkpointing every step through ``use_gemini``; the killed launch SIGKILLs the last rank during
step ``FAIL_AT`` of config ``a`` on torchrun attempt ``a``, so every config is killed once and torchrun restarts
the group each time; on every even restart the killed rank's node is replaced (its tier root and checkpoint
directory removed), so that config resumes from its peer's copy. Every logged loss and every config's final
weights equal, bit for bit, those of the uninterrupted launch. Async configs log, once ``save_checkpoint(N)``
returned, the newest step they saw committed: never older than ``N - 1`` (the bound), and a resume never falls
further back than that.

Then, from the uninterrupted launch's tiers: ``gemini-dcp export --format deepspeed`` writes a step as
DeepSpeed's directory that DeepSpeed's ``zero_to_fp32`` reads into the final weights (``save_16bit_model``
ran after the last step and did not overwrite it); a 1-rank launch on the 2-rank steps fails with
``WorldSizeError`` naming the conversion; a NaN put into the weights marks its steps unhealthy and the next
launch resumes from the step before it, continuing the reference's losses.

Runs ``examples/deepspeed_resume.py``. Skipped where deepspeed is not importable: run it with the python of
``scripts/deepspeed_venv.sh``. About 3-4 min on 2 shared cores (six launches of ~15 s each, plus restarts).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from integration_runs import REPO, private_tier_root

SCRIPT = REPO / "examples" / "deepspeed_resume.py"
CONFIGS = ["1:fp32:sync", "2:fp32:async", "3:fp32:sync", "3:bf16:async"]
NAMES = [f"z{s}-{p}-{m}" for s, p, m in (c.split(":") for c in CONFIGS)]
STEPS, FAIL_AT = 8, 5

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="deepspeed is not installed in this python: run from the venv of scripts/deepspeed_venv.sh",
)


def launch(out: Path, nodes: Path, *args: str, restarts: int = 0, nproc: int = 2) -> subprocess.CompletedProcess[str]:
    """torchrun of the example: each rank a simulated node (``nodes/<rank>`` tier root, ``out/ckpt<rank>``)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", DS_ACCELERATOR="cpu",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--max-restarts", str(restarts),
           "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", str(SCRIPT), "--node-root", f"{nodes}/{{node}}",
           "--ckpt-dir", f"{out}/ckpt{{node}}", "--replicas", "2", "--loss-log", str(out / "losses"),
           "--dump-final", str(out / "final.pt"), *args]
    return subprocess.run(cmd, env=env, text=True, capture_output=True, timeout=900, cwd=out)


def losses(out: Path) -> dict[tuple[str, int], str]:
    """(config, step) -> loss.hex(); a step logged twice (before a kill and after the resume) keeps its last line."""
    return {(c, int(s)): v for c, s, v in (line.split() for line in (out / "losses").read_text().splitlines())}


def resumes(log: str) -> list[tuple[str, int, int, dict[str, int]]]:
    """(config, attempt, restored step, bytes per tier) of every resume from the tiers."""
    pat = re.compile(r"config (\S+) attempt (\d+): resumed step (\d+) \(.*\) bytes per tier (\{.*\}) in")
    return [(m[1], int(m[2]), int(m[3]), eval(m[4])) for m in pat.finditer(log)]  # noqa: S307 - our own log line


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    """The uninterrupted launch (every config); its tier roots stay for the export and world-size tests."""
    with private_tier_root("gemini_ds_ref_") as nodes:
        out = tmp_path_factory.mktemp("ds_ref")
        run = launch(out, nodes, "--job-id", "ref", "--configs", ",".join(CONFIGS), "--steps", str(STEPS),
                     "--save-16bit-model")
        assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-6000:]
        yield out, nodes


def test_kill_each_zero_stage_and_resume_bit_exact(tmp_path: Path, reference: tuple[Path, Path]) -> None:
    ref, _ = reference
    with private_tier_root("gemini_ds_kill_") as nodes:
        run = launch(tmp_path, nodes, "--job-id", "kill", "--configs", ",".join(CONFIGS), "--steps", str(STEPS),
                     "--fail-at-step", str(FAIL_AT), "--wipe-on-restart", "--save-log", str(tmp_path / "saves"),
                     restarts=len(CONFIGS))
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-8000:]
    assert log.count("injected failure") == len(CONFIGS)
    assert len(re.findall(r"replaced node", log)) == len(CONFIGS) // 2
    got, want = losses(tmp_path), losses(ref)
    assert sorted(got) == sorted(want) and len(want) == len(CONFIGS) * STEPS
    assert got == want
    final, final_ref = torch.load(tmp_path / "final.pt", weights_only=True), torch.load(ref / "final.pt", weights_only=True)
    for name in NAMES:
        assert final[name].keys() == final_ref[name].keys()
        assert all(torch.equal(final[name][k], final_ref[name][k]) for k in final[name]), name
    # every config resumed after its own kill; a replaced node's shards came from its peer
    back = {(c, a): (s, tiers) for c, a, s, tiers in resumes(log)}
    last_returned: dict[tuple[int, str], int] = {}
    seen: set[tuple[str, str, str]] = set()
    for row in (tmp_path / "saves").read_text().splitlines():
        attempt, rank, name, step, committed = row.split()
        if (attempt, rank, name) in seen and name.endswith("async"):  # the bound, as a mechanism: N - 1 committed
            assert committed != "None" and int(committed) >= int(step) - 1, row
        if name.endswith("-sync"):
            assert committed == step, row
        seen.add((attempt, rank, name))
        key = (int(attempt), name)
        last_returned[key] = max(last_returned.get(key, 0), int(step))
    for index, name in enumerate(NAMES):
        step, tiers = back[(name, index + 1)]
        fallback = 1 if name.endswith("async") else 0
        assert step >= last_returned[(index, name)] - fallback, (name, step)
        assert FAIL_AT - 1 - fallback <= step <= FAIL_AT - 1
        if (index + 1) % 2 == 0:  # this restart replaced the killed rank's node
            assert tiers["peer"] > 0, (name, tiers)


def test_export_is_read_by_zero_to_fp32(tmp_path: Path, reference: tuple[Path, Path]) -> None:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from typer.testing import CliRunner

    from cli.main import app

    ref, nodes = reference
    final = torch.load(ref / "final.pt", weights_only=True)
    assert (ref / "ckpt0" / "z1-fp32-sync" / "pytorch_model.bin").is_file()  # save_16bit_model wrote to disk
    for name in ("z1-fp32-sync", "z2-fp32-async", "z3-fp32-sync"):
        out = tmp_path / name
        res = CliRunner().invoke(app, ["export", str(STEPS), "--format", "deepspeed", "--to", str(out),
                                       "--root", str(nodes / "0"), "--job", f"ref-{name}"])
        assert res.exit_code == 0, res.output
        assert (out / "latest").read_text() == f"global_step{STEPS}"
        sd = get_fp32_state_dict_from_zero_checkpoint(str(out))
        assert sd.keys() == final[name].keys()
        for k in sd:
            assert torch.equal(sd[k], final[name][k]), (name, k)


def test_other_world_size_is_refused(tmp_path: Path, reference: tuple[Path, Path]) -> None:
    _, nodes = reference
    run = launch(tmp_path, nodes, "--job-id", "ref", "--configs", "3:fp32:sync", "--steps", str(STEPS + 1), nproc=1)
    log = run.stdout + run.stderr
    assert run.returncode != 0
    assert "WorldSizeError" in log and "saved by 2 ranks; this job has 1" in log, log[-4000:]
    assert "--format deepspeed" in log and "ds_to_universal" in log


def test_nan_steps_are_passed_over(tmp_path: Path, reference: tuple[Path, Path]) -> None:
    ref, _ = reference
    with private_tier_root("gemini_ds_nan_") as nodes:
        first = launch(tmp_path, nodes, "--job-id", "ref", "--configs", "2:fp32:async", "--steps", "5", "--nan-at-step", "3")
        assert first.returncode == 0, first.stderr[-4000:]
        poisoned = losses(tmp_path)
        assert float.fromhex(poisoned[("z2-fp32-async", 4)]) != float.fromhex(poisoned[("z2-fp32-async", 4)])  # NaN
        second = launch(tmp_path, nodes, "--job-id", "ref", "--configs", "2:fp32:async", "--steps", str(STEPS))
    log = second.stdout + second.stderr
    assert second.returncode == 0, log[-4000:]
    assert [(c, s) for c, _, s, _ in resumes(log)] == [("z2-fp32-async", 2)]
    got, want = losses(tmp_path), losses(ref)
    for step in range(3, STEPS + 1):
        assert got[("z2-fp32-async", step)] == want[("z2-fp32-async", step)], step
