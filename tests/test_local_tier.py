"""Issue 2: the local CPU-memory tier through real dcp.save / dcp.load in spawned gloo ranks."""

from __future__ import annotations

import os
import signal
import stat
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from mp_utils import run_ranks, run_until_death
from workloads import load_and_check, plain_state, save_steps

from gemini_dcp import (
    CheckpointNotFoundError,
    GeminiStorageReader,
    GeminiStorageWriter,
    InvalidStepError,
    ShardUnavailableError,
    StepNotFoundError,
    TierFullError,
    TierRootError,
    find_gemini_error,
)
from gemini_dcp.local.tier import LocalTier


@pytest.fixture
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    base = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else tmp_path_factory.getbasetemp()
    import tempfile

    d = tempfile.mkdtemp(prefix="gemini-test-", dir=base)
    yield d
    import shutil

    shutil.rmtree(d, ignore_errors=True)


def _last_committed(rank: int, world_size: int, root: str, *, job: str) -> list[int | None]:
    import torch.distributed.checkpoint as dcp
    from workloads import plain_state

    from gemini_dcp import GeminiStorageWriter

    writer = GeminiStorageWriter(root=root, job_id=job)
    seen = [writer.commit.last_committed_step]
    for step in (4, 9):
        dcp.save(plain_state(step, rank), storage_writer=writer, checkpoint_id=step)
        seen.append(writer.commit.last_committed_step)
    return seen


def test_last_committed_step_is_known_on_every_rank(root: str) -> None:
    assert run_ranks(_last_committed, 2, root, job="lc") == [[None, 4, 9], [None, 4, 9]]


def test_plain_and_nontensor_roundtrip(root: str) -> None:
    run_ranks(save_steps, 2, root, job="p", steps=[1, 2, 3], kind="plain")
    out = run_ranks(load_and_check, 2, root, job="p", kind="plain")
    assert all(o["ok"] and o["step"] == 3 for o in out), out
    assert out[0]["from"]["local"] > 0 and out[0]["from"]["peer"] == 0


def test_dtensor_reshard_2_to_4_and_4_to_2(root: str) -> None:
    run_ranks(save_steps, 2, root, job="a", steps=[4, 5])
    out = run_ranks(load_and_check, 4, root, job="a", step=4, expect=4)
    assert all(o["ok"] for o in out), out
    run_ranks(save_steps, 4, root, job="b", steps=[7])
    out = run_ranks(load_and_check, 2, root, job="b", expect=7)
    assert all(o["ok"] for o in out), out


def _torchrec_save_load(rank: int, world_size: int, root: str, *, job: str) -> bool:
    import torch.distributed as dist
    import torchrec
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.types import ShardingType

    tables = [
        torchrec.EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=40, feature_names=[f"f{i}"])
        for i in range(2)
    ]

    def build() -> DistributedModelParallel:
        torch.manual_seed(0)
        ebc = torchrec.EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
        cons = {f"t{i}": ParameterConstraints(sharding_types=[ShardingType.TABLE_WISE.value]) for i in range(2)}
        planner = EmbeddingShardingPlanner(topology=Topology(world_size=world_size, compute_device="cpu"), constraints=cons)
        plan = planner.collective_plan(ebc, None, dist.GroupMember.WORLD)
        return DistributedModelParallel(ebc, device=torch.device("cpu"), plan=plan)

    model = build()
    with torch.no_grad():
        for name, t in model.state_dict().items():
            for shard in t.local_shards():
                shard.tensor.copy_(torch.arange(shard.tensor.numel(), dtype=shard.tensor.dtype).reshape(shard.tensor.shape) + hash(name) % 97)
    sd = model.state_dict()
    dcp.save(sd, storage_writer=GeminiStorageWriter(root=root, job_id=job), checkpoint_id=3)
    fresh = build()
    target = fresh.state_dict()
    for t in target.values():
        for shard in t.local_shards():
            shard.tensor.zero_()
    dcp.load(target, storage_reader=GeminiStorageReader(root=root, job_id=job))
    return all(
        torch.equal(a.tensor, b.tensor)
        for k in sd
        for a, b in zip(sd[k].local_shards(), target[k].local_shards())
    )


def test_torchrec_sharded_tensor_roundtrip(root: str) -> None:
    pytest.importorskip("torchrec")
    assert all(run_ranks(_torchrec_save_load, 2, root, job="rec"))


def test_retention_keeps_last_k_and_slot_ring(root: str) -> None:
    run_ranks(save_steps, 2, root, job="r", steps=[1, 2, 3, 4, 5], keep=2)
    tier = LocalTier(root, "r")
    assert tier.steps() == [4, 5]
    assert sorted(p.name for p in tier.layout.slot_files(0).values()) == ["slot-0.bin", "slot-1.bin", "slot-2.bin"]
    mode = stat.S_IMODE(os.stat(tier.layout.job_dir).st_mode)
    assert mode == 0o700


def _killer(rank: int, world_size: int, root: str, *, job: str, point: str) -> None:
    """Save step 1 cleanly, then SIGKILL this rank at ``point`` while saving step 2."""
    from workloads import dtensor_state

    import gemini_dcp.local.job_dir as layout_mod
    import gemini_dcp.local.record_codec as rec_mod

    dcp.save(dtensor_state(1, world_size), storage_writer=GeminiStorageWriter(root=root, job_id=job), checkpoint_id=1)

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    if point == "mid-copy":
        # The copy lives in gemini_dcp.save.local_write (small items batched): die at its mid-copy point.
        import gemini_dcp.save.local_write as lw

        orig = lw.fault_point

        def die_mid_copy(phase: str) -> None:
            if phase == "save.mid_copy":
                die()
            orig(phase)

        lw.fault_point = die_mid_copy  # type: ignore[assignment]
    elif point == "before-seal":
        import gemini_dcp.commit.protocol as protocol_mod

        protocol_mod.build_record = lambda *a, **k: die()  # type: ignore[assignment]
    elif point == "record-tmp-written":
        orig_replace = os.replace

        def replace_then_die(src, dst):  # type: ignore[no-untyped-def]
            if str(dst).endswith(".rec"):
                die()
            return orig_replace(src, dst)

        layout_mod.os.replace = replace_then_die  # type: ignore[attr-defined]
    elif point == "after-record":
        orig_write = rec_mod.write_record

        def write_then_die(path, record):  # type: ignore[no-untyped-def]
            orig_write(path, record)
            die()

        import gemini_dcp.local.tier as lt

        lt.write_record = write_then_die
    dcp.save(dtensor_state(2, world_size), storage_writer=GeminiStorageWriter(root=root, job_id=job), checkpoint_id=2)
    die()  # the save finished: still die, as a crashed worker would


@pytest.mark.parametrize("point", ["mid-copy", "before-seal", "record-tmp-written", "after-record"])
def test_sigkill_during_save_keeps_previous_step(root: str, point: str) -> None:
    codes = run_until_death(_killer, 2, root, job="k", point=point)
    assert -signal.SIGKILL in codes, f"no rank was killed (the fault injection did not fire): {codes}"
    out = run_ranks(load_and_check, 2, root, job="k")
    assert all(o.get("ok") for o in out), out
    assert out[0]["step"] == (2 if point == "after-record" else 1)
    out = run_ranks(load_and_check, 2, root, job="k", step=1, expect=1)
    assert all(o.get("ok") for o in out), out


def test_corrupt_byte_is_detected_and_named(root: str) -> None:
    run_ranks(save_steps, 2, root, job="c", steps=[1])
    tier = LocalTier(root, "c")
    rec = tier.record(1)
    assert rec is not None
    idx, ref = next((i, r) for i, r in rec.metadata.storage_data.items() if i.fqn == "model.w" and r.rank == 1)
    slot = rec.slot_of(1)
    path = tier.slot_path(1, slot.slot)
    with open(path, "r+b") as f:
        f.seek(ref.offset + 5)
        b = f.read(1)
        f.seek(ref.offset + 5)
        f.write(bytes([b[0] ^ 0xFF]))
    out = run_ranks(load_and_check, 2, root, job="c")
    assert all(o.get("error") == "ChecksumMismatchError" for o in out if "error" in o)
    assert any("model.w" in o.get("message", "") and "checksum" in o.get("message", "") for o in out), out


# ---- bad input, single process (no process group needed) ----------------------------------
def test_missing_root_raises() -> None:
    with pytest.raises(TierRootError, match="does not exist"):
        GeminiStorageWriter(root="/nonexistent/gemini-root", job_id="x")
    with pytest.raises(TierRootError):
        GeminiStorageReader(root="/nonexistent/gemini-root", job_id="x")


def test_root_is_a_file_raises(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(TierRootError, match="not a directory"):
        GeminiStorageWriter(root=f, job_id="x")


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_root_not_writable_raises(tmp_path: Path) -> None:
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(TierRootError, match="not writable"):
            GeminiStorageWriter(root=tmp_path, job_id="x")
    finally:
        tmp_path.chmod(0o700)


def test_checkpoint_id_not_a_step(root: str) -> None:
    w = GeminiStorageWriter(root=root, job_id="x")
    with pytest.raises(InvalidStepError, match="not a training step"):
        dcp.save({"a": torch.ones(2)}, storage_writer=w, checkpoint_id="/some/path")
    with pytest.raises(InvalidStepError):
        w.reset(-3)
    assert not GeminiStorageWriter.validate_checkpoint_id("abc")
    assert GeminiStorageWriter.validate_checkpoint_id(12)


def test_unknown_step_and_wrong_job(root: str) -> None:
    dcp.save(plain_state(1), storage_writer=GeminiStorageWriter(root=root, job_id="real"), checkpoint_id=1)
    with pytest.raises(StepNotFoundError, match=r"step 7 .*committed steps: \[1\]"):
        dcp.load(plain_state(0), storage_reader=GeminiStorageReader(root=root, job_id="real"), checkpoint_id=7)
    with pytest.raises(BaseException, match="no committed checkpoint of job 'wrong'.*real"):
        dcp.load(plain_state(0), storage_reader=GeminiStorageReader(root=root, job_id="wrong"))


def test_a_failed_metadata_read_reaches_the_caller_on_every_torch(root: str) -> None:
    """torch 2.10-2.12's dcp.load swallows read_metadata()'s error and retries with
    read_metadata(rank=...): the retry's stand-in re-raises the first error when DCP sets the
    reader up, so the caller sees our error (and its message) on every supported torch."""
    dcp.save(plain_state(1), storage_writer=GeminiStorageWriter(root=root, job_id="real"), checkpoint_id=1)
    reader = GeminiStorageReader(root=root, job_id="wrong")
    with pytest.raises(ShardUnavailableError, match="collective"):
        reader.read_metadata(rank=0)  # a retry with no first error: no collective is run alone
    with pytest.raises(CheckpointNotFoundError) as first:
        reader.read_metadata()
    stand_in = reader.read_metadata(rank=0)
    with pytest.raises(CheckpointNotFoundError) as again:
        reader.set_up_storage_reader(stand_in, True, rank=0, use_collectives=False)
    assert again.value is first.value
    with pytest.raises(BaseException) as through_dcp:
        dcp.load(plain_state(0), storage_reader=GeminiStorageReader(root=root, job_id="wrong"))
    err = find_gemini_error(through_dcp.value)
    assert isinstance(err, CheckpointNotFoundError) and "'real'" in str(err)


def test_not_enough_space_is_checked_before_writing(root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import gemini_dcp.commit.slot_pool as wmod  # the space check lives in the slot pool

    monkeypatch.setattr(wmod, "free_bytes", lambda path: 1 << 20)  # a 1 MiB tmpfs, as in a small container
    sd = {"big": torch.zeros(4 << 20, dtype=torch.uint8)}
    with pytest.raises(BaseException) as ei:
        dcp.save(sd, storage_writer=GeminiStorageWriter(root=root, job_id="full"), checkpoint_id=1)
    err = find_gemini_error(ei.value)
    assert isinstance(err, TierFullError)
    assert "GiB free" in str(err) and "--shm-size" in str(err)
    assert LocalTier(root, "full").steps() == []


def test_capacity_budget(root: str) -> None:
    sd = {"big": torch.zeros(8 << 20, dtype=torch.uint8)}
    with pytest.raises(BaseException) as ei:
        dcp.save(sd, storage_writer=GeminiStorageWriter(root=root, job_id="b", capacity_bytes=1 << 20), checkpoint_id=1)
    assert isinstance(find_gemini_error(ei.value), TierFullError)


def test_jobs_are_isolated(root: str) -> None:
    dcp.save({"x": torch.ones(3)}, storage_writer=GeminiStorageWriter(root=root, job_id="j1"), checkpoint_id=1)
    dcp.save({"x": torch.full((3,), 2.0)}, storage_writer=GeminiStorageWriter(root=root, job_id="j2"), checkpoint_id=1)
    t = {"x": torch.zeros(3)}
    r = GeminiStorageReader(root=root, job_id="j1")
    dcp.load(t, storage_reader=r)
    assert torch.equal(t["x"], torch.ones(3)) and r.restored_step == 1 and r.restored_from["local"] == 12


def test_defaults_from_environment(root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GEMINI_DCP_ROOT", root)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "envjob")
    w = GeminiStorageWriter()
    assert str(w.root) == root and w.job_id == "envjob"


def test_step_record_encoding_reuses_the_metadata_shell() -> None:
    """Replayed saves share the DCP metadata shell: it is pickled once, and records round-trip."""
    import copyreg
    import dataclasses
    import io
    import pickle

    import xxhash
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex, StorageMeta

    from gemini_dcp.local import record_codec, record_types
    from gemini_dcp.local.record_codec import decode_record, encode_record
    from gemini_dcp.local.record_types import RankSlot, ShardRef, StepRecord

    sd_meta = {f"w{i}": BytesStorageMetadata() for i in range(50)}
    base = Metadata(state_dict_metadata=sd_meta, planner_data={"w0": ("w0",)})

    def record(step: int, meta: Metadata) -> StepRecord:
        data = {MetadataIndex(f"w{i}", [0]): ShardRef(0, 64 * i, 64, step * 100 + i, "crc32c") for i in range(50)}
        meta = dataclasses.replace(meta, storage_data=data, storage_meta=StorageMeta(checkpoint_id=f"gemini://j/step-{step}"))
        return StepRecord("j", step, 1, meta, ("n",), (3200,), {"n": ("n",)}, 1, "mixed",
                          (RankSlot(0, step % 2, 3200),), "n", created_unix=1.0 + step)

    calls: list[str] = []
    real_dumps = record_types.pickle.dumps

    def counting_dumps(obj: object, *a: object, **k: object) -> bytes:
        calls.append(type(obj).__name__)
        return real_dumps(obj, *a, **k)

    record_types.pickle.dumps = counting_dumps  # type: ignore[assignment]
    try:
        encoded = [encode_record(record(s, base)) for s in range(3)]
        other = encode_record(record(3, Metadata(state_dict_metadata=dict(sd_meta))))  # another shell object
    finally:
        record_types.pickle.dumps = real_dumps  # type: ignore[assignment]
    assert calls.count("Metadata") == 2  # once for the three replayed steps, once for the other shell
    for s, blob in enumerate(encoded):
        got = decode_record(blob)
        assert got == record(s, base)
        assert got.metadata.storage_meta.checkpoint_id == f"gemini://j/step-{s}"
    assert decode_record(other).metadata.planner_data is None

    # a record pickled field by field (the format before the shell was cached) still decodes
    class FieldByField(pickle.Pickler):
        def reducer_override(self, obj: object) -> object:
            if type(obj) is StepRecord:  # what pickle made of the slotted dataclass by default
                return (copyreg.__newobj__, (StepRecord,), obj.__getstate__())
            return NotImplemented

    buf = io.BytesIO()
    FieldByField(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(record(7, base))
    payload = buf.getvalue()
    assert b"_rebuild_record" not in payload
    old = record_codec._HEADER.pack(record_codec.RECORD_MAGIC_V1, len(payload), xxhash.xxh3_64_intdigest(payload)) + payload
    assert decode_record(old) == record(7, base)

    # decoding shares what the records of one plan have in common: the shell and the chunk indexes
    a, b = decode_record(encoded[0]), decode_record(encoded[1])
    assert a.metadata.state_dict_metadata is b.metadata.state_dict_metadata
    assert [k for k in a.metadata.storage_data] == [k for k in b.metadata.storage_data]
    assert all(x is y for x, y in zip(a.metadata.storage_data, b.metadata.storage_data))
    assert a.metadata.storage_data != b.metadata.storage_data  # their checksums differ
    assert a.metadata.storage_meta != b.metadata.storage_meta


def test_checksum_overlay_behaves_like_the_dict_it_stands_for() -> None:
    """A replayed record's storage_data (layout + checksum array) equals, pickles and fingerprints
    like the plain dict of the same chunks; the fingerprint still sees every checksum."""
    import pickle

    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

    from gemini_dcp.local.record_types import ChecksumOverlay, RankSlot, ShardRef, StepRecord

    layout = {MetadataIndex(f"w{i % 7}", [i // 7, 0]): ShardRef(i % 3, 64 * i, 64, 0, "crc32c", "float32", (4, 4))
              for i in range(60)}
    sums = [(i * 2654435761) % (1 << 32) for i in range(60)]
    overlay = ChecksumOverlay(layout, sums)
    plain = {k: v.with_checksum(sums[i]) for i, (k, v) in enumerate(layout.items())}
    assert overlay == plain and plain == overlay and len(overlay) == 60
    assert overlay[MetadataIndex("w3", [1, 0])] == plain[MetadataIndex("w3", [1, 0])]
    again = pickle.loads(pickle.dumps(overlay))
    assert isinstance(again, ChecksumOverlay) and again == plain

    def record(sd: object) -> StepRecord:
        return StepRecord("j", 5, 3, Metadata({}, storage_data=sd), ("a", "b", "b"), (1, 2, 3), {}, 2, "mixed",
                          (RankSlot(0, 0, 1),), "a")

    assert record(overlay).fingerprint() == record(plain).fingerprint() == record(again).fingerprint()
    changed = ChecksumOverlay(layout, sums[:-1] + [sums[-1] ^ 1])
    assert record(changed).fingerprint() != record(overlay).fingerprint()
    with pytest.raises(ValueError):
        ChecksumOverlay(layout, sums[:-1])

    from gemini_dcp.local.record_types import refs_by_location

    by_loc = refs_by_location(overlay)
    assert dict(by_loc.items()) == refs_by_location(plain)  # a view over the overlay, the same chunks
    assert by_loc[(2, 64 * 59)] == plain[MetadataIndex("w3", [8, 0])]

    # a fresh process: the fingerprint's location digest arrives with the layout, not recomputed
    from gemini_dcp.local import record_types
    from gemini_dcp.local.record_codec import decode_record, encode_record

    blob = encode_record(record(overlay))
    record_types._digests._entries.clear()
    record_types._layouts_by_blob.clear()
    decoded = decode_record(blob)
    assert record_types._digests._entries and record_types._digests._entries[0][0] is decoded.metadata.storage_data.layout
    assert decoded.fingerprint() == record(plain).fingerprint()


def test_decoded_layout_is_packed_and_behaves_like_the_dict() -> None:
    """A decoded record keeps its chunks as the packed rows it stored (no per-chunk objects until
    read); lookups, iteration order, pickling, location views and fingerprints match the dict."""
    import pickle

    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex

    from gemini_dcp.local.record_codec import decode_record, encode_record
    from gemini_dcp.local.record_types import (
        ChecksumOverlay,
        PackedLayout,
        RankSlot,
        ShardRef,
        StepRecord,
        refs_by_location,
    )

    plain = {MetadataIndex(f"w{i % 7}", [i // 7, 0], i % 5): ShardRef(i % 3, 64 * i, 64, i * 7919, "crc32c", "float32", (4, 4))
             for i in range(60)}
    plain[MetadataIndex("extra")] = ShardRef(0, 64 * 60, 10, 1, "crc32c")  # a bytes item: no offset, dtype, shape

    def record(sd: object) -> StepRecord:
        return StepRecord("j", 5, 3, Metadata({"extra": BytesStorageMetadata()}, storage_data=sd), ("a", "b", "b"),
                          (1, 2, 3), {}, 2, "mixed", (RankSlot(0, 0, 1),), "a")

    decoded = decode_record(encode_record(record(plain)))
    sd = decoded.metadata.storage_data
    assert isinstance(sd, PackedLayout) and sd._keys is None  # nothing materialized by the decode
    assert sd[MetadataIndex("w3", [1, 0])] == plain[MetadataIndex("w3", [1, 0])]
    assert sd[MetadataIndex("extra")] == plain[MetadataIndex("extra")]
    assert MetadataIndex("w3", [1, 0]) in sd and MetadataIndex("w3", [99, 0]) not in sd and "w3" not in sd
    with pytest.raises(KeyError):
        sd[MetadataIndex("nope", [0])]
    assert sd == plain and plain == sd and len(sd) == len(plain)
    assert list(sd) == list(plain) and [k.index for k in sd] == [k.index for k in plain]  # hints kept
    assert list(sd.values()) == list(plain.values()) and list(sd.items()) == list(plain.items())
    assert dict(refs_by_location(sd).items()) == refs_by_location(plain)
    assert decoded.fingerprint() == record(plain).fingerprint()
    assert pickle.loads(pickle.dumps(sd)) == plain
    assert decode_record(encode_record(decoded)).metadata.storage_data == plain  # re-encoded as rows

    # an overlay decoded from a record sits on a packed layout; its views read the overlay's checksums
    layout = {k: v for k, v in plain.items() if k.fqn != "extra"}
    sums = [(i * 2654435761) % (1 << 32) for i in range(len(layout))]
    overlay = ChecksumOverlay(layout, sums)
    back = decode_record(encode_record(record(overlay))).metadata.storage_data
    assert isinstance(back, ChecksumOverlay) and isinstance(back.layout, PackedLayout)
    assert back == overlay and back[MetadataIndex("w3", [8, 0])] == overlay[MetadataIndex("w3", [8, 0])]
    assert dict(refs_by_location(back).items()) == dict(refs_by_location(overlay).items())
    assert record(back).fingerprint() == record(overlay).fingerprint() == record(dict(overlay)).fingerprint()
    # content only: the same chunks built from other string objects (not interned) fingerprint alike
    rebuilt = {MetadataIndex("".join(list(k.fqn)), k.offset, k.index): ShardRef(*v) for k, v in plain.items()}
    assert record(rebuilt).fingerprint() == record(plain).fingerprint() == decoded.fingerprint()


def test_metadata_shell_of_a_replanned_save_is_compared_once_and_pickled_never(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 of a plain dcp.save digests the newly planned metadata, then encodes the record with
    the equal shell every rank already holds: one comparison per save, no pickling, and the held
    shell stays an identity hit (the cache keeps several entries)."""
    import copy

    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

    from gemini_dcp.local import record_types as record_caches

    def planned() -> Metadata:
        return Metadata(state_dict_metadata={f"w{i}": BytesStorageMetadata() for i in range(40)},
                        planner_data={f"w{i}": (f"w{i}",) for i in range(40)})

    held = planned()
    first = record_caches.metadata_shell_blob(held)
    compares: list[int] = []
    pickles: list[int] = []
    real_equal, real_dumps = record_caches._equal_parts, record_caches.pickle.dumps
    monkeypatch.setattr(record_caches, "_equal_parts", lambda *a: compares.append(1) or real_equal(*a))
    monkeypatch.setattr(record_caches.pickle, "dumps", lambda *a, **k: pickles.append(1) or real_dumps(*a, **k))
    for save in range(1, 6):
        assert record_caches.metadata_shell_blob(copy.deepcopy(planned())) == first  # the protocol's digest
        assert record_caches.metadata_shell_blob(held) == first  # the record's encoding
        assert len(compares) == save and pickles == []
