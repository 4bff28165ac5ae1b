"""Issue 19, trust boundary: files in a tier root never run as code; owners, links and modes are checked.

Every test is single-process. Tests that hand files to another user need root
(``os.chown``); they are skipped otherwise. uid 65534 stands for a hostile local
user ("nobody").
"""

from __future__ import annotations

import errno
import os
import pickle
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex, TensorProperties
from typer.testing import CliRunner

from cli.main import app
from gemini_dcp import GeminiStorageReader, GeminiStorageWriter, find_gemini_error
from gemini_dcp.core.safe_pickle import restricted_loads
from gemini_dcp.errors import IncompatibleCheckpointError, TierFullError, TierRootError, UntrustedDataError
from gemini_dcp.local import job_dir as layout_mod, record_codec, record_types
from gemini_dcp.local.job_dir import (
    JobLayout,
    atomic_write_bytes,
    check_root,
    create_root,
    ensure_private_dir,
    remove_stale_tmp,
)
from gemini_dcp.local.record_codec import decode_record, encode_record, read_record
from gemini_dcp.local.record_types import RankSlot, ShardRef, StepRecord
from gemini_dcp.local.slots import ReadOnlySlot, SlotFile
from gemini_dcp.local.tier import LocalTier

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="handing files to another uid needs root")
runner = CliRunner()


@pytest.fixture
def root() -> Iterator[Path]:
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    d = Path(tempfile.mkdtemp(prefix="gemini-sec-", dir=base))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory outside the tier root (a victim's files live here)."""
    d = tmp_path / "outside"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    return d


# ---- planted records -------------------------------------------------------------------------------
class _RunsCode:
    """What an attacker pickles: unpickling it would run ``touch <marker>``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def _framed(payload: bytes, magic: bytes = record_codec.RECORD_MAGIC, torch_version: str = torch.__version__) -> bytes:
    """``payload`` behind a valid record header (the checksum is unkeyed: anyone can compute it)."""
    if magic == record_codec.RECORD_MAGIC_V1:
        body = payload
    else:
        v = torch_version.encode()
        body = record_codec._VERSIONS.pack(record_codec.RECORD_FORMAT, len(v)) + v + payload
    return record_codec._HEADER.pack(magic, len(body), xxhash.xxh3_64_intdigest(body)) + body


def _plant_record(root: Path, job: str, step: int, marker: Path, magic: bytes = record_codec.RECORD_MAGIC) -> Path:
    steps = ensure_private_dir(root / job / "steps")
    path = steps / f"step-{step:012d}.rec"
    path.write_bytes(_framed(pickle.dumps(_RunsCode(marker)), magic))
    return path


def _save(root: Path, job: str, step: int) -> dict[str, torch.Tensor]:
    sd = {"w": torch.arange(12, dtype=torch.float32) + step}
    dcp.save(sd, storage_writer=GeminiStorageWriter(root=str(root), job_id=job), checkpoint_id=step)
    return sd


@pytest.mark.parametrize("magic", [record_codec.RECORD_MAGIC, record_codec.RECORD_MAGIC_V1], ids=["gemrec02", "gemrec01"])
def test_planted_record_does_not_run_code_on_dcp_load(
    root: Path, tmp_path: Path, magic: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """The planted newest record is refused (UntrustedDataError, raised or reported) and never run;
    if the load goes on, it restores the genuine older step, never the planted one."""
    marker = tmp_path / "pwned"
    saved = _save(root, "j", 1)
    _plant_record(root, "j", 2, marker, magic)
    target = {"w": torch.zeros(12)}
    try:
        dcp.load(target, storage_reader=GeminiStorageReader(root=str(root), job_id="j"))
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP wraps it (a BaseException)
        err = find_gemini_error(exc)
        assert isinstance(err, UntrustedDataError), exc
        refusal = str(err)
    else:
        assert torch.equal(target["w"], saved["w"])
        refusal = caplog.text
        assert "UntrustedDataError" in refusal
    assert "posix.system" in refusal and "step-000000000002.rec" in refusal
    assert not marker.exists()


def test_planted_record_does_not_run_code_on_cli_inspect(root: Path, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    _plant_record(root, "j", 7, marker)
    res = runner.invoke(app, ["inspect", "--root", str(root), "--json"])
    assert res.exit_code == 0, res.output
    assert "UntrustedDataError" in res.output and "posix.system" in res.output
    res = runner.invoke(app, ["inspect", "--root", str(root)])
    assert res.exit_code == 0 and "unreadable" in res.output
    res = runner.invoke(app, ["verify", "--root", str(root), "--job", "j", "--json"])
    assert "UntrustedDataError" in res.output
    assert not marker.exists()


def test_restricted_loads_refuses_every_global_outside_the_allow_list() -> None:
    for evil in (pickle.dumps(getattr), pickle.dumps(os.system), pickle.dumps(subprocess.Popen)):
        with pytest.raises(UntrustedDataError, match="src.*names"):
            restricted_loads(evil, source="src")
    # what a record legitimately holds loads
    meta = Metadata(state_dict_metadata={"b": BytesStorageMetadata()}, storage_data={MetadataIndex("b"): 1})
    assert restricted_loads(pickle.dumps(meta), source="m") == meta
    assert restricted_loads(pickle.dumps((torch.bfloat16, torch.Size([2]))), source="t") == (torch.bfloat16, torch.Size([2]))


def test_unreadable_pickle_from_a_newer_torch_names_both_versions() -> None:
    with pytest.raises(IncompatibleCheckpointError) as info:
        restricted_loads(b"\x80\x05garbage", source="rec", writer_torch="9.1.0")
    assert "9.1.0" in str(info.value) and torch.__version__ in str(info.value)
    with pytest.raises(IncompatibleCheckpointError) as info:
        decode_record(_framed(b"\x80\x05garbage", torch_version="9.1.0"), source="r")
    assert "9.1.0" in str(info.value)
    with pytest.raises(UntrustedDataError):  # same torch: just not ours
        restricted_loads(b"\x80\x05garbage", source="rec", writer_torch=torch.__version__)


def test_record_of_a_newer_format_is_refused_as_incompatible() -> None:
    data = bytearray(encode_record(_record(1)))
    data[:8] = b"GEMREC09"
    with pytest.raises(IncompatibleCheckpointError, match="newer gemini_dcp"):
        decode_record(bytes(data), source="r")


# ---- record formats --------------------------------------------------------------------------------
def _record(step: int, **kw: object) -> StepRecord:
    meta = Metadata(state_dict_metadata={"b": BytesStorageMetadata()},
                    storage_data={MetadataIndex("b"): ShardRef(0, 0, 8, 123, "crc32c")})
    return StepRecord("j", step, 1, meta, ("n",), (8,), {"n": ("n",)}, 1, "mixed", (RankSlot(0, 0, 8),), "n",
                      created_unix=1.0, **kw)  # type: ignore[arg-type]


def test_old_gemrec01_records_still_decode() -> None:
    rec = _record(3)
    old = _framed(pickle.dumps(rec, protocol=pickle.HIGHEST_PROTOCOL), record_codec.RECORD_MAGIC_V1)
    assert decode_record(old, source="old") == rec
    # a record of the version before launch_id existed: its pickle has 13 fields
    import copyreg

    state = [getattr(rec, f.name) for f in record_types._STEP_FIELDS][:13]

    class Old(pickle.Pickler):
        def reducer_override(self, obj: object) -> object:
            if type(obj) is StepRecord:
                return (copyreg.__newobj__, (StepRecord,), state)
            return NotImplemented

    import io

    buf = io.BytesIO()
    Old(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(rec)
    got = decode_record(_framed(buf.getvalue(), record_codec.RECORD_MAGIC_V1), source="older")
    assert got == rec and got.launch_id == "" and got.launch_description == ""


def test_new_records_carry_torch_version_and_launch_fields() -> None:
    rec = _record(4, launch_id="L1", launch_description="torchrun run 1")
    data = encode_record(rec)
    assert data[:8] == b"GEMREC02" and torch.__version__.encode() in data[: 64]
    back = decode_record(data)
    assert back == rec and back.launch_id == "L1"


def test_six_field_tensor_properties_decode_on_this_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    props = TensorProperties(dtype=torch.float16, memory_format=torch.channels_last)
    five = TensorProperties.__getstate__
    monkeypatch.setattr(TensorProperties, "__getstate__", lambda self: five(self)[:5] + ((4, 1),))  # + strides
    six = pickle.dumps(props)
    monkeypatch.undo()
    got = restricted_loads(six, source="torch-2.15 metadata")
    assert type(got) is TensorProperties
    fields = ("dtype", "layout", "requires_grad", "memory_format", "pin_memory")
    assert all(getattr(got, f) == getattr(props, f) for f in fields)
    if "strides" in getattr(TensorProperties, "__dataclass_fields__", {}):  # torch >= 2.15 keeps them
        assert tuple(got.strides) == (4, 1)
    assert restricted_loads(pickle.dumps(props), source="5 fields") == props


# ---- owners, links and modes ---------------------------------------------------------------------------
@as_root
def test_root_owned_by_another_uid_is_refused(root: Path) -> None:
    os.chown(root, NOBODY, NOBODY)
    with pytest.raises(TierRootError, match=f"uid {NOBODY}"):
        GeminiStorageWriter(root=str(root), job_id="j")
    with pytest.raises(TierRootError, match=f"uid {NOBODY}"):
        GeminiStorageReader(root=str(root), job_id="j")


@as_root
def test_job_dir_owned_by_another_uid_is_refused(root: Path, tmp_path: Path) -> None:
    job = root / "default"
    (job / "steps").mkdir(parents=True, mode=0o700)
    for d in (job, job / "steps"):
        os.chown(d, NOBODY, NOBODY)
    with pytest.raises(TierRootError) as info:
        LocalTier(root, "default")
    msg = str(info.value)
    assert f"uid {NOBODY}" in msg and "GEMINI_DCP_ROOT" in msg and str(job) in msg
    with pytest.raises(TierRootError, match=f"uid {NOBODY}"):
        LocalTier(root, "default", create=False).steps()
    res = runner.invoke(app, ["inspect", "--root", str(root), "--json"])
    assert res.exit_code == 0 and f"uid {NOBODY}" in res.output


@as_root
def test_steps_dir_owned_by_another_uid_is_refused(root: Path) -> None:
    steps = root / "j" / "steps"
    steps.mkdir(parents=True, mode=0o700)
    os.chown(steps, NOBODY, NOBODY)
    with pytest.raises(TierRootError, match=f"{steps}.*uid {NOBODY}"):
        LocalTier(root, "j")


@as_root
def test_record_owned_by_another_uid_is_refused(root: Path, tmp_path: Path) -> None:
    path = _plant_record(root, "j", 1, tmp_path / "pwned")
    path.write_bytes(encode_record(_record(1)))
    os.chown(path, NOBODY, NOBODY)
    with pytest.raises(UntrustedDataError, match=f"uid {NOBODY}"):
        read_record(path)


def test_symlinked_job_dir_is_refused_and_its_target_unchanged(root: Path, outside: Path) -> None:
    (root / "j").symlink_to(outside)
    with pytest.raises(TierRootError, match="symbolic link"):
        LocalTier(root, "j")
    with pytest.raises(TierRootError, match="symbolic link"):
        GeminiStorageWriter(root=str(root), job_id="j")
    assert stat.S_IMODE(os.stat(outside).st_mode) == 0o755
    assert list(outside.iterdir()) == []


def test_symlinked_root_is_refused(root: Path, outside: Path) -> None:
    os.chmod(outside, 0o700)
    link = root / "link-root"
    link.symlink_to(outside)
    with pytest.raises(TierRootError, match="symbolic link"):
        check_root(link, explicit=True)


def test_planted_slot_symlink_is_not_followed(root: Path, outside: Path) -> None:
    victim = outside / "precious"
    victim.write_bytes(b"root's file")
    rank_dir = ensure_private_dir(root / "j" / "ranks" / "rank-00000")
    for slot in range(4):
        (rank_dir / f"slot-{slot}.bin").symlink_to(victim)
    with pytest.raises(UntrustedDataError, match="symbolic link"):
        SlotFile(rank_dir / "slot-0.bin")
    with pytest.raises(UntrustedDataError, match="symbolic link"):
        ReadOnlySlot(rank_dir / "slot-0.bin")
    with pytest.raises((Exception, CheckpointException)) as info:
        _save(root, "j", 1)
    assert isinstance(find_gemini_error(info.value), UntrustedDataError), info.value
    assert victim.read_bytes() == b"root's file"


@as_root
def test_precreated_world_writable_slot_of_another_uid_is_refused(root: Path) -> None:
    rank_dir = ensure_private_dir(root / "j" / "ranks" / "rank-00000")
    for slot in range(4):
        p = rank_dir / f"slot-{slot}.bin"
        p.write_bytes(b"\0" * 4096)
        os.chmod(p, 0o666)
        os.chown(p, NOBODY, NOBODY)
    with pytest.raises(UntrustedDataError, match=f"uid {NOBODY}"):
        SlotFile(rank_dir / "slot-0.bin")
    with pytest.raises((Exception, CheckpointException)) as info:
        _save(root, "j", 1)
    assert isinstance(find_gemini_error(info.value), UntrustedDataError), info.value
    assert all((rank_dir / f"slot-{s}.bin").read_bytes() == b"\0" * 4096 for s in range(4))


def test_own_slot_with_loose_mode_is_tightened(root: Path) -> None:
    rank_dir = ensure_private_dir(root / "j" / "ranks" / "rank-00000")
    p = rank_dir / "slot-0.bin"
    p.write_bytes(b"")
    os.chmod(p, 0o666)
    SlotFile(p).close()
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o600


@pytest.mark.parametrize("mode", [0o775, 0o777, 0o757])
def test_group_or_other_writable_root_is_refused(root: Path, mode: int) -> None:
    os.chmod(root, mode)
    with pytest.raises(TierRootError, match="writable"):
        check_root(root, explicit=True)


def test_sticky_root_of_our_own_is_accepted(root: Path) -> None:
    os.chmod(root, 0o1777)
    assert check_root(root, explicit=True) == root


def test_group_writable_job_dir_is_refused(root: Path) -> None:
    (root / "j").mkdir(mode=0o700)
    os.chmod(root / "j", 0o770)
    with pytest.raises(TierRootError, match="writable"):
        LocalTier(root, "j")


def test_private_dirs_are_created_0700_and_tightened(root: Path) -> None:
    (root / "j").mkdir()
    os.chmod(root / "j", 0o755)
    LocalTier(root, "j")
    for d in (root / "j", root / "j" / "steps", root / "j" / "ranks"):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700


def test_create_root_makes_a_missing_root_private_and_leaves_an_existing_one(tmp_path: Path, outside: Path) -> None:
    root = tmp_path / "made" / "gemini"
    assert create_root(root) and check_root(root, explicit=True) == root
    assert stat.S_IMODE(os.lstat(root).st_mode) == 0o700 and stat.S_IMODE(os.lstat(root.parent).st_mode) == 0o700
    os.chmod(root, 0o755)
    assert not create_root(root) and stat.S_IMODE(os.lstat(root).st_mode) == 0o755  # existing: not touched
    link = tmp_path / "planted"
    link.symlink_to(outside)
    assert not create_root(link)  # a planted link is not followed, and refused by the root check
    with pytest.raises(TierRootError, match="symbolic link"):
        check_root(link, explicit=True)
    assert not list(outside.iterdir())


@as_root
def test_create_root_leaves_another_users_root_to_be_refused(root: Path) -> None:
    os.chown(root, NOBODY, NOBODY)
    assert not create_root(root)
    with pytest.raises(TierRootError, match=f"owned by another user; it belongs to uid {NOBODY}"):
        check_root(root, explicit=True)


@as_root
def test_squatted_default_root_is_refused(tmp_path: Path, outside: Path) -> None:
    shm = tmp_path / "shm"  # stands for /dev/shm: world-writable with the sticky bit
    shm.mkdir()
    os.chmod(shm, 0o1777)
    default = shm / "gemini_dcp"
    default.mkdir()
    os.chown(default, NOBODY, NOBODY)
    with pytest.raises(TierRootError) as info:
        check_root(default, explicit=False)
    msg = str(info.value)
    assert f"uid {NOBODY}" in msg and "GEMINI_DCP_ROOT" in msg and "gemini_dcp-$UID" in msg
    default.rmdir()
    default.symlink_to(outside)
    with pytest.raises(TierRootError, match="symbolic link"):
        check_root(default, explicit=False)
    default.unlink()
    assert check_root(default, explicit=False) == default  # not squatted: created private
    assert stat.S_IMODE(os.lstat(default).st_mode) == 0o700


# ---- atomic writes, full tiers, stale files ------------------------------------------------------------
def test_enospc_at_the_record_write_gives_tier_full_and_no_tmp_file(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = LocalTier(root, "j")

    def full(fd: int, data: object) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(layout_mod.os, "write", full)
    with pytest.raises(TierFullError) as info:
        tier.write_record(_record(5))
    monkeypatch.undo()
    assert "bytes" in str(info.value) and "free of" in str(info.value)
    assert os.listdir(tier.layout.steps_dir) == []


def test_enospc_on_a_real_full_tmpfs(tmp_path: Path) -> None:
    mnt = tmp_path / "small"
    mnt.mkdir(mode=0o700)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs is not permitted here")
    try:
        with pytest.raises(TierFullError, match="need 1,048,576 bytes"):
            atomic_write_bytes(mnt / "big.rec", b"x" * (1 << 20))
        assert os.listdir(mnt) == []
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_stale_tmp_files_of_dead_processes_are_removed(root: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    steps = ensure_private_dir(root / "j" / "steps")
    stale = steps / f".step-000000000001.rec.tmp-{dead.pid}-140001"
    live = steps / f".step-000000000002.rec.tmp-{os.getppid()}"
    stale.write_bytes(b"x")
    live.write_bytes(b"x")
    assert remove_stale_tmp(steps) == [stale.name]
    assert live.exists() and not stale.exists()
    stale.write_bytes(b"x")
    JobLayout(root, "j2").create()  # another steps dir: this one untouched
    assert stale.exists()
    layout_mod._swept.discard(steps)
    JobLayout(root, "j").create()
    assert not stale.exists()


def test_tmp_file_is_created_exclusively_not_through_a_link(root: Path, outside: Path) -> None:
    victim = outside / "precious"
    victim.write_bytes(b"keep")
    ensure_private_dir(root / "d")
    target = root / "d" / "x.rec"
    (root / "d" / f".x.rec.tmp-{os.getpid()}-{threading.get_ident()}").symlink_to(victim)
    atomic_write_bytes(target, b"new")  # the planted link is removed, never written through
    assert target.read_bytes() == b"new" and victim.read_bytes() == b"keep"


def test_large_steps_and_stray_rank_dirs_are_handled(root: Path) -> None:
    layout = JobLayout(root, "j").create()
    big = 1_700_000_000_000  # a millisecond timestamp
    atomic_write_bytes(layout.record_path(big), b"")
    atomic_write_bytes(layout.record_path(3), b"")
    assert layout.record_steps() == [3, big]
    (layout.ranks_dir / "rank-xyz").mkdir()
    (layout.ranks_dir / "rank-00002").mkdir()
    assert layout.ranks_present() == [2]
