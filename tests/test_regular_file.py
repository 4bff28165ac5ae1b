"""Data files read back from a tier root or a local store must be plain regular files (no processes).

A planted symbolic link is never followed, a FIFO never blocks the reader (it would wait forever
for a writer), a directory or device is refused — each with a message naming the path and what
was found. Covers ``core/regular_file.open_regular`` and its users (the persistent tier's mapped
reads).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from gemini_dcp.core.regular_file import NotRegularFileError, open_regular
from gemini_dcp.persistent.item_payload import MappedFile


def _opens_quickly(path: Path) -> BaseException | None:
    """Open ``path`` in a thread; a hang (a FIFO opened blocking) fails the test instead of the suite."""
    out: list[BaseException | None] = []

    def run() -> None:
        try:
            os.close(open_regular(path))
            out.append(None)
        except BaseException as exc:  # noqa: BLE001
            out.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(10)
    assert out, f"opening {path} did not return within 10 s"
    return out[0]


def test_a_regular_file_opens(tmp_path: Path) -> None:
    f = tmp_path / "data.distcp"
    f.write_bytes(b"abc")
    fd = open_regular(f)
    try:
        assert os.read(fd, 3) == b"abc"
        assert os.get_blocking(fd)
    finally:
        os.close(fd)


def test_a_planted_link_is_not_followed(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"not yours")
    link = tmp_path / "__0_0.distcp"
    link.symlink_to(secret)
    err = _opens_quickly(link)
    assert isinstance(err, NotRegularFileError) and "symbolic link" in str(err) and str(link) in str(err)


def test_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "__0_0.distcp"
    os.mkfifo(fifo)
    err = _opens_quickly(fifo)
    assert isinstance(err, NotRegularFileError) and "FIFO" in str(err)


def test_a_directory_and_a_device_are_refused(tmp_path: Path) -> None:
    d = tmp_path / "dir.distcp"
    d.mkdir()
    err = _opens_quickly(d)
    assert isinstance(err, OSError) and str(d) in str(err)
    if os.path.exists("/dev/zero"):
        err = _opens_quickly(Path("/dev/zero"))
        assert isinstance(err, NotRegularFileError) and "device" in str(err)


def test_a_missing_file_raises_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        open_regular(tmp_path / "gone")


def test_mapped_store_file_refuses_a_planted_link(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.write_bytes(b"x" * 100)
    link = tmp_path / "__1_0.distcp"
    link.symlink_to(real)
    with pytest.raises(NotRegularFileError):
        MappedFile(str(link))
    assert MappedFile(str(real)).size == 100
