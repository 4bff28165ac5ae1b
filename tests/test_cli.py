"""Issue 6: the `gemini-dcp` CLI, through Typer's CliRunner and through real subprocesses,
on tier contents written by real dcp.save calls (one process, and 2 gloo ranks on 2 simulated nodes)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
import torch.distributed.checkpoint as dcp
from typer.testing import CliRunner

from gemini_dcp.core.checksum import resolve_algo
from gemini_dcp.errors import ConfigError
from gemini_dcp.local.tier import LocalTier
from gemini_dcp_cli.main import app

REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()

# One real single-process save per step, in a separate process (as a trainer would).
SAVE_SCRIPT = textwrap.dedent(
    """
    import sys, warnings
    warnings.simplefilter("ignore")
    import torch, torch.distributed.checkpoint as dcp
    from gemini_dcp import GeminiStorageWriter
    root, job = sys.argv[1], sys.argv[2]
    for step in map(int, sys.argv[3:]):
        sd = {"model": {"w": torch.arange(64 * 33, dtype=torch.float32).reshape(64, 33) + step,
                        "b": torch.full((17,), float(step), dtype=torch.float64)},
              "step": step, "meta": {"lr": 0.1 * step}}
        dcp.save(sd, storage_writer=GeminiStorageWriter(root=root, job_id=job), checkpoint_id=step)
    """
)


def expected_state(step: int) -> dict[str, Any]:
    return {"model": {"w": torch.arange(64 * 33, dtype=torch.float32).reshape(64, 33) + step,
                      "b": torch.full((17,), float(step), dtype=torch.float64)},
            "step": step, "meta": {"lr": 0.1 * step}}


def _tmp_base() -> str:
    return "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


@pytest.fixture(scope="module")
def saved_root() -> Iterator[str]:
    """A tier root holding job 'j', steps 1..3 saved with keep=2 (so steps 2 and 3 remain)."""
    d = tempfile.mkdtemp(prefix="gemini-cli-", dir=_tmp_base())
    subprocess.run([sys.executable, "-c", SAVE_SCRIPT, d, "j", "1", "2", "3"], check=True, cwd=REPO,
                   env={**os.environ, "PYTHONWARNINGS": "ignore"})
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def root_copy(saved_root: str) -> Iterator[str]:
    """A private copy of the saved root, for tests that change it."""
    d = tempfile.mkdtemp(prefix="gemini-cli-copy-", dir=_tmp_base())
    shutil.copytree(saved_root, d, dirs_exist_ok=True)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def cli(*args: str) -> Any:
    return runner.invoke(app, list(args))


def cli_json(*args: str, code: int = 0) -> Any:
    res = cli(*args, "--json")
    assert res.exit_code == code, (res.exit_code, res.output)
    return json.loads(res.stdout)


def assert_user_error(res: Any, *needles: str) -> None:
    assert res.exit_code == 1, (res.exit_code, res.output)
    assert "Traceback" not in res.output, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    for n in needles:
        assert n in res.output, (n, res.output)


def gemini_dcp_cmd() -> list[str]:
    exe = shutil.which("gemini-dcp")
    return [exe] if exe else [sys.executable, "-m", "gemini_dcp_cli.main"]


def run_cli(*args: str, module: bool = False) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "gemini_dcp_cli.main"] if module else gemini_dcp_cmd()
    return subprocess.run(cmd + list(args), capture_output=True, text=True, cwd=REPO, timeout=120,
                          env={**os.environ, "COLUMNS": "160", "PYTHONWARNINGS": "ignore"})


def has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:
        return False


# ---- help / structure ----------------------------------------------------------------------------
COMMANDS = ["inspect", "verify", "flush", "restore", "export", "plan", "gc", "doctor"]


def test_every_command_has_help_and_json() -> None:
    res = cli("--help")
    assert res.exit_code == 0
    for c in COMMANDS:
        assert c in res.output
        sub = cli(c, "--help")
        assert sub.exit_code == 0, (c, sub.output)
        assert "--json" in sub.output, c


# ---- inspect -------------------------------------------------------------------------------------
def test_inspect_json_and_table(saved_root: str) -> None:
    out = cli_json("inspect", "--root", saved_root)
    assert out["ok"] and out["root"] == saved_root
    (job,) = out["jobs"]
    assert job["job_id"] == "j" and job["newest_restorable"] == 3 and job["usage_bytes"] > 0
    assert [s["step"] for s in job["steps"]] == [2, 3]
    for s in job["steps"]:
        assert s["committed"] and s["restorable"] == "memory" and s["local_ranks"] == [0] and s["peer_ranks"] == []
        assert s["world_size"] == 1 and s["bytes_here"] == s["total_bytes"] > 64 * 33 * 4
        assert 0 <= s["age_s"] < 3600 and s["in_persistent"] is None
    res = cli("inspect", "--root", saved_root, "--job", "j")
    assert res.exit_code == 0, res.output
    assert "committed" in res.output and "memory" in res.output and "newest restorable step: 3" in res.output


DRAIN_SCRIPT = textwrap.dedent(
    """
    import sys, warnings
    warnings.simplefilter("ignore")
    import torch, torch.distributed.checkpoint as dcp
    from gemini_dcp import GeminiStorageWriter
    from gemini_dcp.persistent.drain import wait_idle
    root, url = sys.argv[1], sys.argv[2]
    for step in (1, 2, 3, 4):
        w = GeminiStorageWriter(root=root, job_id="d", persistent=url, persist_every=2)
        dcp.save({"w": torch.full((8,), float(step))}, storage_writer=w, checkpoint_id=step)
        assert wait_idle(w.tier.layout.persist_dir, 120)
    """
)


def test_inspect_shows_the_drain_to_the_persistent_tier(saved_root: str, tmp_path: Path) -> None:
    assert cli_json("inspect", "--root", saved_root)["jobs"][0]["drain"] is None  # no persistent tier configured
    d = tempfile.mkdtemp(prefix="gemini-cli-drain-", dir=_tmp_base())
    url = f"file://{tmp_path / 'store'}"
    try:
        subprocess.run([sys.executable, "-c", DRAIN_SCRIPT, d, url], check=True, cwd=REPO, timeout=300,
                       env={**os.environ, "PYTHONWARNINGS": "ignore", "GEMINI_DCP_DRAIN_IDLE_S": "1"})
        drain = cli_json("inspect", "--root", d)["jobs"][0]["drain"]
        assert drain["url"] == url and drain["every"] == 2 and drain["pending"] == [] and drain["adopt_pending"] == []
        assert [(e["step"], e["state"]) for e in drain["recent"]] == [(2, "done"), (4, "done")], drain
        res = cli("inspect", "--root", d)
        assert res.exit_code == 0, res.output
        assert f"persistent drain -> {url} (steps that are multiples of 2)   pending: none" in res.output
        assert "this node's part: step 2 done" in res.output and "step 4 done" in res.output
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_inspect_errors_are_messages_not_tracebacks(saved_root: str, tmp_path: Path) -> None:
    assert_user_error(cli("inspect", "--root", str(tmp_path / "nope")), "does not exist")
    assert_user_error(cli("inspect", "--root", saved_root, "--job", "other"), "jobs present: j")
    err = cli_json("inspect", "--root", saved_root, "--job", "other", code=1)
    assert err == {"ok": False, "error": "CheckpointNotFoundError", "message": err["message"]}
    (tmp_path / "f").write_text("x")
    assert_user_error(cli("inspect", "--root", str(tmp_path / "f")), "not a directory")
    assert_user_error(cli("inspect", "--root", saved_root, "--job", "bad/name"), "not usable as a directory name")


def test_root_from_environment(saved_root: str) -> None:
    res = runner.invoke(app, ["inspect", "--json"], env={"GEMINI_DCP_ROOT": saved_root})
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["jobs"][0]["job_id"] == "j"
    res = runner.invoke(app, ["verify", "--json"], env={"GEMINI_DCP_ROOT": saved_root, "TORCHELASTIC_RUN_ID": "j"})
    assert res.exit_code == 0 and json.loads(res.stdout)["ok"], res.output


# ---- verify --------------------------------------------------------------------------------------
def _corrupt(root: str, job: str, step: int, fqn: str, at: int = 5) -> Path:
    """Flip one byte of item ``fqn`` of ``step``, found through the step record."""
    tier = LocalTier(root, job, create=False)
    rec = tier.record(step)
    assert rec is not None
    (idx, ref), = [(i, r) for i, r in rec.metadata.storage_data.items() if i.fqn == fqn]
    slot = rec.slot_of(ref.rank)
    path = tier.slot_path(ref.rank, slot.slot)
    with open(path, "r+b") as f:
        f.seek(ref.offset + at)
        b = f.read(1)
        f.seek(ref.offset + at)
        f.write(bytes([b[0] ^ 0xFF]))
    return path


def test_verify_detects_a_corrupted_byte(root_copy: str) -> None:
    out = cli_json("verify", "--root", root_copy, "--job", "j")
    assert out["ok"] and out["steps"] == [2, 3] and out["counts"]["bad"] == 0 and out["counts"]["ok"] >= 8
    _corrupt(root_copy, "j", 3, "model.w")
    out = cli_json("verify", "--root", root_copy, "--job", "j", code=1)
    bad = [i for i in out["items"] if i["status"] == "bad"]
    assert [(i["step"], i["fqn"], i["rank"]) for i in bad] == [(3, "model.w", 0)]
    assert resolve_algo("auto") in bad[0]["detail"]  # the algorithm the default writer used here
    assert cli_json("verify", "2", "--root", root_copy, "--job", "j")["ok"]  # the other slot is intact
    res = cli("verify", "3", "--root", root_copy, "--job", "j")
    assert res.exit_code == 1 and "FAILED" in res.output and "model.w" in res.output
    assert_user_error(cli("verify", "9", "--root", root_copy, "--job", "j"), "step 9", "steps here: [2, 3]")
    assert cli("verify", "-1", "--root", root_copy, "--job", "j").exit_code == 2  # usage error


def test_verify_reports_a_missing_slot_file(root_copy: str) -> None:
    tier = LocalTier(root_copy, "j", create=False)
    rec = tier.record(2)
    tier.slot_path(0, rec.slot_of(0).slot).unlink()
    out = cli_json("verify", "--root", root_copy, "--job", "j", code=1)
    assert out["counts"]["missing"] >= 1 and all(i["step"] == 2 for i in out["items"] if i["status"] == "missing")
    step2 = [s for s in cli_json("inspect", "--root", root_copy)["jobs"][0]["steps"] if s["step"] == 2][0]
    assert step2["restorable"] == "no" and "missing" in step2["problem"]


# ---- flush / restore / export ----------------------------------------------------------------------
def _load_stock(path: str, step: int) -> None:
    sd = expected_state(0)
    sd["model"]["w"].zero_()
    sd["model"]["b"].zero_()
    dcp.load(sd, checkpoint_id=path)  # stock FileSystemReader: no gemini_dcp code involved
    want = expected_state(step)
    assert torch.equal(sd["model"]["w"], want["model"]["w"]) and torch.equal(sd["model"]["b"], want["model"]["b"])
    assert sd["step"] == step and sd["meta"] == want["meta"]


def test_flush_restore_export(saved_root: str, tmp_path: Path) -> None:
    store = tmp_path / "store"
    out = cli_json("flush", "3", "--to", f"file://{store}", "--root", saved_root, "--job", "j")
    assert out["complete"] and out["step"] == 3 and out["from_memory"] > 0 and out["missing"] == []
    _load_stock(str(store / "j" / "step-3"), 3)
    # The persistent tier now shows up in inspect and verify.
    steps = cli_json("inspect", "--root", saved_root, "--persistent", f"file://{store}")["jobs"][0]["steps"]
    assert {s["step"]: s["in_persistent"] for s in steps} == {2: False, 3: True}
    ver = cli_json("verify", "3", "--root", saved_root, "--job", "j", "--persistent", str(store))
    assert ver["ok"] and {i["tier"] for i in ver["items"]} == {"memory", "persistent"}

    res = cli("restore", "2", "--to", str(tmp_path / "restored"), "--root", saved_root, "--job", "j")
    assert res.exit_code == 0 and "complete" in res.output, res.output
    _load_stock(str(tmp_path / "restored"), 2)
    assert_user_error(cli("restore", "7", "--to", str(tmp_path / "x"), "--root", saved_root, "--job", "j"), "step 7")
    assert_user_error(cli("flush", "3", "--to", "nosuchproto://x", "--root", saved_root, "--job", "j"), "protocol")

    from safetensors.torch import load_file

    exp = cli_json("export", "3", "--to", str(tmp_path / "st"), "--root", saved_root, "--job", "j")
    tensors = load_file(exp["path"])
    assert torch.equal(tensors["w"], expected_state(3)["model"]["w"]) and set(tensors) == {"w", "b"}
    assert_user_error(cli("export", "3", "--to", str(tmp_path / "st2"), "--root", saved_root, "--job", "j",
                          "--prefix", "nothing."), "prefix")
    assert cli("export", "3", "--to", str(tmp_path / "st3"), "--format", "onnx", "--root", saved_root).exit_code == 2


# ---- gc / remove ---------------------------------------------------------------------------------
def _holder(path: Path) -> subprocess.Popen[str]:
    """A process that keeps ``path`` open (as a running trainer keeps its slot files)."""
    p = subprocess.Popen([sys.executable, "-c", f"f = open({str(path)!r}, 'rb'); print('ready', flush=True); "
                          "import time; time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


def test_gc_never_evicts_the_newest_committed_step(root_copy: str) -> None:
    tier = LocalTier(root_copy, "j", create=False)
    # A save of step 4 whose commit has not finished yet: newer than the newest committed step (3).
    pending = dataclasses.replace(tier.record(3), step=4, complete=False)
    tier.write_record(pending)
    dry = cli_json("gc", "--keep", "1", "--dry-run", "--root", root_copy, "--job", "j")
    assert dry["evicted_steps"] == [2] and dry["kept_steps"] == [3, 4] and tier.steps() == [2, 3, 4]
    out = cli_json("gc", "--keep", "1", "--root", root_copy, "--job", "j")
    assert out["evicted_steps"] == [2] and tier.steps() == [3, 4]
    assert out["freed_bytes"] > 0 and len(out["freed_files"]) == 2  # slots of step 2 and the spare one
    assert cli_json("verify", "3", "--root", root_copy, "--job", "j")["ok"]
    tier.delete_record(4)
    again = cli_json("gc", "--keep", "1", "--root", root_copy, "--job", "j")
    assert again["evicted_steps"] == [] and tier.steps() == [3]
    res = cli("gc", "--keep", "0", "--root", root_copy, "--job", "j")
    assert res.exit_code == 2 and tier.steps() == [3]
    from gemini_dcp.ops.housekeeping import collect_garbage

    with pytest.raises(ConfigError, match="remove-job"):
        collect_garbage(root_copy, "j", 0)


def test_gc_leaves_slot_files_a_process_has_open(root_copy: str) -> None:
    tier = LocalTier(root_copy, "j", create=False)
    spare = [p for s, p in tier.layout.slot_files(0).items() if s not in {r.slot_of(0).slot for r in tier.records().values()}]
    assert len(spare) == 1
    holder = _holder(spare[0])
    try:
        res = cli("gc", "--keep", "2", "--root", root_copy, "--job", "j")
        assert res.exit_code == 0 and "open in process" in res.output, res.output
        assert spare[0].exists()
    finally:
        holder.kill()
        holder.wait()
    out = cli_json("gc", "--keep", "2", "--root", root_copy, "--job", "j")
    assert out["freed_files"] == [str(spare[0])] and not spare[0].exists() and out["busy_files"] == {}


def test_remove_job(root_copy: str) -> None:
    assert_user_error(cli("gc", "--remove-job", "--root", root_copy), "--job")
    some_slot = next(iter(LocalTier(root_copy, "j", create=False).layout.slot_files(0).values()))
    holder = _holder(some_slot)
    try:
        assert_user_error(cli("gc", "--remove-job", "--job", "j", "--root", root_copy), "still in use", "--force")
    finally:
        holder.kill()
        holder.wait()
    out = cli_json("gc", "--remove-job", "--job", "j", "--root", root_copy)
    assert out["removed"] and out["steps"] == [2, 3] and out["freed_bytes"] > 0
    assert not (Path(root_copy) / "j").exists()
    assert cli_json("inspect", "--root", root_copy)["jobs"] == []
    assert_user_error(cli("gc", "--remove-job", "--job", "j", "--root", root_copy), "no checkpoint")


# ---- doctor --------------------------------------------------------------------------------------
def test_doctor(saved_root: str, tmp_path: Path) -> None:
    out = cli_json("doctor", "--root", saved_root, code=0 if _on_tmpfs(saved_root) else 1)
    checks = {c["name"]: c for c in out["checks"]}
    assert set(checks) >= {"tier root", "tmpfs", "free space", "/dev/shm", "memory", "GPUs", "torch", "extension"}
    assert checks["tier root"]["status"] == "pass" and checks["torch"]["status"] == "pass"
    huge = cli_json("doctor", "--root", saved_root, "--expected-gb", "100000", "--replicas", "2", code=1)
    fs = {c["name"]: c for c in huge["checks"]}["free space"]
    assert fs["status"] == "fail"
    if saved_root.startswith("/dev/shm/"):  # the container fix: a bigger /dev/shm
        assert "--shm-size" in fs["fix"] and "medium: Memory" in fs["fix"]
    assert "x 3 slots x 2 replicas" in fs["detail"]
    assert checks["extension"]["status"] in ("pass", "warn")  # never builds without --build-ext
    res = cli("doctor", "--root", str(tmp_path / "missing"))
    assert res.exit_code == 1 and "FAIL" in res.output and "mkdir -p" in res.output, res.output


def _on_tmpfs(path: str) -> bool:
    from gemini_dcp.ops.doctor import mount_of

    m = mount_of(Path(path))
    return m is not None and m[1] == "tmpfs"


def test_doctor_flags_disk_and_small_shm(tmp_path: Path) -> None:
    from gemini_dcp.ops.doctor import doctor

    mounts = tmp_path / "mounts"
    mounts.write_text("/dev/sda1 / ext4 rw 0 0\ntmpfs /dev/shm tmpfs rw 0 0\n")
    rep = doctor(str(tmp_path), mounts_file=str(mounts))
    tmpfs = {c.name: c for c in rep.checks}["tmpfs"]
    assert tmpfs.status == "fail" and "ext4" in tmpfs.detail and not rep.ok
    with pytest.raises(ConfigError):
        doctor(str(tmp_path), expected_gb=-1)


def test_doctor_reports_tmpfs_page_size(tmp_path: Path) -> None:
    from gemini_dcp.ops.doctor import doctor, tmpfs_huge_pages

    mounts = tmp_path / "mounts"
    sysfs = tmp_path / "shmem_enabled"
    tier = tmp_path / "tier"
    tier.mkdir()
    mounts.write_text(f"/dev/sda1 / ext4 rw 0 0\ntmpfs {tier} tmpfs rw,relatime,size=8388608k,huge=within_size 0 0\n")
    sysfs.write_text("always within_size advise [never] deny force\n")
    assert tmpfs_huge_pages(tier, str(mounts), str(sysfs)) == "within_size"
    sysfs.write_text("always within_size advise never [deny] force\n")
    assert tmpfs_huge_pages(tier, str(mounts), str(sysfs)) == "deny"  # sysfs deny overrides the mount
    sysfs.write_text("always within_size advise never deny [force]\n")
    assert tmpfs_huge_pages(tmp_path, str(mounts), str(sysfs)) == "force"
    sysfs.write_text("always within_size [advise] never deny force\n")
    assert tmpfs_huge_pages(tmp_path, str(mounts), str(sysfs)) == "never"  # "/" has no huge= option
    assert tmpfs_huge_pages(tier, str(tmp_path / "absent"), str(tmp_path / "absent")) == "never"

    mounts.write_text(f"/dev/sda1 / ext4 rw 0 0\ntmpfs {tier} tmpfs rw,relatime,size=8388608k 0 0\n")
    check = {c.name: c for c in doctor(str(tier), mounts_file=str(mounts)).checks}["huge pages"]
    if tmpfs_huge_pages(tier, str(mounts)) != "force":  # this machine's sysfs may force huge pages
        assert check.status == "info" and "4 KiB" in check.detail and "huge=within_size" in check.fix


# ---- plan ----------------------------------------------------------------------------------------
@pytest.mark.skipif(not has_module("gemini_dcp.peer.placement"), reason="gemini_dcp.peer.placement (issue 3) is not in the tree yet")
def test_plan_placement_and_probabilities() -> None:
    out = cli_json("plan", "--nodes", "16", "--replicas", "2", "--strategy", "group", "--failures", "3")
    probs = {r["failures"]: r["p_recover"] for r in out["recovery"]}
    assert probs[1] == pytest.approx(1.0) and probs[2] == pytest.approx(1 - 8 / 120, abs=1e-4)  # 0.9333
    assert len(out["holders"]) == 16 and len(out["groups"]) == 8
    mixed = cli_json("plan", "--nodes", "5", "--replicas", "2")
    assert mixed["strategy"] == "mixed" and len(mixed["holders"]) == 5
    res = cli("plan", "--nodes", "5", "--replicas", "2", "--strategy", "ring")
    assert res.exit_code == 0 and "P(recover from memory)" in res.output
    assert_user_error(cli("plan", "--nodes", "2", "--replicas", "3"), "replicas=3")
    assert_user_error(cli("plan", "--nodes", "5", "--replicas", "2", "--strategy", "group"), "divide")


def test_missing_component_is_a_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "gemini_dcp.peer.placement", None)  # as if this install lacked the module
    assert_user_error(cli("plan", "--nodes", "4", "--replicas", "2"), "gemini_dcp.peer.placement", "lacks")


@pytest.mark.skipif(not (has_module("gemini_dcp.peer.placement") and has_module("gemini_dcp.ops.costmodel")),
                    reason="gemini_dcp.peer.placement / gemini_dcp.ops.costmodel are not in the tree yet")
def test_plan_wasted_time() -> None:
    out = cli_json("plan", "--nodes", "16", "--replicas", "2", "--checkpoint-gb", "100", "--iteration-s", "60",
                   "--memory-bw-gbps", "50", "--persistent-bw-gbps", "2.5", "--failures-per-day", "2")
    wt = out["wasted_time"]
    # GEMINI's model: checkpoint time + interval / 2 + retrieval time.
    assert wt["gemini_wasted_per_failure_s"] == pytest.approx(2 + 60 / 2 + 2)
    assert wt["persistent_wasted_per_failure_s"] == pytest.approx(40 + 60 / 2 + 40)
    assert wt["gemini_wasted_per_day_s"] == pytest.approx(2 * 34)
    res = cli("plan", "--nodes", "16", "--replicas", "2", "--checkpoint-gb", "100", "--iteration-s", "60")
    assert res.exit_code == 0 and "wasted per failure" in res.output, res.output
    assert_user_error(cli("plan", "--nodes", "4", "--replicas", "2", "--iteration-s", "60"), "--checkpoint-gb")
    assert_user_error(cli("plan", "--nodes", "4", "--replicas", "2", "--checkpoint-gb", "0", "--iteration-s", "1"),
                      "checkpoint_gb")


# ---- real subprocesses ---------------------------------------------------------------------------
def test_subprocess_console_script(root_copy: str) -> None:
    p = run_cli("inspect", "--root", root_copy, "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["jobs"][0]["newest_restorable"] == 3
    _corrupt(root_copy, "j", 2, "model.b")
    p = run_cli("verify", "--root", root_copy, "--job", "j", module=True)
    assert p.returncode == 1 and "FAILED" in p.stdout and "model.b" in p.stdout, (p.stdout, p.stderr)
    p = run_cli("verify", "--root", root_copy + "-absent", "--job", "j")
    assert p.returncode == 1 and "does not exist" in p.stderr and "Traceback" not in p.stderr, p.stderr


# ---- two simulated nodes, 2 gloo ranks ---------------------------------------------------------------
def _save_two_nodes(rank: int, world_size: int, root: str, *, with_replicas: bool) -> None:
    from workloads import save_steps

    save_steps(rank, world_size, root, job="mp", steps=[5, 6], kind="dtensor", replicas=1)
    if with_replicas:  # one peer copy of each node's shards (needs gemini_dcp.peer.placement)
        save_steps(rank, world_size, root, job="rep", steps=[1], kind="dtensor", replicas=2)


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[list[str]]:
    """Two simulated nodes (one tier root each), one gloo rank per node: job 'mp' with replicas=1
    (each node holds only its own shards) and, where placement exists, job 'rep' with replicas=2."""
    from mp_utils import run_ranks

    roots = [tempfile.mkdtemp(prefix=f"gemini-cli-node{i}-", dir=_tmp_base()) for i in range(2)]
    run_ranks(_save_two_nodes, 2, roots, with_replicas=has_module("gemini_dcp.peer.placement"))
    yield roots
    for r in roots:
        shutil.rmtree(r, ignore_errors=True)


def test_two_nodes_partial_flush(two_nodes: list[str], tmp_path: Path) -> None:
    from workloads import full_weight

    n0, n1 = two_nodes
    job = cli_json("inspect", "--root", n0, "--job", "mp")["jobs"][0]
    s6 = job["steps"][-1]
    assert s6["step"] == 6 and s6["world_size"] == 2 and len(s6["nodes"]) == 2
    assert s6["local_ranks"] == [0] and s6["missing_ranks"] == [1] and s6["restorable"] == "no"
    assert "ranks [1]" in s6["problem"]
    url = f"file://{tmp_path / 'store'}"
    # Node 0 alone cannot flush the step: it refuses and names the shards it lacks.
    assert_user_error(cli("flush", "6", "--to", url, "--root", n0, "--job", "mp"), "not readable from this host", "rank1")
    part = cli_json("flush", "6", "--to", url, "--root", n0, "--job", "mp", "--allow-partial")
    assert not part["complete"] and part["missing"]
    done = cli_json("flush", "6", "--to", url, "--root", n1, "--job", "mp", "--allow-partial")
    assert done["complete"] and done["missing"] == []
    # Stock DCP reads the assembled step (single process: the whole tensor).
    sd = {"model": {"w": torch.zeros(64, 33), "b": torch.zeros(33, dtype=torch.float64)}, "step": 0}
    dcp.load(sd, checkpoint_id=str(tmp_path / "store" / "mp" / "step-6"))
    assert torch.equal(sd["model"]["w"], full_weight(6)) and sd["step"] == 6
    # With the persistent tier, node 0 can restore the whole step (memory + persistent).
    s6 = cli_json("inspect", "--root", n0, "--job", "mp", "--persistent", url)["jobs"][0]["steps"][-1]
    assert s6["restorable"] == "memory+persistent"
    res = cli_json("restore", "6", "--to", str(tmp_path / "r"), "--root", n0, "--job", "mp", "--persistent", url)
    assert res["complete"] and res["from_memory"] > 0 and res["from_persistent"] > 0


@pytest.mark.skipif(not has_module("gemini_dcp.peer.placement"), reason="gemini_dcp.peer.placement (issue 3) is not in the tree yet")
def test_two_nodes_with_peer_replicas(two_nodes: list[str], tmp_path: Path) -> None:
    n0, n1 = two_nodes
    s = cli_json("inspect", "--root", n0, "--job", "rep")["jobs"][0]["steps"][-1]
    assert s["local_ranks"] == [0] and s["peer_ranks"] == [1] and s["restorable"] == "memory"
    assert all(len(h) == 2 for h in s["holders"].values())
    res = cli("inspect", "--root", n0, "--job", "rep")
    assert "replica placement" in res.output and "n0 (ranks 0) -> n0, n1" in res.output, res.output
    ver = cli_json("verify", "--root", n1, "--job", "rep")
    assert ver["ok"] and {i["rank"] for i in ver["items"]} == {0, 1}
    out = cli_json("restore", "1", "--to", str(tmp_path / "r"), "--root", n1, "--job", "rep")
    assert out["complete"] and out["from_persistent"] == 0
