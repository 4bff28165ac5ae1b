"""Issue 22: XOR parity in peer memory with real processes (4 simulated nodes, one rank each)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from mp_utils import node_root_factory, run_ranks, wipe
from typer.testing import CliRunner
from workloads import dtensor_state

from gemini_dcp import GeminiStorageReader, GeminiStorageWriter, find_gemini_error
from gemini_dcp.errors import ConfigError
from gemini_dcp.local.tier import LocalTier
from gemini_dcp.ops.inspection import inspect_root
from gemini_dcp.ops.verify import verify
from gemini_dcp_cli.main import app


def _state(step: int, world_size: int) -> dict[str, Any]:
    sd = dtensor_state(step, world_size)
    sd["extra"] = torch.arange(300, dtype=torch.int32) * step  # a plain tensor (saved by rank 0)
    sd["meta"] = {"lr": 0.5 * step, "name": f"run-{step}"}  # a non-tensor value
    return sd


def _save(rank: int, world_size: int, root: str, *, steps: list[int], **kw: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for step in steps:
        w = GeminiStorageWriter(root=root, job_id="par", parity_group=4, **kw)
        dcp.save(_state(step, world_size), storage_writer=w, checkpoint_id=step)
        out = dict(w.commit.last_replication)
    return out


def _load(rank: int, world_size: int, root: str) -> dict[str, Any]:
    target = _state(0, world_size)
    target["meta"] = {"lr": 0.0, "name": ""}
    reader = GeminiStorageReader(root=root, job_id="par")
    try:
        dcp.load(target, storage_reader=reader)
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        err = find_gemini_error(exc)
        return {"error": type(err or exc).__name__, "message": str(err or exc)[-900:]}
    step = reader.restored_step
    want = _state(step, world_size)
    parts = {k: torch.equal(target["model"][k].full_tensor(), want["model"][k].full_tensor()) for k in ("w", "b")}
    parts.update(extra=torch.equal(target["extra"], want["extra"]), meta=target["meta"] == want["meta"], step=target["step"] == step)
    if not all(parts.values()):
        return {"ok": False, "parts": parts, "step": step}
    ok = all(torch.equal(target["model"][k].full_tensor(), want["model"][k].full_tensor()) for k in ("w", "b"))
    ok = ok and torch.equal(target["extra"], want["extra"]) and target["meta"] == want["meta"] and target["step"] == step
    return {"ok": ok, "step": step, "from": dict(reader.restored_from)}


@pytest.fixture
def nodes():  # noqa: ANN201 - a pytest fixture (generator)
    make, cleanup = node_root_factory("gemini-parity")
    yield make
    cleanup()


def _flip_parity_byte(root: str, rank: int, step: int) -> Path:
    tier = LocalTier(root, "par")
    rec = tier.record(step)
    assert rec is not None and rec.parity is not None
    slot = rec.slot_of(rank)
    assert slot is not None
    path = tier.layout.rank_dir(rank) / f"parity-{slot.slot}.bin"
    data = bytearray(path.read_bytes())
    data[rec.parity.parity_nbytes[rank] // 2] ^= 0x10
    path.write_bytes(bytes(data))
    return path


def test_parity_and_replicas_are_exclusive(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="replicas=1"):
        GeminiStorageWriter(root=tmp_path, job_id="x", replicas=2, parity_group=4)
    with pytest.raises(ConfigError, match=">= 3"):
        GeminiStorageWriter(root=tmp_path, job_id="x", parity_group=2)
    assert not (tmp_path / "x").exists()  # refused before any directory was made


def test_lost_node_rebuilt_from_parity_then_corrupt_parity_and_two_lost(nodes) -> None:
    n = nodes(4)
    stats = run_ranks(_save, 4, n, steps=[1, 2])
    assert all(s["scheme"] == "parity g=4" and not s["degraded"] for s in stats), stats
    rec = LocalTier(n[0], "par").record(2)
    assert rec is not None and rec.parity is not None and rec.parity.lanes == ((0, 1, 2, 3),)
    for r in range(4):  # parity slots: ~1/3 of the data slot each, named so
        slot = LocalTier(n[r], "par").record(2).slot_of(r)  # type: ignore[union-attr]
        assert (Path(n[r]) / "par" / "ranks" / f"rank-{r:05d}" / f"parity-{slot.slot}.bin").exists()
        assert rec.parity.parity_nbytes[r] <= max(rec.rank_nbytes) // 3 + 64  # a third of the lane's longest slot
    info = inspect_root(n[1], "par").jobs[0].steps[-1].parity  # inspect shows parity slots and groups
    assert info is not None and info["lanes"] == [[0, 1, 2, 3]] and len(info["groups"]) == 1
    assert info["parity_bytes_here"] <= max(rec.rank_nbytes) // 3 + 64
    res = CliRunner().invoke(app, ["inspect", "--root", n[1], "--job", "par"])
    assert res.exit_code == 0 and "parity slot of rank 1" in res.output, res.output
    report = verify(n[1], "par")
    assert report.ok and any(i.fqn == "<parity of rank 1>" and i.status == "ok" for i in report.items)

    # one node of the group lost, and a resharded load (6 ranks on the 4 nodes): the slot rebuilt
    # bit-exact from the survivors' stripes and parity is served to the ranks of other nodes too
    wipe(n[2])
    out = run_ranks(_load, 6, [n[0], n[0], n[1], n[1], n[2], n[3]])
    assert all(o.get("ok") and o["step"] == 2 for o in out), out
    assert out[0]["from"]["parity"] > 0 and out[0]["from"]["persistent"] == 0
    assert not list(Path(n[1]).rglob("rebuilt-from-parity-*"))  # the rebuilt slot is dropped after the load

    # a flipped byte in a parity slot: detected, named, never decoded into the restore
    stats = run_ranks(_save, 4, n, steps=[3])  # re-protection: the next save rebuilds full parity
    assert all(not s["degraded"] for s in stats), stats
    bad = _flip_parity_byte(n[0], 0, 3)
    report = verify(n[0], "par", 3)  # verify names the corrupt parity slot
    assert not report.ok and any(i.status == "bad" and str(bad) in i.detail for i in report.items)
    wipe(n[3])
    out = run_ranks(_load, 4, n)
    assert all(o.get("error") == "ChecksumMismatchError" for o in out), out
    assert str(bad) in out[0]["message"] and "parity" in out[0]["message"]

    # a survivor's parity file missing: the shards are unavailable (not corrupt), named with the file and node
    stats = run_ranks(_save, 4, n, steps=[4])
    assert all(not s["degraded"] for s in stats), stats
    rec4 = LocalTier(n[0], "par").record(4)
    assert rec4 is not None
    gone = Path(n[0]) / "par" / "ranks" / "rank-00000" / f"parity-{rec4.slot_of(0).slot}.bin"  # type: ignore[union-attr]
    gone.unlink()
    wipe(n[3])
    out = run_ranks(_load, 4, n)
    assert all(o.get("error") == "ShardUnavailableError" for o in out), out
    assert str(gone) in out[0]["message"] and repr(rec4.rank_nodes[0]) in out[0]["message"], out[0]["message"]

    # two nodes of one group lost: no memory copy, no persistent tier: a clear refusal naming the group
    wipe(n[1])
    out = run_ranks(_load, 4, n)
    assert all(o.get("error") == "ShardUnavailableError" for o in out), out
    assert "parity group of saving ranks [0, 1, 2, 3]" in out[0]["message"]


def _save_persisted(rank: int, world_size: int, root: str, *, store: str) -> bool:
    w = GeminiStorageWriter(root=root, job_id="par", parity_group=4, persistent=store, persist_every=1)
    dcp.save(_state(1, world_size), storage_writer=w, checkpoint_id=1)
    return w.wait_persisted(timeout_s=120) == 1


def _load_with_store(rank: int, world_size: int, root: str, *, store: str) -> dict[str, Any]:
    target = _state(0, world_size)
    target["meta"] = {"lr": 0.0, "name": ""}
    reader = GeminiStorageReader(root=root, job_id="par", persistent=store)
    dcp.load(target, storage_reader=reader)
    want = _state(reader.restored_step, world_size)
    ok = all(torch.equal(target["model"][k].full_tensor(), want["model"][k].full_tensor()) for k in ("w", "b"))
    ok = ok and torch.equal(target["extra"], want["extra"]) and target["meta"] == want["meta"]
    return {"ok": ok, "step": reader.restored_step, "from": dict(reader.restored_from)}


def test_parity_that_cannot_rebuild_falls_back_to_the_persistent_tier(nodes, tmp_path: Path) -> None:
    """A corrupt parity slot with a node lost, then two nodes of the group lost: the lost ranks'
    bytes come from the persistent tier, bit-exact, never from a wrong decode."""
    n = nodes(4)
    store = f"file://{tmp_path / 'store'}"
    assert all(run_ranks(_save_persisted, 4, n, store=store))
    _flip_parity_byte(n[0], 0, 1)
    wipe(n[2])
    out = run_ranks(_load_with_store, 4, n, store=store)
    assert all(o["ok"] and o["step"] == 1 for o in out), out
    assert out[0]["from"].get("persistent", 0) > 0 and out[0]["from"].get("parity", 0) == 0, out[0]
    wipe(n[3])
    out = run_ranks(_load_with_store, 4, n, store=store)
    assert all(o["ok"] and o["step"] == 1 for o in out), out
    assert out[0]["from"].get("persistent", 0) > 0, out[0]


def _flip_data_byte(root: str, rank: int, step: int) -> None:
    tier = LocalTier(root, "par")
    rec = tier.record(step)
    assert rec is not None
    slot = rec.slot_of(rank)
    assert slot is not None
    path = tier.slot_path(rank, slot.slot)
    data = bytearray(path.read_bytes())
    data[64] ^= 0x10
    path.write_bytes(bytes(data))


def test_a_flipped_data_byte_is_named_on_every_rank(nodes) -> None:
    """Found by the feature soak (issue 55): a bit flipped in rank 0's data slot of the newest step.
    Every rank reports the corrupt shard itself, not only "another rank failed" (find_gemini_error
    prefers a rank's own error to the echo other ranks raise). The slot is present, so it is not
    rebuilt from parity (only lost ones are: docs/parity.md): with no store, the restore refuses."""
    roots = nodes(4)
    run_ranks(_save, 4, roots, steps=[1, 2])
    _flip_data_byte(roots[0], 0, 2)
    out = run_ranks(_load, 4, roots)
    for o in out:
        assert o.get("error") == "ChecksumMismatchError", out
        assert "saved by rank 0" in o["message"] and "every copy tried" in o["message"], out


def test_find_gemini_error_prefers_a_ranks_own_error() -> None:
    from gemini_dcp.errors import ChecksumMismatchError, ShardUnavailableError, mark_from_another_rank

    class Wrapped(Exception):  # DCP's CheckpointException: every rank's failure by rank
        def __init__(self, failures: dict[int, BaseException]) -> None:
            super().__init__("wrapped")
            self.failures = failures

    own = ChecksumMismatchError("rank 0's shard is corrupt")
    echoes = {r: mark_from_another_rank(ShardUnavailableError("another rank failed")) for r in (1, 2, 3)}
    for failures in ({0: own, **echoes}, {**echoes, 0: own}):
        assert find_gemini_error(Wrapped(failures)) is own
    assert find_gemini_error(Wrapped(dict(echoes))) in echoes.values()  # only echoes: one of them
    assert not own.from_another_rank
