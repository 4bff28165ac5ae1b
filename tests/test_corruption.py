"""Named corruption and bad-input tests.

Part 1, corruption in every tier: a bit flip, a truncation, a deleted slot or data file and a
deleted record, in the node's own memory (local tier), in the peer replica and in the
persistent store. Each must be detected; the next copy (peer, then store) is used when one
exists; else the restore raises the package's error, never returns wrong values, and leaves the
caller's tensors as they were. The jobs are real 2-rank gloo jobs on 2 simulated nodes
(replicas=2, every step drained to a ``file://`` store), run through the fault harness's
forkserver (tests/fault_harness.py); one saved tree is copied per case.

Part 2, bad inputs: every bad argument of every public entry point (GeminiStorageWriter and
GeminiStorageReader arguments, AsyncCheckpointer arguments, checkpoint_id values) raises an
error from :mod:`gemini_dcp.errors`; every bad argument of each CLI command exits non-zero
with a message and no traceback.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

import fault_harness as fh
import pytest
import torch
from typer.testing import CliRunner

from gemini_dcp import GeminiStorageReader, GeminiStorageWriter
from gemini_dcp.errors import ConfigError, GeminiError, InvalidStepError
from gemini_dcp.local.tier import LocalTier

JOB = fh.JOB
TRIAL = fh.Trial(seed=0, kind="none", layout=(0, 1), steps=2, keep=2, replicas=2)


# ---- part 1: corruption ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def template() -> Iterator[Path]:
    """Steps 1 and 2 saved by 2 ranks on 2 nodes (replicas=2), step 2 drained to the store (step 1
    too unless the drain coalesced it away: a test that cares checks which)."""
    base = Path(tempfile.mkdtemp(prefix="gemini-corrupt-", dir=fh._tmp_base()))
    roots = [str(base / "node0"), str(base / "node1")]
    for r in roots:
        os.mkdir(r, 0o700)
    (base / "out").mkdir()
    (base / "store").mkdir()
    run = fh.run_group(fh._specs(TRIAL, "save", roots, base / "out", fault=None, fault_log=None,
                                 persistent=f"file://{base / 'store'}", node_ids=True), 120)
    assert run.codes == [0, 0], run
    assert not fh._wait_drains(roots, 60.0), "drain processes outlived the save"
    assert (base / "store" / JOB / "step-2" / ".metadata").exists(), sorted(map(str, (base / "store").rglob("*")))
    yield base
    shutil.rmtree(base, ignore_errors=True)


class Case:
    """A private copy of the saved tree, to damage and restore from."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.roots = [str(base / "node0"), str(base / "node1")]
        self.store = f"file://{base / 'store'}"
        self.out = base / "out"

    def tier(self, node: int) -> LocalTier:
        return LocalTier(self.roots[node], JOB)

    def slot_file(self, node: int, rank: int, step: int = 2) -> tuple[Path, int, int]:
        """(slot file on ``node`` holding ``rank``'s shards of ``step``, offset and length of its model.w chunk)."""
        tier = self.tier(node)
        rec = tier.record(step)
        assert rec is not None, f"node {node} has no record of step {step}"
        slot = rec.slot_of(rank)
        assert slot is not None, f"node {node} holds no copy of rank {rank}'s shards of step {step}"
        ref = next(r for i, r in rec.metadata.storage_data.items() if i.fqn == "model.w" and r.rank == rank)
        return tier.slot_path(rank, slot.slot), ref.offset, ref.length

    def record_file(self, node: int, step: int = 2) -> Path:
        files = list((Path(self.roots[node]) / JOB / "steps").glob(f"step-*{step}.rec"))
        assert len(files) == 1, files
        return files[0]

    def store_file(self, pattern: str, step: int = 2) -> Path:
        files = sorted((self.base / "store" / JOB / f"step-{step}").glob(pattern))
        assert files, f"no {pattern} in the store's step {step}"
        return files[0]

    def wipe(self, node: int) -> None:
        fh._wipe(self.roots[node])

    def load(self, *, persistent: bool = False) -> list[dict[str, Any]]:
        run = fh.run_group(fh._specs(TRIAL, "load", self.roots, self.out, fault=None, fault_log=None,
                                     persistent=self.store if persistent else None, node_ids=True), 90)
        res = fh._results(self.out, "load", TRIAL.world)
        fh._wait_drains(self.roots, 20.0)
        assert not run.timed_out and all(r is not None for r in res), (run, res)
        assert run.codes == [0, 0], f"a loading process exited {run.codes}: {res}"
        return res  # type: ignore[return-value]


@pytest.fixture
def case(template: Path) -> Iterator[Case]:
    d = Path(tempfile.mkdtemp(prefix="gemini-case-", dir=fh._tmp_base()))
    shutil.copytree(template, d, dirs_exist_ok=True, symlinks=True)
    yield Case(d)
    shutil.rmtree(d, ignore_errors=True)


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


def scramble(path: Path) -> None:
    """Flip one bit in every 97th byte: whatever the file's layout, tensor bytes change."""
    data = bytearray(path.read_bytes())
    for i in range(0, len(data), 97):
        data[i] ^= 0x04
    path.write_bytes(bytes(data))


def truncate(path: Path, size: int) -> None:
    os.truncate(path, size)


def restored(res: list[dict[str, Any]], step: int, tier: str | None = None) -> None:
    """Every rank restored ``step`` bit-exact (and, with ``tier``, some bytes came from it)."""
    assert all("error" not in r for r in res), res
    assert {r["restored"] for r in res} == {step}, res
    assert all(r["bad_keys"] == [] for r in res), res
    if tier is not None:
        assert res[0]["from"][tier] > 0, res


def refused(res: list[dict[str, Any]], *, older: int | None = None) -> None:
    """No good copy of the step: the package's error on every rank with the caller's tensors
    untouched, or (``older``) that older step restored bit-exact. Never wrong values."""
    assert all(not r.get("bad_keys") for r in res), res
    if all("error" not in r for r in res) and older is not None:
        assert {r["restored"] for r in res} == {older}, res
        return
    assert all(r.get("gemini_error") for r in res), f"not the package's error: {res}"
    assert all(r.get("touched") == [] for r in res), f"a failed restore changed the caller's tensors: {res}"


# local tier: node 0's own copy of rank 0's shards; node 1's replica is the next copy
def test_local_bit_flip_uses_peer_copy(case: Case) -> None:
    path, off, n = case.slot_file(0, 0)
    flip(path, off + n // 2)
    restored(case.load(), 2, "peer")


def test_local_truncated_slot_uses_peer_copy(case: Case) -> None:
    path, off, n = case.slot_file(0, 0)
    truncate(path, off + n // 2)
    restored(case.load(), 2, "peer")


def test_local_deleted_slot_uses_peer_copy(case: Case) -> None:
    path, _, _ = case.slot_file(0, 0)
    path.unlink()
    restored(case.load(), 2, "peer")


def test_local_deleted_record_uses_other_node(case: Case) -> None:
    case.record_file(0).unlink()
    restored(case.load(), 2)


def test_local_corrupt_record_detected(case: Case) -> None:
    """A record whose bytes changed is refused (not unpickled) and the other node's serves."""
    rec = case.record_file(0)
    flip(rec, rec.stat().st_size // 2)
    restored(case.load(), 2)


# peer replica: node 0 is lost, so node 1's replica of rank 0 is the only memory copy; the store is next
@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_peer_replica_damaged_next_copy_is_store(case: Case, damage: str) -> None:
    path, off, n = case.slot_file(1, 0)
    case.wipe(0)
    {"flip": lambda: flip(path, off + n // 2), "truncate": lambda: truncate(path, off + n // 2),
     "delete": path.unlink}[damage]()
    restored(case.load(persistent=True), 2, "persistent")


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_peer_replica_damaged_no_other_copy_refused(case: Case, damage: str) -> None:
    path, off, n = case.slot_file(1, 0)
    case.wipe(0)
    {"flip": lambda: flip(path, off + n // 2), "truncate": lambda: truncate(path, off + n // 2),
     "delete": path.unlink}[damage]()
    refused(case.load(), older=1)


def test_peer_deleted_record_with_node_lost_restores_older_step(case: Case) -> None:
    """Node 0 lost and node 1's record of step 2 gone: step 2 is in no memory; step 1 (both ranks
    on node 1) or the store's step 2 comes back, bit-exact."""
    case.wipe(0)
    case.record_file(1).unlink()
    res = case.load()
    restored(res, 1)
    restored(case.load(persistent=True), 2)


def test_both_memory_copies_corrupt_falls_back_to_store(case: Case) -> None:
    for node in (0, 1):
        path, off, n = case.slot_file(node, 0)
        flip(path, off + n // 2)
    restored(case.load(persistent=True), 2, "persistent")


def test_both_memory_copies_corrupt_no_store_refused(case: Case) -> None:
    for node in (0, 1):
        path, off, n = case.slot_file(node, 0)
        flip(path, off + n // 2)
    refused(case.load(), older=1)


# persistent store: every node's memory lost, the store is the only copy
@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_store_data_file_damaged_refused(case: Case, damage: str) -> None:
    for node in (0, 1):
        case.wipe(node)
    data = case.store_file("__0_*.distcp")
    size = data.stat().st_size
    {"flip": lambda: scramble(data), "truncate": lambda: truncate(data, size // 2),
     "delete": data.unlink}[damage]()
    refused(case.load(persistent=True))


def test_store_deleted_metadata_refused(case: Case) -> None:
    """Step 2's ``.metadata`` gone from the store: the store's step 1, when the drain wrote it (it
    may coalesce step 1 away), comes back bit-exact; with no step 1 there, the package's error."""
    for node in (0, 1):
        case.wipe(node)
    case.store_file(".metadata").unlink()
    step1 = case.base / "store" / JOB / "step-1"
    if (step1 / ".metadata").exists():
        refused(case.load(persistent=True), older=1)
        shutil.rmtree(step1)
    refused(case.load(persistent=True))


def test_store_index_corrupt_refused_never_unchecked(case: Case) -> None:
    """The store's checksum index unreadable: an error, never a load with checksums off."""
    for node in (0, 1):
        case.wipe(node)
    index = case.store_file(".gemini/index.pkl")
    flip(index, index.stat().st_size // 2)
    refused(case.load(persistent=True))


def test_store_index_deleted_and_data_corrupt_refused(case: Case) -> None:
    """Deleting the index of a drained step must not turn its checksums off: corrupt data is refused."""
    for node in (0, 1):
        case.wipe(node)
    case.store_file(".gemini/index.pkl").unlink()
    scramble(case.store_file("__0_*.distcp"))
    refused(case.load(persistent=True))


def test_store_damaged_memory_intact_unaffected(case: Case) -> None:
    """A bad store does not matter while memory holds the step: restored from memory."""
    flip(case.store_file("__0_*.distcp"), 10)
    restored(case.load(persistent=True), 2, "local")


# ---- part 2: bad inputs ---------------------------------------------------------------------------
@pytest.fixture
def root() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="gemini-bad-", dir=fh._tmp_base())
    os.chmod(d, 0o700)
    yield d
    shutil.rmtree(d, ignore_errors=True)


BAD_WRITER_ARGS: list[tuple[str, dict[str, Any]]] = [
    ("keep=0", {"keep": 0}),
    ("keep=-1", {"keep": -1}),
    ("keep=1.5", {"keep": 1.5}),
    ("keep='2'", {"keep": "2"}),
    ("replicas=0", {"replicas": 0}),
    ("replicas=2.0", {"replicas": 2.0}),
    ("placement", {"placement": "random"}),
    ("checksum", {"checksum": "md5"}),
    ("capacity_bytes=0", {"capacity_bytes": 0}),
    ("capacity_bytes=-5", {"capacity_bytes": -5}),
    ("capacity_bytes=1.5", {"capacity_bytes": 1.5}),
    ("timeout_s=0", {"timeout_s": 0}),
    ("timeout_s=-1", {"timeout_s": -1}),
    ("timeout_s=nan", {"timeout_s": math.nan}),
    ("timeout_s=inf", {"timeout_s": math.inf}),
    ("timeout_s='5'", {"timeout_s": "5"}),
    ("on_peer_failure", {"on_peer_failure": "ignore"}),
    ("persist_every=0", {"persist_every": 0}),
    ("persist_every=2.5", {"persist_every": 2.5}),
    ("job_id=''/''", {"job_id": "../x"}),
    ("job_id=/", {"job_id": "a/b"}),
    ("job_id=space", {"job_id": "a b"}),
    ("job_id=int", {"job_id": 5}),
    ("job_id=long", {"job_id": "x" * 200}),
    ("persistent=5", {"persistent": 5}),
    ("persistent=''", {"persistent": ""}),
    ("placement=None", {"placement": None}),
    ("checksum=None", {"checksum": None}),
    ("timeout_s=True", {"timeout_s": True}),
]


@pytest.mark.parametrize("name,kw", [
    *[pytest.param(n, kw, id=n) for n, kw in BAD_WRITER_ARGS],
    pytest.param("keep=True", {"keep": True}, id="keep=True"),
    pytest.param("replicas=True", {"replicas": True}, id="replicas=True"),
    pytest.param("root=5", {"root": 5}, id="root=5"),
])
def test_writer_bad_argument(root: str, name: str, kw: dict[str, Any]) -> None:
    kw = {"root": root, **kw}
    with pytest.raises(GeminiError):
        GeminiStorageWriter(**kw)


@pytest.mark.parametrize("kw", [{"persist_keep": 0}, {"persist_keep": -1}, {"persist_keep": 1.5},
                                {"persist_keep_every": 0}, {"persist_keep_every": -2}], ids=str)
def test_writer_bad_store_retention(root: str, tmp_path: Path, kw: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        GeminiStorageWriter(root=root, persistent=f"file://{tmp_path / 'store'}", **kw)


def test_writer_bad_persist_every_creates_nothing(root: str, tmp_path: Path) -> None:
    """A refused persist_every leaves no persistent directory behind."""
    store = tmp_path / "store"
    with pytest.raises(ConfigError):
        GeminiStorageWriter(root=root, persistent=f"file://{store}", persist_every=0)
    assert not store.exists()


def test_writer_bad_persistent_url(root: str) -> None:
    with pytest.raises(GeminiError):
        GeminiStorageWriter(root=root, persistent="nosuchproto://bucket/x")


BAD_READER_ARGS: list[Any] = [
    pytest.param("timeout_s=0", {"timeout_s": 0}, id="timeout_s=0"),
    pytest.param("timeout_s=-3", {"timeout_s": -3}, id="timeout_s=-3"),
    pytest.param("timeout_s=nan", {"timeout_s": math.nan}, id="timeout_s=nan"),
    pytest.param("timeout_s=inf", {"timeout_s": math.inf}, id="timeout_s=inf"),
    pytest.param("timeout_s=True", {"timeout_s": True}, id="timeout_s=True"),
    pytest.param("timeout_s='3'", {"timeout_s": "3"}, id="timeout_s=str"),
    pytest.param("root=5", {"root": 5}, id="root=5"),
    pytest.param("persistent=5", {"persistent": 5}, id="persistent=5"),
    pytest.param("job_id", {"job_id": "../etc"}, id="job_id"),
    pytest.param("persistent", {"persistent": "nosuchproto://bucket/x"}, id="persistent"),
]


@pytest.mark.parametrize("name,kw", BAD_READER_ARGS)
def test_reader_bad_argument(root: str, name: str, kw: dict[str, Any]) -> None:
    kw = {"root": root, **kw}
    with pytest.raises(GeminiError):
        GeminiStorageReader(**kw)


@pytest.mark.parametrize("root_kind", ["missing", "file", "world_writable"])
def test_bad_root(tmp_path: Path, root_kind: str) -> None:
    """A root that is missing, a file, or writable by others is refused with the package's error."""
    p = tmp_path / "r"
    if root_kind == "file":
        p.write_bytes(b"")
    elif root_kind == "world_writable":
        p.mkdir()
        os.chmod(p, 0o777)
    for cls in (GeminiStorageWriter, GeminiStorageReader):
        with pytest.raises(GeminiError):
            cls(root=str(p), job_id="j")


BAD_STEPS: list[Any] = [-1, "-3", "abc", "", "1.5", 1.5, True, None, [1], b"3", float("nan"), "12abc", object()]


@pytest.mark.parametrize("value", BAD_STEPS, ids=[repr(v)[:20] for v in BAD_STEPS])
def test_bad_checkpoint_id(root: str, value: Any) -> None:
    """Every non-step checkpoint_id is refused by reset() of the writer (None means "no step"
    only for the reader) and by validate_checkpoint_id."""
    w = GeminiStorageWriter(root=root, job_id="j")
    if value is None:
        w.reset(None)
        with pytest.raises(InvalidStepError):
            w._require_step()
        return
    with pytest.raises(InvalidStepError):
        w.reset(value)
    assert GeminiStorageWriter.validate_checkpoint_id(value) is False
    assert GeminiStorageReader.validate_checkpoint_id(value) is False
    with pytest.raises(InvalidStepError):
        GeminiStorageReader(root=root, job_id="j").reset(value)


@pytest.mark.parametrize("value", [0, 7, "42", 10**12, 10**15, 2**62])
def test_large_and_string_steps_accepted(root: str, value: Any) -> None:
    """Any int step the writer accepts is a valid id (a millisecond timestamp included)."""
    w = GeminiStorageWriter(root=root, job_id="j")
    w.reset(value)
    assert w.checkpoint_id == int(value)


def test_large_step_saved_is_found_again(root: str) -> None:
    """checkpoint_id >= 10**12 (a timestamp, a token count) saves and loads back (single process)."""
    import torch.distributed.checkpoint as dcp

    step = 1_700_000_000_123
    sd = {"w": torch.arange(12, dtype=torch.float32)}
    dcp.save(sd, storage_writer=GeminiStorageWriter(root=root, job_id="big"), checkpoint_id=step)
    out = {"w": torch.zeros(12)}
    reader = GeminiStorageReader(root=root, job_id="big")
    dcp.load(out, storage_reader=reader)
    assert reader.restored_step == step and torch.equal(out["w"], sd["w"])


def _async(root: str, **kw: Any) -> Callable[[], Any]:
    def make() -> Any:
        from gemini_dcp import AsyncCheckpointer

        ck = AsyncCheckpointer(root=root, job_id="a", **kw) if "writer" not in kw else AsyncCheckpointer(**kw)
        ck.close()
        return ck
    return make


BAD_ASYNC_ARGS: list[tuple[str, dict[str, Any]]] = [
    ("on_busy", {"on_busy": "drop"}),
    ("max_pending=0", {"max_pending": 0}),
    ("max_pending=-2", {"max_pending": -2}),
    ("timeout_s=0", {"timeout_s": 0}),
    ("timeout_s=-1", {"timeout_s": -1}),
    ("timeout_s=inf", {"timeout_s": math.inf}),
    ("interleave='yes'", {"interleave": "yes"}),
    ("writer kwarg keep=0", {"keep": 0}),
]


@pytest.mark.parametrize("name,kw", BAD_ASYNC_ARGS, ids=[n for n, _ in BAD_ASYNC_ARGS])
def test_async_checkpointer_bad_argument(root: str, name: str, kw: dict[str, Any]) -> None:
    with pytest.raises(GeminiError):
        _async(root, **kw)()


def test_async_checkpointer_writer_and_kwargs(root: str) -> None:
    with pytest.raises(GeminiError):
        _async(root, writer=GeminiStorageWriter(root=root, job_id="a"), keep=3)()


def test_async_checkpointer_writer_not_a_writer(root: str) -> None:
    with pytest.raises(GeminiError):
        _async(root, writer=42)()


@pytest.mark.parametrize("value", [-1, "abc", 1.5, True])
def test_async_checkpointer_bad_step(root: str, value: Any) -> None:
    from gemini_dcp import AsyncCheckpointer

    ck = AsyncCheckpointer(root=root, job_id="a", interleave=False)
    try:
        with pytest.raises(InvalidStepError):
            ck.save({"w": torch.zeros(3)}, value)
    finally:
        ck.close()


# CLI: every bad argument exits non-zero with a message and no traceback
runner = CliRunner()


def _cli(*args: str) -> Any:
    from gemini_dcp_cli.main import app

    return runner.invoke(app, list(args))


def _cli_refused(res: Any) -> None:
    assert res.exit_code in (1, 2), (res.exit_code, res.output)
    assert "Traceback" not in res.output, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert res.output.strip(), "refused without a message"


def _bad_cli_cases(root: str, tmp: str) -> list[list[str]]:
    missing = f"{tmp}/missing-root"
    return [
        ["inspect", "--root", missing],
        ["inspect", "--root", root, "--job", "../x"],
        ["verify", "--root", missing],
        ["verify", "--root", root, "--job", "a b"],
        ["verify", "--root", root, "--job", "none-such"],
        ["flush", "-1", "--to", f"file://{tmp}/s"],
        ["flush", "abc", "--to", f"file://{tmp}/s"],
        ["flush", "3", "--to", f"file://{tmp}/s", "--root", root, "--job", "none-such"],
        ["flush", "3", "--root", root],  # --to missing
        ["restore", "-2", "--to", f"{tmp}/o"],
        ["restore", "5", "--to", f"{tmp}/o", "--root", root, "--job", "none-such"],
        ["restore", "5", "--to", f"{tmp}/o", "--root", missing],
        ["export", "3", "--to", f"{tmp}/e", "--format", "onnx", "--root", root],
        ["export", "3", "--to", f"{tmp}/e", "--max-shard-gb", "-1", "--root", root],
        ["export", "3", "--to", f"{tmp}/e", "--root", root, "--job", "none-such"],
        ["plan", "--nodes", "0", "--replicas", "2"],
        ["plan", "--nodes", "4", "--replicas", "0"],
        ["plan", "--nodes", "4", "--replicas", "2", "--strategy", "star"],
        ["plan", "--nodes", "4", "--replicas", "2", "--failures", "0"],
        ["plan", "--nodes", "4", "--replicas", "2", "--checkpoint-gb", "-3", "--iteration-s", "1"],
        ["plan", "--nodes", "4", "--replicas", "9"],
        ["gc", "--keep", "0", "--root", root],
        ["gc", "--root", missing],
        ["gc", "--root", root, "--job", "../up"],
        ["doctor", "--root", missing, "--keep", "0"],
        ["doctor", "--root", root, "--expected-gb", "-1"],
        ["doctor", "--root", root, "--replicas", "0"],
        ["nosuchcommand"],
    ]


def test_cli_bad_arguments_exit_cleanly(root: str, tmp_path: Path) -> None:
    failures = []
    for args in _bad_cli_cases(root, str(tmp_path)):
        res = _cli(*args)
        try:
            _cli_refused(res)
        except AssertionError as exc:
            failures.append(f"gemini-dcp {' '.join(args)}: {exc}")
    assert not failures, "\n".join(failures)


def test_cli_stray_rank_directory_does_not_crash_gc(root: str) -> None:
    """A stray ranks/rank-xyz directory: gc reports or ignores it, never a traceback."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.zeros(4)}, storage_writer=GeminiStorageWriter(root=root, job_id="g"), checkpoint_id=1)
    (Path(root) / "g" / "ranks" / "rank-xyz").mkdir(parents=True)
    res = _cli("gc", "--root", root, "--job", "g")
    assert "Traceback" not in res.output and res.exception is None or isinstance(res.exception, SystemExit), res.output
    assert res.exit_code in (0, 1), res.output


def test_stray_entry_in_steps_does_not_block_load(root: str) -> None:
    """One odd entry in steps/ (a directory named like a record) must not block the job's loads."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(4)}, storage_writer=GeminiStorageWriter(root=root, job_id="s"), checkpoint_id=1)
    (Path(root) / "s" / "steps" / "step-000000000009.rec").mkdir()
    out = {"w": torch.zeros(4)}
    reader = GeminiStorageReader(root=root, job_id="s")
    dcp.load(out, storage_reader=reader)
    assert reader.restored_step == 1 and torch.equal(out["w"], torch.ones(4))


def test_json_record_of_trial_is_serializable() -> None:
    """The harness's trial records are plain JSON (the soak writes them as is)."""
    rec = fh.summarize([{"kind": "save", "phase": "save.mid_copy", "signal": "SIGKILL", "outcome": "pass", "fired": True}])
    json.dumps(rec)
