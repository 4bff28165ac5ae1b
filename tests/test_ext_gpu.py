"""gemini_dcp.ext on a CUDA device: host registration of a tmpfs mmap, chunked D2H copies
and the xsum64 GPU checksum, each checked bit-exact. Skipped without CUDA.

    python -m pytest -q tests/test_ext_gpu.py        # builds the CUDA ops (JIT) on first use
"""

from __future__ import annotations

import mmap
import os
import tempfile
from pathlib import Path
from typing import Iterator

import pytest
import torch

from gemini_dcp import ext
from gemini_dcp.ops import gpuinfo

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def loaded() -> bool:
    ext.load(verbose=True)
    return ext.HAS_CUDA_EXT


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


@pytest.fixture
def shm_tensor(request: pytest.FixtureRequest) -> Iterator[torch.Tensor]:
    """A uint8 tensor over a MAP_SHARED mmap of a tmpfs file (what a memory tier holds)."""
    nbytes: int = request.param
    fd, path = tempfile.mkstemp(prefix="gemini_ext_test_", dir=_shm_dir())
    try:
        os.ftruncate(fd, max(nbytes, 1))
        mm = mmap.mmap(fd, max(nbytes, 1), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        t = torch.frombuffer(mm, dtype=torch.uint8)[:nbytes]
        yield t
        del t
        try:
            mm.close()
        except BufferError:  # a view is still referenced (e.g. by a failure's traceback)
            pass
    finally:
        os.close(fd)
        Path(path).unlink(missing_ok=True)


def test_cuda_ops_built_when_nvcc_present(loaded: bool) -> None:
    if os.environ.get("GEMINI_DCP_CUDA_EXT", "auto") == "0" or os.environ.get("GEMINI_DCP_EXT") == "0":
        pytest.skip("CUDA ops disabled by env")
    if ext.loader.find_nvcc() is None:
        pytest.skip("no nvcc: the CUDA ops cannot be built here")
    assert loaded, ext.status()
    assert "CUDA ops" in ext.status()


@pytest.mark.parametrize("shm_tensor", [(64 << 20) + 13], indirect=True)
def test_host_register_mmap_and_copy_d2h_bit_exact(loaded: bool, shm_tensor: torch.Tensor) -> None:
    dst = shm_tensor
    n = dst.numel()
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
    ext.host_register(dst)
    ext.host_register(dst)  # idempotent
    if loaded:
        assert torch.ops.gemini_dcp.host_registered_bytes() >= n
    try:
        for chunk in (n, 4 << 20, (3 << 20) + 7):
            dst.zero_()
            ev = ext.copy_d2h_chunked(dst, src, chunk_bytes=chunk)
            assert isinstance(ev, torch.cuda.Event)
            ev.synchronize()
            assert torch.equal(dst, src.cpu()), chunk
    finally:
        ext.host_unregister(dst)
        ext.host_unregister(dst)  # idempotent
    if loaded:
        assert torch.ops.gemini_dcp.host_registered_bytes() == 0


@pytest.mark.parametrize("n", [0, 1, 7, 4097, (1 << 20) + 3])
def test_copy_d2h_sizes_and_dtypes(loaded: bool, n: int) -> None:
    src = torch.randn(n, device="cuda")
    dst = torch.empty(n * 4, dtype=torch.uint8).pin_memory()  # bytes of a float32 tensor
    ext.copy_d2h_chunked(dst, src, chunk_bytes=1 << 16).synchronize()
    assert torch.equal(dst.view(torch.float32), src.cpu())
    pageable = torch.empty(n, dtype=torch.float32)
    ext.copy_d2h_chunked(pageable, src).synchronize()
    assert torch.equal(pageable, src.cpu())


def test_copy_d2h_is_ordered_after_the_producer(loaded: bool) -> None:
    n = 32 << 20
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    a = torch.randn(4096, 4096, device="cuda")
    src.fill_(1)
    for _ in range(4):  # keep the current stream busy, then write the final value
        a = a @ a
        a = a / a.norm()
    src.fill_(7)
    dst = torch.zeros(n, dtype=torch.uint8).pin_memory()
    ev = ext.copy_d2h_chunked(dst, src, chunk_bytes=8 << 20)
    ev.synchronize()
    assert bool((dst == 7).all())


def test_copy_d2h_fallback_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ext.loader, "load", lambda verbose=False: False)
    src = torch.randint(0, 256, ((8 << 20) + 3,), dtype=torch.uint8, device="cuda")
    dst = torch.empty(src.numel(), dtype=torch.uint8)
    ext.host_register(dst)  # fallback: cudart().cudaHostRegister
    try:
        ext.copy_d2h_chunked(dst, src, chunk_bytes=1 << 20).synchronize()
        assert torch.equal(dst, src.cpu())
    finally:
        ext.host_unregister(dst)


def test_gpu_checksum_matches_cpu_reference(loaded: bool) -> None:
    big = torch.randint(0, 256, ((16 << 20) + 41,), dtype=torch.uint8, device="cuda")
    for n in (0, 1, 7, 8, 9, 15, 16, 17, 31, 1000, 65_537, (1 << 20) + 5, big.numel() - 8):
        for off in (0, 1, 3, 8):
            t = big[off : off + n]
            want = ext.xsum64_reference(t.cpu())
            assert ext.gpu_checksum(t) == want, (n, off)
            assert ext.gpu_checksum(t.cpu()) == want, (n, off)  # the CPU kernel agrees
    f = torch.randn(333, 77, device="cuda", dtype=torch.bfloat16)
    assert ext.gpu_checksum(f) == ext.xsum64_reference(f.cpu())
    g = big.clone()
    g[12345] ^= 1
    assert ext.gpu_checksum(g) != ext.gpu_checksum(big)


def test_gpu_checksum_on_a_side_stream(loaded: bool) -> None:
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        t = torch.arange(1 << 22, device="cuda", dtype=torch.int32)
        v = ext.gpu_checksum(t)
    assert v == ext.xsum64_reference(t.cpu())


def test_gpu_info_lists_the_device() -> None:
    info = gpuinfo.gpu_info()
    if not info:
        pytest.skip("NVML not readable in this environment")
    g = info[0]
    assert g["name"] and g["memory_total_bytes"] and g["memory_total_bytes"] > 1 << 30
    assert 4 << 20 <= gpuinfo.suggest_chunk_bytes(0, info) <= 64 << 20


@pytest.mark.parametrize("dtype,kind", [(torch.uint8, 0), (torch.float32, 1), (torch.float64, 2),
                                        (torch.float16, 3), (torch.bfloat16, 4)])
def test_xsum64_accumulate_sums_and_counts_with_no_readback(loaded: bool, dtype: torch.dtype, kind: int) -> None:
    """The kernel a save runs per CUDA tensor: S of xsum64 and the non-finite count, added into a device
    array, equal to the CPU reference (odd sizes and offsets: unaligned and tail words)."""
    from gemini_dcp.ext.cuda import has_accumulate, xsum64_accumulate, xsum64_finish, xsum64_reference
    from gemini_dcp.health.count import count_nonfinite

    if not loaded or not has_accumulate():
        pytest.skip("the extension's CUDA ops are not built")
    acc = torch.zeros((8, 2), dtype=torch.int64, device="cuda")
    want = []
    for row, n in enumerate((1, 7, 4097, 1 << 20, (1 << 20) + 3)):
        t = (torch.randn(n + 1, device="cuda") * 100).to(dtype)[1:] if dtype != torch.uint8 else \
            torch.randint(0, 256, (n + 1,), dtype=torch.uint8, device="cuda")[1:]
        if kind and n > 5:
            t[[0, 3, n - 1]] = torch.tensor([float("nan"), float("inf"), -float("inf")], device="cuda").to(dtype)
        xsum64_accumulate(t.contiguous(), acc, row, kind)
        want.append((xsum64_reference(t.contiguous().cpu()), count_nonfinite(t.cpu()) if kind else 0, t.nbytes))
    host = acc.cpu().tolist()
    for row, (ref, count, nbytes) in enumerate(want):
        assert xsum64_finish(host[row][0] & ((1 << 64) - 1), nbytes) == ref
        assert host[row][1] == count
