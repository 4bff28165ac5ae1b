"""gemini_dcp.ext on the CPU: the C++ ops against the `crc32c` package and torch, the
pure-torch fallbacks, the loader's env switches and failure modes, and gpuinfo.

The extension is JIT-built once per machine (≈30–60 s on 2 cores the first time,
cached under ~/.cache/gemini_dcp/ext or $GEMINI_DCP_EXT_CACHE); the tests that need
it are skipped when it cannot be built (GEMINI_DCP_EXT=0 or no compiler).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import crc32c as crc32c_pkg
import pytest
import torch

from gemini_dcp import ext
from gemini_dcp.errors import ConfigError, GeminiError
from gemini_dcp.ops import gpuinfo

REPO = Path(__file__).resolve().parents[1]

SIZES = [0, 1, 2, 3, 7, 8, 9, 15, 16, 17, 63, 64, 255, 256, 767, 768, 769, 1000, 8191, 8192,
         24575, 24576, 24577, 49157, (1 << 20) + 3]


def _rand(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + n)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def _ref(t: torch.Tensor, value: int = 0) -> int:
    return crc32c_pkg.crc32c(t.numpy().tobytes(), value)


@pytest.fixture(scope="module")
def built() -> bool:
    ok = ext.load()
    if not ok:
        pytest.skip(f"extension not available here: {ext.status()}")
    return ok


@pytest.fixture(params=["ext", "fallback"])
def impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "ext":
        request.getfixturevalue("built")
    else:
        monkeypatch.setattr(ext.loader, "load", lambda verbose=False: False)
    return request.param


# ------------------------------------------------------------------------------------- crc32c


def test_crc32c_matches_package_on_fixed_and_random_sizes(impl: str) -> None:
    g = torch.Generator().manual_seed(7)
    sizes = SIZES + torch.randint(0, 300_000, (12,), generator=g).tolist()
    for n in sizes:
        b = _rand(n)
        for value in (0, 0xFFFFFFFF, 0x1234ABCD):
            assert ext.crc32c(b, value) == _ref(b, value), (impl, n, value)
    assert ext.crc32c(torch.empty(0, dtype=torch.uint8)) == 0


def test_crc32c_unaligned_slices(impl: str) -> None:
    big = _rand(200_003, seed=1)
    for off in range(1, 9):
        for n in (1, 7, 13, 771, 24_577, 100_001):
            s = big[off : off + n]
            assert ext.crc32c(s) == _ref(s), (impl, off, n)
            assert ext.crc32c(s, 99) == _ref(s, 99), (impl, off, n)


def test_crc32c_continuation(impl: str) -> None:
    a, b = _rand(100_001, 2), _rand(77_777, 3)
    whole = torch.cat([a, b])
    assert ext.crc32c(b, ext.crc32c(a)) == ext.crc32c(whole) == _ref(whole)
    # piecewise over many odd pieces
    v = 0
    for start in range(0, whole.numel(), 9_999):
        v = ext.crc32c(whole[start : start + 9_999], v)
    assert v == _ref(whole)


def test_crc32c_known_answer(impl: str) -> None:
    # RFC 3720 / iSCSI check value of "123456789".
    assert ext.crc32c(torch.frombuffer(bytearray(b"123456789"), dtype=torch.uint8)) == 0xE3069283


@pytest.mark.parametrize("path", ["auto", "crc32", "pclmul", "blocks"])
def test_every_cpu_code_path_matches_package(built: bool, path: str) -> None:
    """x86 has three kernels: PCLMULQDQ folding (default on long buffers), the 3-way crc32
    instruction loop, and copy-blocks-then-CRC for the fused op; each must agree."""
    ops = torch.ops.gemini_dcp
    try:
        ops.crc32c_path("auto")
        impl = ops.crc32c_path(path)
        big = _rand((3 << 20) + 77, 13)
        out = torch.zeros(big.numel() + 64, dtype=torch.uint8)
        g = torch.Generator().manual_seed(3)
        sizes = list(range(0, 300, 7)) + [767, 768, 769, 24_575, 24_577, 98_305] + \
            torch.randint(0, 3 << 20, (8,), generator=g).tolist()
        for i, n in enumerate(sizes):
            off, doff = i % 13, (i * 5) % 17
            src, dst = big[off : off + n], out[doff : doff + n]
            want = _ref(src, 0xDEADBEEF)
            assert ext.crc32c(src, 0xDEADBEEF) == want, (impl, n, off)
            dst.zero_()
            assert ext.copy_with_crc32c(dst, src, num_threads=1 + i % 3) == _ref(src), (impl, n, off, doff)
            assert torch.equal(dst, src), (impl, n)
    finally:
        ops.crc32c_path("auto")


# ------------------------------------------------------------------------------------- copies


@pytest.mark.parametrize("threads", [0, 1, 2, 3, 7])
def test_copy_bytes_odd_sizes(impl: str, threads: int) -> None:
    for n in (0, 1, 7, 63, 64, 65, 1000, 8191, 100_003):
        src, dst = _rand(n, 4), torch.zeros(n, dtype=torch.uint8)
        ext.copy_bytes(dst, src, num_threads=threads)
        assert torch.equal(dst, src), (impl, threads, n)


def test_copy_bytes_large_default_threads(impl: str) -> None:
    n = (20 << 20) + 5  # > 2 x 8 MiB, so the default uses 2 threads where torch has 2
    src, dst = _rand(n, 5), torch.zeros(n, dtype=torch.uint8)
    ext.copy_bytes(dst, src)
    assert torch.equal(dst, src)


@pytest.mark.parametrize("threads", [0, 1, 2, 3, 5])
def test_copy_with_crc32c(impl: str, threads: int) -> None:
    for n in (0, 1, 7, 9, 63, 65, 1000, 98_303, 98_304, 98_305, 300_007):
        src, dst = _rand(n, 6), torch.zeros(n, dtype=torch.uint8)
        assert ext.copy_with_crc32c(dst, src, num_threads=threads) == _ref(src), (impl, threads, n)
        assert torch.equal(dst, src)


def test_copy_with_crc32c_unaligned_and_large(impl: str) -> None:
    big = _rand((17 << 20) + 11, 8)
    out = torch.zeros(big.numel() + 16, dtype=torch.uint8)
    for soff, doff in ((1, 3), (5, 0), (0, 7)):
        n = big.numel() - 8
        src, dst = big[soff : soff + n], out[doff : doff + n]
        assert ext.copy_with_crc32c(dst, src) == _ref(src)
        assert torch.equal(dst, src)
    # save then load round trip: the CRC of what was written equals the CRC of what is read back
    tier, live = torch.empty_like(big), torch.empty_like(big)
    assert ext.copy_with_crc32c(tier, big) == ext.copy_with_crc32c(live, tier) == _ref(big)


@pytest.mark.parametrize("threads", [0, 1, 3])
def test_copy_with_crc32c_continues_a_running_crc(impl: str, threads: int) -> None:
    """The paced snapshot copy: block after block, each continuing the last block's CRC."""
    src = _rand((3 << 20) + 12_345, 9)
    dst = torch.zeros_like(src)
    for block, n in ((1, 777), (4096, 100_003), (98_305, src.numel()), (1 << 20, src.numel())):
        dst.zero_()
        value = 0
        for start in range(0, n, block):
            end = min(start + block, n)
            value = ext.copy_with_crc32c(dst[start:end], src[start:end], threads, value)
        assert value == _ref(src[:n]), (impl, threads, block)
        assert torch.equal(dst[:n], src[:n])
    assert ext.copy_with_crc32c(dst[:0], src[:0], threads, 0x1234ABCD) == 0x1234ABCD  # empty: unchanged
    seed = _ref(src[:1000])
    assert ext.copy_with_crc32c(dst[1000:5000], src[1000:5000], threads, seed) == _ref(src[:5000])
    with pytest.raises(ConfigError, match="uint32"):
        ext.copy_with_crc32c(dst[:8], src[:8], 0, 1 << 32)


def test_paced_copy_and_checksum_matches_unpaced(impl: str) -> None:
    from gemini_dcp.core.checksum import copy_and_checksum

    src = _rand((2 << 20) + 77, 10)
    blocks: list[int] = []
    for algo in ("crc32c", "xxh3"):
        a, b = torch.zeros_like(src), torch.zeros_like(src)
        paced = copy_and_checksum(a, src, algo, block=1 << 19, pace=blocks.append)
        assert paced == copy_and_checksum(b, src, algo) and torch.equal(a, src) and torch.equal(b, src), (impl, algo)
    assert blocks == [1 << 19] * 4 + [77] + [1 << 19] * 4 + [77]  # the scheduler sees every block, in order


def test_argument_checks() -> None:
    u8 = torch.zeros(16, dtype=torch.uint8)
    with pytest.raises(ConfigError, match="uint8"):
        ext.crc32c(torch.zeros(4, dtype=torch.float32))
    with pytest.raises(ConfigError, match="1-D"):
        ext.crc32c(torch.zeros(4, 4, dtype=torch.uint8))
    with pytest.raises(ConfigError, match="non-contiguous"):
        ext.crc32c(torch.zeros(32, dtype=torch.uint8)[::2])
    with pytest.raises(ConfigError, match="uint32"):
        ext.crc32c(u8, -1)
    with pytest.raises(ConfigError, match="uint32"):
        ext.crc32c(u8, 1 << 32)
    with pytest.raises(ConfigError, match="size mismatch"):
        ext.copy_bytes(u8, torch.zeros(15, dtype=torch.uint8))
    with pytest.raises(ConfigError, match="overlap"):
        ext.copy_with_crc32c(u8[0:8], u8[4:12])
    with pytest.raises(ConfigError, match="num_threads"):
        ext.copy_bytes(u8, u8.clone(), num_threads=-1)
    assert issubclass(ext.ExtensionBuildError, GeminiError)
    assert issubclass(ConfigError, GeminiError)


def test_ops_release_the_gil(built: bool) -> None:
    """While a 192 MiB CRC runs on a thread, the main thread keeps executing Python."""
    buf = torch.full((192 << 20,), 0x5A, dtype=torch.uint8)
    ext.crc32c(buf[:1024])
    results: list[int] = []
    worker = threading.Thread(target=lambda: results.extend(ext.crc32c(buf) for _ in range(2)))
    spins = 0
    worker.start()
    t0 = time.perf_counter()
    while worker.is_alive():
        spins += 1
    elapsed = time.perf_counter() - t0
    assert results and results[0] == results[1]
    # With the GIL held for the whole op the main thread would get in only at the
    # switch points around the two calls (a handful of spins).
    # (a loose floor: on a loaded host the main thread gets a fraction of a core, still far above a handful)
    assert spins > 100, f"only {spins} spins in {elapsed:.3f} s: the op seems to hold the GIL"


# ------------------------------------------------------------------------------------- xsum64


def test_xsum64_cpu_kernel_matches_reference(built: bool) -> None:
    big = _rand(300_011, 10)
    for n in (0, 1, 7, 8, 9, 15, 16, 17, 1000, 65_537, 300_000):
        for off in (0, 1, 3):
            t = big[off : off + n]
            assert ext.gpu_checksum(t) == ext.xsum64_reference(t), (n, off)
    f = torch.randn(1001, 3)
    assert ext.gpu_checksum(f) == ext.xsum64_reference(f)
    assert ext.gpu_checksum(f) == ext.xsum64_reference(ext.cuda.byte_view(f))
    # A big buffer exercises the multi-threaded CPU kernel (> 16 MiB) and the blocked reference.
    t = _rand((18 << 20) + 5, 11)
    assert ext.gpu_checksum(t) == ext.xsum64_reference(t, block_words=1 << 18)


def test_xsum64_reference_known_answers_and_sensitivity() -> None:
    def c(b: bytes) -> int:
        return ext.xsum64_reference(torch.frombuffer(bytearray(b), dtype=torch.uint8)) if b else \
            ext.xsum64_reference(torch.empty(0, dtype=torch.uint8))

    # Frozen values: the CUDA and CPU kernels are checked against this reference, and
    # these keep the definition itself from drifting.
    assert c(b"") == 0x3564B439CD1E1F16
    assert c(b"123456789") == 0xC9B7F6AF52289255
    base = bytes(range(64))
    swapped = base[8:16] + base[0:8] + base[16:]
    assert c(base) != c(swapped)  # order-sensitive
    flipped = bytearray(base)
    flipped[37] ^= 0x10
    assert c(base) != c(bytes(flipped))
    assert c(base) != c(base + b"\0")  # length-sensitive (zero padding is not free)


def test_gpu_checksum_fallback_is_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ext.loader, "load", lambda verbose=False: False)
    t = _rand(12_345, 12)
    assert ext.gpu_checksum(t) == ext.xsum64_reference(t)


def test_cuda_wrappers_without_cuda_are_safe() -> None:
    if torch.cuda.is_available():
        pytest.skip("covered by tests/test_ext_gpu.py")
    t = torch.zeros(4096, dtype=torch.uint8)
    ext.host_register(t)  # no CUDA: a no-op
    ext.host_register(t)
    ext.host_unregister(t)
    ext.host_unregister(t)
    with pytest.raises(ConfigError, match="CUDA tensor"):
        ext.copy_d2h_chunked(t, t.clone())


# ------------------------------------------------------------------------------------- loader


def test_fallback_forced_by_env_in_subprocess(tmp_path: Path) -> None:
    code = (
        "import torch, crc32c\n"
        "from gemini_dcp import ext\n"
        "assert ext.load() is False and ext.HAS_EXT is False and ext.HAS_CUDA_EXT is False\n"
        "assert 'GEMINI_DCP_EXT=0' in ext.status(), ext.status()\n"
        "b = torch.arange(100003, dtype=torch.int64).to(torch.uint8)\n"
        "d = torch.empty_like(b)\n"
        "assert ext.crc32c(b, 5) == crc32c.crc32c(b.numpy().tobytes(), 5)\n"
        "assert ext.copy_with_crc32c(d, b) == crc32c.crc32c(b.numpy().tobytes()) and torch.equal(d, b)\n"
        "d.zero_(); ext.copy_bytes(d, b); assert torch.equal(d, b)\n"
        "assert ext.gpu_checksum(b) == ext.xsum64_reference(b)\n"
        "try:\n"
        "    torch.ops.gemini_dcp.crc32c\n"
        "    raise SystemExit('ops registered although GEMINI_DCP_EXT=0')\n"
        "except (AttributeError, RuntimeError):\n"
        "    pass\n"
        "print('FALLBACK_OK')\n"
    )
    env = dict(os.environ, GEMINI_DCP_EXT="0", GEMINI_DCP_EXT_CACHE=str(tmp_path / "cache"),
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "FALLBACK_OK" in r.stdout
    assert not (tmp_path / "cache").exists()  # nothing was built


def _broken_sources(tmp_path: Path) -> Path:
    csrc = tmp_path / "csrc"
    (csrc / "cuda").mkdir(parents=True)
    # Fails at the preprocessor, before any torch header is parsed: a cheap failed build.
    (csrc / "gemini_ops.cpp").write_text('#error "deliberately broken source for the test"\n')
    (csrc / "cuda" / "gemini_cuda.cu").write_text('#error "broken"\n')
    return csrc


def test_required_build_failure_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GEMINI_DCP_EXT", "1")
    monkeypatch.setenv("GEMINI_DCP_CUDA_EXT", "0")
    monkeypatch.setenv("GEMINI_DCP_EXT_CACHE", str(tmp_path / "cache"))
    loader = ext.loader.Loader(_broken_sources(tmp_path))
    with pytest.raises(ext.ExtensionBuildError, match="deliberately broken|failed"):
        loader.load()
    # Required: every later call raises again instead of silently falling back.
    with pytest.raises(ext.ExtensionBuildError):
        loader.load()
    assert not loader.has_ext
    # auto: the same failure only falls back.
    monkeypatch.setenv("GEMINI_DCP_EXT", "auto")
    loader2 = ext.loader.Loader(tmp_path / "csrc")
    assert loader2.load() is False
    assert "build failed" in loader2.how


def test_missing_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GEMINI_DCP_EXT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("GEMINI_DCP_EXT", "auto")
    assert ext.loader.Loader(tmp_path / "no-csrc").load() is False
    monkeypatch.setenv("GEMINI_DCP_EXT", "1")
    with pytest.raises(ext.ExtensionBuildError, match="sources not found"):
        ext.loader.Loader(tmp_path / "no-csrc").load()


def test_cuda_required_without_cuda_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine can build the CUDA ops")
    monkeypatch.setenv("GEMINI_DCP_EXT", "auto")
    monkeypatch.setenv("GEMINI_DCP_CUDA_EXT", "1")
    monkeypatch.setenv("GEMINI_DCP_EXT_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ext.ExtensionBuildError, match="GEMINI_DCP_CUDA_EXT=1"):
        ext.loader.Loader(ext.CSRC_DIR).load()


def test_invalid_env_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GEMINI_DCP_EXT", "maybe")
    with pytest.raises(ConfigError, match="GEMINI_DCP_EXT"):
        ext.loader.Loader(ext.CSRC_DIR).load()


def test_build_dir_names_torch_version_and_hash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GEMINI_DCP_EXT_CACHE", str(tmp_path))
    loader = ext.loader.Loader(ext.CSRC_DIR)
    d_cpu = loader.build_dir(False)
    assert d_cpu.parent == tmp_path and d_cpu.name.startswith(torch.__version__ + "-")
    assert loader.build_dir(False) == d_cpu
    copy = tmp_path / "src2"
    copy.mkdir()
    (copy / "gemini_ops.cpp").write_text((ext.CSRC_DIR / "gemini_ops.cpp").read_text() + "\n// changed\n")
    assert ext.loader.Loader(copy).build_dir(False) != d_cpu  # a source change means a new build


def test_file_lock_serializes(tmp_path: Path) -> None:
    lock = tmp_path / "x.lock"
    order: list[str] = []
    held = threading.Event()

    def other() -> None:
        held.wait(5)
        with ext.loader._file_lock(lock):
            order.append("other")

    th = threading.Thread(target=other)
    th.start()
    with ext.loader._file_lock(lock):
        held.set()
        time.sleep(0.3)
        order.append("first")
    th.join(5)
    assert order == ["first", "other"]


def test_status_and_info(built: bool) -> None:
    assert ext.HAS_EXT is True
    assert "CPU ops" in ext.status()
    i = ext.info()
    assert i["has_ext"] is True and "crc32c=" in (i["build_info"] or "")


# ------------------------------------------------------------------------------------- gpuinfo


def test_gpu_info_without_gpu_is_empty_list() -> None:
    info = gpuinfo.gpu_info()
    assert isinstance(info, list)
    if not torch.cuda.is_available():
        assert info == [] or all("name" in g for g in info)


def test_suggest_chunk_bytes() -> None:
    def fake(gen: int | None, width: int | None) -> list[dict]:
        return [{"index": 0, "pcie_gen_max": gen, "pcie_width_max": width,
                 "pcie_link_gbps": gpuinfo.pcie_link_gbps(gen, width)}]

    assert gpuinfo.suggest_chunk_bytes(0, fake(3, 16)) == 16 << 20
    assert gpuinfo.suggest_chunk_bytes(0, fake(4, 16)) == 32 << 20
    assert gpuinfo.suggest_chunk_bytes(0, fake(5, 16)) == 64 << 20
    assert gpuinfo.suggest_chunk_bytes(0, fake(6, 16)) == 64 << 20
    assert gpuinfo.suggest_chunk_bytes(0, fake(1, 1)) == 4 << 20
    assert gpuinfo.suggest_chunk_bytes(0, fake(None, None)) == gpuinfo.DEFAULT_CHUNK_BYTES
    assert gpuinfo.suggest_chunk_bytes(0, []) == gpuinfo.DEFAULT_CHUNK_BYTES
    chunk = gpuinfo.suggest_chunk_bytes()
    assert 4 << 20 <= chunk <= 64 << 20


@pytest.mark.parametrize("n", [0, 1, 63, 64, 65, 4096 + 7, (3 << 20) + 13])
@pytest.mark.parametrize("threads", [0, 2, 3, 4])
def test_crc32c_split_over_threads_equals_one_pass(n: int, threads: int) -> None:
    """The device-to-host copy checksums each piece on several threads: same CRC as one pass, any seed."""
    from gemini_dcp.ext import cpu as ext_cpu

    g = torch.Generator().manual_seed(n)
    buf = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    for seed in (0, 0xDEADBEEF):
        assert ext_cpu.crc32c(buf, seed, threads) == ext_cpu.crc32c(buf, seed) == crc32c_pkg.crc32c(buf.numpy().tobytes(), seed)
