"""Items checksummed with ``xsum64`` (what a CUDA tensor's save records: the checksum is computed on
the GPU, gemini_dcp.save.device_copy) are verified on the CPU by every reader: the local tier, a peer's
replica after a node loss, the drain to the persistent tier (stock ``dcp.load`` reads the result) and
a restore from it. On the CPU the same records come from ``checksum="xsum64"``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from mp_utils import run_ranks
from workloads import dtensor_state, full_weight, plain_state

from gemini_dcp import GeminiStorageReader, GeminiStorageWriter, find_gemini_error
from gemini_dcp.core.checksum import buffer_checksum, checksum, new_hasher
from gemini_dcp.ext.cuda import xsum64_reference
from gemini_dcp.local.tier import LocalTier


@pytest.fixture(autouse=True)
def _short_lived_drains(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GEMINI_DCP_DRAIN_IDLE_S", "3")


@pytest.fixture
def root() -> Any:
    d = tempfile.mkdtemp(prefix="gemini-xsum-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 4095, (1 << 20) + 5])
def test_streamed_xsum64_equals_the_gpu_definition(n: int) -> None:
    g = torch.Generator().manual_seed(n)
    b = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    want = xsum64_reference(b)
    assert checksum(b, "xsum64") == want
    assert buffer_checksum("xsum64")(memoryview(b.numpy())) == want
    for piece in (1, 3, 8, 1000):
        h = new_hasher("xsum64")
        for off in range(0, n, piece):
            h.update(b[off : off + piece])
        assert h.value() == want, piece


def test_local_save_restore_and_a_flipped_byte(root: str) -> None:
    w = GeminiStorageWriter(root=root, job_id="x", checksum="xsum64")
    for step in (1, 2):
        dcp.save(plain_state(step), storage_writer=w, checkpoint_id=step)
    sd = plain_state(0)
    r = GeminiStorageReader(root=root, job_id="x")
    dcp.load(sd, storage_reader=r)
    assert r.restored_step == 2 and torch.equal(sd["w"], plain_state(2)["w"]) and sd["step"] == 2
    # a flipped byte of step 2's "w" in the slot: detected, the older step restores
    slots = sorted(Path(root).rglob("slot-*"))
    assert slots, sorted(map(str, Path(root).rglob("*")))
    target = plain_state(2)["w"].numpy().tobytes()
    for p in slots:
        data = bytearray(p.read_bytes())
        pos = data.find(target)
        if pos >= 0:
            with open(p, "r+b") as f:
                f.seek(pos + 3)
                f.write(bytes([data[pos + 3] ^ 0x20]))
            break
    else:
        raise AssertionError("step 2's bytes not found in any slot")
    sd = plain_state(0)
    r = GeminiStorageReader(root=root, job_id="x")
    try:
        dcp.load(sd, storage_reader=r)
    except BaseException as exc:  # no other copy of step 2: refused, naming the checksum
        assert "checksum" in str(find_gemini_error(exc) or exc)
    else:
        assert r.restored_step == 1 and torch.equal(sd["w"], plain_state(1)["w"])


def test_drain_writes_stock_checkpoints_and_restores_from_the_store(root: str, tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    url = f"file://{store}"
    w = GeminiStorageWriter(root=root, job_id="d", checksum="xsum64", persistent=url, persist_every=1)
    dcp.save(plain_state(3), storage_writer=w, checkpoint_id=3)
    assert w.wait_persisted(timeout_s=120) == 3
    sd = plain_state(0)
    dcp.load(sd, checkpoint_id=str(store / "d" / "step-3"))  # stock reader, no gemini_dcp
    assert torch.equal(sd["w"], plain_state(3)["w"]) and torch.equal(sd["i"], plain_state(3)["i"])
    LocalTier(root, "d").remove_job()  # every memory copy lost
    sd = plain_state(0)
    r = GeminiStorageReader(root=root, job_id="d", persistent=url)
    dcp.load(sd, storage_reader=r)
    assert r.restored_step == 3 and r.restored_from["persistent"] > 0 and torch.equal(sd["w"], plain_state(3)["w"])


def _save(rank: int, world: int, root: str) -> None:
    w = GeminiStorageWriter(root=root, job_id="p", replicas=2, checksum="xsum64")
    for step in (1, 2):
        dcp.save(dtensor_state(step, world), storage_writer=w, checkpoint_id=step)


def _load(rank: int, world: int, root: str) -> dict[str, Any]:
    sd = dtensor_state(0, world)
    r = GeminiStorageReader(root=root, job_id="p")
    dcp.load(sd, storage_reader=r)
    got = sd["model"]["w"].full_tensor()
    return {"step": r.restored_step, "exact": bool(torch.equal(got, full_weight(2))), "from": dict(r.restored_from)}


def test_a_lost_node_restores_from_the_peer_replica(tmp_path: Path) -> None:
    roots = [str(tmp_path / "n0"), str(tmp_path / "n1")]
    for r in roots:
        os.mkdir(r, 0o700)
    run_ranks(_save, 2, roots)
    shutil.rmtree(roots[1])
    os.mkdir(roots[1], 0o700)  # node 1 replaced: its memory is gone
    out = run_ranks(_load, 2, roots)
    assert all(o["step"] == 2 and o["exact"] for o in out), out
    assert sum(o["from"].get("peer", 0) for o in out) > 0, out
