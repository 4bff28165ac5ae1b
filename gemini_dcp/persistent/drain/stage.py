"""Staging: copying a step's slot bytes beside the request on the same tmpfs, in the kernel.

The server stages at once (no torch needed), so the memory tier may reuse the slots for
newer steps while the upload runs. Torch-free.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import BinaryIO

__all__ = ["copy_prefix"]


def copy_prefix(src: Path, dst: Path, nbytes: int) -> None:
    """Copy the first ``nbytes`` of ``src`` into ``dst`` in the kernel (no GIL-held memcpy)."""
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        if nbytes:
            try:
                os.posix_fallocate(fo.fileno(), 0, nbytes)  # ENOSPC now, not SIGBUS/short write later
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise
        done = 0
        while done < nbytes:
            try:
                n = os.copy_file_range(fi.fileno(), fo.fileno(), nbytes - done, done, done)
            except OSError as exc:
                if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                    raise
                n = _copy_plain(fi, fo, done, nbytes - done)
            if n == 0:
                raise OSError(errno.EIO, f"{src} is shorter than {nbytes} bytes")
            done += n


def _copy_plain(fi: BinaryIO, fo: BinaryIO, offset: int, n: int) -> int:
    fi.seek(offset)
    fo.seek(offset)
    left = n
    while left:
        chunk = fi.read(min(left, 16 << 20))
        if not chunk:
            break
        fo.write(chunk)
        left -= len(chunk)
    fo.flush()
    return n - left
