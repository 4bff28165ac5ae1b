"""Paths inside a node-local tier root, permission handling and atomic file writes.

Layout of one job in a tier root (``<root>/<job_id>/``, mode 0700)::

    ranks/rank-00003/slot-1.bin     # preallocated, reused slot files: rank 3's shard bytes
    steps/step-000000000042.rec     # committed step records (metadata + checksums + slots)
    persist/                        # persistent-tier drain state

A node holds shard bytes of a rank either because the rank ran there (local
copy) or because it keeps a peer replica of another node; both use the same
slot files, the step record says which slot holds which rank's bytes.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import threading
from dataclasses import dataclass
from pathlib import Path

from ..core.regular_file import NotRegularFileError, open_regular
from ..errors import TierFullError, TierRootError, UntrustedDataError
from ..options.local import DEFAULT_ROOT, ENV_ROOT

_STEP_RE = re.compile(r"^step-([0-9]{12,})\.rec$")  # record_path pads to 12 digits; larger steps are longer
_SLOT_RE = re.compile(r"^slot-([0-9]+)\.bin$")
_RANK_RE = re.compile(r"^rank-([0-9]+)$")
_TMP_RE = re.compile(r"^\..+\.tmp-([0-9]+)(?:-[0-9]+)?$")  # atomic_write_bytes' temporary files (pid, thread)

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_PRIVATE_DIR = 0o700
_PRIVATE_FILE = 0o600
_SAFE_ADVICE = (
    f"Remove it if it is not yours, or set {ENV_ROOT} (or root=) to a private directory such as "
    "/dev/shm/gemini_dcp-$UID, owned by the user running the job with mode 0700 (see docs/security.md)."
)


# ---- ownership, links and modes ------------------------------------------------------------
def _user_name(uid: int) -> str:
    try:
        import pwd  # noqa: PLC0415 - POSIX only

        return pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError):
        return "unknown user"


def describe_owner(st: os.stat_result) -> str:
    """``'uid 65534 (nobody), mode 0755 (drwxr-xr-x)'`` for messages."""
    return (
        f"uid {st.st_uid} ({_user_name(st.st_uid)}), mode {stat.S_IMODE(st.st_mode):04o} "
        f"({stat.filemode(st.st_mode)})"
    )


def _we_are() -> str:
    uid = os.geteuid()
    return f"uid {uid} ({_user_name(uid)})"


def _link_text(path: Path) -> str:
    try:
        return f" -> {os.readlink(path)}"
    except OSError:
        return ""


def _dir_problem(st: os.stat_result, *, sticky_ok: bool) -> str | None:
    """Why a directory with this lstat result is not ours to trust, or None."""
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid != os.geteuid():
        return "is owned by another user"
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022 and not (sticky_ok and mode & stat.S_ISVTX):
        return "is group- or other-writable, so others could have planted files in it"
    return None


def check_private_dir_stat(path: Path, st: os.stat_result, *, sticky_ok: bool = False) -> None:
    """Raise TierRootError unless ``st`` (an lstat of ``path``) is a directory we own that no one else can write."""
    problem = _dir_problem(st, sticky_ok=sticky_ok)
    if problem is not None:
        link = _link_text(path) if stat.S_ISLNK(st.st_mode) else ""
        raise TierRootError(
            f"refusing to use {path}{link}: it {problem}; it belongs to {describe_owner(st)}. gemini_dcp runs as "
            f"{_we_are()} and only uses directories it owns that no other user can write. {_SAFE_ADVICE}"
        )


def check_owned(path: Path, *, sticky_ok: bool = False) -> os.stat_result:
    """``lstat`` of ``path``, checked: a regular file or directory owned by us, not a link.

    Directories must not be group/other-writable (``sticky_ok``: unless the sticky bit is
    set); files are checked as :func:`check_file_stat` does. FileNotFoundError passes through.
    """
    st = os.lstat(path)
    if stat.S_ISDIR(st.st_mode) or stat.S_ISLNK(st.st_mode):
        check_private_dir_stat(path, st, sticky_ok=sticky_ok)
    else:
        check_file_stat(path, st)
    return st


def check_file_stat(path: Path, st: os.stat_result, *, single_link: bool = False) -> None:
    """Raise UntrustedDataError unless ``st`` is a regular file owned by us (with one link if asked)."""
    problem = None
    if not stat.S_ISREG(st.st_mode):
        problem = "is not a regular file"
    elif st.st_uid != os.geteuid():
        problem = f"is owned by another user (this process is {_we_are()})"
    elif single_link and st.st_nlink != 1:
        problem = f"has {st.st_nlink} hard links (a gemini_dcp file has one)"
    if problem is not None:
        raise UntrustedDataError(
            f"refusing to use {path}: it {problem}; it belongs to {describe_owner(st)}. It was not read or written. "
            f"{_SAFE_ADVICE}"
        )


def _refuse_link(path: Path, exc: OSError) -> UntrustedDataError:
    try:
        detail = describe_owner(os.lstat(path))
    except OSError:
        detail = "gone"
    return UntrustedDataError(
        f"refusing to open {path}{_link_text(path)}: it is a symbolic link ({detail}); gemini_dcp never follows "
        f"links inside a tier root. {_SAFE_ADVICE}"
    )


def open_private(path: Path, flags: int, mode: int = _PRIVATE_FILE, *, single_link: bool = False) -> int:
    """``os.open`` that never follows a final symlink and returns only an fd of a regular file we own.

    With ``O_CREAT`` add ``O_EXCL`` yourself for a new file. An existing file with group/other
    permissions is tightened to 0600 when opened writable. Raises UntrustedDataError for a link,
    a non-regular file or another owner; FileNotFoundError / FileExistsError pass through.
    """
    try:
        fd = open_regular(path, flags, mode)  # no link followed, a planted FIFO never waited on
    except NotRegularFileError as exc:
        if exc.st is None:
            raise _refuse_link(path, exc) from exc
        check_file_stat(path, exc.st, single_link=single_link)  # names what it is and whose
        raise
    try:
        st = os.fstat(fd)
        check_file_stat(path, st, single_link=single_link)
        if flags & (os.O_WRONLY | os.O_RDWR) and stat.S_IMODE(st.st_mode) & 0o077:
            os.fchmod(fd, _PRIVATE_FILE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_private_bytes(path: Path) -> bytes:
    """The content of ``path``, read only if it is a regular file we own (never through a link)."""
    fd = open_private(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        chunks: list[bytes] = []
        while True:
            chunk = os.read(fd, max(size, 1 << 16))
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _tighten_dir(path: Path, *, sticky_ok: bool = False) -> None:
    """Open ``path`` without following a link, check it, and chmod it to 0700 through the fd."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW | _CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            check_private_dir_stat(path, os.lstat(path))  # raises with the details
        raise
    try:
        st = os.fstat(fd)
        check_private_dir_stat(path, st, sticky_ok=sticky_ok)
        if stat.S_IMODE(st.st_mode) & 0o077 and not (sticky_ok and st.st_mode & stat.S_ISVTX):
            os.fchmod(fd, _PRIVATE_DIR)
    finally:
        os.close(fd)


def check_root(root: Path, *, explicit: bool) -> Path:
    """Make sure ``root`` is a directory we own and may write, creating only the default root.

    An explicitly configured root (argument or ``$GEMINI_DCP_ROOT``) must exist: a typo must
    not silently put checkpoints on the wrong filesystem. The root must not be a symbolic
    link, must be owned by the effective uid, and must not be group/other-writable unless
    the sticky bit is set (a squatted ``/dev/shm/gemini_dcp`` is refused).
    """
    try:
        st = os.lstat(root)
    except FileNotFoundError:
        if explicit or not root.parent.is_dir():
            raise TierRootError(
                f"tier root {root} does not exist. Create it (mkdir -m 0700 -p {root}) on a memory-backed "
                f"filesystem such as /dev/shm, or pass root=/{ENV_ROOT}= pointing at an existing private "
                f"directory (default {DEFAULT_ROOT})."
            ) from None
        try:
            os.mkdir(root, _PRIVATE_DIR)
        except FileExistsError:
            pass  # created meanwhile (another rank, or someone else: checked below)
        except OSError as exc:
            raise TierRootError(
                f"cannot create the default tier root {root}: {exc.strerror}. "
                f"Create it yourself (mode 0700) or set {ENV_ROOT} to a writable private tmpfs directory."
            ) from exc
        st = os.lstat(root)
    if not stat.S_ISDIR(st.st_mode) and not stat.S_ISLNK(st.st_mode):
        raise TierRootError(f"tier root {root} exists but is not a directory: point root at a directory.")
    check_private_dir_stat(root, st, sticky_ok=True)
    if not os.access(root, os.W_OK | os.X_OK):
        raise TierRootError(
            f"tier root {root} is not writable by this user (uid {os.geteuid()}): fix its permissions "
            "or choose another root."
        )
    return root


def create_root(root: Path) -> bool:
    """Create a missing tier root private (mode 0700, missing parents too), as ``mkdir -m 0700 -p``; True when
    it was missing. An existing root is left as it is, for :func:`check_root` to accept or refuse (another
    user's, a link, group/other-writable); so is one made meanwhile by another rank. TierRootError when it
    cannot be created. For a job's own explicit root setting only: ``check_root`` refuses a missing explicit
    root (a typo must not put checkpoints elsewhere), readers and tools never create one."""
    try:
        os.lstat(root)
        return False
    except FileNotFoundError:
        pass
    try:
        ensure_private_dir(root)
    except OSError as exc:
        raise TierRootError(
            f"cannot create the tier root {root}: {exc.strerror}. Create it yourself (mkdir -m 0700 -p {root}) "
            "or choose a root in a directory this user may write."
        ) from exc
    return True


def ensure_private_dir(path: Path) -> Path:
    """Create ``path`` (and missing parents) with mode 0700, or check and tighten it if it exists.

    An existing directory must be ours, not a link and not group/other-writable
    (TierRootError saying whose it is otherwise); its mode is tightened to 0700 through
    an fd opened with ``O_NOFOLLOW``, never through a path.
    """
    try:
        os.lstat(path)
    except FileNotFoundError:
        parent = path.parent
        if parent != path:
            try:
                os.lstat(parent)
            except FileNotFoundError:
                ensure_private_dir(parent)
        try:
            os.mkdir(path, _PRIVATE_DIR)
        except FileExistsError:
            pass  # made meanwhile by another rank (or someone else: checked next)
    _tighten_dir(path)
    return path


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _space_message(path: Path, need: int, exc: OSError) -> str:
    try:
        st = os.statvfs(path.parent)
        free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
        numbers = f"{free:,} bytes free of {total:,}"
    except OSError:
        numbers = "free space unknown"
    return (
        f"cannot write {path}: {exc.strerror} (need {need:,} bytes, {numbers}); the partial file was removed "
        "and nothing was committed. Free memory in the tier (a larger /dev/shm: docker run --shm-size, a "
        f"bigger tmpfs, or {ENV_ROOT} on a larger one), then save again."
    )


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via tmp file + fsync + rename + dir fsync.

    The tmp file is created exclusively (``O_EXCL|O_NOFOLLOW``, 0600) and removed on any
    failure; a full filesystem raises TierFullError with the numbers.
    """
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    try:
        fd = open_private(tmp, flags, _PRIVATE_FILE)
    except FileExistsError:  # left by an earlier attempt of a dead process that had our pid and thread id
        os.unlink(tmp)
        fd = open_private(tmp, flags, _PRIVATE_FILE)
    try:
        try:
            _write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException as exc:
        remove_quietly(tmp)
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise TierFullError(_space_message(path, len(data), exc)) from exc
        raise
    fsync_dir(path.parent)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_tmp(directory: Path) -> list[str]:
    """Remove ``.<name>.tmp-<pid>`` files of processes that are gone; the names removed."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    removed = []
    for name in names:
        m = _TMP_RE.match(name)
        if m and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
            if remove_quietly(directory / name):
                removed.append(name)
    return removed


def remove_quietly(path: Path) -> bool:
    """Unlink ``path``; a file already gone (another rank won the race) is fine."""
    try:
        path.unlink()
        return True
    except FileNotFoundError:
        return False


_swept: set[Path] = set()  # steps dirs cleared of stale tmp files by this process


@dataclass(frozen=True, slots=True)
class JobLayout:
    """Where one job's files live inside one node's tier root."""

    root: Path
    job_id: str

    @property
    def job_dir(self) -> Path:
        return self.root / self.job_id

    @property
    def steps_dir(self) -> Path:
        return self.job_dir / "steps"

    @property
    def ranks_dir(self) -> Path:
        return self.job_dir / "ranks"

    @property
    def persist_dir(self) -> Path:
        return self.job_dir / "persist"

    def rank_dir(self, rank: int) -> Path:
        return self.ranks_dir / f"rank-{rank:05d}"

    def slot_path(self, rank: int, slot: int) -> Path:
        return self.rank_dir(rank) / f"slot-{slot}.bin"

    def record_path(self, step: int) -> Path:
        return self.steps_dir / f"step-{step:012d}.rec"

    def create(self) -> "JobLayout":
        """Create (or check: ours, no links, private) the job's directories."""
        ensure_private_dir(self.job_dir)
        ensure_private_dir(self.steps_dir)
        ensure_private_dir(self.ranks_dir)
        if self.steps_dir not in _swept:
            remove_stale_tmp(self.steps_dir)
            _swept.add(self.steps_dir)
        return self

    def exists(self) -> bool:
        return self.job_dir.is_dir()

    def check(self) -> "JobLayout":
        """Raise TierRootError unless the job's directories that exist are ours, not links, not writable by others."""
        for d in (self.job_dir, self.steps_dir, self.ranks_dir):
            try:
                st = os.lstat(d)
            except FileNotFoundError:
                continue
            check_private_dir_stat(d, st)
        return self

    def record_steps(self) -> list[int]:
        """Steps with a record file in this root, ascending (the job's directories checked first)."""
        self.check()
        try:
            names = os.listdir(self.steps_dir)
        except FileNotFoundError:
            return []
        steps = [int(m.group(1)) for n in names if (m := _STEP_RE.match(n))]
        return sorted(steps)

    def slot_files(self, rank: int) -> dict[int, Path]:
        try:
            names = os.listdir(self.rank_dir(rank))
        except FileNotFoundError:
            return {}
        return {int(m.group(1)): self.rank_dir(rank) / n for n in names if (m := _SLOT_RE.match(n))}

    def ranks_present(self) -> list[int]:
        try:
            names = os.listdir(self.ranks_dir)
        except FileNotFoundError:
            return []
        return sorted(int(m.group(1)) for n in names if (m := _RANK_RE.match(n)))


def list_jobs(root: Path) -> list[str]:
    """Job ids that have a directory in ``root``."""
    try:
        return sorted(n for n in os.listdir(root) if (root / n / "steps").is_dir())
    except FileNotFoundError:
        return []
    except OSError as exc:
        if exc.errno == errno.EACCES:
            return []
        raise
