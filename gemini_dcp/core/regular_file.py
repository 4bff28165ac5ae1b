"""Open a file that must be a plain regular file, without following a planted link.

The one mechanism behind every open of a data file read back from a tier root or a local
persistent store: a symbolic link planted in its place would read another file, a FIFO would
block the opening process forever (an unbounded wait), a device such as ``/dev/zero`` would read
without end. :func:`open_regular` opens with ``O_NOFOLLOW`` (the last component is never
followed) and ``O_NONBLOCK`` (opening a FIFO never waits), then checks on the descriptor that it
is a regular file, so no race between a check and the open exists. Files inside a tier root are
opened through :func:`gemini_dcp.local.job_dir.open_private`, which adds the ownership checks on
top of this. Torch-free.
"""

from __future__ import annotations

import errno
import os
import stat

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


class NotRegularFileError(OSError):
    """The path is a link, a FIFO, a device or a directory where a data file was expected.

    ``errno`` is ``ELOOP`` for a link; ``st`` is the descriptor's ``fstat`` otherwise.
    """

    st: os.stat_result | None = None


def open_regular(path: str | os.PathLike[str], flags: int = os.O_RDONLY, mode: int = 0o600) -> int:
    """A descriptor of ``path`` opened with ``flags`` (blocking), which must be a regular file and not a link.

    Raises :class:`NotRegularFileError` (an ``OSError``) naming what was found instead, or the
    ``OSError`` of the open (e.g. ``FileNotFoundError``). The caller closes the descriptor.
    """
    try:
        fd = os.open(path, flags | _NOFOLLOW | _CLOEXEC | _NONBLOCK, mode)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EMLINK):  # EMLINK: the BSDs' answer for O_NOFOLLOW on a link
            raise NotRegularFileError(
                errno.ELOOP, f"{path} is a symbolic link where a data file was expected; links are never "
                "followed (remove it, or restore the real file)"
            ) from exc
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a directory" if stat.S_ISDIR(st.st_mode) else "a device or socket"
            err = NotRegularFileError(
                errno.EINVAL, f"{path} is {kind}, not a regular file; a planted or damaged entry: remove it"
            )
            err.st = st
            raise err
        if _NONBLOCK:
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd
