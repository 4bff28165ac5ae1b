"""Issue 20: the GPU save path's copier, tested on the CPU with the copy function injected.

``DeviceCopier`` copies a tensor piece by piece (each piece paced first), checksums each piece
after it landed (the same value as the slot's usual checksum of the whole), page-locks each slot
mapping once and unregisters it before the mapping goes (a slot that grows or closes). On a CUDA
machine one test checks which path a CUDA tensor of a real save takes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from gemini_dcp.core.checksum import checksum
from gemini_dcp.errors import GeminiError
from gemini_dcp.ext.cuda import DeviceCopyError
from gemini_dcp.local.slots import SlotFile
from gemini_dcp.save.device_copy import DeviceCopier, DeviceSums, Pending, copy_path


class _Done:
    def __init__(self, log: list[str], what: str) -> None:
        self.log, self.what = log, what

    def synchronize(self) -> None:
        self.log.append(f"wait {self.what}")


def _fake_copy(log: list[str]) -> Any:
    def copy(dst: torch.Tensor, src: torch.Tensor, chunk: int) -> _Done:
        dst.copy_(src)
        log.append(f"copy {chunk}")
        return _Done(log, str(chunk))

    return copy


@pytest.mark.parametrize("algo", ["crc32c", "xxh3"])
@pytest.mark.parametrize("nbytes", [0, 1, 999, 4096, 10_000])
def test_pieces_land_exact_and_the_checksum_is_the_whole_ones(algo: str, nbytes: int) -> None:
    log: list[str] = []
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    paced: list[int] = []
    c = DeviceCopier(chunk_bytes=4096, copy_fn=_fake_copy(log))
    cs = c.copy(dst, src, algo, pace=paced.append)
    assert torch.equal(dst, src)
    assert cs == checksum(src, algo)
    assert sum(paced) == nbytes and all(p <= 4096 for p in paced)
    assert len(paced) == -(-nbytes // 4096)


def test_the_next_piece_is_issued_before_the_previous_is_waited_on() -> None:
    log: list[str] = []
    c = DeviceCopier(chunk_bytes=4, copy_fn=_fake_copy(log))
    c.copy(torch.zeros(10, dtype=torch.uint8), torch.arange(10, dtype=torch.uint8), "crc32c")
    assert log == ["copy 4", "copy 4", "wait 4", "copy 2", "wait 4", "wait 2"]


def test_typed_and_strided_sources_are_copied_as_their_bytes() -> None:
    src = torch.arange(60, dtype=torch.float32).reshape(6, 10).t()  # not contiguous
    dst = torch.zeros(src.numel() * 4, dtype=torch.uint8)
    c = DeviceCopier(chunk_bytes=64, copy_fn=_fake_copy([]))
    c.copy(dst, src, "crc32c")
    assert torch.equal(dst.view(torch.float32).view(10, 6), src)


def test_a_wrong_destination_is_refused() -> None:
    c = DeviceCopier(chunk_bytes=64, copy_fn=_fake_copy([]))
    with pytest.raises(GeminiError, match="does not take"):
        c.copy(torch.zeros(3, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8), "crc32c")


def test_each_mapping_is_registered_once_and_unregistered_before_it_goes(tmp_path: Path) -> None:
    reg: list[int] = []
    unreg: list[int] = []
    slot = SlotFile(tmp_path / "slot-0")
    slot.ensure_capacity(4096)
    c = DeviceCopier(copy_fn=_fake_copy([]), register_fn=lambda t: reg.append(t.data_ptr()),
                     unregister_fn=lambda t: unreg.append(t.data_ptr()))
    c.ensure_registered(slot)
    c.ensure_registered(slot)
    first = slot.tensor.data_ptr()
    assert reg == [first] and unreg == []
    slot.ensure_capacity(slot.capacity + 1)  # grows: remapped, the old mapping unregistered first
    assert unreg == [first]
    c.ensure_registered(slot)
    assert reg == [first, slot.tensor.data_ptr()]
    second = slot.tensor.data_ptr()
    slot.close()
    assert unreg == [first, second]
    c.close()  # nothing left registered: no second unregister
    assert unreg == [first, second]


def test_a_failed_registration_logs_once_and_copies_go_on(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    calls: list[int] = []

    def refuse(t: torch.Tensor) -> None:
        calls.append(1)
        raise DeviceCopyError("cudaHostRegister of 4096 bytes failed with CUDA error 2")

    slot = SlotFile(tmp_path / "slot-0")
    slot.ensure_capacity(4096)
    c = DeviceCopier(copy_fn=_fake_copy([]), register_fn=refuse, unregister_fn=lambda t: None)
    with caplog.at_level("WARNING"):
        c.ensure_registered(slot)
        c.ensure_registered(slot)
    assert len(calls) == 1 and c.register_failed and "ulimit -l" in caplog.text
    slot.close()


def test_copy_path_names_the_path() -> None:
    assert copy_path() in ("extension", "torch-fallback", "none")
    if not torch.cuda.is_available():
        assert copy_path() == "none"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_tensor_of_a_save_goes_through_the_device_copier(tmp_path: Path) -> None:
    import os

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from mp_utils import free_port

    from gemini_dcp import GeminiStorageReader, GeminiStorageWriter

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        sd = {"w": torch.randn(1 << 20, device="cuda"), "b": torch.randn(7, device="cuda")}
        w = GeminiStorageWriter(root=str(tmp_path), job_id="gpu")
        dcp.save(sd, storage_writer=w, checkpoint_id=1)
        dc = w.local_writer.device_copier
        assert dc.bytes_copied == sum(t.nbytes for t in sd.values())
        assert copy_path() in ("extension", "torch-fallback")
        back = {k: torch.zeros_like(v) for k, v in sd.items()}
        dcp.load(back, storage_reader=GeminiStorageReader(root=str(tmp_path), job_id="gpu"))
        assert all(torch.equal(back[k], sd[k]) for k in sd)
    finally:
        dist.destroy_process_group()


def test_gpu_checksummed_items_queue_their_pieces_and_wait_once() -> None:
    """The xsum64 path (checksum on the device) does not wait per tensor: the pieces of every tensor
    queue on the copy stream and one wait() at the end of the write covers them all."""
    log: list[str] = []
    c = DeviceCopier(chunk_bytes=4096, copy_fn=_fake_copy(log))
    srcs = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in (10_000, 5, 4096)]
    dsts = [torch.zeros_like(s) for s in srcs]
    sums = [c.copy(d, s, "xsum64") for d, s in zip(dsts, srcs)]
    assert not any(line.startswith("wait") for line in log)  # nothing waited yet
    c.wait()
    assert [line for line in log if line.startswith("wait")] == ["wait 4096"]  # the last piece, once
    c.wait()  # idempotent
    sums = c.resolve(sums)  # the checksums were read back once, by the first wait
    assert sums == [checksum(s, "xsum64") for s in srcs] and all(torch.equal(d, s) for d, s in zip(dsts, srcs))
    assert c.bytes_copied == sum(s.numel() for s in srcs)


def test_gpu_checksummed_counts_come_back_with_the_checksums_in_one_read() -> None:
    """``copy_counted`` on the xsum64 path: the non-finite count is summed with the checksum (one
    kernel per tensor, on the device), and both are numbers only after ``wait`` + ``resolve``."""
    c = DeviceCopier(chunk_bytes=4096, copy_fn=_fake_copy([]))
    srcs = [torch.randn(3000), torch.randn(1000).to(torch.bfloat16), torch.randn(7, dtype=torch.float64)]
    srcs[0][[5, 17, 2999]] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    srcs[1][0] = float("nan")
    kinds = [1, 4, 2]
    dsts = [torch.empty(s.nbytes, dtype=torch.uint8) for s in srcs]
    got = [c.copy_counted(d, s, "xsum64", k) for d, s, k in zip(dsts, srcs, kinds)]
    assert all(isinstance(v, Pending) for pair in got for v in pair)
    c.wait()
    values = c.resolve([v for pair in got for v in pair])
    want = [checksum(s.view(torch.uint8), "xsum64") for s in srcs]
    assert values == [want[0], 3, want[1], 1, want[2], 0]
    again = c.copy_counted(dsts[0], srcs[0], "xsum64", 1)  # the next write starts from zeroed rows
    c.wait()
    assert c.resolve(list(again)) == [want[0], 3]


def test_device_sums_grow_past_their_first_array() -> None:
    sums = DeviceSums()
    ts = [torch.full((16,), i, dtype=torch.uint8) for i in range(150)]
    pend = [sums.add(t, t.nbytes) for t in ts]
    assert sums.pending == 150
    got = sums.read()
    assert [got[p.row][0] for p in pend] == [checksum(t, "xsum64") for t in ts]
