"""The restore's CUDA landing (gemini_dcp.restore.device_land): which slot mappings are page-locked.

The decision and the bookkeeping run on the CPU with injected registration functions and
destinations that say they are CUDA tensors; the real host-to-device path is exercised by the
GPU test below (skipped without CUDA) and by benchmarks/bench_gpu_save.py on a lent GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from gemini_dcp.restore.device_land import MIN_REGISTER_BYTES, DeviceLander

MiB = 1 << 20


def _lander(mode: Any, registered: list[int], unregistered: list[int] | None = None, refuse: bool = False,
            min_bytes: int = MIN_REGISTER_BYTES) -> DeviceLander:
    def reg(t: torch.Tensor) -> None:
        if refuse:
            raise RuntimeError("cudaHostRegister(read-only) failed with CUDA error 1")
        registered.append(t.nbytes)

    def unreg(t: torch.Tensor) -> None:
        (unregistered if unregistered is not None else []).append(t.nbytes)

    return DeviceLander(register_fn=reg, unregister_fn=unreg, mode=mode, min_bytes=min_bytes,
                        cuda_available=lambda: True)


def _chunks(mapping: torch.Tensor, spans: list[tuple[int, int]], cuda: bool) -> tuple[list[Any], dict[int, Any]]:
    chunks, dests = [], {}
    for off, n in spans:
        item = SimpleNamespace(fqn=f"t{off}")
        chunks.append(([item], mapping[off : off + n]))
        dests[id(item)] = SimpleNamespace(is_cuda=cuda)
    return chunks, dests


def test_auto_registers_a_mapping_mostly_bound_for_cuda() -> None:
    m = torch.zeros(4 * MiB, dtype=torch.uint8)
    chunks, dests = _chunks(m, [(0, 2 * MiB), (2 * MiB, 2 * MiB)], cuda=True)
    got: list[int] = []
    undone: list[int] = []
    lander = _lander("auto", got, undone, min_bytes=MiB)
    lander.prepare([m], chunks, dests)
    assert got == [4 * MiB] and lander.bytes_registered == 4 * MiB
    lander.release()
    lander.release()  # idempotent
    assert undone == [4 * MiB]


def test_auto_skips_small_shares_cpu_destinations_and_other_memory() -> None:
    m = torch.zeros(8 * MiB, dtype=torch.uint8)
    other = torch.zeros(2 * MiB, dtype=torch.uint8)
    got: list[int] = []
    # a quarter of the mapping to the GPU: pinning all of it for that is not worth it
    chunks, dests = _chunks(m, [(0, 2 * MiB)], cuda=True)
    _lander("auto", got, min_bytes=MiB).prepare([m], chunks, dests)
    # below the minimum
    chunks, dests = _chunks(m, [(0, 8 * MiB)], cuda=True)
    _lander("auto", got, min_bytes=16 * MiB).prepare([m], chunks, dests)
    # CPU destinations
    chunks, dests = _chunks(m, [(0, 8 * MiB)], cuda=False)
    _lander("always", got).prepare([m], chunks, dests)
    # chunks outside every mapping (peer receive buffers, persistent reads)
    chunks, dests = _chunks(other, [(0, 2 * MiB)], cuda=True)
    _lander("always", got).prepare([m], chunks, dests)
    assert got == []


def test_always_registers_any_share_and_never_none() -> None:
    m = torch.zeros(8 * MiB, dtype=torch.uint8)
    chunks, dests = _chunks(m, [(0, MiB)], cuda=True)
    got: list[int] = []
    _lander("always", got).prepare([m], chunks, dests)
    assert got == [8 * MiB]
    _lander("never", got).prepare([m], chunks, dests)
    assert got == [8 * MiB]


def test_env_chooses_the_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    m = torch.zeros(8 * MiB, dtype=torch.uint8)
    chunks, dests = _chunks(m, [(0, MiB)], cuda=True)
    got: list[int] = []
    monkeypatch.setenv("GEMINI_DCP_H2D_REGISTER", "0")
    _lander(None, got).prepare([m], chunks, dests)
    monkeypatch.setenv("GEMINI_DCP_H2D_REGISTER", "1")
    lander = DeviceLander(register_fn=lambda t: got.append(t.nbytes), unregister_fn=lambda t: None,
                          cuda_available=lambda: True)
    lander.prepare([m], chunks, dests)
    assert got == [8 * MiB]


def test_a_refused_registration_logs_once_and_falls_back(caplog: pytest.LogCaptureFixture) -> None:
    a, b = torch.zeros(2 * MiB, dtype=torch.uint8), torch.zeros(2 * MiB, dtype=torch.uint8)
    ca, da = _chunks(a, [(0, 2 * MiB)], cuda=True)
    cb, db = _chunks(b, [(0, 2 * MiB)], cuda=True)
    got: list[int] = []
    lander = _lander("always", got, refuse=True)
    with caplog.at_level("WARNING"):
        lander.prepare([a, b], ca + cb, {**da, **db})
    assert got == [] and lander.register_failed and caplog.text.count("ulimit -l") == 1
    lander.release()


def test_cpu_destinations_land_with_a_plain_copy() -> None:
    lander = DeviceLander(cuda_available=lambda: False)
    dst, src = torch.zeros(5), torch.arange(5.0)
    lander.copy(dst, src)
    lander.finish()
    assert torch.equal(dst, src) and lander.bytes_to_device == 0 and not lander.devices


@contextlib.contextmanager
def _saved_and_loaded_on_gpu(tmp_path: Path, job: str) -> Iterator[tuple[dict[str, torch.Tensor], Any]]:
    """One rank's group; a state on the GPU (a large float32, a small float16, a CPU int tensor) saved
    and loaded back by a fresh reader: yields (state, reader) with the load checked bit-exact."""
    import os

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from mp_utils import free_port

    from gemini_dcp import GeminiStorageReader, GeminiStorageWriter

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        sd = {"w": torch.randn(1 << 22, device="cuda"), "h": torch.randn(33, 7, device="cuda").half(),
              "cpu": torch.arange(10)}
        dcp.save(sd, storage_writer=GeminiStorageWriter(root=str(tmp_path), job_id=job), checkpoint_id=1)
        back = {k: torch.zeros_like(v) for k, v in sd.items()}
        reader = GeminiStorageReader(root=str(tmp_path), job_id=job)
        dcp.load(back, storage_reader=reader)
        assert all(torch.equal(back[k], sd[k]) for k in sd)
        yield sd, reader
    finally:
        dist.destroy_process_group()


def _load_converted(tmp_path: Path, job: str, sd: dict[str, torch.Tensor]) -> None:
    """Another dtype on the GPU: converted values, as stock DCP."""
    import torch.distributed.checkpoint as dcp

    from gemini_dcp import GeminiStorageReader

    conv = {"w": torch.zeros(1 << 22, device="cuda", dtype=torch.float64), "h": torch.zeros(33, 7, device="cuda"),
            "cpu": torch.zeros(10, dtype=torch.int64)}
    dcp.load(conv, storage_reader=GeminiStorageReader(root=str(tmp_path), job_id=job))
    assert torch.equal(conv["w"], sd["w"].double()) and torch.equal(conv["h"], sd["h"].float())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_load_onto_cuda_tensors_lands_from_the_registered_slot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GEMINI_DCP_H2D_REGISTER", "1")
    monkeypatch.setenv("GEMINI_DCP_H2D_VERIFY", "cpu")  # this test: the host-to-device landing from the slot
    with _saved_and_loaded_on_gpu(tmp_path, "gpu") as (sd, reader):
        landed = reader._staging.last_lander
        assert landed is not None and reader._staging.lander is None  # released after the load
        assert landed.bytes_registered >= sd["w"].nbytes  # the slot mapping was page-locked for the DMA
        assert landed.bytes_to_device == sd["w"].nbytes + sd["h"].nbytes
        _load_converted(tmp_path, "gpu", sd)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_load_onto_cuda_tensors_verifies_on_the_gpu_and_lands_nothing_corrupt(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """GEMINI_DCP_H2D_VERIFY=gpu: chunks saved from CUDA tensors (xsum64) are copied into staging buffers on
    the GPU, checksummed there and landed device-to-device; a flipped byte in the slot fails the load
    before anything lands."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    from gemini_dcp import GeminiStorageReader
    from gemini_dcp.ext import loader

    if not (loader.load() and loader.has_cuda_ext()):
        pytest.skip("the extension's CUDA ops are not built")
    monkeypatch.setenv("GEMINI_DCP_H2D_VERIFY", "gpu")
    with _saved_and_loaded_on_gpu(tmp_path, "gpuv") as (sd, reader):
        on_gpu = sd["w"].nbytes + sd["h"].nbytes
        assert reader._staging.device_verified == on_gpu
        landed = reader._staging.last_lander
        assert landed is not None and landed.bytes_on_device == on_gpu and landed.bytes_to_device == 0
        _load_converted(tmp_path, "gpuv", sd)
        # one flipped byte in the middle of the slot (inside "w"): refused, nothing landed
        slot = max((p for p in tmp_path.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
        with open(slot, "r+b") as f:
            f.seek(slot.stat().st_size // 2)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0x40]))
        fresh = {k: torch.zeros_like(v) for k, v in sd.items()}
        with pytest.raises(CheckpointException, match="failed its xsum64 checksum"):
            dcp.load(fresh, storage_reader=GeminiStorageReader(root=str(tmp_path), job_id="gpuv"))
        assert not fresh["w"].any() and not fresh["h"].any()
