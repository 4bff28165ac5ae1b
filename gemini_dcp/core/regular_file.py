"""Open a file that must be a plain regular file, read-only, without following a planted link.

Data files read back from a tier root or a local persistent store are untrusted: a symbolic link
planted in their place would read another file, a FIFO would block the opening process forever
(an unbounded wait), a device such as ``/dev/zero`` would read without end. :func:`open_regular`
opens with ``O_NOFOLLOW`` (the last component is never followed) and ``O_NONBLOCK`` (opening a FIFO
never waits), then checks on the descriptor that it is a regular file, so no race between a check
and the open exists. Torch-free.
"""

from __future__ import annotations

import errno
import os
import stat

_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)


class NotRegularFileError(OSError):
    """The path is a link, a FIFO, a device or a directory where a data file was expected."""


def open_regular(path: str | os.PathLike[str]) -> int:
    """A read-only descriptor of ``path``, which must be a regular file and not a link.

    Raises :class:`NotRegularFileError` (an ``OSError``) naming what was found instead, or the
    ``OSError`` of the open (e.g. ``FileNotFoundError``). The caller closes the descriptor.
    """
    try:
        fd = os.open(path, _FLAGS)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise NotRegularFileError(
                errno.ELOOP, f"{path} is a symbolic link where a data file was expected; links are never "
                "followed (remove it, or restore the real file)"
            ) from exc
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a directory" if stat.S_ISDIR(st.st_mode) else "a device or socket"
            raise NotRegularFileError(
                errno.EINVAL, f"{path} is {kind}, not a regular file; a planted or damaged entry: remove it"
            )
        if _FLAGS & getattr(os, "O_NONBLOCK", 0):
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd
